"""Wide & deep CTR on a Kafka topic with TF parameter-server training: the chief script of ``tf-ps-run``.

Records are JSON ``{"label": 0|1, "c0".."c3": categorical ids, "d0", "d1": dense floats}``. Each
categorical id is hashed into a bucket of its own embedding table (sharded across the parameter
servers by the variable partitioner); the wide part is a per-bucket weight, the deep part an MLP
over the embeddings and the dense features. Adagrad, as CTR models usually train.

    streamrover tf-ps-run --ps 2 --workers 3 --shard-service HOST:PORT --token TOKEN --ckpt-dir CKPT \\
        examples/tf_ps/train.py --dataset clicks
"""

from __future__ import annotations

import argparse
from typing import Any

import tensorflow as tf

from streamrover.trainers.tensorflow import Adagrad, PSTrainer

CATEGORICAL = ["c0", "c1", "c2", "c3"]
DENSE = ["d0", "d1"]
_Module: Any = tf.Module


class WideDeep(_Module):
    def __init__(self, buckets: int, dim: int = 8, hidden: int = 32) -> None:
        super().__init__()
        init = tf.random_normal_initializer(stddev=0.05, seed=1)
        self.emb = [tf.Variable(init((buckets, dim)), name=f"emb_{c}") for c in CATEGORICAL]
        self.wide = [tf.Variable(tf.zeros((buckets, 1)), name=f"wide_{c}") for c in CATEGORICAL]
        width = dim * len(CATEGORICAL) + len(DENSE)
        self.w1 = tf.Variable(init((width, hidden)), name="w1")
        self.b1 = tf.Variable(tf.zeros(hidden), name="b1")
        self.w2 = tf.Variable(init((hidden, 1)), name="w2")
        self.b2 = tf.Variable(tf.zeros(1), name="b2")
        self.buckets = buckets

    def logits(self, batch: dict[str, tf.Tensor]) -> tf.Tensor:
        hashed = [tf.math.floormod(tf.cast(batch[c], tf.int64) * 2654435761, self.buckets) for c in CATEGORICAL]
        deep_in = [tf.nn.embedding_lookup(e, h) for e, h in zip(self.emb, hashed)]
        deep_in += [tf.expand_dims(tf.cast(batch[d], tf.float32), 1) for d in DENSE]
        hidden = tf.nn.relu(tf.concat(deep_in, axis=1) @ self.w1 + self.b1)
        wide = tf.add_n([tf.nn.embedding_lookup(w, h) for w, h in zip(self.wide, hashed)])
        return tf.squeeze(hidden @ self.w2 + self.b2 + wide, axis=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="clicks")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--buckets", type=int, default=100_000)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--records", type=int, default=0, help="a stream: stop once the committed cut holds this many")
    args = p.parse_args()
    trainer = PSTrainer(ckpt_every=args.ckpt_every)
    with trainer.strategy.scope():
        model = WideDeep(args.buckets)
        opt = Adagrad(0.05)
        opt.build(model.trainable_variables)

    def step(batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        labels = tf.cast(batch["label"], tf.float32)
        with tf.GradientTape() as tape:
            logits = model.logits(batch)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return {"loss": loss, "rows": tf.size(labels)}

    seen = {"steps": 0, "loss": 0.0}

    def on_result(step_no: int, out: Any) -> None:
        seen["steps"] += 1
        seen["loss"] = 0.98 * seen["loss"] + 0.02 * float(out["loss"]) if seen["steps"] > 1 else float(out["loss"])
        if step_no % 200 == 0:
            print(f"step {step_no}: loss (moving average) {seen['loss']:.4f}", flush=True)

    result = trainer.fit(
        step, {"model": model, "opt": opt}, dataset=args.dataset, batch_size=args.batch_size,
        columns=["label", *CATEGORICAL, *DENSE], stop_at_records=args.records or None, on_result=on_result,
    )  # fmt: skip
    print(f"done at step {result.step}: {result.records:,} records in the last checkpoint, "
          f"{result.rollbacks} rollbacks, restored from {result.restored_from}, loss {seen['loss']:.4f}")  # fmt: skip
    trainer.close()


if __name__ == "__main__":
    main()
