"""TensorFlow adapter: the variables of a model (or any ``tf.Module``) as numpy state, and back.

For the parameter-server trainer: the coordinator reads every variable (wherever the
parameter servers hold it) into numpy arrays and saves them with its cut; loading assigns
them back. Variables are keyed by their ``tf.Module`` path (``model.layer.kernel``) when the
object tracks them, else by name, so the keys are stable across processes. TensorFlow is
imported only when these functions run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from streamrover.ckpt.api import UnsupportedStateError


def _named_variables(obj: Any) -> dict[str, Any]:
    """Variables of a tf.Module / Keras model (by attribute path) or of a sequence (by name)."""
    import tensorflow as tf

    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        named: dict[str, Any] = {}
        for var in obj:
            key = var.name
            if key in named:
                raise UnsupportedStateError(f"two variables are named {key!r}; pass a tf.Module to key them by path")
            named[key] = var
        return named
    if isinstance(obj, tf.Module) or hasattr(obj, "variables"):
        named = {}
        seen: set[int] = set()
        for path, var in _module_paths(obj):
            if id(var) not in seen:
                seen.add(id(var))
                named[path] = var
        if not named:  # Keras 3 models are not tf.Modules: key their variables by path (by position if not unique)
            keys = [getattr(v, "path", v.name) for v in obj.variables]
            if len(set(keys)) != len(keys):
                keys = [f"{i:05d}:{k}" for i, k in enumerate(keys)]
            named = dict(zip(keys, obj.variables))
        return named
    raise UnsupportedStateError(f"cannot find TensorFlow variables in a {type(obj).__qualname__}")


def _module_paths(obj: Any) -> list[tuple[str, Any]]:
    import tensorflow as tf

    if not isinstance(obj, tf.Module):
        return []
    out = []
    for path, var in obj._flatten(predicate=lambda v: isinstance(v, tf.Variable), with_path=True):
        out.append((".".join(str(p) for p in path), var))
    return out


def tf_variables_state(obj: Any) -> dict[str, Any]:
    """``{key: numpy array}`` of every variable of ``obj`` (read from the parameter servers if there)."""
    return {key: var.numpy() for key, var in _named_variables(obj).items()}


def load_tf_variables_state(state: dict[str, Any], obj: Any, strict: bool = True) -> None:
    """Assign ``state`` (from :func:`tf_variables_state`) back to the variables of ``obj``."""
    variables = _named_variables(obj)
    missing = sorted(set(variables) - set(state))
    unexpected = sorted(set(state) - set(variables))
    if strict and (missing or unexpected):
        raise UnsupportedStateError(
            f"TensorFlow state does not match the variables: missing {missing}, unexpected {unexpected}"
        )
    for key, var in variables.items():
        if key in state:
            value = state[key]
            if tuple(var.shape) != tuple(value.shape):
                raise UnsupportedStateError(
                    f"variable {key!r} has shape {tuple(var.shape)}, checkpoint has {value.shape}"
                )
            var.assign(value)
