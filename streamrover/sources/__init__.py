"""Placeholder; see ARCHITECTURE.md."""
