"""Optimizers for parameter-server training: plain ``tf.Module`` s with their slots on the parameter servers.

Keras 3 (the ``tf.keras`` of TensorFlow 2.16+) does not support ``ParameterServerStrategy``, so
these few lines replace it: SGD and Adagrad (the usual optimizer of sparse CTR models) with dense
and sparse (``IndexedSlices``) updates. Call :meth:`build` under ``strategy.scope()`` on the chief
with the variables to train: each slot is colocated with its variable (one slot per part of a
sharded variable), so the update runs on the parameter server that holds it. :meth:`apply` runs
inside the step function, on a worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

_Module: Any = tf.Module


class SGD(_Module):
    """``var -= lr * grad``."""

    def __init__(self, learning_rate: float = 0.01, name: str | None = None) -> None:
        super().__init__(name=name)
        self.learning_rate = float(learning_rate)

    def build(self, variables: Sequence[tf.Variable], strategy: Any = None) -> None:
        """No slots."""

    def apply(self, grads: Sequence[Any], variables: Sequence[tf.Variable]) -> None:
        """Apply one step's gradients (dense tensors or ``IndexedSlices``; ``None`` is skipped)."""
        for grad, var in zip(grads, variables, strict=True):
            if grad is None:
                continue
            if isinstance(grad, tf.IndexedSlices):
                var.scatter_sub(tf.IndexedSlices(self.learning_rate * grad.values, grad.indices))
            else:
                var.assign_sub(self.learning_rate * grad)


class Adagrad(_Module):
    """Adagrad: ``acc += grad**2; var -= lr * grad / sqrt(acc)``, sparse rows updated alone."""

    def __init__(self, learning_rate: float = 0.1, initial_accumulator: float = 0.1, name: str | None = None) -> None:
        super().__init__(name=name)
        self.learning_rate = float(learning_rate)
        self.initial_accumulator = float(initial_accumulator)
        self.accumulators: list[tf.Variable] = []
        self._index: dict[int, int] = {}

    def build(self, variables: Sequence[tf.Variable], strategy: Any = None) -> None:
        """Create one accumulator per variable, colocated with it (call under ``strategy.scope()``)."""
        strategy = strategy or tf.distribute.get_strategy()
        for var in variables:
            if id(var) in self._index:
                continue
            with strategy.extended.colocate_vars_with(var):
                acc = tf.Variable(
                    tf.fill(var.shape, tf.constant(self.initial_accumulator, var.dtype)), trainable=False,
                    name=var.name.split(":")[0].replace("/", "_") + "_accumulator",
                )  # fmt: skip
            self._index[id(var)] = len(self.accumulators)
            self.accumulators.append(acc)

    def apply(self, grads: Sequence[Any], variables: Sequence[tf.Variable]) -> None:
        """Apply one step's gradients; every variable must have been :meth:`build` -t."""
        for grad, var in zip(grads, variables, strict=True):
            if grad is None:
                continue
            if id(var) not in self._index:
                raise KeyError(f"Adagrad.apply: {var.name} has no accumulator; call build() with it first")
            acc = self.accumulators[self._index[id(var)]]
            if isinstance(grad, tf.IndexedSlices):
                acc.scatter_add(tf.IndexedSlices(tf.square(grad.values), grad.indices))
                rows = tf.gather(acc, grad.indices)
                step = self.learning_rate * grad.values * tf.math.rsqrt(rows)
                var.scatter_sub(tf.IndexedSlices(step, grad.indices))
            else:
                acc.assign_add(tf.square(grad))
                var.assign_sub(self.learning_rate * grad * tf.math.rsqrt(acc))
