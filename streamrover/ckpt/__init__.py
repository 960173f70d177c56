"""Flash checkpoints bound to the data cursor (ARCHITECTURE.md, "Flash checkpoint").

Save to shared memory in the time of a memcpy, persist asynchronously from a saver
process that outlives the trainer, load the newest consistent snapshot from memory
or storage, and keep the data cursor in every manifest. Importing this package does
not import torch or tensorflow; the adapters import them when called.
"""

from streamrover.ckpt.api import (
    FORMAT_VERSION,
    CheckpointError,
    CorruptCheckpointError,
    CursorBinder,
    LoadedCheckpoint,
    NoCheckpointError,
    PersistResult,
    RetentionPolicy,
    SaverError,
    SharedMemoryTooSmallError,
    Source,
    UnsupportedStateError,
)
from streamrover.ckpt.checkpointer import Checkpointer, CheckpointFallbackWarning
from streamrover.ckpt.saver import CheckpointSaver
from streamrover.ckpt.wire import namespace_for, saver_address

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointFallbackWarning",
    "CheckpointSaver",
    "Checkpointer",
    "CorruptCheckpointError",
    "CursorBinder",
    "LoadedCheckpoint",
    "NoCheckpointError",
    "PersistResult",
    "RetentionPolicy",
    "SaverError",
    "SharedMemoryTooSmallError",
    "Source",
    "UnsupportedStateError",
    "namespace_for",
    "saver_address",
]
