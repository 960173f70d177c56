"""The TensorFlow parameter-server trainer's contract: roles, cluster spec, what the launcher tells the chief.

Roles (all processes on 127.0.0.1 by default, started by ``streamrover tf-ps-run``):

* **parameter servers** (``ps``) and **workers**: plain ``tf.distribute.Server`` processes
  (``python -m streamrover.trainers.tensorflow.server``); they hold no state of their own that
  a restart must keep. The launcher restarts a dead one on the same port.
* the **chief**: the user's script. It builds ``ParameterServerStrategy`` +
  ``ClusterCoordinator`` from the cluster spec the launcher wrote into its environment
  (:func:`TrainerEnv.from_env`), leases shards from the shard service, reads their records and
  schedules one step per batch on the workers; it alone acks and checkpoints.

Exactly once (the design :class:`~streamrover.trainers.tensorflow.trainer.PSTrainer` keeps):

1. **Ack after fetch.** The positions a step consumed are acked (tagged with the step number)
   only after the chief fetched that step's result, in the order the steps were scheduled, so
   an ack never runs ahead of a step of the same shard that is still in flight.
2. **Checkpoint = drain + one part.** Every ``ckpt_every`` steps the chief drains the
   coordinator (``join``: no closure is running), fetches and acks every step, flushes the
   acks, and saves *all* PS variables (model, optimizer slots and the ledger) as one part
   through :class:`streamrover.ckpt.Checkpointer` with a cut: shared memory first, persisted
   asynchronously, the cut committed once the manifest is durable.
3. **Roll back on any re-run.** ``ClusterCoordinator`` re-runs a closure whose worker died,
   and a closure is not atomic: the updates it already pushed to the parameter servers would
   land twice. The trainer hooks the coordinator's closure queue: when a closure is *put back*
   (the only way TF re-runs one) the chief stops scheduling, drains, and rolls the PS variables
   *and* the shard service's cursor back to the newest checkpoint (from shared memory: a memcpy
   and one assign per variable). Every step since that checkpoint, including the partial one,
   is discarded and its records are leased and applied again, once. The same rollback follows
   a refused ack (a lease lost under applied records) and a step whose result cannot be fetched
   (its worker died after the closure ran): its records are not acked, and its updates undone.
4. **PS loss and chief loss restart the chief.** A dead parameter server loses its variables;
   the launcher restarts it and restarts the chief, which (like any chief at start) loads the
   newest checkpoint — this host's shared memory when it is at least as new as storage, storage
   otherwise — assigns it to the new PS variables and resets the shard service to its cursor
   before it leases anything. A chief killed at any point does the same when restarted.
5. **Elastic workers.** TensorFlow fixes the cluster when the strategy is made, so a
   membership change restarts the chief gracefully (SIGTERM: it drains, acks and checkpoints,
   then exits) with the new cluster spec; the new chief restores that checkpoint from shared
   memory. A leaving worker is stopped only after the chief drained its steps.

The residual risk, stated: a SIGKILLed worker's last RPCs that already reached a PS are
applied by the PS before the chief learns of the death (it learns from the broken RPC), so they
are inside what the rollback undoes; the ledger tests check the outcome.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

CLUSTER = "STREAMROVER_TF_CLUSTER"  # the cluster spec (JSON) the launcher built
EVENTS = "STREAMROVER_TF_EVENTS"  # optional JSON-lines file where the chief reports restores, rollbacks, checkpoints
MASTER = "STREAMROVER_MASTER"
TOKEN = "STREAMROVER_TOKEN"
CKPT_DIR = "STREAMROVER_CKPT_DIR"
CKPT_JOB = "STREAMROVER_CKPT_JOB"

EXIT_RESTART = 75  # the chief asks to be restarted (a parameter server was lost: EX_TEMPFAIL)


class PSTrainingError(RuntimeError):
    """Base class of the TensorFlow parameter-server trainer's errors."""


class ClusterConfigError(PSTrainingError, ValueError):
    """The cluster spec or the launcher's settings are missing or malformed; the message names what."""


class ParameterServerLostError(PSTrainingError):
    """A parameter server failed: its variables are gone; the chief must restart and restore."""


@dataclass(frozen=True)
class ClusterSpec:
    """Addresses (``host:port``) of every task of one TF-PS cluster; the chief is task 0 of ``chief``."""

    chief: str
    ps: list[str]
    workers: list[str]

    def __post_init__(self) -> None:
        if not self.ps:
            raise ClusterConfigError("a parameter-server cluster needs at least one ps task")
        if not self.workers:
            raise ClusterConfigError("a parameter-server cluster needs at least one worker task")
        for address in [self.chief, *self.ps, *self.workers]:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ClusterConfigError(f"task address {address!r} is not HOST:PORT")
        every = [self.chief, *self.ps, *self.workers]
        if len(set(every)) != len(every):
            raise ClusterConfigError(f"two tasks share an address in {every}")

    def as_tf(self) -> dict[str, list[str]]:
        """The ``tf.train.ClusterSpec`` dict."""
        return {"chief": [self.chief], "ps": list(self.ps), "worker": list(self.workers)}

    def to_json(self) -> str:
        """The cluster as TensorFlow's ``TF_CONFIG`` cluster JSON (:meth:`from_json` reads it back)."""
        return json.dumps(self.as_tf(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterSpec:
        """Parse :meth:`to_json` output; a malformed spec raises :class:`ClusterConfigError` naming the problem."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ClusterConfigError(f"{CLUSTER} is not JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise ClusterConfigError(f"{CLUSTER} must be a JSON object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - {"chief", "ps", "worker"})
        if unknown:
            raise ClusterConfigError(f"{CLUSTER} has unknown task types {unknown}")
        chief = doc.get("chief") or []
        if len(chief) != 1:
            raise ClusterConfigError(f"{CLUSTER} must name exactly one chief, got {chief}")
        return cls(str(chief[0]), [str(a) for a in doc.get("ps") or []], [str(a) for a in doc.get("worker") or []])


@dataclass(frozen=True)
class TrainerEnv:
    """The launcher's settings as the chief sees them (environment variables, read once)."""

    cluster: ClusterSpec
    master: str
    token: str
    ckpt_dir: str
    ckpt_job: str | None = None
    events: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> TrainerEnv:
        """Read the chief's settings; a missing one raises :class:`ClusterConfigError` saying how to set it."""
        env = dict(os.environ) if environ is None else environ
        missing = [
            name
            for name, hint in ((CLUSTER, "--ps/--workers"), (MASTER, "--shard-service"), (CKPT_DIR, "--ckpt-dir"))
            if not env.get(name)
        ]
        if missing:
            raise ClusterConfigError(
                f"{', '.join(missing)} not set: run the script under `streamrover tf-ps-run` "
                "(--ps N --workers N --shard-service HOST:PORT --ckpt-dir DIR)"
            )
        return cls(
            cluster=ClusterSpec.from_json(env[CLUSTER]),
            master=env[MASTER],
            token=env.get(TOKEN, ""),
            ckpt_dir=env[CKPT_DIR],
            ckpt_job=env.get(CKPT_JOB) or None,
            events=env.get(EVENTS) or None,
        )

    def to_env(self) -> dict[str, str]:
        """The environment variables that :meth:`from_env` reads."""
        out = {CLUSTER: self.cluster.to_json(), MASTER: self.master, TOKEN: self.token, CKPT_DIR: self.ckpt_dir}
        if self.ckpt_job:
            out[CKPT_JOB] = self.ckpt_job
        if self.events:
            out[EVENTS] = self.events
        return out


__all__ = [
    "CKPT_DIR",
    "CKPT_JOB",
    "CLUSTER",
    "EVENTS",
    "EXIT_RESTART",
    "MASTER",
    "TOKEN",
    "ClusterConfigError",
    "ClusterSpec",
    "PSTrainingError",
    "ParameterServerLostError",
    "TrainerEnv",
]
