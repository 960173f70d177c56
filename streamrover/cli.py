"""``streamrover``: run a job master, manage datasets, watch status.

Client commands find the master with ``--master HOST:PORT`` (or ``$STREAMROVER_MASTER``)
and authenticate with ``--token`` (or ``$STREAMROVER_TOKEN``, or ``--token-file``). The tables
they print are drawn in ``cli_tables.py``; ``run`` and ``jobs`` are ``operator/cli.py``'s, ``checkpoints``
``ckpt/cli.py``'s.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console

from streamrover.ckpt import cli as ckpt_cli
from streamrover.cli_tables import commit_gaps_table, dataset_table, partitions_table, status_view
from streamrover.cursor import DataCursor
from streamrover.operator import cli as operator_cli
from streamrover.shard_service.api import DEFAULT_LEASE_TTL, DEFAULT_MAX_SESSIONS, DatasetSpec, ShardServiceError
from streamrover.sources.api import SourceError
from streamrover.tokens import resolve_token

LOG_WIDTH = 4096  # columns of a console that is not a terminal: tables take their natural width


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", default=os.environ.get("STREAMROVER_MASTER", "127.0.0.1:7070"), help="HOST:PORT")
    p.add_argument("--token", default=None, help="job token (default: $STREAMROVER_TOKEN)")
    p.add_argument("--token-file", default=None, help="read the token from this file (e.g. STATE_DIR/token)")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds to keep retrying an unreachable master")
    p.add_argument("--tls-ca", default=os.environ.get("STREAMROVER_TLS_CA"),
                   help="verify the master's certificate by this CA (PEM; default $STREAMROVER_TLS_CA): TLS")
    p.add_argument("--tls-cert", default=os.environ.get("STREAMROVER_TLS_CERT"),
                   help="this client's certificate, for a master with mutual TLS (default $STREAMROVER_TLS_CERT)")
    p.add_argument("--tls-key", default=os.environ.get("STREAMROVER_TLS_KEY"),
                   help="this client's key (default $STREAMROVER_TLS_KEY)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrover", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    m = sub.add_parser("master", help="run the job master (shard service); `master stop` stops a running one")
    m.add_argument("--state-dir", required=True, help="directory of the durable journal (and the token file)")
    m.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1 only)")
    m.add_argument("--port", type=int, default=7070, help="port (0 = pick a free one)")
    m.add_argument("--token", default=os.environ.get("STREAMROVER_TOKEN"), help="auth token (default: STATE_DIR/token)")
    m.add_argument("--token-file", default=None, help="read the auth token from this file")
    m.add_argument("--lease-ttl", type=float, default=DEFAULT_LEASE_TTL, help="seconds a lease lives without heartbeat")
    m.add_argument("--durability", choices=["normal", "fsync"], default="normal")
    m.add_argument("--address-file", default=None, help="write HOST:PORT here once listening")
    m.add_argument("--http-port", type=int, default=None,
                   help="port of the HTTP endpoint (/metrics, the dashboard): default the gRPC port + 1 (a free"
                   " port if that is taken or the gRPC port is 0); 0 = a free port; -1 = none"
                   " (its URL goes to STATE_DIR/dashboard.url)")
    m.add_argument("--http-host", default="127.0.0.1", help="interface of the HTTP endpoint (default: 127.0.0.1)")
    m.add_argument("--worker-token-file", default=None,
                   help="the worker token (default: derived from the admin token; `streamrover worker-token`)")
    m.add_argument("--tls-cert", default=None, help="serve gRPC and HTTP over TLS with this certificate (PEM)")
    m.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    m.add_argument("--tls-client-ca", default=None,
                   help="mutual TLS: clients must present a certificate this CA signed")
    m.add_argument("--max-request-mb", type=float, default=4.0,
                   help="larger requests are refused RESOURCE_EXHAUSTED unread (default 4)")
    m.add_argument("--straggler-threshold", type=float, default=2.0,
                   help="a node whose ranks' busy time per step is above this times the other nodes' median ...")
    m.add_argument("--straggler-window", type=float, default=30.0,
                   help="... for this many seconds is a straggler (status, /metrics; default 2x for 30 s)")
    m.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS,
                   help="worker session streams served at once, a server thread each (default %(default)s); past it"
                   " a worker uses unary calls")
    m.add_argument("--switch-interval-ms", type=float, default=None,
                   help="the interpreter's thread switch interval (Python's default 5 ms); 1 halves the lease p99"
                   " of a master serving ~1,000 worker streams, for ~20%% more CPU per shard (issue 32)")

    wt = sub.add_parser("worker-token", help="print the worker token of an admin token (what workers are given)")
    wt.add_argument("--token", default=os.environ.get("STREAMROVER_TOKEN"), help="the admin token")
    wt.add_argument("--token-file", default=None, help="read the admin token from this file (e.g. STATE_DIR/token)")

    d = sub.add_parser("dataset", help="register and inspect datasets")
    dsub = d.add_subparsers(dest="dataset_command", required=True)
    add = dsub.add_parser("add", help="register a dataset")
    add.add_argument("name")
    add.add_argument("uri", help="path, glob, directory or fsspec URL")
    add.add_argument("--format", default="", choices=["", "parquet", "csv", "jsonl"])
    add.add_argument("--records-per-shard", type=int, default=0)
    add.add_argument("--epochs", type=int, default=1)
    add.add_argument("--shuffle", action="store_true")
    add.add_argument("--seed", type=int, default=0)
    add.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="source option (repeatable)")
    _client_args(add)
    rm = dsub.add_parser("remove", help="remove a dataset (revokes its leases, forgets its shards and progress)")
    rm.add_argument("name")
    _client_args(rm)
    lst = dsub.add_parser("list", help="list datasets")
    _client_args(lst)
    res = dsub.add_parser("resume", help="resume a failed dataset once its cause is fixed")
    res.add_argument("name")
    res.add_argument("--skip-lost", action="store_true",
                     help="account records deleted upstream before they were trained as lost, and go on")
    _client_args(res)
    desc = dsub.add_parser("describe", help="show one dataset")
    desc.add_argument("name")
    desc.add_argument("--json", action="store_true")
    desc.add_argument("--partitions", type=_partition_count, default=20, metavar="N|all",
                      help="partitions to show, the most lagging first (default 20; all: every one, by index)")
    _client_args(desc)

    sub.add_parser("tf-ps-run", help="launch a TensorFlow parameter-server job (see tf-ps-run --help)", add_help=False)

    st = sub.add_parser("status", help="datasets, shards, workers and rates (or, given JOB, a job's nodes)")
    st.add_argument("job", nargs="?", default=None, help="a job started with `streamrover run`: show its status")
    st.add_argument("--json", action="store_true", help="with JOB: the status document as JSON")
    operator_cli.add_platform_args(st)  # with JOB: where it runs
    st.add_argument("--watch", type=float, default=0.0, metavar="SECONDS", help="refresh every SECONDS")
    st.add_argument("--partitions", type=_partition_count, default=None, metavar="N|all",
                    help="also each dataset's N most lagging partitions (all: every one); totals are always shown")
    _client_args(st)
    operator_cli.add_parsers(sub)
    ckpt_cli.add_parsers(sub)

    rs = sub.add_parser("restore", help="reset the shard service's cursor (what a checkpoint load does)")
    target = rs.add_mutually_exclusive_group(required=True)
    target.add_argument("--cut", type=int, help="reset to a cut the master remembers")
    target.add_argument("--empty", action="store_true", help="reset to an empty cursor: start over")
    rs.add_argument(
        "--discard-committed",
        action="store_true",
        help="allow --empty to throw away the committed cursor: every record already in a committed checkpoint "
        "is read (and trained on) again",
    )
    _client_args(rs)
    return parser


def _options(pairs: list[str]) -> dict[str, str]:
    """``--option KEY=VALUE`` arguments as a dict; a malformed one is an error naming it."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SourceError(f"--option {pair!r}: write it as KEY=VALUE, e.g. sr.max_delay_ms=500")
        options[key] = value
    return options


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from streamrover.shard_service.client import ShardClient
    from streamrover.shard_service.client.tls import ClientTls

    token = resolve_token(args.token, args.token_file)
    tls = ClientTls(args.tls_ca, args.tls_cert, args.tls_key, os.environ.get("STREAMROVER_TLS_SERVER_NAME") or None)
    return ShardClient(args.master, token=token, heartbeat=False, timeout=args.timeout,
                       tls=tls if args.tls_ca else None)  # fmt: skip


def _stop_master(argv: list[str]) -> int:
    """``streamrover master stop``: the Stop call (admin token only); the master ends its RPCs and exits."""
    parser = argparse.ArgumentParser(prog="streamrover master stop",
                                     description="stop a running master (the admin token's Stop call)")  # fmt: skip
    parser.add_argument("--reason", default="streamrover master stop", help="recorded in the master's log")
    _client_args(parser)
    args = parser.parse_args(argv)
    console = _console()
    try:
        with _client(args) as client:
            client.stop(args.reason)
    except (ShardServiceError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    console.print(f"master {args.master} stopping ({args.reason})")
    return 0


def _run_master(args: argparse.Namespace) -> int:
    from streamrover.shard_service.master import MasterServer, load_or_create_token
    from streamrover.shard_service.master.auth import Tokens
    from streamrover.shard_service.master.tls import TlsFiles

    state_dir = Path(args.state_dir)
    if args.token_file or not args.token:  # a file is read again when it changes (a rotation)
        token_file = args.token_file or (load_or_create_token(state_dir) and state_dir / "token")
        tokens = Tokens(admin_file=token_file, worker_file=args.worker_token_file)
    else:
        tokens = Tokens(args.token, worker_file=args.worker_token_file)
    tls = None
    if args.tls_cert or args.tls_key or args.tls_client_ca:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("streamrover master: --tls-cert and --tls-key go together (--tls-client-ca needs both)")
        tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca)
    if args.straggler_threshold <= 1.0 or args.straggler_window < 0:
        raise SystemExit(f"streamrover master: --straggler-threshold {args.straggler_threshold} must be more than 1 "
                         f"and --straggler-window {args.straggler_window} at least 0")  # fmt: skip
    http_port = args.http_port
    if http_port is None:
        http_port = args.port + 1 if args.port else 0
    if args.switch_interval_ms is not None:
        if not 0 < args.switch_interval_ms <= 1000:
            raise SystemExit(f"streamrover master: --switch-interval-ms {args.switch_interval_ms} must be in (0, 1000]")
        sys.setswitchinterval(args.switch_interval_ms / 1000)  # a thread woken by gRPC waits this long at most
    server = MasterServer(
        state_dir, tokens, host=args.host, port=args.port, lease_ttl=args.lease_ttl, durability=args.durability,
        http_port=None if http_port < 0 else http_port, http_host=args.http_host, http_fallback=args.http_port is None,
        tls=tls, max_request_bytes=int(args.max_request_mb * (1 << 20)), max_sessions=args.max_sessions,
        straggler_threshold=args.straggler_threshold, straggler_window=args.straggler_window,
    )  # fmt: skip
    if args.address_file:
        tmp = Path(args.address_file + ".tmp")
        tmp.write_text(server.address + "\n")
        tmp.rename(args.address_file)
    print(f"streamrover master listening on {server.address}; state in {state_dir}", flush=True)
    if not args.token and not args.token_file:
        print(f"token: {state_dir / 'token'}", flush=True)
    if server.security_warning:
        print(f"WARNING: {server.security_warning}", file=sys.stderr, flush=True)
    if server.dashboard is not None:  # the token is never printed: the page asks for it (or takes it after #token=)
        print(f"dashboard: {server.dashboard.url} (Prometheus: {server.dashboard.url}metrics)", flush=True)

    def _stop(signum: int, frame: FrameType | None) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 MASTER`: every thread's stack, to stderr
    server.wait()
    if server.fatal:  # fail-stop: a journal write failed
        print(f"streamrover master stopped: {server.fatal}", file=sys.stderr, flush=True)
        return 3
    return 0


def _partition_count(text: str) -> int:
    """``--partitions``: a count > 0, or ``all`` (-1)."""
    if text == "all":
        return -1
    if not text.isdigit() or not int(text):
        raise argparse.ArgumentTypeError(f"give a number of partitions > 0 or 'all', not {text!r}")
    return int(text)


def _console() -> Console:
    """The console to print to. Not a terminal (piped to a log or a file) and no ``$COLUMNS``: no width limit,
    as rich would squeeze every table to 80 columns and cut its headers to a letter or two."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=LOG_WIDTH)


def _restore(console: Console, client: Any, args: argparse.Namespace) -> int:
    before = client.status().last_committed_cut
    if args.empty:
        resp = client.restore_cursor(DataCursor(), discard_committed=args.discard_committed)
    else:
        resp = client.restore_cut(args.cut)
    what = "an empty cursor" if args.empty else f"cut {args.cut}"
    console.print(
        f"reset to {what} (the committed cut was {before}): {resp.leases_revoked} lease(s) revoked, "
        f"{resp.records_requeued:,} record(s) to be read again"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``streamrover`` command line; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tf-ps-run"]:  # its own parser: everything after the script belongs to the script
        from streamrover.trainers.tensorflow.launcher import main as tf_ps_run

        return tf_ps_run(argv[1:])
    if argv[:2] == ["master", "stop"]:  # not `master`'s flags: that one runs a master
        return _stop_master(argv[2:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s")
    console = _console()
    try:
        if args.command == "master":
            return _run_master(args)
        if args.command == "worker-token":
            from streamrover.tokens import worker_token

            admin = resolve_token(args.token, args.token_file)
            if not admin:
                raise SystemExit("streamrover worker-token: give --token-file STATE_DIR/token (or $STREAMROVER_TOKEN)")
            print(worker_token(admin))
            return 0
        if operator_cli.handles(args):
            return operator_cli.main(args, console)
        if ckpt_cli.handles(args):
            return ckpt_cli.main(args, console)
        if args.command == "status" and args.job:
            return operator_cli.main(argparse.Namespace(**{**vars(args), "command": "jobs", "jobs_command": "status"}),
                                     console)  # fmt: skip
        with _client(args) as client:
            if args.command == "status":
                if not args.watch:
                    console.print(status_view(client, args.partitions))
                    return 0
                if not console.is_terminal:  # a log: one timestamped view per interval (a live view redraws in place)
                    while True:
                        console.print(time.strftime("%Y-%m-%d %H:%M:%S"), status_view(client, args.partitions))
                        sys.stdout.flush()
                        time.sleep(args.watch)  # display refresh interval
                from rich.live import Live

                with Live(status_view(client, args.partitions), console=console, refresh_per_second=4) as live:
                    while True:
                        time.sleep(args.watch)  # display refresh interval
                        live.update(status_view(client, args.partitions))
            if args.command == "restore":
                return _restore(console, client, args)
            if args.dataset_command == "add":
                options = _options(args.option)
                spec = DatasetSpec(
                    args.name,
                    args.uri,
                    args.format,
                    options,
                    args.records_per_shard,
                    args.epochs,
                    args.shuffle,
                    args.seed,
                )
                resp = client.register_dataset(spec)
                verb = "registered" if resp.created else "already registered (same spec)"
                console.print(f"dataset {args.name!r} {verb}")
                console.print(dataset_table([resp.dataset]))
            elif args.dataset_command == "resume":
                resumed = client.resume_dataset(args.name, skip_lost=args.skip_lost)
                verb = "resumed" if resumed.resumed else "was not failed (nothing to resume)"
                console.print(f"dataset {args.name!r} {verb}")
                console.print(dataset_table([resumed.dataset]))
            elif args.dataset_command == "remove":
                removed = client.remove_dataset(args.name)
                console.print(
                    f"dataset {args.name!r} removed ({removed.shards_removed} shards, "
                    f"{removed.leases_revoked} leases revoked)"
                )
            elif args.dataset_command == "list":
                console.print(dataset_table(client.list_datasets()))
            elif args.dataset_command == "describe":
                from google.protobuf.json_format import MessageToDict

                info = client.describe_dataset(args.name, partition_limit=max(args.partitions, 0))
                if args.json:
                    print(json.dumps(MessageToDict(info), indent=2))
                else:
                    console.print(dataset_table([info]))
                    console.print(partitions_table(info))
                    if info.commit_gaps:
                        console.print(commit_gaps_table(info))
        return 0
    except (ShardServiceError, SourceError, ValueError) as exc:  # ValueError: a token file that cannot be read
        console.print(f"[red]error:[/red] {exc}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
