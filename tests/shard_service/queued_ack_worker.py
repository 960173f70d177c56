"""A worker that is killed with acks still queued (for tests/shard_service/test_async_acks.py).

    python -m tests.shard_service.queued_ack_worker MASTER TOKEN DATASET LEDGER

It leases one shard and prints ``LEASED``; once a line arrives on stdin (the test has
stopped the master meanwhile) it writes the shard to the ledger batch by batch, queueing
an ack after each (a different step each, so no two merge; the first is on the wire before
the rest are queued), prints ``QUEUED <n> <k>`` with
the number of acks not yet answered and how many of them were sent, and waits on stdin
again, where the test SIGKILLs it.
"""

from __future__ import annotations

import sys
import time

from streamrover.shard_service import ShardClient
from streamrover.testing.ledger import Ledger


def main(argv: list[str]) -> int:
    master, token, dataset, ledger_path = argv
    ledger = Ledger(ledger_path)
    client = ShardClient(master, token=token, name="queued", heartbeat=False, timeout=60, async_acks=True)
    worker = client.join()
    _, (shard,) = client.lease(dataset, 1)
    print(f"LEASED {shard.shard_id}", flush=True)
    sys.stdin.readline()
    for step, batch in enumerate(shard.batches(1000), start=1):
        ledger.apply(shard.shard_id, batch.start, batch.end, batch.records.column("id").to_numpy(), worker)
        shard.ack(batch.end, step=step)
        if step == 1:
            # The first ack is sent (the master, stopped, cannot answer it) before the others are queued: the
            # sender then waits for its answer, so the later acks provably stay in this process and die with
            # it. (Sent acks reach the master's socket and are recorded when it resumes; had the first ack
            # waited until all were queued, one batch would carry them all and nothing would need catching up.)
            deadline = time.monotonic() + 30
            while client.acks_in_flight == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError("the first ack was never sent")
                time.sleep(0.001)  # polls the sender's state; the test gets no answer sooner from waiting longer
    print(f"QUEUED {client.acks_pending} {client.acks_in_flight}", flush=True)
    sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
