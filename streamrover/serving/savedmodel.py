"""Export durable TF parameter-server checkpoints as SavedModel versions (the TF-PS path of serving/api.py).

``PSTrainer(exporter=...)`` (``streamrover tf-ps-run`` scripts) hands every durable checkpoint to a
:class:`SavedModelExporter`; the rules are the torch exporter's (durable checkpoints only, exactly once across a
chief's SIGKILL, atomic publish, a restore retires the versions above it, retention)::

    exporter = SavedModelExporter(ExportConfig.from_env(), None, make_model, select="model")
    trainer = PSTrainer(exporter=exporter)
    ...
    trainer.fit(step, {"model": model, "opt": opt}, dataset="clicks")

A version is ``NAME/STEP/model.savedmodel/`` (``saved_model.pb``, ``variables/``) plus ``lineage.json``, and
``NAME/config.pbtxt`` names Triton's ``tensorflow_savedmodel`` platform: TF Serving and Triton load it as is.
The exporter reads the checkpoint's variables back from storage (``state["vars"]``, keys ``<select>/<path>``;
the parts of a variable sharded across parameter servers, ``<path>/part_<i>``, are concatenated along the
first axis) into a fresh module built by ``model_factory`` (no strategy), and saves that module: its
``serving_signature`` (a ``tf.function`` with an input signature) is the ``serving_default`` signature.
Embedding tables are exported whole (kind ``"full"``): no deltas on this path.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from streamrover.serving.api import ExportConfig, ExportError
from streamrover.serving.export import TorchExporter

SAVEDMODEL_DIR = "model.savedmodel"
_PART = re.compile(r"^(.*)/part_(\d+)$")


def savedmodel_config(name: str) -> str:
    """``config.pbtxt`` for Triton's TensorFlow backend (a SavedModel; signatures auto-completed)."""
    return (f'name: "{name}"\nplatform: "tensorflow_savedmodel"\nmax_batch_size: 0\n'
            "version_policy: { latest: { num_versions: 1 } }\n")  # fmt: skip


def merge_parts(variables: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Variables sharded across parameter servers (``<key>/part_<i>``) concatenated back into ``<key>``."""
    whole: dict[str, np.ndarray] = {}
    parts: dict[str, dict[int, np.ndarray]] = {}
    for key, value in variables.items():
        m = _PART.match(key)
        if m:
            parts.setdefault(m.group(1), {})[int(m.group(2))] = np.asarray(value)
        else:
            whole[key] = np.asarray(value)
    for key, by_index in parts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ExportError(f"variable {key!r}: parts {sorted(by_index)}, not 0..{len(by_index) - 1}")
        whole[key] = np.concatenate([by_index[i] for i in range(len(by_index))], axis=0)
    return whole


class SavedModelExporter(TorchExporter):
    """Exports the durable checkpoints of a TF-PS job as SavedModel versions (see the module docstring).

    Args:
        config: the repository, name and retention (``base_every`` does not apply: every version is full).
        ckpt_url: the checkpoint root (None: the trainer binds its own).
        model_factory: builds the served ``tf.Module`` with fresh variables and a ``serving_signature``.
        select: the name the module has in the trainer's state (``fit(step, {"model": model, ...})``).
    """

    def __init__(self, config: ExportConfig, ckpt_url: str | None, model_factory: Callable[[], Any], *,
                 select: str = "model", ckpt_storage_options: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__(config, ckpt_url, model_factory, (), input_names=[], output_names=[], select=select,
                         ckpt_storage_options=ckpt_storage_options)  # fmt: skip

    def _model_state(self, state: dict[str, Any]) -> dict[str, Any]:
        prefix = self.select.rstrip("/") + "/"
        variables = state.get("vars")
        if not isinstance(variables, dict):
            raise ExportError("the checkpoint holds no TF variables (state['vars']): not a PSTrainer checkpoint")
        return merge_parts({k[len(prefix):]: v for k, v in variables.items() if k.startswith(prefix)})

    def _model_files(self, model_state: dict[str, Any]) -> dict[str, bytes]:
        import tensorflow as tf

        module = self.model_factory()
        signature = getattr(module, "serving_signature", None)
        if signature is None:
            raise ExportError(f"{type(module).__qualname__} has no serving_signature (a tf.function with an "
                              "input_signature): SavedModel needs one to serve")  # fmt: skip
        found = module._flatten(predicate=lambda v: isinstance(v, tf.Variable), with_path=True)
        variables = {"/".join(str(p) for p in path): var for path, var in found}
        if set(variables) != set(model_state):
            raise ExportError(f"the checkpoint's variables do not fit the model factory's module: missing "
                              f"{sorted(set(variables) - set(model_state))[:8]}, unexpected "
                              f"{sorted(set(model_state) - set(variables))[:8]} (select={self.select!r})")  # fmt: skip
        for key, var in variables.items():
            if tuple(var.shape) != tuple(model_state[key].shape):
                raise ExportError(f"variable {key!r}: shape {tuple(var.shape)} in the module, "
                                  f"{tuple(model_state[key].shape)} in the checkpoint")  # fmt: skip
            var.assign(model_state[key])
        files: dict[str, bytes] = {}
        with tempfile.TemporaryDirectory(prefix="streamrover-savedmodel-") as tmp:
            tf.saved_model.save(module, tmp, signatures={"serving_default": signature})
            for here, _dirs, names in os.walk(tmp):
                for name in names:
                    path = os.path.join(here, name)
                    with open(path, "rb") as fh:
                        files[f"{SAVEDMODEL_DIR}/{os.path.relpath(path, tmp)}"] = fh.read()
        return files

    def _config(self) -> str:
        return savedmodel_config(self.config.name)


__all__ = ["SAVEDMODEL_DIR", "SavedModelExporter", "merge_parts", "savedmodel_config"]
