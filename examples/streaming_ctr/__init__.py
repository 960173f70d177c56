"""The flagship example: an online CTR model trained from a Kafka click stream, exactly once (see README.md)."""
