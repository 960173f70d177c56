"""``dlrover-run``: torchrun's command line, launching torchelastic's agent with streamrover's duties.

Every torchrun flag keeps its meaning (the parser *is* ``torch.distributed.run``'s);
streamrover adds:

``--shard-service HOST:PORT``  the job master (also ``STREAMROVER_MASTER``); workers lease shards from it
``--token TOKEN``              its bearer token (also ``STREAMROVER_TOKEN``)
``--tls-ca FILE``              speak TLS to the master, verified by this CA (also ``STREAMROVER_TLS_CA``;
                               ``--tls-cert``/``--tls-key`` for mutual TLS)
``--ckpt-dir URL``             flash-checkpoint root; the agent hosts this node's checkpoint saver
``--node-id ID``               this node's name in health reports and its checkpoint namespace
``--node-check``               check the node before its first rendezvous (a matmul and a gloo all-reduce, timed
                               against the other nodes' median: ``--node-check-threshold``, default 2x); a slow
                               or broken node exits 86 without joining (nodecheck.py)
``--hang-timeout T``           restart the worker group when a worker made no progress (a step, a lockstep round)
                               for T seconds: a rank stuck in a collective (default 0: off)

``--rdzv-backend=streamrover`` runs the rendezvous through the job master (its endpoint
defaults to ``--shard-service``); ``--standalone`` and ``c10d`` work as with torchrun.

Example (two nodes, elastic between 1 and 3, four restarts per node)::

    dlrover-run --nnodes 1:3 --nproc-per-node 2 --max-restarts 4 --rdzv-backend streamrover \\
        --rdzv-id job1 --shard-service 10.0.0.5:7070 --token $TOKEN --ckpt-dir /data/ckpt train.py
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from argparse import ArgumentParser, Namespace
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port
from torch.distributed.run import config_from_args, get_args_parser

from streamrover.ckpt import namespace_for, saver_address
from streamrover.shard_service import ShardServiceError
from streamrover.shard_service.api import InvalidArgumentError
from streamrover.shard_service.client.tls import add_tls_args, export_tls_args
from streamrover.tokens import resolve_token
from streamrover.trainers.standby import StandbyPool
from streamrover.trainers.torch import env
from streamrover.trainers.torch.agent import HealthReporter, StreamroverAgent, progress_directory
from streamrover.trainers.torch.nodecheck import DEFAULT_THRESHOLD, NODE_CHECK_EXIT, NodeCheck
from streamrover.trainers.torch.rendezvous import BACKEND_NAME, master_client, register

log = logging.getLogger(__name__)
EXIT_BARRIER_TIMEOUT = 30.0  # seconds a finished node waits for the others of its group to finish too


def build_parser() -> ArgumentParser:
    """torchrun's argument parser with streamrover's options added."""
    parser = get_args_parser()
    parser.prog = "dlrover-run"
    parser.description = "torchrun, with streams: " + (parser.description or "")
    group = parser.add_argument_group("streamrover")
    group.add_argument("--shard-service", "--shard_service", default=os.environ.get(env.MASTER),
                       help="HOST:PORT of the job master (shard service); default $STREAMROVER_MASTER")  # fmt: skip
    group.add_argument("--token", default=os.environ.get(env.TOKEN, ""), help="bearer token of the job master")
    group.add_argument("--token-file", "--token_file", default=None,
                       help="read the job master's token from this file (e.g. STATE_DIR/token)")  # fmt: skip
    add_tls_args(group)
    group.add_argument("--ckpt-dir", "--ckpt_dir", default=os.environ.get(env.CKPT_DIR),
                       help="flash-checkpoint root (a directory or fsspec URL); the agent hosts its saver")  # fmt: skip
    group.add_argument("--node-id", "--node_id", default=None,
                       help="this node's name (default: HOST-PID-RANDOM, unique per agent)")  # fmt: skip
    group.add_argument("--standby-workers", "--standby_workers", type=int, default=None,
                       help="warm interpreters kept to restart workers in (torch already imported); "
                            "default --nproc-per-node, 0 disables")  # fmt: skip
    group.add_argument("--heartbeat-interval", "--heartbeat_interval", type=float, default=5.0,
                       help="seconds between the agent's heartbeats to the job master (0: none)")  # fmt: skip
    group.add_argument("--node-check", "--node_check", action="store_true",
                       help="check the node (matmul, gloo all-reduce) before its first rendezvous")  # fmt: skip
    group.add_argument("--node-check-threshold", "--node_check_threshold", type=float, default=DEFAULT_THRESHOLD,
                       help="fail the check when the node's compute probe is slower than this times the other "
                            "nodes' median (default 2)")  # fmt: skip
    group.add_argument("--node-check-wait", "--node_check_wait", type=float, default=60.0,
                       help="seconds the check waits for the other nodes to probe with it (default 60)")  # fmt: skip
    group.add_argument("--hang-timeout", "--hang_timeout", type=float, default=0.0,
                       help="seconds without progress after which a worker counts as hung and the group restarts "
                            "(0: off)")  # fmt: skip
    return parser


def parse_args(argv: list[str] | None = None) -> Namespace:
    """Parse ``argv`` as ``dlrover-run`` does (``--standalone``, a single static node: a private store)."""
    args = build_parser().parse_args(argv)
    try:
        args.token = resolve_token(args.token, args.token_file)
        export_tls_args(args)  # the agent's clients and its workers speak TLS to the master
    except (ValueError, InvalidArgumentError) as exc:
        raise SystemExit(f"dlrover-run: {exc}") from None
    if args.standalone:  # as torchrun's run(): c10d on a private store
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "127.0.0.1:0", str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, _, max_nodes = args.nnodes.partition(":")
        if int(max_nodes or args.nnodes) == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "127.0.0.1:0", str(uuid.uuid4())
    if args.node_check and not args.shard_service:
        raise SystemExit("dlrover-run: --node-check compares the nodes through the job master: give --shard-service")
    if args.node_check_threshold <= 1.0:
        raise SystemExit(f"dlrover-run: --node-check-threshold {args.node_check_threshold}: must be more than 1")
    if args.hang_timeout < 0:
        raise SystemExit(f"dlrover-run: --hang-timeout {args.hang_timeout}: must be >= 0 (0: off)")
    if args.master_port is None:
        args.master_port = 29500
    if args.rdzv_backend == BACKEND_NAME:
        if not args.rdzv_endpoint:
            args.rdzv_endpoint = args.shard_service
        if not args.rdzv_endpoint:
            raise SystemExit("dlrover-run: --rdzv-backend=streamrover needs --shard-service HOST:PORT")
        if args.token and "token=" not in (args.rdzv_conf or ""):
            args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"token={args.token}"]))
    if args.node_id is None:
        args.node_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    return args


HUGE_PAGES = "glibc.malloc.hugetlb"  # glibc >= 2.35; older ones ignore a tunable they do not know


def malloc_tunables(current: str | None) -> str:
    """``GLIBC_TUNABLES`` for the workers and their standbys: ``current`` plus ``glibc.malloc.hugetlb=1`` (malloc
    advises transparent huge pages for its heap and large chunks), unless ``current`` sets that tunable itself
    (``glibc.malloc.hugetlb=0`` turns it off).

    Why: a worker that dies takes the kernel ~45 ms per GB of its resident memory to unmap (a torch worker holds
    ~0.4 GB after its imports, ~1 GB training), and a group restart waits for two such teardowns in a row: the
    dead worker's (its peers learn of the death only when its sockets close, after its memory is freed) and
    then the survivors' it stops. 2 MB pages cut it by a third to a half (bench torch_recovery: detection 0.13 ->
    0.09 s), and make the restarted workers' first step faster too (fewer page faults)."""
    if current and HUGE_PAGES in current:
        return current
    return ":".join(filter(None, [current, f"{HUGE_PAGES}=1"]))


def _worker_environment(args: Namespace, run_id: str) -> dict[str, str]:
    """What the workers learn about streamrover (see env.py); the agent's environment passes to them."""
    out = {env.NODE_ID: args.node_id, env.RUN_ID: run_id}
    if args.shard_service:
        out[env.MASTER] = args.shard_service
    if args.token:
        out[env.TOKEN] = args.token
    if args.ckpt_dir:
        out[env.CKPT_DIR] = args.ckpt_dir
        out[env.CKPT_JOB] = f"{run_id}.{args.node_id}"
        out[env.SAVER] = "agent"
    return out


def launch(config: LaunchConfig, entrypoint: Any, script_args: list[str], args: Namespace) -> dict[int, Any]:
    """torchelastic's ``launch_agent`` with :class:`StreamroverAgent` in place of LocalElasticAgent."""
    run_id = config.run_id or str(uuid.uuid4().int)
    config.run_id = run_id
    os.environ.update(_worker_environment(args, run_id))
    os.environ["GLIBC_TUNABLES"] = malloc_tunables(os.environ.get("GLIBC_TUNABLES"))  # read at each child's start
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(params)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(script_args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    client = master_client(args.shard_service, args.token, f"agent:{args.node_id}") if args.shard_service else None
    health = HealthReporter(client, run_id, args.node_id)
    health.start_heartbeat(args.heartbeat_interval)
    if args.node_check and client is not None:
        _node_check(client, run_id, args, config.min_nodes, health)
    progress = progress_directory() if args.hang_timeout > 0 else None
    if progress is not None:
        os.environ[env.PROGRESS_DIR] = str(progress)
    namespace = namespace_for(args.ckpt_dir, os.environ[env.CKPT_JOB]) if args.ckpt_dir else None
    address = saver_address(namespace) if namespace else None
    size = config.nproc_per_node if args.standby_workers is None else args.standby_workers
    standby = None
    if size > 0 and isinstance(entrypoint, str) and not args.no_python and not args.run_path:
        # torchrun's command: PYTHON_EXEC or this interpreter, "-u", then the script or "-m" module
        standby = StandbyPool(size, interpreter=entrypoint, flags=("-u",))
    agent = StreamroverAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=int(config.shutdown_timeout or 30),
        # torchelastic's default 300 s: a node that finished right after a scale-in waited out the left nodes'
        # arrival for 5 min. The group's ranks end at the same step; the store is the master's, no agent's.
        exit_barrier_timeout=EXIT_BARRIER_TIMEOUT,
        saver_address=address,
        health=health,
        ckpt_namespace=namespace,
        standby=standby,
        hang_timeout=args.hang_timeout,
        progress_dir=progress,
    )
    shutdown_rdzv = True
    try:
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name=str(entrypoint), failures=result.failures)
        return result.return_values
    except ChildFailedError:
        raise
    except Exception as exc:
        # A signal (SIGTERM: the node is leaving) must not close the rendezvous for the others.
        shutdown_rdzv = type(exc).__name__ != "SignalException"
        raise
    finally:
        if shutdown_rdzv:
            try:
                spec.rdzv_handler.shutdown()
            except Exception:  # torchelastic's launcher logs and goes on here too
                log.exception("error shutting down the rendezvous handler")
        health.stop_heartbeat()
        if client is not None:
            client.close()


def _node_check(client: Any, run_id: str, args: Namespace, min_nodes: int, health: HealthReporter) -> None:
    """Run the pre-flight check (nodecheck.py); a node that fails it reports so and exits NODE_CHECK_EXIT."""
    from dataclasses import asdict

    from streamrover.trainers.torch.rendezvous import desired_nodes

    wanted = desired_nodes(client, run_id)
    check = NodeCheck(client, run_id, args.node_id, expected=lambda: wanted() or min_nodes,
                      threshold=args.node_check_threshold, wait=args.node_check_wait,
                      host=args.local_addr or "127.0.0.1")  # fmt: skip
    result = check.run()
    health.node_check = asdict(result)
    values = {"node_check_compute_s": result.compute_s or 0.0, "node_check_allreduce_s": result.allreduce_s or 0.0,
              "node_check_cost_s": result.cost_s, "node_check_passed": float(result.passed)}  # fmt: skip
    try:
        client.report(values, reporter=f"agent@{args.node_id}")
    except ShardServiceError as exc:  # advisory, as the health document
        log.warning("could not report the node check to the master: %s", exc)
    print(f"dlrover-run: node check of {args.node_id}: {result.describe()}", flush=True)
    if result.passed:
        log.info("node check of %s: %s", args.node_id, result.describe())
        health.report("NODE_CHECK_PASSED", args.max_restarts, -1)
        return
    log.error("node check of %s failed: %s; leaving without joining the rendezvous", args.node_id, result.describe())
    health.report("NODE_CHECK_FAILED", args.max_restarts, -1)
    health.stop_heartbeat()
    client.close()
    raise SystemExit(NODE_CHECK_EXIT)


@record
def main(argv: list[str] | None = None) -> None:
    """``dlrover-run``: run a torch job's workers under streamrover's agent."""
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    register()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    log.info("dlrover-run agent of node %s up (pid %d)", args.node_id, os.getpid())  # its imports are done
    # Workers bootstrap their own store each attempt (rank 0's worker hosts it). Torch's shared agent store
    # is reused across restarts without a per-attempt prefix when MASTER_ADDR names this host (so a
    # restarted group reads the dead group's gloo addresses), and it dies with the agent that hosts it.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config, cmd, cmd_args = config_from_args(args)
    launch(config, cmd, list(cmd_args), args)


if __name__ == "__main__":
    main()
