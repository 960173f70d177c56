"""TensorFlow adapter checks, run in their own process: TensorFlow and torch's triton abort when both load in one."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import numpy as np
import tensorflow as tf

from streamrover.ckpt import Checkpointer, LoadedFrom, UnsupportedStateError
from streamrover.ckpt.tf_adapter import load_tf_variables_state, tf_variables_state

_Module: Any = tf.Module


class Tower(_Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = tf.Variable(tf.random.normal((10, 4), seed=1), name="emb")
        self.bias = tf.Variable(tf.zeros(4), name="emb")  # same name: keyed by path, not name
        self.steps = tf.Variable(7, dtype=tf.int64)


def module_round_trip(root: str, from_memory: bool) -> None:
    tower = Tower()
    saved = tf_variables_state(tower)
    assert sorted(saved) == ["bias", "embedding", "steps"], sorted(saved)
    with Checkpointer(root, saver="thread") as ckpt:
        ckpt.save(1, {"tf": saved})
        ckpt.wait(timeout=60)
        for var in tower.trainable_variables:
            var.assign_add(tf.ones_like(var))
        tower.steps.assign(0)
        loaded = ckpt.load(memory=from_memory)
        assert loaded.source == (LoadedFrom.MEMORY if from_memory else LoadedFrom.STORAGE)
        load_tf_variables_state(loaded.state["tf"], tower)
        ckpt.close(unlink=True)
    np.testing.assert_array_equal(tower.embedding.numpy(), saved["embedding"])
    assert int(tower.steps.numpy()) == 7


def keras_round_trip() -> None:
    keras: Any = importlib.import_module("keras")

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head")])
    state = tf_variables_state(model)
    assert any("head" in k for k in state), list(state)
    model.layers[0].kernel.assign(tf.zeros((3, 2)))
    load_tf_variables_state(state, model)
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), next(v for k, v in state.items() if "kernel" in k))
    try:
        load_tf_variables_state({}, model)
    except UnsupportedStateError as exc:
        assert "missing" in str(exc)
    else:
        raise AssertionError("an empty state was accepted")


if __name__ == "__main__":
    if sys.argv[1] == "keras":
        keras_round_trip()
    else:
        module_round_trip(sys.argv[2], from_memory=sys.argv[1] == "memory")
    print("OK")
