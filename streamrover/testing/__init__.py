"""Tools to prove exactly-once: a durable ledger model and a worker that consumes shards into it."""

from streamrover.testing.ledger import Ledger, LedgerConflict, LedgerReport

__all__ = ["Ledger", "LedgerConflict", "LedgerReport"]
