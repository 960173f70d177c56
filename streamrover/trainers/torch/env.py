"""What ``dlrover-run`` tells its worker processes, in environment variables (read once, by :func:`from_env`).

Workers started by torchrun-compatible launchers learn RANK, WORLD_SIZE, MASTER_ADDR... from the
environment; ``dlrover-run`` adds the shard service and checkpoint settings under ``STREAMROVER_*``
names, so a training script needs no extra flags. Nothing here imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MASTER = "STREAMROVER_MASTER"
TOKEN = "STREAMROVER_TOKEN"
CKPT_DIR = "STREAMROVER_CKPT_DIR"
CKPT_JOB = "STREAMROVER_CKPT_JOB"  # checkpoint namespace of this node (shared memory + the agent's saver)
SAVER = "STREAMROVER_CKPT_SAVER"  # "agent" under dlrover-run, else the Checkpointer default ("auto")
NODE_ID = "STREAMROVER_NODE_ID"
RUN_ID = "STREAMROVER_RUN_ID"
CKPT_EVERY = "STREAMROVER_CKPT_EVERY"  # steps between checkpoints (a job spec's checkpoint.every_steps)
CKPT_KEEP = "STREAMROVER_CKPT_KEEP"  # checkpoints kept on storage (a job spec's checkpoint.keep_last)
PROGRESS_DIR = "STREAMROVER_PROGRESS_DIR"  # where workers mark progress for the agent's hang watch (--hang-timeout)


@dataclass(frozen=True)
class WorkerEnv:
    """The launcher's settings as a worker sees them."""

    master: str | None
    token: str
    ckpt_dir: str | None
    ckpt_job: str | None
    saver: str
    node_id: str
    run_id: str
    ckpt_every: int | None = None  # None: not set (the session's default applies)
    ckpt_keep: int | None = None
    progress_dir: str | None = None  # set by dlrover-run --hang-timeout

    @property
    def under_agent(self) -> bool:
        """Whether the checkpoint saver is the agent's (the worker runs under ``dlrover-run``)."""
        return self.saver == "agent"


def _positive(env: dict[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r}: must be a whole number >= 1")
    return value


def from_env(environ: dict[str, str] | None = None) -> WorkerEnv:
    """The worker's settings from ``environ`` (default ``os.environ``); a bad number raises naming the variable."""
    env = dict(os.environ) if environ is None else environ
    return WorkerEnv(
        master=env.get(MASTER) or None,
        token=env.get(TOKEN, ""),
        ckpt_dir=env.get(CKPT_DIR) or None,
        ckpt_job=env.get(CKPT_JOB) or None,
        saver=env.get(SAVER, "auto"),
        node_id=env.get(NODE_ID, ""),
        run_id=env.get(RUN_ID, ""),
        ckpt_every=_positive(env, CKPT_EVERY),
        ckpt_keep=_positive(env, CKPT_KEEP),
        progress_dir=env.get(PROGRESS_DIR) or None,
    )
