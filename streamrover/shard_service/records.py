"""Old name of :mod:`streamrover.shard_service.bookkeeping`, kept while branches that import it are in flight.

Import from ``bookkeeping`` instead; this module goes once nothing imports it.
"""

from streamrover.shard_service.bookkeeping import (
    CutRecord,
    CutState,
    DatasetRecord,
    ShardRecord,
    WorkerRecord,
)

__all__ = ["CutRecord", "CutState", "DatasetRecord", "ShardRecord", "WorkerRecord"]
