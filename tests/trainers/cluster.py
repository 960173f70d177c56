"""Real ``dlrover-run`` agents around a real job master, for the torch trainer tests and the bench."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.shard_service.client.tls import ClientTls
from streamrover.testing.procs import MasterProcess, python_env
from streamrover.tokens import worker_token
from streamrover.trainers.torch.agent import read_health

HERE = Path(__file__).resolve().parent
LEDGER_SCRIPT = HERE / "ledger_train.py"
DLROVER_RUN = Path(sys.executable).parent / "dlrover-run"


def records_table(ids: np.ndarray) -> dict[str, np.ndarray]:
    """The test records: ``y = 3x + 1`` with x in [-1, 1) derived from the id."""
    x = ((ids * 7919) % 2000).astype(np.float64) / 1000.0 - 1.0
    return {"id": ids.astype(np.int64), "x": x, "y": 3.0 * x + 1.0}


@dataclass
class TorchJob:
    workdir: Path
    uri: str
    options: dict[str, str] = field(default_factory=dict)
    records_per_shard: int = 1000
    run_id: str = "job"
    lease_ttl: float = 10.0
    master_args: list[str] = field(default_factory=list)  # more `streamrover master` flags (--tls-cert ...)
    env: dict[str, str] = field(default_factory=dict)  # for the agents and this side's clients (STREAMROVER_TLS_CA)
    worker_role: bool = False  # agents get the worker token (as the operator hands it), not the admin token
    master: MasterProcess = field(init=False)
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.master = MasterProcess(self.workdir / "master", lease_ttl=self.lease_ttl, extra_args=self.master_args)
        self.out = self.workdir / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.ckpt = self.workdir / "ckpt"

    def start(self) -> None:
        self.master.start()
        with self.admin() as admin:
            spec = DatasetSpec("stream", self.uri, options=self.options, records_per_shard=self.records_per_shard)
            admin.register_dataset(spec)

    def admin(self) -> ShardClient:
        tls = ClientTls.from_env(self.env) if self.env else None
        return ShardClient(self.master.address, token=self.master.token, heartbeat=False, timeout=90, tls=tls)

    def agent_cmd(self, name: str, nnodes: str, nproc: int, script: Path, script_args: list[str]) -> list[str]:
        token = worker_token(self.master.token) if self.worker_role else self.master.token
        return [
            str(DLROVER_RUN), "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--max-restarts", "30",
            "--monitor-interval", "0.2", "--rdzv-backend", "streamrover", "--rdzv-id", self.run_id,
            "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1,join_timeout=300",
            "--local-addr", "127.0.0.1", "--shard-service", self.master.address, "--token", token,
            "--ckpt-dir", str(self.ckpt), "--node-id", name, str(script), *script_args,
        ]  # fmt: skip

    def start_agent(
        self, name: str, nnodes: str, nproc: int, script_args: list[str], script: Path = LEDGER_SCRIPT
    ) -> None:
        env = {**python_env(), **self.env}
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
        log = open(self.workdir / f"agent-{name}.log", "ab")
        self.agents[name] = subprocess.Popen(
            self.agent_cmd(name, nnodes, nproc, script, script_args), env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def workers(self, name: str | None = None) -> list[psutil.Process]:
        """Worker processes (the training script) of one agent, or of all running agents.

        The agent's health report names its workers' pids (a worker started in a warm standby
        has the standby's command line, so the command line cannot tell them apart).
        """
        names = [name] if name else [n for n, p in self.agents.items() if p.poll() is None]
        found = []
        with self.admin() as admin:
            for n in names:
                health = read_health(admin, self.run_id, n) or {}
                for pid in health.get("workers", {}).values():
                    try:
                        proc = psutil.Process(pid)
                        if proc.status() != psutil.STATUS_ZOMBIE and proc.ppid() == self.agents[n].pid:
                            found.append(proc)
                    except psutil.Error:  # exited while we looked
                        continue
        return found

    def kill_agent(self, name: str) -> None:
        self.agents[name].send_signal(signal.SIGKILL)
        self.agents[name].wait()

    def stop_agent(self, name: str) -> None:
        """The node leaves: SIGTERM its agent (torchelastic stops its workers)."""
        self.agents[name].send_signal(signal.SIGTERM)
        self.agents[name].wait(timeout=120)

    def acked(self) -> int:
        with self.admin() as admin:
            return admin.get_cursor()[1].size()

    def ledger(self) -> np.ndarray | None:
        path = self.out / "ledger.npy"
        return np.load(path) if path.exists() else None

    def losses(self) -> list[float]:
        path = self.out / "loss.txt"
        lines = path.read_text().splitlines() if path.exists() else []
        return [float(line.split()[1]) for line in lines if line and not line.startswith("#")]

    def stop(self) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
                proc.wait()
        self.master.stop()

    def logs(self) -> str:
        parts = [f"--- {p.name}\n" + p.read_text(errors="replace")[-4000:] for p in sorted(self.workdir.glob("*.log"))]
        loss = self.out / "loss.txt"
        if loss.exists():
            parts.append("--- loss.txt (attempt lines)\n" + "\n".join(
                line for line in loss.read_text().splitlines() if line.startswith("#")))  # fmt: skip
        return "\n".join(parts)
