"""``streamrover run`` and ``streamrover jobs ...``: run a job spec on a platform, and manage running jobs.

::

    streamrover run job.yaml [--platform local|ray|k8s] [--detach]
    streamrover jobs list
    streamrover jobs status JOB [--json]      (also: streamrover status JOB)
    streamrover jobs stop JOB                 (also: streamrover stop JOB)
    streamrover jobs scale JOB N              (also: streamrover scale JOB N)
    streamrover jobs schema                   the job spec's JSON schema
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

PLATFORMS = ("local", "ray", "k8s")


def add_parsers(sub: Any) -> None:
    """Add ``run``, ``jobs``, ``stop`` and ``scale`` to the ``streamrover`` command's subparsers."""
    run = sub.add_parser("run", help="run a job spec (YAML) on a platform")
    run.add_argument("spec", help="the job spec file (see `streamrover jobs schema`)")
    run.add_argument("--platform", choices=PLATFORMS, default="local", help="where the nodes run (default: local)")
    run.add_argument("--detach", "-d", action="store_true", help="run the job's controller in the background")
    run.add_argument("--home", default=None, help="jobs directory (default: $STREAMROVER_HOME)")
    run.add_argument("--namespace", "-n", default="default", help="k8s: the namespace of the StreamTrainJob")
    run.add_argument("--kubeconfig", default=None, help="k8s: the cluster (default: $KUBECONFIG or in-cluster)")

    jobs = sub.add_parser("jobs", help="jobs started with `streamrover run`")
    jsub = jobs.add_subparsers(dest="jobs_command", required=True)
    lst = jsub.add_parser("list", help="every job under the jobs home")
    lst.add_argument("--home", default=None)
    sch = jsub.add_parser("schema", help="print the job spec's JSON schema")
    sch.add_argument("--home", default=None)
    for name, helptext in (("status", "a job's nodes, restarts and decisions"), ("stop", "stop a job gracefully")):
        for parser in (jsub.add_parser(name, help=helptext),) + ((sub.add_parser(name, help=helptext),)
                                                                  if name == "stop" else ()):  # fmt: skip
            parser.add_argument("job")
            parser.add_argument("--home", default=None)
            if name == "status":
                parser.add_argument("--json", action="store_true")
    for parser in (jsub.add_parser("scale", help="ask for N nodes"), sub.add_parser("scale", help="ask for N nodes")):
        parser.add_argument("job")
        parser.add_argument("nodes", type=int)
        parser.add_argument("--home", default=None)


def handles(args: argparse.Namespace) -> bool:
    return args.command in ("run", "jobs", "stop", "scale")


def main(args: argparse.Namespace, console: Console) -> int:
    """Run one of this module's commands; errors print plainly and return 2."""
    from streamrover.operator.api import PlatformError
    from streamrover.operator.jobs import JobNotFoundError
    from streamrover.operator.spec import SpecError

    try:
        if args.command == "run":
            return _run(args, console)
        command = args.jobs_command if args.command == "jobs" else args.command
        if command == "schema":
            from streamrover.operator.spec import schema_text

            print(schema_text(), end="")
            return 0
        if command == "list":
            return _list(args, console)
        if command == "status":
            return show_status(args.job, args.json, _home(args), console)
        if command == "stop":
            return _stop(args, console)
        if command == "scale":
            return _scale(args, console)
        raise AssertionError(command)
    except (SpecError, JobNotFoundError, PlatformError, ValueError) as exc:
        console.print("[red]error:[/red]", end=" ")
        console.print(str(exc), markup=False, highlight=False, soft_wrap=True)
        return 2


def _home(args: argparse.Namespace) -> Path | None:
    return Path(args.home) if getattr(args, "home", None) else None


def _run(args: argparse.Namespace, console: Console) -> int:
    from streamrover.operator.jobs import job_dir, write_atomic
    from streamrover.operator.spec import load_spec

    spec = load_spec(args.spec)
    if args.platform == "k8s":
        return _run_k8s(spec, args, console)
    job = job_dir(spec.name, _home(args), create=True)
    pid = job.controller_pid()
    if pid is not None:
        raise ValueError(f"job {spec.name!r} is already running (controller pid {pid}); `streamrover stop "
                         f"{spec.name}` first")  # fmt: skip
    write_atomic(job.path / "job.yaml", Path(args.spec).read_text())
    (job.requests / "scale.json").unlink(missing_ok=True)
    if args.detach:
        cmd = [sys.executable, "-m", "streamrover.cli", "run", args.spec, "--platform", args.platform]
        if args.home:
            cmd += ["--home", args.home]
        (job.path / "logs").mkdir(exist_ok=True)
        with open(job.path / "logs" / "controller.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)  # fmt: skip
        console.print(f"job [bold]{spec.name}[/bold] started in the background (controller pid {proc.pid}); "
                      f"`streamrover status {spec.name}`, `streamrover stop {spec.name}`")  # fmt: skip
        return 0
    from streamrover.operator.controller import run_controller

    console.print(f"job [bold]{spec.name}[/bold] on {args.platform}: status in {job.status_path}")
    code = run_controller(spec, job, args.platform)
    doc = job.status()
    console.print(f"job {spec.name}: {doc.get('phase')} {doc.get('reason', '')}".rstrip(), highlight=False)
    return code


def _run_k8s(spec: Any, args: argparse.Namespace, console: Console) -> int:
    """Create the job's StreamTrainJob; the operator runs it. Follows its status unless ``--detach``."""
    from streamrover.operator import k8s

    api = k8s.api_client(args.kubeconfig)
    k8s.submit(spec, args.namespace, api)
    console.print(f"job [bold]{spec.name}[/bold]: StreamTrainJob created in namespace {args.namespace} "
                  f"(`kubectl get streamtrainjob {spec.name} -n {args.namespace}`)")  # fmt: skip
    if args.detach:
        return 0

    def report(status: dict[str, Any]) -> None:
        last = (status.get("events") or [""])[-1]
        console.print(f"{spec.name}: {status.get('phase', 'pending')} nodes {status.get('replicas', 0)} {last}",
                      markup=False, highlight=False)  # fmt: skip

    phase = k8s.follow(spec.name, args.namespace, api, report)
    return 0 if phase in ("succeeded", "stopped") else 1


def _list(args: argparse.Namespace, console: Console) -> int:
    from streamrover.operator.jobs import list_jobs

    table = Table(title="jobs")
    for col in ("job", "phase", "platform", "nodes", "relaunches", "updated", "reason"):
        table.add_column(col)
    for job in list_jobs(_home(args)):
        doc = job.status()
        running = sum(1 for n in doc.get("nodes", []) if n.get("state") == "running")
        updated = doc.get("updated_at")
        table.add_row(job.name, _phase(doc["phase"]), str(doc.get("platform", "")),
                      f"{running}/{doc.get('desired_nodes', '?')}", str(doc.get("relaunches", 0)),
                      time.strftime("%H:%M:%S", time.localtime(updated)) if updated else "",
                      doc.get("reason", ""))  # fmt: skip
    console.print(table)
    return 0


def _phase(phase: str) -> str:
    color = {"running": "green", "succeeded": "blue", "failed": "red", "lost": "red"}.get(phase, "yellow")
    return f"[{color}]{phase}[/{color}]"


def show_status(name: str, as_json: bool, root: Path | None, console: Console) -> int:
    """``status JOB``: the controller's last status document, as a table or JSON."""
    from streamrover.operator.jobs import job_dir

    doc = job_dir(name, root).status()
    if as_json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    lo, hi = doc.get("bounds", ["?", "?"])
    console.print(f"job [bold]{name}[/bold] {_phase(doc['phase'])} {doc.get('reason', '')}  platform "
                  f"{doc.get('platform', '?')}  master {doc.get('master', '?')}  nodes {doc.get('desired_nodes', '?')} "
                  f"({lo}:{hi})  relaunches {doc.get('relaunches', 0)}/{doc.get('relaunch_budget', '?')}  memory "
                  f"limits: {doc.get('memory_enforcement', '?')}")  # fmt: skip
    nodes = Table(title="nodes")
    for col in ("node", "state", "pid", "memory", "oom kills", "restarts left", "workers", "heartbeat", "detail"):
        nodes.add_column(col)
    for n in doc.get("nodes", []) + doc.get("ended_nodes", [])[-5:]:
        beat = n.get("heartbeat_age")
        nodes.add_row(n["node_id"], n["state"], str(n.get("pid") or ""), n.get("memory") or "", str(n["oom_kills"]),
                      "" if n.get("restarts_left") is None else str(n["restarts_left"]), str(len(n.get("workers", {}))),
                      f"{beat:.0f}s ago" if beat is not None else "", n.get("detail", ""))  # fmt: skip
    console.print(nodes)
    events = Table(title="decisions")
    for col in ("time", "kind", "node", "message"):
        events.add_column(col)
    for e in doc.get("events", [])[-15:]:
        events.add_row(time.strftime("%H:%M:%S", time.localtime(e["at"])), e["kind"], e["node"], e["message"])
    console.print(events)
    return 0


def _stop(args: argparse.Namespace, console: Console) -> int:
    from streamrover.operator.jobs import job_dir

    job = job_dir(args.job, _home(args))
    if not job.request_stop():
        console.print(f"job {args.job!r} is not running ({job.status()['phase']})")
        return 0
    console.print(f"stopping job {args.job!r} (its nodes leave, then the master)")
    return 0


def _scale(args: argparse.Namespace, console: Console) -> int:
    from streamrover.operator.jobs import job_dir

    job = job_dir(args.job, _home(args))
    doc = job.status()
    lo, hi = doc.get("bounds", [1, 1 << 30])
    if not lo <= args.nodes <= hi:
        raise ValueError(f"{args.nodes} nodes is outside job {args.job!r}'s bounds {lo}:{hi}")
    if job.controller_pid() is None:
        raise ValueError(f"job {args.job!r} is not running ({doc['phase']})")
    job.request_scale(args.nodes)
    console.print(f"job {args.job!r}: asked for {args.nodes} nodes")
    return 0
