"""The chief script of the TF-PS ledger tests (run by ``tf-ps-run``): y = 3x + 1 plus a sharded embedding.

The model's state holds a per-record ledger, ``seen`` (int32, one slot per record id, on a
parameter server), updated by the training step itself. Losses go to OUT/loss.txt (``step loss``);
at the end the ledger goes to OUT/ledger.npy and the result to OUT/result.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from streamrover.trainers.tensorflow import Adagrad, PSTrainer, default_partitioner
from streamrover.trainers.tensorflow.api import TrainerEnv

BUCKETS = 2048
_Module: Any = tf.Module


class Model(_Module):
    def __init__(self, records: int) -> None:
        super().__init__()
        self.w = tf.Variable(0.0, name="w")
        self.b = tf.Variable(0.0, name="b")
        self.emb = tf.Variable(tf.zeros((BUCKETS, 4)), name="emb")  # 32 KB: sharded over the PS (see main)
        self.seen = tf.Variable(tf.zeros((records,), tf.int32), name="seen", trainable=False)


class Served(Model):
    """The model as served (``--export``): the same variables, and a signature that predicts ``y`` from ``x, id``."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x"), tf.TensorSpec([None], tf.int64,
                                                                                             name="id")])  # fmt: skip
    def serving_signature(self, x: tf.Tensor, ids: tf.Tensor) -> dict[str, tf.Tensor]:
        e = tf.reduce_sum(tf.nn.embedding_lookup(self.emb, ids % BUCKETS), axis=1)
        return {"y": self.w * x + self.b + e}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--dataset", default="stream")
    p.add_argument("--out", required=True)
    p.add_argument("--stop-at-records", action="store_true", help="a stream: end once the cut holds --records")
    args = p.parse_args()
    out = Path(args.out)
    env = TrainerEnv.from_env()
    exporter = None
    from streamrover.serving import ExportConfig

    export = ExportConfig.from_env()  # the job spec's export: section, as streamrover run and tf-ps-run pass it
    if export is not None:
        from streamrover.serving.savedmodel import SavedModelExporter

        exporter = SavedModelExporter(export, None, lambda: Served(args.records), select="model")
    trainer = PSTrainer(env, variable_partitioner=default_partitioner(len(env.cluster.ps), 8 << 10),
                        ckpt_every=args.ckpt_every, exporter=exporter)  # fmt: skip
    with trainer.strategy.scope():
        model = Model(args.records)
        opt = Adagrad(0.2)
        opt.build(model.trainable_variables)
    assert len(model.emb.variables) == len(env.cluster.ps), "the embedding is sharded over every PS"

    def step(batch: dict[str, tf.Tensor]) -> tf.Tensor:
        ids = batch["id"]
        x = tf.cast(batch["x"], tf.float32)
        y = tf.cast(batch["y"], tf.float32)
        with tf.GradientTape() as tape:
            e = tf.reduce_sum(tf.nn.embedding_lookup(model.emb, ids % BUCKETS), axis=1)
            loss = tf.reduce_mean(tf.square(model.w * x + model.b + e - y))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        model.seen.scatter_add(tf.IndexedSlices(tf.ones_like(ids, tf.int32), ids))
        return loss

    losses = open(out / "loss.txt", "a")
    losses.write(f"# chief {os.getpid()} starts\n")

    def on_result(step_no: int, loss: Any) -> None:
        losses.write(f"{step_no} {float(loss):.6f}\n")
        losses.flush()

    result = trainer.fit(
        step, {"model": model, "opt": opt}, dataset=args.dataset, batch_size=args.batch_size,
        columns=["id", "x", "y"], stop_at_records=args.records if args.stop_at_records else None, on_result=on_result,
    )  # fmt: skip
    if not result.stopped:
        np.save(out / "ledger.npy", model.seen.numpy())
        (out / "result.json").write_text(json.dumps(result.__dict__))
    trainer.close()


if __name__ == "__main__":
    main()
