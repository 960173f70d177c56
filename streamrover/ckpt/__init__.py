"""Flash checkpoints bound to the data cursor (ARCHITECTURE.md, "Flash checkpoint").

Save to shared memory in the time of a memcpy, persist asynchronously from a saver
process that outlives the trainer, load the newest consistent snapshot from memory
or storage, and keep the data cursor in every manifest. Importing this package does
not import torch or tensorflow; the adapters import them when called.

Trainer side::

    ckpt = Checkpointer(url, rank=rank, world_size=world, binder=shard_client)
    model_ckpt = TorchCheckpoint(ckpt, model, optimizer, overlap=True)   # or fsdp_sharded_state(...)
    model_ckpt.save(step)                 # prepare_cut -> copy to shm (params in the background until the
                                          # next optimizer.step()) -> async persist -> commit_cut
    loaded, extra = model_ckpt.load()     # newest of shm/storage; shard_client.restore_cursor(cursor)

Agent side (the elastic agent hosts the node's saver; trainers pass ``saver="agent"``)::

    saver = CheckpointSaver(saver_address(namespace_for(url, job)), linger=None)
    threading.Thread(target=saver.serve_forever).start()       # or: python -m streamrover.ckpt --address @...
    ...                                                         # workers stopped or died:
    saver.wait_idle(timeout)              # their sessions ended: snapshots of dead workers persisted
    purge_shared_memory(namespace_for(url, job))               # only when no worker will restart here

Without an agent, the first persisting save starts ``python -m streamrover.ckpt`` itself.
"""

from streamrover.ckpt.api import (
    FORMAT_VERSION,
    CheckpointError,
    CorruptCheckpointError,
    CursorBinder,
    LoadedCheckpoint,
    LoadedFrom,
    NoCheckpointError,
    PersistResult,
    RetentionPolicy,
    SaverError,
    SharedMemoryTooSmallError,
    SnapshotCopyError,
    SnapshotRef,
    SnapshotRefusedError,
    StorageUnavailableError,
    UnsupportedStateError,
)
from streamrover.ckpt.checkpointer import Checkpointer, CheckpointFallbackWarning
from streamrover.ckpt.lineage import CheckpointInfo, list_checkpoints, new_since
from streamrover.ckpt.memory import purge_shared_memory
from streamrover.ckpt.saver import CheckpointSaver
from streamrover.ckpt.shared import load_shared, newest_ref
from streamrover.ckpt.tf_adapter import load_tf_variables_state, tf_variables_state
from streamrover.ckpt.torch_adapter import (
    TorchCheckpoint,
    fsdp_sharded_state,
    load_fsdp_sharded_state,
    load_module_state,
    load_torch_state,
    torch_state,
)
from streamrover.ckpt.wire import namespace_for, saver_address

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointFallbackWarning",
    "CheckpointInfo",
    "CheckpointSaver",
    "Checkpointer",
    "CorruptCheckpointError",
    "CursorBinder",
    "LoadedCheckpoint",
    "LoadedFrom",
    "NoCheckpointError",
    "PersistResult",
    "RetentionPolicy",
    "SaverError",
    "SharedMemoryTooSmallError",
    "SnapshotCopyError",
    "SnapshotRef",
    "SnapshotRefusedError",
    "StorageUnavailableError",
    "TorchCheckpoint",
    "UnsupportedStateError",
    "fsdp_sharded_state",
    "list_checkpoints",
    "load_fsdp_sharded_state",
    "load_module_state",
    "load_shared",
    "load_tf_variables_state",
    "load_torch_state",
    "namespace_for",
    "new_since",
    "newest_ref",
    "purge_shared_memory",
    "saver_address",
    "tf_variables_state",
    "torch_state",
]
