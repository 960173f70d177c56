"""PS variables as numpy state and back, sharded variables included.

``streamrover.ckpt.tf_adapter`` keys plain variables by their ``tf.Module`` path; under
``ParameterServerStrategy`` with a ``variable_partitioner`` a large variable is a
``ShardedVariable`` whose parts live on different parameter servers, and ``tf.Module``'s walk
does not look inside it. Here every part is its own entry (``model/emb/part_1``), so the chief
saves all parameter servers' variables as one checkpoint part and assigns each part back to the
server that holds it. TensorFlow is imported only when these functions run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from streamrover.ckpt.api import UnsupportedStateError


def named_variables(objects: Mapping[str, Any]) -> dict[str, Any]:
    """``{key: tf.Variable}`` of every variable (each part of a sharded one) of each named ``tf.Module``."""
    import tensorflow as tf
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    named: dict[str, Any] = {}
    for prefix, obj in objects.items():
        if not isinstance(obj, tf.Module):
            raise UnsupportedStateError(f"state {prefix!r} is a {type(obj).__qualname__}, not a tf.Module")
        found = obj._flatten(
            predicate=lambda v: isinstance(v, (tf.Variable, ShardedVariable)), with_path=True, expand_composites=False
        )
        seen: set[int] = set()
        for path, var in found:
            key = "/".join([prefix, *(str(p) for p in path)])
            parts = list(var.variables) if isinstance(var, ShardedVariable) else [var]
            for i, part in enumerate(parts):
                if id(part) in seen:
                    continue
                seen.add(id(part))
                named[f"{key}/part_{i}" if isinstance(var, ShardedVariable) else key] = part
    return named


def variables_state(objects: Mapping[str, Any]) -> dict[str, Any]:
    """``{key: numpy array}`` of every variable of ``objects``, read from the parameter servers."""
    return {key: var.numpy() for key, var in named_variables(objects).items()}


def load_variables_state(state: Mapping[str, Any], objects: Mapping[str, Any]) -> int:
    """Assign ``state`` (from :func:`variables_state`) to the variables of ``objects``; returns how many.

    Every variable must be in the state with its shape (a changed partitioning or model is named).
    """
    variables = named_variables(objects)
    missing = sorted(set(variables) - set(state))
    unexpected = sorted(set(state) - set(variables))
    if missing or unexpected:
        raise UnsupportedStateError(
            f"checkpoint does not match the PS variables: missing {missing[:8]}, unexpected {unexpected[:8]} "
            "(a different model or a different number of parameter servers?)"
        )
    for key, var in variables.items():
        value = state[key]
        if tuple(var.shape) != tuple(value.shape):
            raise UnsupportedStateError(f"variable {key!r} has shape {tuple(var.shape)}, checkpoint has {value.shape}")
        var.assign(value)
    return len(variables)
