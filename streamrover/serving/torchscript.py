"""TorchScript versions beside ONNX: ``NAME/STEP/model.pt``, Triton's ``pytorch_libtorch`` layout.

:class:`TorchScriptExporter` keeps every rule of :class:`~streamrover.serving.TorchExporter` (durable
checkpoints only, exactly once, atomic publish, retirement, retention, table deltas) and writes the checkpoint's
module traced with ``torch.jit.trace`` as ``model.pt`` instead of ``model.onnx``. Tracked embedding tables are
inputs of the traced module after the model's own inputs, in ``tables`` order, as in the ONNX graph: the
server feeds them from :func:`~streamrover.serving.read_tables`. Loading a version back::

    module = torch.jit.load(io.BytesIO(repo.read(version, TORCHSCRIPT_FILE)))
    tables = read_tables(repo, version)
    logits = module(ids, *(torch.from_numpy(tables[t]) for t in repo.info(version).inputs[1:]))

Triton's libtorch backend names inputs by position (``INPUT__0``...); ``lineage.json`` lists them by name
(``inputs``, ``outputs``).
"""

from __future__ import annotations

import io
from typing import Any

from streamrover.serving.export import TorchExporter

TORCHSCRIPT_FILE = "model.pt"


def torchscript_config(name: str, max_batch_size: int = 0) -> str:
    """``config.pbtxt`` for Triton's libtorch backend."""
    return (f'name: "{name}"\nplatform: "pytorch_libtorch"\nmax_batch_size: {max_batch_size}\n'
            "version_policy: { latest: { num_versions: 1 } }\n")  # fmt: skip


class TorchScriptExporter(TorchExporter):
    """A :class:`~streamrover.serving.TorchExporter` that writes ``model.pt`` (TorchScript) for each version."""

    def _model_files(self, model_state: dict[str, Any]) -> dict[str, bytes]:
        import torch

        module, args = self._module_and_args(model_state, clone=True)
        with torch.no_grad():
            traced = torch.jit.trace(module, args, check_trace=False)
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
        return {TORCHSCRIPT_FILE: buffer.getvalue()}

    def _config(self) -> str:
        return torchscript_config(self.config.name)


__all__ = ["TORCHSCRIPT_FILE", "TorchScriptExporter", "torchscript_config"]
