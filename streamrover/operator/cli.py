"""``streamrover run`` and ``streamrover jobs ...``: run a job spec on a platform, and manage running jobs.

::

    streamrover run job.yaml [--platform local|ray|k8s] [--detach]
    streamrover jobs list
    streamrover jobs status JOB [--json]      (also: streamrover status JOB)
    streamrover jobs stop JOB                 (also: streamrover stop JOB)
    streamrover jobs scale JOB N              (also: streamrover scale JOB N)
    streamrover jobs schema                   the job spec's JSON schema

``list``, ``status``, ``stop`` and ``scale`` take the platform as ``run`` does (``--platform``, default
``$STREAMROVER_PLATFORM`` or ``local``): ``local`` and ``ray`` jobs live in the jobs home (their
controller runs on this machine); a ``k8s`` job is its ``StreamTrainJob`` (``--namespace``,
``--kubeconfig``), read and patched by :mod:`streamrover.operator.k8s_jobs` with the same meaning.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

PLATFORMS = ("local", "ray", "k8s")


def add_platform_args(parser: argparse.ArgumentParser, home: bool = True) -> None:
    """``--platform``, ``--namespace``, ``--kubeconfig`` (and ``--home``): where a job lives."""
    default = os.environ.get("STREAMROVER_PLATFORM") or "local"
    parser.add_argument("--platform", choices=PLATFORMS, default=default,
                        help=f"where the job runs (default: $STREAMROVER_PLATFORM or local; now {default})")
    if home:
        parser.add_argument("--home", default=None, help="local/ray: the jobs directory (default: $STREAMROVER_HOME)")
    parser.add_argument("--namespace", "-n", default="default", help="k8s: the namespace of the StreamTrainJob")
    parser.add_argument("--kubeconfig", default=None, help="k8s: the cluster (default: $KUBECONFIG or in-cluster)")


def add_parsers(sub: Any) -> None:
    """Add ``run``, ``jobs``, ``stop`` and ``scale`` to the ``streamrover`` command's subparsers."""
    run = sub.add_parser("run", help="run a job spec (YAML) on a platform")
    run.add_argument("spec", help="the job spec file (see `streamrover jobs schema`)")
    run.add_argument("--detach", "-d", action="store_true", help="run the job's controller in the background")
    start = float(os.environ.get("STREAMROVER_K8S_START_TIMEOUT") or 60)
    run.add_argument("--start-timeout", type=float, default=start, metavar="SECONDS",
                     help="k8s: fail if no operator takes the job within this time (default: "
                          f"$STREAMROVER_K8S_START_TIMEOUT or 60; now {start:g})")  # fmt: skip
    add_platform_args(run)

    jobs = sub.add_parser("jobs", help="jobs started with `streamrover run`")
    jsub = jobs.add_subparsers(dest="jobs_command", required=True)
    lst = jsub.add_parser("list", help="every job under the jobs home (k8s: every StreamTrainJob in the namespace)")
    add_platform_args(lst)
    sch = jsub.add_parser("schema", help="print the job spec's JSON schema")
    sch.add_argument("--home", default=None)
    for name, helptext in (("status", "a job's nodes, restarts and decisions"), ("stop", "stop a job gracefully")):
        for parser in (jsub.add_parser(name, help=helptext),) + ((sub.add_parser(name, help=helptext),)
                                                                  if name == "stop" else ()):  # fmt: skip
            parser.add_argument("job")
            add_platform_args(parser)
            if name == "status":
                parser.add_argument("--json", action="store_true")
    for parser in (jsub.add_parser("scale", help="ask for N nodes"), sub.add_parser("scale", help="ask for N nodes")):
        parser.add_argument("job")
        parser.add_argument("nodes", type=int)
        add_platform_args(parser)


def handles(args: argparse.Namespace) -> bool:
    """Whether ``args`` is one of this module's commands (run, jobs, stop, scale)."""
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
        if getattr(args, "platform", "local") == "k8s":
            return _k8s_command(command, args, console)
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

    if args.platform == "k8s":  # relative paths are shipped or refused there, not resolved on this machine
        return _run_k8s(load_spec(args.spec, resolve=False), args, console)
    spec = load_spec(args.spec)
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
    from streamrover.operator import k8s, k8s_files, k8s_jobs

    spec, files = k8s_files.for_pods(spec, Path(args.spec).resolve().parent, args.spec)
    api = k8s.api_client(args.kubeconfig)
    k8s.submit(spec, args.namespace, api, files=files)
    console.print(f"job [bold]{spec.name}[/bold]: StreamTrainJob created in namespace {args.namespace} "
                  f"(`kubectl get streamtrainjob {spec.name} -n {args.namespace}`)")  # fmt: skip
    if args.detach:
        return 0

    def report(status: dict[str, Any]) -> None:
        last = (status.get("events") or [""])[-1]
        console.print(f"{spec.name}: {status.get('phase', 'pending')} nodes {status.get('replicas', 0)} {last}",
                      markup=False, highlight=False)  # fmt: skip

    phase = k8s_jobs.follow(spec.name, args.namespace, api, report, start_timeout=args.start_timeout)
    return 0 if phase in ("succeeded", "stopped") else 1


def _k8s_command(command: str, args: argparse.Namespace, console: Console) -> int:
    """``list``, ``status``, ``stop``, ``scale`` of ``StreamTrainJob`` resources (see :mod:`.k8s_jobs`)."""
    from streamrover.operator import k8s, k8s_jobs

    api, ns = k8s.api_client(args.kubeconfig), args.namespace
    if command == "list":
        table = Table(title=f"StreamTrainJobs in {ns}")
        for col in ("job", "phase", "platform", "nodes", "relaunches", "updated", "reason"):
            table.add_column(col)
        for body in k8s_jobs.list_jobs(api, ns):
            st = body.get("status") or {}
            table.add_row(body["metadata"]["name"], _phase(k8s_jobs.phase(body)), "k8s",
                          f"{st.get('replicas', 0)}/{st.get('desiredNodes', '?')}", str(st.get("relaunches", 0)),
                          str(st.get("updatedAt", "")), str(st.get("reason", "")))  # fmt: skip
        console.print(table)
        return 0
    if command == "status":
        body = k8s_jobs.get_job(api, ns, args.job)
        return _show_k8s_status(body, args.json, console)
    if command == "stop":
        ended = k8s_jobs.stop(api, ns, args.job)
        if ended is not None:
            console.print(f"job {args.job!r} is not running ({ended})")
        else:
            console.print(f"stopping job {args.job!r} (its nodes leave, then the master)")
        return 0
    if command == "scale":
        k8s_jobs.scale(api, ns, args.job, args.nodes)
        console.print(f"job {args.job!r}: asked for {args.nodes} nodes")
        return 0
    raise AssertionError(command)


def _show_k8s_status(body: dict[str, Any], as_json: bool, console: Console) -> int:
    st, meta = body.get("status") or {}, body["metadata"]
    if as_json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    nodes = ((body.get("spec") or {}).get("job") or {}).get("trainer", {}).get("nodes") or {}
    bounds = f"{nodes.get('min', 1)}:{nodes.get('max', 1)}" if isinstance(nodes, dict) else str(nodes)
    console.print(f"job [bold]{meta['name']}[/bold] {_phase(st.get('phase', 'pending'))} {st.get('reason', '')}  "
                  f"platform k8s  namespace {meta['namespace']}  master {st.get('master', '?')}  nodes "
                  f"{st.get('replicas', 0)}/{st.get('desiredNodes', '?')} ({bounds})  relaunches "
                  f"{st.get('relaunches', 0)}  lag {st.get('lag', '?')}  acked {st.get('recordsAcked', '?')}  "
                  f"checkpoint {st.get('lastCheckpoint', '?')}")  # fmt: skip
    table = Table(title="nodes")
    for col in ("node", "state", "memory", "detail"):
        table.add_column(col)
    for n in st.get("nodes", []):
        table.add_row(n.get("node", ""), n.get("state", ""), n.get("memory") or "", n.get("detail", ""))
    console.print(table)
    events = Table(title="decisions")
    events.add_column("event")
    for e in st.get("events", [])[-15:]:
        events.add_row(e)
    console.print(events)
    return 0


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
