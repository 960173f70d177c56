"""Lease+ack over TLS against plaintext (issue 33): the cost of the encrypted wire, as a ratio in one run.

Two real masters (``streamrover master`` processes, SQLite journals in a temporary directory), one serving
plaintext and one TLS (a certificate the ``openssl`` command made, the client verifying it by its CA), each with
a dataset of one-record shards so that only the lease+ack cycle is measured. One client per master, in this
process, both connected before the clock starts; a worker's cycle is ``lease()`` then ``ack()`` (two messages
on the worker session stream, as ``ShardClient`` sends them). The two take turns of ``--slice`` seconds,
round after round, so each round's ratio compares turns a second apart (these VMs' speed drifts within a
minute); the median of the rounds is the row. Goal (issue 33): TLS/plaintext >= 0.9.

Also a row for new connections: a client connecting and making its first call (a TLS handshake each time),
plaintext against TLS, the same alternation.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._common import environment, load, table
from benchmarks.bench_shard_service.rtt import write_rtt_file


def _cycles(client: object, seconds: float) -> int:
    """Lease+ack cycles of one-record shards for ``seconds``."""
    done = 0
    give_up = time.perf_counter() + seconds
    while time.perf_counter() < give_up:
        _, leased = client.lease("rtt", 1, wait=5.0)  # type: ignore[attr-defined]
        for shard in leased:
            shard.ack(shard.lease.end)
            done += 1
    return done


def _connects(address: str, token: str, tls: object, seconds: float) -> int:
    """New clients connected (and answered a call) for ``seconds``."""
    from streamrover.shard_service import ShardClient

    done = 0
    give_up = time.perf_counter() + seconds
    while time.perf_counter() < give_up:
        with ShardClient(address, token=token, heartbeat=False, tls=tls, session=False) as c:  # type: ignore[arg-type]
            c.status()
        done += 1
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks tls", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--quick", action="store_true", help="a smoke-sized run")
    p.add_argument("--slice", type=float, default=None, help="seconds of each turn (default 0.5, quick 0.25)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of turns (default 12, quick 3)")
    args, _ = p.parse_known_args(argv)
    slice_s = args.slice or (0.25 if args.quick else 0.5)
    rounds = args.rounds or (3 if args.quick else 12)

    from streamrover.shard_service import DatasetSpec, ShardClient
    from streamrover.shard_service.client.tls import ClientTls
    from streamrover.testing.certs import issue, make_ca
    from streamrover.testing.procs import MasterProcess

    print(environment())
    print(f"load: {load()}")
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp_s:
        tmp = Path(tmp_s)
        ca = make_ca(tmp / "pki")
        server = issue(ca, tmp / "pki", "server")
        data = tmp / "rtt.parquet"
        write_rtt_file(data, 200_000)
        plain = MasterProcess(tmp / "plain", lease_ttl=30)
        secure = MasterProcess(tmp / "tls", lease_ttl=30,
                               extra_args=["--tls-cert", str(server.cert), "--tls-key", str(server.key)])  # fmt: skip
        tls = ClientTls(str(ca.cert))
        clients = {}
        try:
            for name, master, t in (("plaintext", plain, None), ("TLS", secure, tls)):
                master.start()
                c = ShardClient(master.address, token=master.token, heartbeat=False, tls=t)
                c.register_dataset(DatasetSpec("rtt", str(data), records_per_shard=1, epochs=100))
                c.join()
                _cycles(c, 0.3)  # warm-up: the session stream open, the first pages of the journal touched
                clients[name] = (c, master, t)
            ratios, rates = [], {"plaintext": [], "TLS": []}
            conn_ratios = []
            for r in range(rounds):
                order = ["plaintext", "TLS"] if r % 2 == 0 else ["TLS", "plaintext"]
                got = {k: _cycles(clients[k][0], slice_s) / slice_s for k in order}
                for k, v in got.items():
                    rates[k].append(v)
                ratios.append(got["TLS"] / got["plaintext"])
                conn = {k: _connects(clients[k][1].address, clients[k][1].token, clients[k][2], slice_s / 2)
                        for k in order}  # fmt: skip
                conn_ratios.append(conn["TLS"] / max(conn["plaintext"], 1))
        finally:
            for c, _master, _ in clients.values():
                c.close()
            for master in (plain, secure):
                if master.proc is not None:
                    master.stop()
    rows = [
        ("lease+ack cycles/s (1 client, session)", statistics.median(rates["plaintext"]),
         statistics.median(rates["TLS"]), statistics.median(ratios), min(ratios), max(ratios)),
        ("new connection + first call", "", "", statistics.median(conn_ratios), min(conn_ratios), max(conn_ratios)),
    ]  # fmt: skip
    print(f"\n{rounds} rounds of {slice_s}s turns, alternating; ratio = TLS / plaintext per round (goal >= 0.9)")
    print(table(["what", "plaintext/s", "TLS/s", "ratio (median)", "min", "max"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
