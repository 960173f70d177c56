"""Where records come from: the source contract (``api.py``) and its backends, one module each (``registry.py``)."""

from streamrover.sources.api import (
    MasterSource,
    Partition,
    ReadBatch,
    Source,
    SourceError,
    SourceGoneError,
    SourceKind,
    SourceNotFoundError,
    SourceSchemaError,
    SourceUnavailableError,
    SourceUnreadableError,
    WorkerSource,
    open_source,
    register_source,
)

__all__ = [
    "MasterSource",
    "Partition",
    "ReadBatch",
    "Source",
    "SourceError",
    "SourceGoneError",
    "SourceKind",
    "SourceNotFoundError",
    "SourceSchemaError",
    "SourceUnavailableError",
    "SourceUnreadableError",
    "WorkerSource",
    "open_source",
    "register_source",
]
