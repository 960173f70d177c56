"""A real PyFlink job process (tests/sinks/flink_job.py) for the sink tests and the bench.

The job runs in the PyFlink venv that ``make flink-sink`` (scripts/build-flink-sink.sh) sets up, in its
own process group: :meth:`FlinkJob.kill` SIGKILLs the driver, its JVM (the mini cluster) and its Python
workers at once. Its retained checkpoints are found under ``checkpoints/<job id>/chk-N/_metadata``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CACHE = Path(os.environ.get("STREAMROVER_CACHE") or Path.home() / ".cache" / "streamrover")
FLINK_VENV = CACHE / "flink-venv"
CONNECTOR = CACHE / "jars" / "flink-kafka-5.0.0-2.2"


def build_sink() -> Path:
    """The sink jar (built once per source version; the PyFlink venv made once), as the Makefile does."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-flink-sink.sh")], capture_output=True, text=True, timeout=1200
    )
    assert out.returncode == 0, f"scripts/build-flink-sink.sh failed:\n{out.stderr[-4000:]}"
    fetch = subprocess.run(["bash", str(ROOT / "scripts" / "fetch-jars.sh"), "flink-kafka"], capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    assert fetch.returncode == 0, f"scripts/fetch-jars.sh flink-kafka failed:\n{fetch.stderr[-4000:]}"
    return Path(out.stdout.strip().splitlines()[-1])


class FlinkJob:
    """One PyFlink job: ``start()`` (or resume from a checkpoint), ``kill()`` (SIGKILL), REST status."""

    def __init__(
        self, workdir: Path, jar: Path, args: list[str], rest_port: int, env: dict[str, str] | None = None
    ) -> None:
        self.env = dict(env or {})  # more environment for the job (STREAMROVER_TLS_CA for the committer)
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.jar = jar
        self.args = args
        self.rest_port = rest_port
        self.checkpoints = workdir / "flink-checkpoints"
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def start(self, restore: Path | None = None) -> None:
        jars = os.pathsep.join(str(p) for p in sorted(CONNECTOR.glob("*.jar")))
        cmd = [str(FLINK_VENV / "bin" / "python"), str(HERE / "flink_job.py"), "--jars", jars,
               "--checkpoints", str(self.checkpoints), "--rest-port", str(self.rest_port), *self.args]  # fmt: skip
        if restore is not None:
            cmd += ["--restore", str(restore)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env["PATH"] = f"{FLINK_VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # its Python workers run `python`
        env["PYTHONPATH"] = str(ROOT)
        env["STREAMROVER_FLINK_SINK_JAR"] = str(self.jar)
        env.update(self.env)
        self.runs += 1
        # the mini cluster's log (not the venv's), one folder per run: a run would overwrite the one before's
        env["FLINK_LOG_DIR"] = str(self.workdir / "flink-logs" / f"run-{self.runs}")
        log = open(self.workdir / f"flink-{self.runs}.log", "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the job's whole process group: driver, JVM, Python workers."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def rest(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.rest_port}{path}", timeout=5) as r:
            return json.load(r)

    def job_id(self) -> str | None:
        """The running job's id, None while the REST endpoint or the job is not up yet."""
        try:
            jobs = self.rest("/jobs")["jobs"]
        except OSError:
            return None
        running = [j["id"] for j in jobs if j["status"] == "RUNNING"]
        return running[0] if running else None

    def checkpoint_history(self, job_id: str) -> list[dict[str, Any]]:
        """The job's checkpoints from its REST endpoint (id, status, latest_ack_timestamp in ms...)."""
        return list(self.rest(f"/jobs/{job_id}/checkpoints")["history"])

    def committer_metric(self, name: str) -> int | None:
        """The sum over the running job's committer subtasks of a Sink V2 committer metric (Flink's
        ``failedCommittables``, ``retriedCommittables``...), None while no job runs. A failover resets it."""
        job_id = self.job_id()
        if job_id is None:
            return None
        total = 0
        for vertex in self.rest(f"/jobs/{job_id}")["vertices"]:
            path = f"/jobs/{job_id}/vertices/{vertex['id']}/metrics"
            ids = [m["id"] for m in self.rest(path) if m["id"].endswith("." + name)]
            if ids:
                total += sum(int(float(m["value"])) for m in self.rest(f"{path}?get={','.join(ids)}"))
        return total

    def latest_retained(self) -> Path | None:
        """The newest completed checkpoint on disk (its chk-N folder holds _metadata)."""
        found = sorted(self.checkpoints.glob("*/chk-*/_metadata"), key=lambda p: int(p.parent.name[4:]))
        return found[-1].parent if found else None

    def cluster_log(self) -> str:
        """The mini cluster's own log (where the sink's Java classes log), all runs."""
        return "\n".join(p.read_text(errors="replace") for p in sorted((self.workdir / "flink-logs").glob("*/*.log")))

    def logs(self) -> str:
        """The driver's output and the lines of the mini cluster's log that tell of failures."""
        drivers = sorted(self.workdir.glob("flink-*.log"))
        out = [f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in drivers]
        for p in sorted((self.workdir / "flink-logs").glob("*/*.log")):
            lines = [ln for ln in p.read_text(errors="replace").splitlines() if "ERROR" in ln or "Exception" in ln]
            out.append(f"--- {p.name} (ERROR/Exception lines)\n" + "\n".join(lines[-40:]))
        return "\n".join(out)
