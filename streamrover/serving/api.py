"""The serving contract: what a servable version is, where it lives, its formats, and the errors.

A **version** is a servable export of one **durable** checkpoint (its manifest is published: see
:mod:`streamrover.ckpt.api`), numbered by that checkpoint's step. It is never written before the
checkpoint is durable, and it carries the checkpoint's lineage. The rules, in the order an exporter
keeps them:

1. **Only from durable checkpoints.** An exporter reads the checkpoint back from storage (manifest
   verified, checksums checked) and exports *that* state, never the live model: a version's weights
   are the checkpoint's, bit for bit, and no version exists without its durable checkpoint.
2. **Exactly once per durable checkpoint.** The trainer that made the checkpoint durable exports it
   when its checkpointer reports durability (``Checkpointer(on_durable=...)``). If it dies between
   durability and export, the next trainer exports every durable checkpoint that has no version when
   it starts (:meth:`Exporter.catch_up`) and after each of its own durable checkpoints. Publishing is
   idempotent: a version that exists is never written again.
3. **Atomic publish.** A version is written into a temporary directory beside it and renamed into
   place (local repositories; Triton polling such a directory never sees half a version). On object
   stores (no directory rename) the files are written in place and ``lineage.json`` last: a version
   exists exactly when its ``lineage.json`` does, for every reader here.
4. **A restore retires the future.** When a trainer resumes from step K, every version above K
   belongs to an abandoned timeline: it is unpublished (``lineage.json`` first) before training goes
   on, so no delta of it is ever applied to a state of the new timeline, and step numbers reused by
   the new timeline are exported afresh. A model name holds one checkpoint root's versions: an exporter
   refuses to start on a name holding versions of another root (it would retire them).
5. **Retention after publish.** The newest ``keep_last`` versions are kept, with every version their
   delta chains need (down to their base).

Repository layout (Triton's model repository: ``NAME/config.pbtxt`` and ``NAME/VERSION/model.onnx``)::

    <repository>/<name>/config.pbtxt                 written once (Triton's onnxruntime_onnx platform)
    <repository>/<name>/<step>/model.onnx            the graph; embedding tables under tracking are inputs
    <repository>/<name>/<step>/tables.safetensors    kind "base": every tracked table, whole
    <repository>/<name>/<step>/delta.safetensors     kind "delta": for table T, "T.rows" (int64) and "T.values"
    <repository>/<name>/<step>/lineage.json          written last: what this version is (see VersionInfo)

TF parameter-server jobs export ``<step>/model.savedmodel/`` instead of ``model.onnx`` (``tensorflow_savedmodel``
in ``config.pbtxt``; :mod:`streamrover.serving.savedmodel`), always whole.

A model with no tracked tables is exported whole (kind ``"full"``): its ``model.onnx`` holds every
weight and any ONNX server serves it as is. With tracked tables (:class:`~streamrover.serving.RowTracker`)
the tables are inputs of the graph named by their parameter names, and the server feeds them: version N's
tables are its base's tables with the deltas of its chain applied in order (:func:`read_tables`). A delta
holds the rows touched since its ``parent`` version (tracked while training, never diffed), with their
values at N; a base holds whole tables, and is written every ``base_every`` versions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Bumped when the version layout changes incompatibly.
SERVING_FORMAT = 1
LINEAGE = "lineage.json"
MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.pbtxt"
TABLES_FILE = "tables.safetensors"
DELTA_FILE = "delta.safetensors"
EXPORT_ENV = "STREAMROVER_EXPORT"  # the job spec's export section (JSON), set by the supervisor for trainers
#: Version kinds.
FULL, BASE, DELTA = "full", "base", "delta"


class ServingError(RuntimeError):
    """Base class of every error this package raises."""


class ExportError(ServingError):
    """A version could not be exported (the model factory, ONNX export or the repository failed)."""


class CheckpointGoneError(ExportError):
    """The checkpoint to export is no longer on storage (checkpoint retention removed it first): keep more
    checkpoints (``RetentionPolicy(keep_last=...)``) or export faster. Later versions stay correct: a delta is
    taken against the newest version that exists."""


class BrokenChainError(ServingError):
    """Version N cannot be rebuilt: a version of its delta chain (named in the message) is missing or not
    complete. Retention never removes a version a kept chain needs; this means the repository was edited
    by hand or by another job sharing the model name."""


@dataclass(frozen=True)
class ExportConfig:
    """How a trainer exports (the job spec's ``export:`` section).

    Args:
        repository: model repository root: a local directory or an fsspec URL.
        name: the model's name in the repository (Triton's model name).
        keep_last: versions kept (with the versions their delta chains need).
        base_every: with tracked tables, a full base every this many versions (1: every version is a base).
        opset: the ONNX opset to export with (18: bitwise ops on integer ids).
    """

    repository: str
    name: str = "model"
    keep_last: int = 5
    base_every: int = 10
    opset: int = 18  # BitwiseAnd (hashing ids in the graph, as the flagship DeepFM does) needs 18
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"export keep_last must be >= 1, got {self.keep_last}")
        if self.base_every < 1:
            raise ValueError(f"export base_every must be >= 1, got {self.base_every}")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"export name must be a plain directory name, got {self.name!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ExportConfig | None:
        """The job spec's ``export:`` section, as ``streamrover run`` passes it to trainers (``STREAMROVER_EXPORT``,
        JSON); None when the job exports nothing."""
        raw = (os.environ if env is None else env).get(EXPORT_ENV)
        if not raw:
            return None
        try:
            doc = json.loads(raw)
            return cls(**{k: doc[k] for k in ("repository", "name", "keep_last", "base_every") if k in doc})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{EXPORT_ENV} is not a valid export section ({exc}): {raw!r}") from exc


@dataclass
class VersionInfo:
    """What ``lineage.json`` of one version says.

    ``kind`` is ``"full"``, ``"base"`` or ``"delta"``; ``parent`` is the version a delta applies to
    (``None`` for a base or a full export) and ``base`` the base its chain starts from. ``checkpoint``
    names the durable checkpoint (its storage URL, step, manifest checksum and cut ids); ``lineage`` is
    that manifest's lineage section (offset ranges per partition, as ``streamrover checkpoints show``
    prints them) and ``cursor`` its cursor (JSON). ``reported`` is what the trainer reported at that
    step (loss, AUC...), when it did.
    """

    version: int
    kind: str
    parent: int | None
    base: int | None
    checkpoint: dict[str, Any]
    lineage: dict[str, Any]
    cursor: Any
    reported: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    exported_at: float = 0.0
    format: int = SERVING_FORMAT

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> VersionInfo:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in doc.items() if k in known})


__all__ = [
    "BASE",
    "CONFIG_FILE",
    "DELTA",
    "DELTA_FILE",
    "FULL",
    "LINEAGE",
    "MODEL_FILE",
    "SERVING_FORMAT",
    "TABLES_FILE",
    "BrokenChainError",
    "CheckpointGoneError",
    "ExportConfig",
    "ExportError",
    "ServingError",
    "VersionInfo",
]
