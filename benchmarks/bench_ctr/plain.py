"""The loop users write today, for the ctr bench: torchrun, one confluent-kafka consumer per rank, no exactly-once.

Each rank joins one consumer group (the group spreads the topic's partitions over the ranks),
polls up to ``--batch-size`` JSON records, decodes them, scores the batch, trains the same
DeepFM with the same optimizer under DDP and goes on; no leases, acks, checkpoints or ledger.
Every rank steps in lock-step (an empty batch when its poll found nothing); the loop ends once
the ranks together trained ``--records`` records. Rank 0 writes ``plain.json``: records, the
seconds from the first to the last step, and the progressive AUC of its own batches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # torchrun runs this file as a script

from examples.streaming_ctr import metrics
from examples.streaming_ctr.clickstream import CATEGORICAL, NUMERIC
from examples.streaming_ctr.model import DeepFM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--records", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from confluent_kafka import Consumer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = DeepFM()
    ddp = DDP(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    consumer = Consumer({"bootstrap.servers": args.bootstrap, "group.id": f"plain-{args.topic}",
                         "auto.offset.reset": "earliest", "session.timeout.ms": 6000})  # fmt: skip
    consumer.subscribe([args.topic])
    rows = np.zeros((1, metrics.ROW))
    total, first, last = 0, None, 0.0
    seen = torch.zeros(1, dtype=torch.int64)
    while True:
        msgs = consumer.consume(args.batch_size, timeout=0.5)
        recs = [json.loads(m.value()) for m in msgs if m.error() is None]
        n = len(recs)
        cats = torch.tensor([[r[c] for c in CATEGORICAL] for r in recs], dtype=torch.int64).reshape(n, len(CATEGORICAL))
        nums = torch.tensor([[r[c] for c in NUMERIC] for r in recs], dtype=torch.float32).reshape(n, len(NUMERIC))
        y = torch.tensor([r["clicked"] for r in recs], dtype=torch.float32)
        logits = ddp(cats, nums)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="sum") / max(n, 1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if n:
            z = logits.detach().double().numpy()
            rows += metrics.window_rows(np.zeros(n, np.int64), z, np.zeros(n), y.double().numpy(), np.zeros(n), 0.0, 1)
        seen[0] = n
        dist.all_reduce(seen)
        if int(seen[0]) and first is None:
            first = time.monotonic()
        total += int(seen[0])
        last = time.monotonic()
        if total >= args.records:
            break
    consumer.close()
    if rank == 0:
        fig = metrics.figures(rows)[0]
        doc = {"records": total, "seconds": last - (first or last), "auc_rank0": fig.auc}
        Path(args.out, "plain.json").write_text(json.dumps(doc))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
