"""Where records come from: the source contract and its backends (files now; brokers in their own modules)."""

from streamrover.sources.api import (
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
    open_source,
    register_source,
)

__all__ = [
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
    "open_source",
    "register_source",
]
