"""The job controller: what ``streamrover run`` runs. Starts the master, registers the datasets, supervises.

One controller per job, on the machine where ``run`` was typed (for ``local`` and
``ray``; on Kubernetes the operator pod runs it). It:

1. launches the job master through the platform (its journal in ``master.state_dir``),
   with the token from ``master.token`` (a file, an environment variable, or generated);
2. registers every dataset of the spec (idempotent: a rerun of the same spec resumes);
3. runs a :class:`~streamrover.operator.supervisor.Supervisor` tick every ``tick`` seconds,
   relaunching the master if it died (same port; its journal makes that lossless),
   taking ``scale`` requests, and writing ``status.json`` each time;
4. on SIGTERM/SIGINT (``streamrover stop JOB``) stops the nodes, then the master.

The exit code is 0 when training finished or the job was stopped, 1 when it failed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from streamrover.operator.api import MasterLaunch, NodeState, Platform
from streamrover.operator.autoscaler import Autoscaler
from streamrover.operator.jobs import JobDir, write_atomic
from streamrover.operator.registry import create_platform
from streamrover.operator.spec import JobSpec
from streamrover.operator.supervisor import JobPhase, Supervisor

if TYPE_CHECKING:
    from streamrover.shard_service.client.tls import ClientTls

log = logging.getLogger(__name__)


def resolve_token(spec: JobSpec, state_dir: Path) -> str:
    """The job's bearer token, from where ``master.token`` says (generated into STATE_DIR/token by default)."""
    source = spec.master.token
    if source.file:
        try:
            return Path(source.file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"master.token.file: cannot read {source.file}: {exc.strerror}") from None
    if source.env:
        value = os.environ.get(source.env, "")
        if not value:
            raise ValueError(f"master.token.env: the environment variable {source.env} is not set")
        return value
    from streamrover.shard_service.master import load_or_create_token

    state_dir.mkdir(parents=True, exist_ok=True)
    return load_or_create_token(state_dir)


class JobController:
    """Runs one job to its end (see the module docstring)."""

    def __init__(self, spec: JobSpec, job: JobDir, platform: str | Platform = "local", tick: float = 0.5) -> None:
        self.spec = spec
        self.job = job
        if isinstance(platform, str):
            lo, hi = spec.scale_bounds
            # warm agents for a scale-out (local), each with its workers' standbys warm
            options: dict[str, Any] = {"standby_agents": hi - lo, "standby_workers": spec.trainer.nproc_per_node}
            if platform == "ray":
                options = {"max_nodes": spec.trainer.nodes.max, "cpu": spec.trainer.cpu}
            try:
                self.platform = create_platform(platform, workdir=job.path / "logs", **options)
            except Exception as exc:  # `jobs status` says why, not phase "unknown"; the CLI prints it too
                job.write_status({"job": spec.name, "phase": "failed", "platform": platform, "nodes": [],
                                  "reason": f"the {platform} platform is not available: {exc}"})  # fmt: skip
                raise
        else:
            self.platform = platform
        self.tick = tick
        self._stop = threading.Event()
        self.state_dir = Path(spec.master.state_dir) if spec.master.state_dir else job.path / "master"
        self.ckpt_url = spec.checkpoint.url or str(job.path / "ckpt")
        self.run_id = f"{spec.name}-{int(time.time() * 1000):x}"
        self.supervisor: Supervisor | None = None
        self.client: Any = None  # the master's client, once it runs
        self.master_relaunches = 0
        self.autoscaler: Autoscaler | None = None
        if spec.autoscaling is not None:
            self.autoscaler = Autoscaler(spec.autoscaling, *spec.scale_bounds)
        self.sample_every = 2.0
        self._sampled_at = 0.0
        self._paced_at = 0.0
        self._published: int | None = None  # the desired node count the agents were told

    def request_stop(self, *_: Any) -> None:
        """Ask the controller to stop the job (a signal handler: the arguments are ignored)."""
        self._stop.set()

    def resolve_token(self) -> str:
        """The job's token (the k8s operator keeps it in a Secret instead)."""
        return resolve_token(self.spec, self.state_dir)

    def tls(self) -> tuple[tuple[str, ...], ClientTls | None, dict[str, str] | None]:
        """``master.tls`` as the master's flags, this controller's client settings and the nodes' environment (the
        files of the spec; the Kubernetes controller mounts Secrets instead)."""
        from streamrover.shard_service.client.tls import ClientTls

        tls = self.spec.master.tls
        if tls is None:
            return (), None, None
        args = tls.master_args()  # refuses a Secret here
        client_tls = ClientTls(tls.ca or "", tls.client_cert, tls.client_key)
        return args, client_tls, client_tls.env()

    def _health(self, client: Any) -> Any:
        from streamrover.trainers.torch.agent import read_health  # torch only when a torch job runs

        return lambda run_id, node_id: read_health(client, run_id, node_id)

    def run(self) -> int:
        """Run the job until it ends; returns the process exit code."""
        from streamrover.shard_service import DatasetSpec, ShardClient

        write_atomic(self.job.pid_path, f"{os.getpid()}\n")
        token = self.resolve_token()
        self._write({"job": self.spec.name, "phase": "starting", "platform": self.platform.name, "nodes": []})
        try:
            master_args, client_tls, node_tls = self.tls()
        except Exception as exc:  # a Secret on a platform of files, a Secret not found...
            self._write({"job": self.spec.name, "phase": "failed", "reason": f"the master did not start: {exc}",
                         "platform": self.platform.name, "nodes": []})  # fmt: skip
            self.platform.close()
            self.job.pid_path.unlink(missing_ok=True)
            raise
        health = self.spec.health
        master_args = (*master_args, "--straggler-threshold", str(health.straggler_threshold),
                       "--straggler-window", str(health.straggler_window_seconds))  # fmt: skip
        launch = MasterLaunch(self.spec.name, self.state_dir, token, self.spec.master.host, self.spec.master.port,
                              self.spec.master.lease_ttl, master_args)  # fmt: skip
        reaped = getattr(self.platform, "reaped", [])
        if reaped:
            log.warning("ended what the job's previous controller left running: pids %s", reaped)
        try:
            master = self.platform.launch_master(launch)
        except Exception as exc:  # the reason goes to status, then up to the CLI
            self._write({"job": self.spec.name, "phase": "failed", "reason": f"the master did not start: {exc}",
                         "platform": self.platform.name, "nodes": []})  # fmt: skip
            self.platform.close()
            self.job.pid_path.unlink(missing_ok=True)
            raise
        client = self.client = ShardClient(master.address, token=token, name=f"controller:{self.spec.name}",
                                           heartbeat=False, timeout=60.0, tls=client_tls or True)  # fmt: skip
        try:
            for ds in self.spec.datasets:
                client.register_dataset(DatasetSpec(ds.name, ds.uri, ds.format, dict(ds.options), ds.records_per_shard,
                                                    ds.epochs, ds.shuffle, ds.seed))  # fmt: skip
            sup = self.supervisor = Supervisor(
                self.spec, self.platform, run_id=self.run_id, master_address=master.address, token=token,
                ckpt_url=self.ckpt_url, health=self._health(client),
                client_env=node_tls,
            )  # fmt: skip
            reaped = getattr(self.platform, "reaped", [])
            if reaped:
                sup.event("reaped", "", f"ended pids {reaped}: the master and nodes the previous controller left")
            sup.start()
            self._write(self._status())
            while not sup.phase.ended:
                if self._stop.wait(self.tick):  # the supervision period; a stop request wakes it at once
                    sup.stop_all("stopped on request")
                    break
                self._keep_master(launch)
                wanted = self.job.take_scale_request()
                if wanted is not None:
                    try:
                        sup.scale(wanted, "streamrover scale")
                    except ValueError as exc:
                        sup.event("scale-refused", "", str(exc))
                sup.tick()
                self._watch_paces(client)
                self._autoscale(client)
                self._publish_desired(client)
                self._write(self._status())
            return 0 if sup.phase in (JobPhase.SUCCEEDED, JobPhase.STOPPED) else 1
        finally:
            if self.supervisor is not None and not self.supervisor.phase.ended:
                self.supervisor.stop_all("the controller is exiting")
            client.close()
            self.platform.stop_master()
            self._write(self._status())
            self.platform.close()
            self.job.pid_path.unlink(missing_ok=True)

    def _keep_master(self, launch: MasterLaunch) -> None:
        status = self.platform.observe_master()
        if status.state is not NodeState.RUNNING and self.supervisor is not None:
            self.master_relaunches += 1
            why = status.detail or status.exit_code
            self.supervisor.event("master", "master", f"{status.state.value} ({why}); relaunching it on the same port")
            self.platform.launch_master(launch)

    def _publish_desired(self, client: Any) -> None:
        """Tell the agents how many nodes the job wants (the rendezvous's join gate: trainers/torch/rendezvous.py
        holds a group restart back until every node launched together waits to join)."""
        from streamrover.shard_service import ShardServiceError

        if self.supervisor is None or self.supervisor.desired == self._published:
            return
        key, value = f"rdzv/{self.run_id}/desired", str(self.supervisor.desired).encode()  # desired_key()
        try:
            found = client.kv_get(key)
            ok, _, _ = client.kv_set(key, value, found[1] if found else 0)
        except ShardServiceError as exc:  # the master may be restarting: next tick
            log.info("could not publish the desired node count: %s", exc)
            return
        if ok:
            self._published = self.supervisor.desired

    def _watch_paces(self, client: Any) -> None:
        """Hand the master's per-node pace (straggler verdicts) to the supervisor, every ``sample_every`` s."""
        from streamrover.shard_service import ShardServiceError

        now = time.time()
        if self.supervisor is None or now - self._paced_at < self.sample_every:
            return
        self._paced_at = now
        try:
            paces = client.status().node_paces
        except ShardServiceError as exc:  # the master may be restarting: next time
            log.info("no pace sample: %s", exc)
            return
        fields = ("node", "busy_per_step", "wall_per_step", "ranks", "median_others", "ratio", "beyond_seconds",
                  "straggler", "threshold", "window_seconds")  # fmt: skip
        self.supervisor.observe_paces([{f: getattr(p, f) for f in fields} for p in paces])

    def _autoscale(self, client: Any) -> None:
        """Feed the autoscaler the master's lag and acked counts; apply what it decides."""
        from streamrover.shard_service import ShardServiceError

        now = time.time()
        if self.autoscaler is None or self.supervisor is None or now - self._sampled_at < self.sample_every:
            return
        self._sampled_at = now
        try:
            datasets = client.status().datasets
        except ShardServiceError as exc:  # the master may be restarting: no sample this time
            log.info("no autoscaling sample: %s", exc)
            return
        streams = [d for d in datasets if d.kind == 2]
        lag, consumed = sum(d.lag for d in streams), sum(d.records_acked for d in streams)
        decision = self.autoscaler.observe(now, lag, consumed, self.supervisor.desired)
        if decision is not None:
            self.supervisor.event("autoscale", "", decision.describe())
            self.supervisor.scale(decision.nodes_to, f"autoscaler: {decision.why}")

    def _status(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"job": self.spec.name, "phase": "starting"}
        if self.supervisor is not None:
            doc = self.supervisor.status()
        doc["master_relaunches"] = self.master_relaunches
        doc["memory_enforcement"] = self.platform.resources().memory_enforcement
        doc["controller_pid"] = os.getpid()
        if self.autoscaler is not None:
            doc["autoscaling"] = {"decisions": [vars(d) for d in self.autoscaler.decisions[-10:]],
                                  "samples": [vars(s) for s in self.autoscaler.samples[-3:]]}  # fmt: skip
        doc["state_dir"], doc["ckpt_url"] = str(self.state_dir), self.ckpt_url
        return doc

    def _write(self, doc: dict[str, Any]) -> None:
        self.job.write_status(doc)


def run_controller(spec: JobSpec, job: JobDir, platform: str = "local") -> int:
    """Run a job in this process, stopping gracefully on SIGTERM or SIGINT."""
    controller = JobController(spec, job, platform)

    def _stop(signum: int, frame: FrameType | None) -> None:
        controller.request_stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return controller.run()
