"""A producer whose rate steps, and a monitor of nodes and lag: the autoscaling test's and bench's harness.

The job is the torch ledger job with a modelled step time (``--step-seconds``: a node trains at
most ``batch / step_seconds`` records/s, as on its own machine, which 2 shared cores cannot show)
on an open-ended Kafka topic (``--until-file``: the producer writes how many records it produced
when it stops, and the job ends once it trained them all).
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from streamrover.shard_service import ShardClient
from tests.operator.runner import RunningJob, kafka_topic, ledger_spec, send

BATCH = 32
STEP_SECONDS = 0.2
NODE_RATE = BATCH / STEP_SECONDS  # records/s one node trains at most: 160


def rate_step_spec(name: str, broker: Any, out: Path, capacity: int, nodes: str,
                   autoscaling: dict[str, Any] | None) -> tuple[dict[str, Any], str]:  # fmt: skip
    """The paced ledger job on a fresh topic; returns (spec, topic). One worker per node (and its warm standby)."""
    topic = kafka_topic(broker, 0)
    spec = ledger_spec(name, f"kafka://{broker.bootstrap}/{topic}", capacity, out, nodes=nodes, nproc_per_node=1)
    spec["datasets"][0]["records_per_shard"] = 256
    spec["datasets"][0]["options"]["sr.max_delay_ms"] = 1000  # shards of ~BATCH+ records at the low rate
    args = spec["trainer"]["args"]
    args[args.index("--batch-size") + 1] = BATCH
    args += ["--step-seconds", STEP_SECONDS, "--until-file", str(out / "produced")]
    # A joining node waits in torch's wait list, polling every second: with a last call of 1 s the group re-formed
    # without it (under load, a scale-out 1 -> 3 went 1, 2, 2, 3 groups: a full restart each). 5 s lets every
    # waiting node in. Heartbeats at torch's default (5 s, 3 missed): each is a compare-and-set of the one
    # rendezvous state, and under load a joining agent whose read-modify-write took longer than the gap
    # between the others' heartbeats lost every one (a node never joined in 2 min, its main thread busy).
    spec["trainer"]["launcher_args"] = ["--monitor-interval", "0.2", "--rdzv-conf",
                                        "keep_alive_interval=5,keep_alive_max_attempt=3,last_call_timeout=5,"
                                        "join_timeout=300,cas_backoff_max_seconds=0.5"]  # fmt: skip
    if autoscaling is not None:
        spec["autoscaling"] = autoscaling
    return spec, topic


class RateProducer(threading.Thread):
    """Produces ledger records 0, 1, 2... to ``topic`` at ``rate`` records/s (changeable) until :meth:`finish`."""

    def __init__(self, broker: Any, topic: str, rate: float) -> None:
        super().__init__(name="rate-producer", daemon=True)
        from confluent_kafka import Producer

        self.producer = Producer(broker.client_config(**{"acks": "all", "enable.idempotence": True,
                                                         "linger.ms": 20}))  # fmt: skip
        self.topic = topic
        self.rate = rate
        self.produced = 0
        self._due = 0.0
        self._halt = threading.Event()  # (not _stop: Thread has a method of that name)

    def send_now(self, count: int) -> None:
        """Produce the next ``count`` records at once (before :meth:`start`: a seed the job trains first)."""
        send(self.producer, self.topic, np.arange(self.produced, self.produced + count))
        assert self.producer.flush(60) == 0
        self.produced += count
        self._due = float(self.produced)

    def set_rate(self, rate: float) -> float:
        """Change the rate; returns when (``time.monotonic()``)."""
        self.rate = rate
        return time.monotonic()

    def run(self) -> None:
        last = time.monotonic()
        while not self._halt.wait(0.05):  # a pace, not a synchronisation: records are due at the rate
            now = time.monotonic()
            self._due += self.rate * (now - last)
            last = now
            count = int(self._due) - self.produced
            if count > 0:
                send(self.producer, self.topic, np.arange(self.produced, self.produced + count))
                self.producer.poll(0)
                self.produced += count

    def finish(self, until_file: Path) -> int:
        """Stop, flush, and tell the job how many records there are (atomically); returns that number."""
        self._halt.set()
        self.join(timeout=30)
        assert self.producer.flush(60) == 0
        tmp = until_file.with_suffix(".tmp")
        tmp.write_text(str(self.produced))
        tmp.replace(until_file)
        return self.produced


@dataclass
class Sample:
    at: float
    nodes: int  # launched and not ended (the resources the job holds)
    running: int  # of which training (workers up)
    lag: int


@dataclass
class Monitor:
    """Samples the job's node count (status.json) and lag (the master's status) every ``every`` seconds."""

    job: RunningJob
    every: float = 0.5
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)
        self._client: ShardClient | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self._client is not None:
            self._client.close()

    def _lag(self) -> int | None:
        doc = self.job.status()
        if self._client is None:
            if "master" not in doc or "state_dir" not in doc:
                return None
            token = (Path(doc["state_dir"]) / "token").read_text().strip()
            self._client = ShardClient(doc["master"], token=token, heartbeat=False, timeout=10)
        return sum(d.lag for d in self._client.status().datasets)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                lag = self._lag()
                nodes = self.job.status().get("nodes", [])
            except Exception:  # the master or the status file between two writes: next sample
                continue
            if lag is not None:
                running = sum(1 for n in nodes if n["state"] == "running" and n.get("workers"))
                self.samples.append(Sample(time.monotonic(), len(nodes), running, lag))

    @property
    def last(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def first_after(self, t0: float, pred: Any) -> Sample | None:
        return next((s for s in self.samples if s.at >= t0 and pred(s)), None)

    def integrals(self, t0: float, t1: float) -> tuple[float, float]:
        """(node-seconds, lag record-seconds) between ``t0`` and ``t1``."""
        inside = [s for s in self.samples if t0 <= s.at <= t1]
        node_s = lag_s = 0.0
        for a, b in itertools.pairwise(inside):
            node_s += a.nodes * (b.at - a.at)
            lag_s += a.lag * (b.at - a.at)
        return node_s, lag_s


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _stamps(path: Path, needle: str = "") -> list[float]:
    """Wall-clock times of a node log's lines (the agent's logging format) that contain ``needle``."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        found = _STAMP.match(line)
        if found and needle in line:
            out.append(datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S,%f").timestamp())  # local time, as logged
    return out


def scale_out_phases(job: RunningJob) -> dict[str, float] | None:
    """Where the first scale-out's pause went, from the job's own records: seconds from the decision to

    ``launched`` (the supervisor launched the last new node), ``agents up`` (the last new agent logged that its
    imports are done), ``workers up`` (rank 0's worker of the first group of the new size started: the
    rendezvous is done), ``gloo``, ``restored`` (rank 0 joined the shard service, restored and broadcast),
    ``first step`` (that group trained its first step); ``rounds``: how many groups formed between the
    decision and that one (1: the new nodes joined in one rendezvous). None if the job never scaled out.
    """
    events = job.status().get("events", [])
    steps = [(e, re.match(r"(\d+) -> (\d+) nodes \(autoscaler", e["message"])) for e in events if e["kind"] == "scale"]
    decision = next(((e, int(m[2])) for e, m in steps if m and int(m[2]) > int(m[1])), None)
    if decision is None:
        return None
    t0, world = float(decision[0]["at"]), decision[1]
    new = [e for e in events if e["kind"] == "launch" and e["message"] == "scale-out" and e["at"] >= t0]
    if not new:
        return None
    logs = job.dir.path / "logs"
    out = {"launched": max(e["at"] for e in new) - t0}
    ups = [_stamps(logs / f"node-{e['node']}.log", "agent of node") for e in new]
    if all(ups):
        out["agents up"] = max(u[0] for u in ups) - t0
    path = job.out / "loss.txt"
    attempts = [(i, line) for i, line in enumerate(path.read_text().splitlines() if path.exists() else [])
                if line.startswith("# attempt") and float(line.rsplit(" at ", 1)[1]) >= t0]  # fmt: skip
    lines = path.read_text().splitlines() if path.exists() else []
    for n, (i, line) in enumerate(attempts, 1):
        if f" world {world} " not in line:
            continue
        words = line.split("; ", 1)[1].rsplit(" at ", 1)[0].split()
        timing = dict(zip(words[::2], map(float, words[1::2]), strict=True))
        out["workers up"] = timing["up"] - t0
        out["gloo"] = out["workers up"] + timing["gloo"]
        out["restored"] = float(line.rsplit(" at ", 1)[1]) - t0
        first = next((x for x in lines[i + 1 :] if x.startswith("# first step at ")), None)
        if first is not None:
            out["first step"] = float(first.rsplit(" ", 1)[1]) - t0
        out["rounds"] = n
        break
    return out
