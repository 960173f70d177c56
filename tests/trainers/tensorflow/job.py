"""A real TF-PS job for the tests: a job master, a dataset, and ``streamrover tf-ps-run`` in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from streamrover.ckpt import namespace_for, purge_shared_memory
from streamrover.ckpt.wire import saver_address
from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.shard_service.client.tls import ClientTls
from streamrover.testing.certs import issue, make_ca
from streamrover.testing.procs import MasterProcess, python_env

HERE = Path(__file__).resolve().parent
LEDGER_SCRIPT = HERE / "ledger_ps.py"


@dataclass
class TFJob:
    workdir: Path
    uri: str
    options: dict[str, str] = field(default_factory=dict)
    records_per_shard: int = 1000
    tls: bool = False  # the master serves TLS; tf-ps-run is given the CA with --tls-ca (and passes it on)
    master: MasterProcess = field(init=False)
    launcher: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.client_tls: ClientTls | None = None
        extra: list[str] = []
        if self.tls:
            pki = self.workdir / "pki"
            ca = make_ca(pki)
            server = issue(ca, pki, "master")
            self.client_tls = ClientTls(str(ca.cert))
            extra = ["--tls-cert", str(server.cert), "--tls-key", str(server.key)]
        self.master = MasterProcess(self.workdir / "master", lease_ttl=10.0, extra_args=extra)
        self.out = self.workdir / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.ckpt = self.workdir / "ckpt"
        self.status_file = self.workdir / "status.json"
        self.events_file = self.workdir / "events.jsonl"
        self.logs_dir = self.workdir / "logs"

    def start(self, ps: int, workers: int, script_args: list[str], env: dict[str, str] | None = None) -> None:
        """Start the master and ``streamrover tf-ps-run`` (with ``env`` added to its environment)."""
        self.master.start()
        with self.admin() as admin:
            admin.register_dataset(DatasetSpec("stream", self.uri, options=self.options,
                                               records_per_shard=self.records_per_shard))  # fmt: skip
        env = {**python_env(), **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[2]), env.get("PYTHONPATH", "")])
        cmd = [
            sys.executable, "-m", "streamrover.cli", "tf-ps-run", "--ps", str(ps), "--workers", str(workers),
            "--shard-service", self.master.address, "--token", self.master.token, "--ckpt-dir", str(self.ckpt),
            "--ckpt-job", self.workdir.name, "--log-dir", str(self.logs_dir), "--status-file", str(self.status_file),
            "--events", str(self.events_file),
            *(["--tls-ca", self.client_tls.ca] if self.client_tls else []),
            str(LEDGER_SCRIPT), *script_args, "--out", str(self.out),
        ]  # fmt: skip
        log = open(self.workdir / "launcher.log", "ab")
        self.launcher = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def admin(self) -> ShardClient:
        return ShardClient(self.master.address, token=self.master.token, heartbeat=False, timeout=90,
                           tls=self.client_tls or True)  # fmt: skip

    def status(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.status_file.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.events_file.exists():
            return []
        rows = [json.loads(line) for line in self.events_file.read_text().splitlines() if line.strip()]
        return [r for r in rows if kind is None or r["event"] == kind]

    def acked(self) -> int:
        with self.admin() as admin:
            return admin.get_cursor()[1].size()

    def kill(self, role: str, index: int = 0) -> int:
        """SIGKILL the chief, ``ps`` ``index`` or ``workers`` ``index``; returns the pid killed."""
        doc = self.status()
        pid = int(doc["chief"] if role == "chief" else doc[role][index])
        os.kill(pid, signal.SIGKILL)
        return pid

    def signal_launcher(self, sig: int) -> None:
        assert self.launcher is not None
        self.launcher.send_signal(sig)

    def ledger(self) -> np.ndarray | None:
        path = self.out / "ledger.npy"
        return np.load(path) if path.exists() else None

    def losses(self) -> list[float]:
        path = self.out / "loss.txt"
        lines = path.read_text().splitlines() if path.exists() else []
        return [float(line.split()[1]) for line in lines if line and not line.startswith("#")]

    def wait(self, timeout: float) -> int:
        assert self.launcher is not None
        return self.launcher.wait(timeout=timeout)

    def stop(self) -> None:
        if self.launcher is not None and self.launcher.poll() is None:
            self.launcher.kill()  # its tasks die with it (PR_SET_PDEATHSIG), the chief is killed below
            self.launcher.wait()
        chief = self.status().get("chief")
        for pid in ([int(chief)] if chief else []) + self._saver_pids():  # the saver's session is its own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Nothing writes the snapshots now: free them. A later job of the same name and checkpoint path on this
        # node (pytest's numbered tmp dirs repeat once their root is wiped) must find none of this one's.
        purge_shared_memory(self.namespace)
        self.master.stop()

    @property
    def namespace(self) -> str:
        """The job's checkpoint namespace on this node (its shared-memory snapshots and its saver's address)."""
        return namespace_for(str(self.ckpt), self.workdir.name)

    def _saver_pids(self) -> list[int]:
        """The node's checkpoint saver serving this job (the chief started it: ``python -m streamrover.ckpt``)."""
        address = "@" + saver_address(self.namespace)[1:]
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                args = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
            except OSError:  # gone, or not ours to read
                continue
            if b"streamrover.ckpt" in args and address.encode() in args:
                pids.append(int(proc.name))
        return pids

    def logs(self) -> str:
        files = [self.workdir / "launcher.log", *sorted(self.logs_dir.glob("chief*.log"))]
        parts = [f"--- {p.name}\n" + p.read_text(errors="replace")[-5000:] for p in files if p.exists()]
        parts.append("--- events\n" + "\n".join(json.dumps(e) for e in self.events()))
        return "\n".join(parts)
