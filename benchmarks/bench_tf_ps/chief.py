"""The chief of ``bench_tf_ps`` (run by ``tf-ps-run``): one model, fed through shards or by tf.data directly.

``--mode shards``: :class:`PSTrainer` on the registered dataset (leases, acks after fetch, flash
checkpoints every ``--ckpt-every`` steps). ``--mode tfdata``: the same coordinator loop (the same
step, the same in-flight window) over ``tf.data`` reading the parquet files' columns directly, no
shard service; with ``--ckpt-manager DIR`` it saves a ``tf.train.CheckpointManager`` checkpoint every
``--ckpt-every`` steps and restores the newest one on start (the recovery peer). Both append JSON
lines (``restore``, ``resumed``: first step done after a start, ``done``) to ``$STREAMROVER_TF_EVENTS``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from collections import deque
from typing import Any

import pyarrow.parquet as pq
import tensorflow as tf

from streamrover.trainers.tensorflow import Adagrad, PSTrainer, default_partitioner
from streamrover.trainers.tensorflow.api import EVENTS, TrainerEnv

_Module: Any = tf.Module


class Model(_Module):
    def __init__(self, buckets: int, dim: int) -> None:
        super().__init__()
        self.w = tf.Variable(0.0, name="w")
        self.b = tf.Variable(0.0, name="b")
        self.emb = tf.Variable(tf.zeros((buckets, dim)), name="emb")


def event(kind: str, **fields: Any) -> None:
    path = os.environ.get(EVENTS)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"event": kind, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["shards", "tfdata"], required=True)
    p.add_argument("--data", default="", help="tfdata: the parquet directory")
    p.add_argument("--ckpt-manager", default="", help="tfdata: a tf.train.CheckpointManager directory")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--buckets", type=int, default=4096)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--ckpt-every", type=int, default=50)
    args = p.parse_args()
    env = TrainerEnv.from_env()
    trainer = PSTrainer(env, variable_partitioner=default_partitioner(len(env.cluster.ps), 64 << 10),
                        ckpt_every=args.ckpt_every)  # fmt: skip
    with trainer.strategy.scope():
        model = Model(args.buckets, args.dim)
        opt = Adagrad(0.2)
        opt.build(model.trainable_variables)

    def step(batch: dict[str, tf.Tensor]) -> tf.Tensor:
        x, y = tf.cast(batch["x"], tf.float32), tf.cast(batch["y"], tf.float32)
        with tf.GradientTape() as tape:
            e = tf.reduce_sum(tf.nn.embedding_lookup(model.emb, batch["id"] % args.buckets), axis=1)
            loss = tf.reduce_mean(tf.square(model.w * x + model.b + e - y))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    started = time.time()
    if args.mode == "shards":
        result = trainer.fit(step, {"model": model, "opt": opt}, dataset="bench", batch_size=args.batch_size,
                             columns=["id", "x", "y"])  # fmt: skip
        event("done", seconds=time.time() - started, records=result.records, rollbacks=result.rollbacks)
        trainer.close()
        return
    table = pq.read_table(sorted(glob.glob(os.path.join(args.data, "*.parquet"))), columns=["id", "x", "y"])
    columns = {name: table.column(name).to_numpy() for name in table.column_names}
    records = len(columns["id"])
    ckpt = tf.train.Checkpoint(model=model, opt=opt, step=tf.Variable(0, dtype=tf.int64))
    manager = tf.train.CheckpointManager(ckpt, args.ckpt_manager, max_to_keep=2) if args.ckpt_manager else None
    first = 0
    if manager is not None and manager.latest_checkpoint:
        t0 = time.time()
        ckpt.restore(manager.latest_checkpoint)
        first = int(ckpt.step.numpy())
        event("restore", source="checkpoint_manager", step=first, seconds=time.time() - t0)
    dataset = tf.data.Dataset.from_tensor_slices(columns).batch(args.batch_size).skip(first).prefetch(8)
    fn = tf.function(step, reduce_retracing=True)
    inflight: deque[Any] = deque()
    step_no, resumed = first, False
    for batch in dataset:
        step_no += 1
        inflight.append(trainer.coordinator.schedule(fn, args=(batch,)))
        while len(inflight) > trainer.max_inflight:
            inflight.popleft().fetch()
            if not resumed:
                resumed = True
                event("resumed", step=step_no)
        if manager is not None and step_no % args.ckpt_every == 0:
            trainer.coordinator.join()
            ckpt.step.assign(step_no)
            manager.save(checkpoint_number=step_no)
            event("checkpoint", step=step_no)
    trainer.coordinator.join()
    event("done", seconds=time.time() - started, records=records - first * args.batch_size, steps=step_no)


if __name__ == "__main__":
    main()
