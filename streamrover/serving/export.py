"""Export durable torch checkpoints as ONNX versions of a model repository (the rules: serving/api.py).

Trainer side (``StreamSession(export=...)`` does all of this)::

    exporter = TorchExporter(ExportConfig("/srv/models", name="ctr"), ckpt_url, make_model, example_inputs,
                             input_names=["cats", "nums"], output_names=["logit"], select="net.")
    checkpointer = Checkpointer(ckpt_url, ..., on_durable=exporter.on_durable)
    loaded = checkpointer.load()                 # resume from step K
    exporter.start(loaded.step)                  # retire versions > K; export durable checkpoints with none
    ...                                          # each durable checkpoint: exported in the background
    exporter.close()

The exporter reads each checkpoint back from storage (verified) into a fresh model built by
``model_factory`` and exports that, so a version is the checkpoint's state, never the live model's.

An export that fails is never silent: it is logged, counted in :meth:`TorchExporter.status` (and sent to
``report``, which a StreamSession points at the job master: reporter ``serving``, ``export_failures``), and
:meth:`TorchExporter.check` raises it in the training thread at the trainer's next checkpoint, which stops the
trainer (a failed write must not let it go on as if versions were published; its restart exports what was
missed: :meth:`TorchExporter.start`). A durable checkpoint removed by checkpoint retention before it could be
exported is counted (``export_skipped``) and logged, not fatal: later versions stay correct.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from streamrover.ckpt.api import CorruptCheckpointError
from streamrover.ckpt.layout import MANIFEST, complete_steps, read_manifest, read_part, step_dir
from streamrover.ckpt.storage import Storage, checksum
from streamrover.serving.api import (
    BASE,
    DELTA,
    DELTA_FILE,
    FULL,
    MODEL_FILE,
    TABLES_FILE,
    CheckpointGoneError,
    ExportConfig,
    ExportError,
    VersionInfo,
)
from streamrover.serving.repository import ModelRepository
from streamrover.serving.tables import TOUCHED_KEY, delta_arrays, dump_arrays

log = logging.getLogger(__name__)


def triton_config(name: str, max_batch_size: int = 0) -> str:
    """``config.pbtxt`` for Triton's onnxruntime backend (inputs and outputs are auto-completed from the graph)."""
    return (f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
            "version_policy: { latest: { num_versions: 1 } }\n")  # fmt: skip


class _TablesAsInputs:
    """Wraps a module so that its tracked tables are graph inputs, not weights (built lazily: torch)."""

    @staticmethod
    def build(model: Any, tables: list[str], n_inputs: int) -> Any:
        from torch import nn

        modules = dict(model.named_modules())
        owners = [t.rsplit(".", 1)[0] for t in tables]

        class Wrapper(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = model

            def forward(self, *args: Any) -> Any:
                inputs, weights = args[:n_inputs], args[n_inputs:]
                saved = {}
                for owner, weight in zip(owners, weights, strict=True):
                    saved[owner] = modules[owner]._parameters.pop("weight")
                    modules[owner].weight = weight  # traced as an input, not an initializer
                try:
                    return self.inner(*inputs)
                finally:
                    for owner in owners:
                        del modules[owner].weight
                        modules[owner]._parameters["weight"] = saved[owner]

        return Wrapper()


class TorchExporter:
    """Exports the durable checkpoints of ``ckpt_url`` to ``config.repository`` (see the module docstring).

    Args:
        config: the repository, name, retention and base cadence.
        ckpt_url: the checkpoint root the trainer persists to (and its ``storage_options``).
        model_factory: builds the served module with fresh weights (no tracker hooks needed).
        example_inputs: a batch for tracing (the batch dimension is exported dynamic).
        select: the prefix of the served module's keys in the checkpoint's ``model`` state (``"net."``).
        tables: the tracked tables' parameter names (``RowTracker.params``); None: no deltas, full exports.
    """

    def __init__(
        self,
        config: ExportConfig,
        ckpt_url: str | None,
        model_factory: Callable[[], Any],
        example_inputs: Sequence[Any],
        *,
        input_names: Sequence[str],
        output_names: Sequence[str],
        select: str = "",
        tables: Sequence[str] | None = None,
        ckpt_storage_options: dict[str, Any] | None = None,
    ) -> None:
        if len(input_names) != len(example_inputs):
            raise ValueError(f"{len(input_names)} input names for {len(example_inputs)} example inputs")
        self.config = config
        self.repo = ModelRepository(config.repository, config.name, config.storage_options)
        self._ckpt_options = ckpt_storage_options
        self._ckpt: Storage | None = Storage(ckpt_url, ckpt_storage_options) if ckpt_url is not None else None
        self.model_factory = model_factory
        self.example_inputs = tuple(example_inputs)
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.select = select
        self.tables = list(tables or [])
        self.exported: list[int] = []  # versions this exporter published, in order
        self.seconds: list[float] = []  # how long each of those took (read, export, publish, retention)
        self.cpu_seconds: list[float] = []  # the CPU time of each (this thread's: fsync waits excluded)
        self.errors: list[str] = []  # exports that failed (raised by check() and close())
        self.skipped: list[int] = []  # durable checkpoints removed by checkpoint retention before their export
        #: called with status() after each export or failure (a StreamSession reports it to the master)
        self.report: Callable[[dict[str, float]], None] | None = None
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        # one repository change at a time: start() (clean, retire) and every export, from any thread (a TF-PS
        # rollback restarts the exporter while the previous checkpoint's export is under way)
        self._lock = threading.RLock()
        self._trace: Any | None = None  # the first version's ONNX graph, reused with each version's weights
        self._prefix = ""

    @property
    def ckpt(self) -> Storage:
        """The checkpoint storage exported from."""
        if self._ckpt is None:
            raise ExportError("the exporter has no checkpoint URL: pass ckpt_url, or give it to a StreamSession")
        return self._ckpt

    def bind_checkpoints(self, ckpt_url: str) -> None:
        """Export from ``ckpt_url`` (a StreamSession binds its checkpoint root; a URL given before must match)."""
        storage = Storage(ckpt_url, self._ckpt_options)
        if self._ckpt is not None and self._ckpt.root != storage.root:
            raise ExportError(f"the exporter reads checkpoints of {self._ckpt.root}, the trainer writes {storage.root}")
        self._ckpt = storage

    # -- the trainer's hooks ----------------------------------------------------------------
    def start(self, resumed_step: int) -> list[int]:
        """The trainer resumed from ``resumed_step`` (0: fresh): retire versions above it, remove temporaries of
        cut-short publishes, export every durable checkpoint with no version yet; returns the versions exported.
        Waits for an export under way (its temporary directory is not cut short, its version is retired if above
        ``resumed_step``)."""
        with self._lock:
            self.repo.clean_temporaries()
            for version in self.repo.versions():
                source = self.repo.info(version).checkpoint.get("url")
                if source != self.ckpt.root:  # another job's versions: never retire or extend them
                    raise ExportError(f"{self.repo.model_dir} holds version {version} exported from checkpoints "
                                      f"of {source}, not of {self.ckpt.root}: give this job its own export "
                                      "name")  # fmt: skip
            self.repo.retire_after(resumed_step)
            return self.catch_up()

    def on_durable(self, step: int) -> None:
        """The checkpoint of ``step`` is durable (``Checkpointer(on_durable=...)``): export it in the background."""
        if self._worker is not None and not self._worker.is_alive():  # never silently queue to a dead thread
            self._failed(step, ExportError("the export thread ended unexpectedly"))
            self._worker = None
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="streamrover-export", daemon=True)
            self._worker.start()
        self._queue.put(step)

    def _run(self) -> None:
        while (step := self._queue.get()) is not None:
            try:
                self.catch_up()
            except Exception as exc:  # raised in the training thread by check(); a restarted trainer catches up
                self._failed(step, exc)

    def _failed(self, step: int, exc: BaseException) -> None:
        log.error("%s: exporting after durable checkpoint %d failed (raised at the trainer's next checkpoint): %s: %s",
                  self.config.name, step, type(exc).__name__, exc, exc_info=exc)  # fmt: skip
        self.errors.append(f"step {step}: {type(exc).__name__}: {exc}")
        self._report()

    def status(self) -> dict[str, float]:
        """What this exporter did: the newest version it published (-1: none), versions published, failures,
        durable checkpoints skipped (removed before their export), the last export's seconds."""
        return {"export_version": float(self.exported[-1] if self.exported else -1),
                "export_versions": float(len(self.exported)), "export_failures": float(len(self.errors)),
                "export_skipped": float(len(self.skipped)),
                "export_seconds": float(self.seconds[-1] if self.seconds else 0.0)}  # fmt: skip

    def _report(self) -> None:
        if self.report is None:
            return
        try:
            self.report(self.status())
        except Exception as exc:  # the master may be restarting: the next export reports again
            log.warning("%s: export status not reported: %s", self.config.name, exc)

    def check(self) -> None:
        """Raise :class:`ExportError` if an export failed (the training thread calls it at each checkpoint)."""
        if self.errors:
            raise ExportError(f"{self.config.name}: exports to {self.repo.model_dir} failed (the trainer stops; "
                              "its restart exports every durable checkpoint left without a version): "
                              + "; ".join(self.errors[-3:]))  # fmt: skip

    def close(self, timeout: float | None = 300.0) -> None:
        """Finish queued exports; raise :class:`ExportError` naming any that failed, or if they are not done
        within ``timeout`` s."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout)
            if self._worker.is_alive():
                raise ExportError(f"{self.config.name}: exports still running after {timeout} s (queued durable "
                                  f"checkpoints: {self._queue.qsize() - 1}); newest version "
                                  f"{self.status()['export_version']:.0f}")  # fmt: skip
            self._worker = None
        self.check()

    # -- exporting ------------------------------------------------------------------------
    def catch_up(self) -> list[int]:
        """Export, oldest first, every durable checkpoint newer than the newest version; returns them."""
        with self._lock:
            versions = self.repo.versions()
            newest = versions[-1] if versions else -1
            done = []
            for step in complete_steps(self.ckpt):
                if step <= newest:
                    continue
                try:
                    if self.export_step(step):
                        done.append(step)
                except CheckpointGoneError as exc:
                    log.warning("%s", exc)
                    self.skipped.append(step)
                    self._report()
            return done

    def export_step(self, step: int) -> bool:
        """Export the durable checkpoint of ``step`` as version ``step``; False if that version exists."""
        started, cpu = time.monotonic(), time.thread_time()
        try:
            manifest_blob = bytes(self.ckpt.read(self.ckpt.join(step_dir(step), MANIFEST)))
            manifest = read_manifest(self.ckpt, step)
            part, state, _cursor = read_part(self.ckpt, manifest, 0)
        except (FileNotFoundError, CorruptCheckpointError) as exc:
            if not self.ckpt.exists(self.ckpt.join(step_dir(step), MANIFEST)):
                raise CheckpointGoneError(f"checkpoint {step} was removed before it was exported ({exc}); keep "
                                          "more checkpoints (RetentionPolicy keep_last)") from exc  # fmt: skip
            raise ExportError(f"checkpoint {step} cannot be read for export: {exc}") from exc
        versions = [v for v in self.repo.versions() if v < step]
        info = VersionInfo(
            version=step,
            kind=FULL,
            parent=None,
            base=None,
            checkpoint={
                "url": self.ckpt.root,
                "step": step,
                "manifest_checksum": checksum(manifest_blob),
                "cut_ids": manifest.get("cut_ids", []),
            },
            lineage=manifest.get("lineage", {}),
            cursor=manifest["cursor"],
            reported=dict((part.get("meta") or {}).get("reported") or {}),
            inputs=[*self.input_names, *self.tables],
            outputs=self.output_names,
        )
        model_state = self._model_state(state)
        files = self._model_files(model_state)
        if self.tables:
            tables = {t: np.array(model_state[t].numpy(), copy=True) for t in self.tables}
            info.tables = {t: {"shape": list(a.shape), "dtype": str(a.dtype)} for t, a in tables.items()}
            parent = self.repo.info(versions[-1]) if versions else None
            chain = self.repo.chain(parent.version) if parent is not None and parent.kind != FULL else []
            if not chain or len(chain) >= self.config.base_every:
                info.kind, info.base = BASE, step
                files[TABLES_FILE] = dump_arrays(tables)
            else:
                assert parent is not None
                touched = ((state.get("extra") or {}).get(TOUCHED_KEY)) or {}
                stamps = {k: np.asarray(v.numpy()) for k, v in touched.items()}
                info.kind, info.parent, info.base = DELTA, parent.version, chain[0].version
                files[DELTA_FILE] = dump_arrays(delta_arrays(tables, stamps, parent.version))
        self.repo.ensure_config(self._config())
        published = self.repo.publish(info, files)
        if published:
            self.exported.append(step)
            self.seconds.append(time.monotonic() - started)
            self.cpu_seconds.append(time.thread_time() - cpu)
            log.info("exported checkpoint %d as %s version %d (%s)", step, self.config.name, step, info.kind)
        self.repo.apply_retention(self.config.keep_last)
        if published:
            self._report()
        return published

    # -- what a framework's exporter overrides -------------------------------------------------
    def _model_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The served module's weights in a checkpoint's state (torch: ``model`` keys under ``select``)."""
        return {k[len(self.select):]: v for k, v in state["model"].items() if k.startswith(self.select)}

    def _model_files(self, model_state: dict[str, Any]) -> dict[str, bytes]:
        """The version's model files by path inside the version directory."""
        return {MODEL_FILE: self._onnx(model_state)}

    def _config(self) -> str:
        """The model's ``config.pbtxt``."""
        return triton_config(self.config.name)

    def _onnx(self, model_state: dict[str, Any]) -> bytes:
        """The ONNX graph of ``model_state``: traced for the first version; later versions reuse that trace with
        their weights substituted (tracing costs ~0.1 s, substituting ~1 ms), when every weight of the state is
        an initializer of the trace under its own name; else each version is traced."""
        if self._trace is not None:
            return self._substituted(model_state)
        blob = self._traced(model_state)
        self._trace = self._bindable(blob, model_state)
        return blob

    def _module_and_args(self, model_state: dict[str, Any], clone: bool = False) -> tuple[Any, tuple[Any, ...]]:
        """A fresh model (``model_factory``) holding ``model_state``, in eval mode, wrapped so that the tracked
        tables are inputs after the model's own, and the arguments to trace it with (the tables' weights cloned
        with ``clone``: a TorchScript trace keeps its example inputs)."""
        model = self.model_factory()
        try:
            model.load_state_dict(model_state)
        except RuntimeError as exc:
            raise ExportError(f"the checkpoint's model state does not fit the model factory's module (select="
                              f"{self.select!r}): {exc}") from exc  # fmt: skip
        model.eval()
        params = dict(model.named_parameters())
        module = _TablesAsInputs.build(model, self.tables, len(self.example_inputs)) if self.tables else model
        tables = (params[t].detach() for t in self.tables)
        return module, (*self.example_inputs, *((t.clone() for t in tables) if clone else tables))

    def _traced(self, model_state: dict[str, Any]) -> bytes:
        import torch

        module, args = self._module_and_args(model_state)
        dynamic = {n: {0: "batch"} for n in [*self.input_names, *self.output_names]}
        with tempfile.TemporaryDirectory(prefix="streamrover-export-") as tmp, torch.no_grad():
            path = os.path.join(tmp, MODEL_FILE)
            torch.onnx.export(module, args, path, dynamo=False, input_names=[*self.input_names, *self.tables],
                              output_names=self.output_names, dynamic_axes=dynamic, do_constant_folding=False,
                              opset_version=self.config.opset)  # fmt: skip
            with open(path, "rb") as fh:
                return fh.read()

    def _bindable(self, blob: bytes, model_state: dict[str, Any]) -> Any | None:
        """The trace as an ONNX ModelProto if each weight of ``model_state`` (tables aside) is one of its
        initializers by name (``inner.`` before it when tables are inputs); None otherwise."""
        import onnx

        proto = onnx.load_from_string(blob)
        names = {init.name for init in proto.graph.initializer}
        self._prefix = "inner." if self.tables else ""
        missing = [k for k in model_state if k not in self.tables and self._prefix + k not in names]
        if missing:
            log.info("%s: weights %s are not initializers of the ONNX trace: every version is traced",
                     self.config.name, missing[:5])  # fmt: skip
            return None
        return proto

    def _substituted(self, model_state: dict[str, Any]) -> bytes:
        from onnx import ModelProto, numpy_helper

        proto = ModelProto()
        proto.CopyFrom(cast(ModelProto, self._trace))
        for init in proto.graph.initializer:
            key = init.name[len(self._prefix) :] if init.name.startswith(self._prefix) else None
            if key is None or key not in model_state or key in self.tables:
                continue  # a constant of the graph, the same in every version
            array = np.ascontiguousarray(model_state[key].numpy())
            if list(array.shape) != list(init.dims) or numpy_helper.to_array(init).dtype != array.dtype:
                raise ExportError(f"{key}: {array.dtype}{list(array.shape)} in checkpoint, the ONNX trace has "
                                  f"{list(init.dims)}: the model's shapes changed during the run")  # fmt: skip
            init.CopyFrom(numpy_helper.from_array(array, init.name))
        return bytes(proto.SerializeToString())


__all__ = ["TorchExporter", "triton_config"]
