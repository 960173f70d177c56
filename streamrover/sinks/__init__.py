"""Sinks: training as the downstream node of a Flink or Spark job (ARCHITECTURE.md, "Sinks")."""
