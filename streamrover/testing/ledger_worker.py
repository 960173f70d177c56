"""A worker process that consumes a dataset's shards into a :class:`Ledger`.

    python -m streamrover.testing.ledger_worker --master HOST:PORT --token T --dataset D --ledger L.db

Used by the ledger tests and the demo; it is also the smallest complete example
of a ShardClient worker that is exactly-once against a transactional sink.

Acks are queued (``async_acks=True``): a worker killed with acks still queued leaves
the ledger ahead of the master, and whoever leases the shard next catches up from the
ledger. A queued ack the master refused (a stale lease) is reported at the next ack of
its shard or at the final flush; harmless here, as the ledger's compare-and-set fences the
stale worker's writes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from streamrover.shard_service import AckFailedError, LeasedShard, LeaseLostError, ShardClient
from streamrover.testing.ledger import Ledger, LedgerConflict


def consume_shard(
    shard: LeasedShard, ledger: Ledger, worker: str, batch_size: int, id_column: str, pause_at: int, counter: list[int]
) -> None:
    """Apply one shard's records to the ledger and ack them; stop quietly if the lease goes stale."""
    found = ledger.position(shard.shard_id)
    if (found if found is not None else shard.lease.start) < shard.lease.resume:
        raise RuntimeError(
            f"shard {shard.shard_id}: the master says {shard.lease.resume} is acked, the ledger has {found}"
        )
    if found is not None and found > shard.lease.resume:
        # Killed after writing, before acking: the ledger (the model) is the truth; ack what it holds.
        ledger.note("catchup", shard.shard_id, f"{worker}: lease resumes at {shard.lease.resume}, ledger at {found}")
        shard.ack(found)
        shard.position = found
        if found == shard.lease.end:
            return
    for batch in shard.batches(batch_size):
        ids = batch.records.column(id_column).to_numpy()
        ledger.apply(shard.shard_id, batch.start, batch.end, ids, worker)
        counter[0] += 1
        if counter[0] == pause_at:
            os.kill(os.getpid(), signal.SIGSTOP)  # the test resumes us after our lease expired
        shard.ack(batch.end)


def main(argv: list[str] | None = None) -> int:
    """Consume the dataset's shards into the ledger until the dataset ends; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--master", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--ledger", required=True)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--id-column", default="id")
    p.add_argument("--name", default=None)
    p.add_argument(
        "--pause-at-batch", type=int, default=0, help="SIGSTOP self after writing this batch, before its ack"
    )
    args = p.parse_args(argv)

    ledger = Ledger(args.ledger)
    counter = [0]
    refused = 0
    with ShardClient(args.master, token=args.token, name=args.name, async_acks=True) as client:
        worker = client.join()
        for shard in client.shards(args.dataset):
            try:
                consume_shard(shard, ledger, worker, args.batch_size, args.id_column, args.pause_at_batch, counter)
            except LeaseLostError as exc:
                refused += 1
                print(f"ACK REFUSED: {exc}", flush=True)
            except LedgerConflict as exc:
                refused += 1
                print(f"LEDGER REFUSED: {exc}", flush=True)
                try:  # the master must refuse this worker's ack too: its lease is stale (wait for its answer)
                    shard.ack(shard.position, wait=True)
                    print("ACK ACCEPTED AFTER LEDGER CONFLICT", flush=True)
                except LeaseLostError as ack_exc:
                    print(f"ACK REFUSED: {ack_exc}", flush=True)
        try:
            client.flush()  # every queued ack answered before leaving
        except AckFailedError as exc:
            for failure in exc.failures:
                refused += 1
                print(f"ACK REFUSED: {failure.error}", flush=True)
    ledger.close()
    print(f"worker {worker} done: {counter[0]} batches written, {refused} stale leases", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
