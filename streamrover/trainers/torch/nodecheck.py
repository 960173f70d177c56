"""The pre-flight node check of ``dlrover-run --node-check``: find a slow or broken node before it joins training.

Before its first rendezvous, each node's agent

1. announces itself in the check document of the run (``health/<run id>/check`` in the job master's
   key-value store, compare-and-set) and waits until the nodes the job wants have announced themselves
   (the controller's ``rdzv/<run id>/desired``, else ``--nnodes``'s minimum; at most ``wait`` seconds),
   so that the nodes probe **at the same time**, under the same load of a shared machine;
2. probes: a **compute probe** (single-threaded float32 matmuls, a fixed amount of work, timed) and a
   **collective probe** (an all-reduce over gloo between two members on this node's address, timed:
   gloo's transport and the interface work);
3. posts its result and waits (again at most ``wait`` s) for the results of the nodes that announced;
4. judges: its compute time against the **median of the other nodes'** (nodes that failed their check
   left out); a ratio above ``threshold``, or a probe that failed, fails the node.

A node that fails writes its verdict into its health document (``nodes/<run id>/<node id>``: state
``NODE_CHECK_FAILED`` and the ``node_check`` evidence, which the master's ``/metrics`` shows) and exits
with :data:`NODE_CHECK_EXIT` without joining the rendezvous, so no round ever counts it; the job's
supervisor relaunches it as a new node (on another machine where the platform has one). A node that
comes later (a relaunch) is judged against the results already posted.

The check's cost (its wall time, waits included) is logged and kept in the result.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from streamrover.shard_service import ShardClient

log = logging.getLogger(__name__)
NODE_CHECK_EXIT = 86  # the agent's exit code when its node failed the check (the supervisor relaunches it)
DEFAULT_THRESHOLD = 2.0
MATMUL_SIZE = 256
MATMUL_REPEATS = 60  # per chunk: ~25 ms of CPU, more than a CPU quota's slice (10 ms of a 100 ms period at 10%)
CHUNKS = 5  # the probe's time is 5x its median chunk: a transient stall (one preemption) does not decide
ALLREDUCE_FLOATS = 1 << 16  # 256 KiB
ALLREDUCE_REPEATS = 10
PROBE_TIMEOUT = 30.0  # seconds the collective probe may take before it counts as failed


def check_key(run_id: str) -> str:
    """The master's KV key of a run's node check document."""
    return f"health/{run_id}/check"


@dataclass
class CheckResult:
    """One node's check: its probes' times, the peers' median, the verdict and what the check cost."""

    node: str
    compute_s: float | None = None  # the matmul probe's wall time
    allreduce_s: float | None = None  # the gloo probe's wall time
    error: str = ""  # a probe that failed, and how
    peers: int = 0  # other nodes' results it was judged against
    median_s: float | None = None  # their median compute time
    ratio: float | None = None  # compute_s / median_s
    threshold: float = DEFAULT_THRESHOLD
    passed: bool = True
    cost_s: float = 0.0  # the check's wall time, waits included
    at: float = 0.0

    def describe(self) -> str:
        """One line for logs and events."""
        if self.error:
            return f"probe failed: {self.error}"
        ratio = f"{self.ratio:.2f}x the median {self.median_s:.3f} s of {self.peers} peers" if self.ratio else "no peer"
        verdict = "passed" if self.passed else "FAILED"
        return (f"compute {self.compute_s:.3f} s ({ratio}; threshold {self.threshold:g}x), all-reduce "
                f"{self.allreduce_s:.3f} s; {verdict}; cost {self.cost_s:.2f} s")


def compute_probe(size: int = MATMUL_SIZE, repeats: int = MATMUL_REPEATS, chunks: int = CHUNKS) -> float:
    """Seconds for ``chunks`` x ``repeats`` single-threaded ``size``x``size`` float32 matmuls: ``chunks`` times the
    median chunk's time (one warm-up first). One thread: the same work on every node whatever its core count, and
    no OpenMP team spinning on an oversubscribed machine (measured: 4-12 s for what one thread does in 0.4 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = torch.rand(size, size, generator=gen), torch.rand(size, size, generator=gen)
        torch.mm(a, b)
        times = []
        for _ in range(chunks):
            started = time.perf_counter()
            for _ in range(repeats):
                a = torch.mm(a, b).clamp_(-1.0, 1.0)
            times.append(time.perf_counter() - started)
        return chunks * statistics.median(times)
    finally:
        torch.set_num_threads(before)


def collective_probe(host: str = "127.0.0.1", floats: int = ALLREDUCE_FLOATS, repeats: int = ALLREDUCE_REPEATS,
                     timeout: float = PROBE_TIMEOUT) -> float:  # fmt: skip
    """Seconds for ``repeats`` gloo all-reduces of ``floats`` floats between two members bound to ``host``."""
    store = dist.HashStore()
    times: dict[int, float] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (torch's own stubs lack it)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = timedelta(seconds=timeout)
            group = dist.ProcessGroupGloo(dist.PrefixStore("probe", store), rank, 2, opts)
            data = torch.ones(floats)
            started = time.perf_counter()
            for _ in range(repeats):
                group.allreduce([data]).wait()  # type: ignore[attr-defined]
            times[rank] = time.perf_counter() - started
            if float(data[0]) != 2.0**repeats:
                raise RuntimeError(f"the all-reduce summed to {float(data[0])}, not {2.0**repeats}")
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    members = [threading.Thread(target=member, args=(r,), name=f"node-check-{r}", daemon=True) for r in (0, 1)]
    for t in members:
        t.start()
    for t in members:
        t.join(timeout + 5)
    if errors:
        raise RuntimeError(f"gloo all-reduce on {host}: {errors[0]}")
    if len(times) < 2:
        raise RuntimeError(f"gloo all-reduce on {host} did not finish within {timeout:.0f} s")
    return max(times.values())


def judge(result: CheckResult, others: list[CheckResult], threshold: float) -> CheckResult:
    """The verdict on ``result`` against the other nodes' results (those that passed or are not judged yet)."""
    result.threshold = threshold
    if result.error:
        result.passed = False
        return result
    peers = [r.compute_s for r in others if r.passed and r.compute_s is not None and not r.error]
    result.peers = len(peers)
    if peers and result.compute_s is not None:
        result.median_s = statistics.median(peers)
        result.ratio = result.compute_s / max(result.median_s, 1e-9)
        result.passed = result.ratio <= threshold
    return result


class NodeCheck:
    """Runs one node's check through the job master (see the module docstring)."""

    def __init__(self, client: ShardClient, run_id: str, node_id: str, *, expected: Callable[[], int],
                 threshold: float = DEFAULT_THRESHOLD, wait: float = 60.0, host: str = "127.0.0.1") -> None:
        if threshold <= 1.0:
            raise ValueError(f"--node-check-threshold {threshold}: must be more than 1 (a ratio to the median)")
        self.client, self.key, self.node_id = client, check_key(run_id), node_id
        self.expected, self.threshold, self.wait, self.host = expected, threshold, wait, host
        self._pause = threading.Event()  # never set: a timed wait between polls of the master

    def _update(self, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Compare-and-set the check document through ``change`` (retried until this write wins)."""
        while True:
            found = self.client.kv_get(self.key)
            doc: dict[str, Any] = json.loads(found[0]) if found else {"ready": [], "results": {}}
            change(doc)
            ok, _, _ = self.client.kv_set(self.key, json.dumps(doc).encode(), found[1] if found else 0)
            if ok:
                return doc

    def _read(self) -> dict[str, Any]:
        found = self.client.kv_get(self.key)
        return json.loads(found[0]) if found else {"ready": [], "results": {}}

    def _await(self, enough: Callable[[dict[str, Any]], bool], until: float) -> dict[str, Any]:
        delay = 0.05
        while True:
            doc = self._read()
            if enough(doc) or time.monotonic() >= until:
                return doc
            self._pause.wait(delay)
            delay = min(delay * 2, 0.5)

    def run(self) -> CheckResult:
        """Announce, probe with the others, post, judge; the result (its ``passed`` is the verdict)."""
        started = time.monotonic()
        want = max(self.expected(), 1)
        self._update(lambda d: d["ready"].append(self.node_id) if self.node_id not in d["ready"] else None)
        self._await(lambda d: len(d["ready"]) >= want, started + self.wait)
        result = CheckResult(self.node_id, threshold=self.threshold)
        try:
            result.compute_s = compute_probe()
            result.allreduce_s = collective_probe(self.host)
        except Exception as exc:
            result.error = str(exc) or type(exc).__name__
        posted = time.monotonic()
        doc = self._update(lambda d: d["results"].__setitem__(self.node_id, asdict(result)))
        announced = set(doc["ready"])
        doc = self._await(lambda d: announced <= set(d["results"]), posted + self.wait)
        others = [CheckResult(**r) for n, r in doc["results"].items() if n != self.node_id]
        judge(result, others, self.threshold)
        result.cost_s, result.at = time.monotonic() - started, time.time()
        self._update(lambda d: d["results"].__setitem__(self.node_id, asdict(result)))
        return result
