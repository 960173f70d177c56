"""PyTorch trainers on streams: ``dlrover-run`` (an elastic, torchrun-compatible launcher), ``StreamDataset``
and ``StreamSession`` (exactly-once glue for a DDP script).

Importing this package imports torch; ``import streamrover`` never does. Adoption in a
torchrun DDP script::

    import streamrover.trainers.torch as srt
    session = srt.attach(model, optimizer, ckpt_every=50)            # restore (rank 0) + broadcast
    loader = DataLoader(session.dataset("clicks", batch_size=256, idle_timeout=1.0), batch_size=None)
    for batch in loader:
        ...; optimizer.step()
        session.step_done()                                          # ack; checkpoint every 50 steps

then launch it with ``dlrover-run`` and torchrun's flags plus ``--shard-service`` and ``--ckpt-dir``.
"""

from streamrover.trainers.torch.agent import HealthReporter, StreamroverAgent, read_health
from streamrover.trainers.torch.dataset import StreamDataset, StreamStateLostError, to_tensors
from streamrover.trainers.torch.env import WorkerEnv, from_env
from streamrover.trainers.torch.rendezvous import (
    BACKEND_NAME,
    MasterRendezvousBackend,
    MasterStore,
    create_rdzv_handler,
    register,
)
from streamrover.trainers.torch.session import StreamSession, attach

__all__ = [
    "BACKEND_NAME",
    "HealthReporter",
    "MasterRendezvousBackend",
    "MasterStore",
    "StreamDataset",
    "StreamSession",
    "StreamStateLostError",
    "StreamroverAgent",
    "WorkerEnv",
    "attach",
    "create_rdzv_handler",
    "from_env",
    "read_health",
    "register",
    "to_tensors",
]
