"""Rendezvous through the job master: torch.distributed.elastic's dynamic rendezvous on the master's KV store.

``DynamicRendezvousHandler`` needs two things: a :class:`RendezvousBackend` that holds
the rendezvous state with compare-and-set (get_state / set_state with fencing tokens),
and a c10d ``Store`` the agents share for rank assignment and barriers. Both live in
the shard service's durable key-value store (``ShardClient.kv_get`` / ``kv_set``), so
the rendezvous survives the death of any agent (no agent hosts it, unlike c10d's
TCPStore) and of the master itself (its journal is durable; clients retry).

Registered as ``--rdzv-backend=streamrover``; ``--rdzv-endpoint`` is the master's
``HOST:PORT`` and the token comes from ``--rdzv-conf token=...`` or ``STREAMROVER_TOKEN``.
Workers bootstrap their own process group (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
rank 0's worker hosts a TCPStore each round), so no agent's death leaves a stale address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
    dynamic_rendezvous,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, create_handler

from streamrover.shard_service import ShardClient, ShardServiceError
from streamrover.trainers.torch import env

log = logging.getLogger(__name__)
BACKEND_NAME = "streamrover"
_PRESENT = b"\x01"
_DELETED = b"\x00"  # how older builds marked a deleted key (read as absent)
_ROUND_KEY = re.compile(r"torch\.rendezvous\.[^/]*\.(?P<round>\d+)/(?P<rest>.*)", re.DOTALL)  # dynamic_rendezvous


FIRST_RUN_SKEW = (0, 0.3)  # DynamicRendezvousHandler.next_rendezvous's random delay while its round is 0


@contextlib.contextmanager
def no_first_round_skew(skipped: list[float] | None = None) -> Iterator[None]:
    """Within the block, torch's dynamic rendezvous does not sleep its random 0-0.3 s before joining in round 0.

    That delay skews the nodes' *first* joins ("if this is our first run"), but a handler is still in round 0
    at the group's first restart, so the first recovery of every job paid 0.15 s on average (later restarts,
    in rounds >= 1, none). The agent wraps its restarts' rendezvous in this; ``skipped`` collects the
    delays skipped. Only that call's bounds are matched; other delays (a CAS back-off) still sleep.
    """
    original = getattr(dynamic_rendezvous, "_delay", None)
    if original is None:  # another torch: nothing to skip
        yield
        return

    def delay(seconds: float | tuple[float, float]) -> None:
        if seconds == FIRST_RUN_SKEW:
            if skipped is not None:
                skipped.append(FIRST_RUN_SKEW[1])
            return
        original(seconds)

    dynamic_rendezvous._delay = delay
    try:
        yield
    finally:
        dynamic_rendezvous._delay = original


def _kv_error(exc: ShardServiceError) -> RendezvousConnectionError:
    return RendezvousConnectionError(f"the job master's key-value store failed: {exc}")


class MasterRendezvousBackend(RendezvousBackend):
    """The rendezvous state of ``run_id`` in the master's KV store; the fencing token is the key's version."""

    def __init__(self, client: ShardClient, run_id: str) -> None:
        if not run_id:
            raise ValueError("a run id is required (--rdzv-id)")
        self._client = client
        self._key = f"rdzv/{run_id}/state"

    @property
    def name(self) -> str:
        """The backend's name (``--rdzv-backend``)."""
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Any] | None:
        """(state, fencing token) from the master's key-value store, or None when there is none."""
        try:
            found = self._client.kv_get(self._key)
        except ShardServiceError as exc:
            raise _kv_error(exc) from exc
        return found

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        """Compare-and-set the state under ``token`` (None: create it); (current state, its token, whether this write
        won).
        """
        if token is not None and not isinstance(token, int):
            raise RendezvousStateError(f"the fencing token {token!r} did not come from this backend")
        try:
            ok, value, version = self._client.kv_set(self._key, state, token or 0)
        except ShardServiceError as exc:
            raise _kv_error(exc) from exc
        if not ok and version == 0:
            return None  # a token for a state that no longer exists
        return value, version, ok


class MasterStore(Store):
    """A c10d ``Store`` over the master's KV store, for the agents (never for collectives).

    Blocking reads (``get``, ``wait``) poll with backoff up to ``timeout``: the KV store
    has no watches, and agents read a handful of keys per rendezvous round.

    The dynamic rendezvous prefixes each round's keys (``torch.rendezvous.RUN.ROUND/...``, a
    ``PrefixStore``), and its c10d stores live as long as their server; this store is durable, so it
    keeps them under ``PREFIX/round/ROUND`` (the round zero-padded: rounds sort as numbers) and, when
    an agent first uses round R, removes the keys of the rounds before R - 1 in one range delete
    (the previous round stays for an agent still reading its ranks). At most two rounds' keys remain.
    """

    def __init__(self, client: ShardClient, prefix: str, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix
        self.set_timeout(timeout)  # what a wait without its own timeout waits (torchelastic's barriers set it)
        self._wake = threading.Event()  # never set: a timed wait between polls that a test can't mistake for sync
        self._round = -1  # the newest rendezvous round this store has used

    def _key(self, key: str) -> str:
        found = _ROUND_KEY.match(key)
        if found is None:
            return f"{self._prefix}/{key}"
        round_ = int(found["round"])
        if round_ > self._round:
            self._round = round_
            if round_ >= 2:
                rounds = f"{self._prefix}/round/"
                try:
                    self._client.kv_delete_range(rounds, f"{rounds}{round_ - 1:012d}")
                except ShardServiceError as exc:
                    raise _kv_error(exc) from exc
        return f"{self._prefix}/round/{round_:012d}/{found['rest']}"

    def _read(self, key: str) -> tuple[bytes | None, int]:
        try:
            found = self._client.kv_get(self._key(key))
        except ShardServiceError as exc:
            raise _kv_error(exc) from exc
        if found is None:
            return None, 0
        value, version = found
        return (value[1:] if value[:1] == _PRESENT else None), version

    def _cas(self, key: str, value: bytes | None, version: int) -> tuple[bool, bytes | None, int]:
        """Compare-and-set ``value``; None deletes the key (no tombstone row stays in the master's journal)."""
        try:
            if value is None:
                ok, current, now = self._client.kv_delete(self._key(key), version)
            else:
                ok, current, now = self._client.kv_set(self._key(key), _PRESENT + value, version)
        except ShardServiceError as exc:
            raise _kv_error(exc) from exc
        return ok, (current[1:] if current[:1] == _PRESENT else None), now

    def _poll(self, keys: list[str], timeout: timedelta | None) -> dict[str, bytes]:
        limit = (timeout or self.timeout).total_seconds()  # type: ignore[attr-defined]  # (c10d Store property)
        give_up = time.monotonic() + limit
        delay = 0.01
        found: dict[str, bytes] = {}
        while True:
            for key in keys:
                if key not in found:
                    value, _ = self._read(key)
                    if value is not None:
                        found[key] = value
            if len(found) == len(keys):
                return found
            if time.monotonic() > give_up:
                missing = sorted(set(keys) - set(found))
                raise TimeoutError(f"keys {missing} did not appear in the master's store within {limit:.0f} s")
            self._wake.wait(delay)
            delay = min(delay * 2, 0.2)

    # -- the c10d Store interface ----------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        """Set ``key`` to ``value``."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        _, version = self._read(key)
        while True:
            ok, _, version = self._cas(key, data, version)
            if ok:
                return

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting until it is set (up to the store's timeout)."""
        return self._poll([key], None)[key]

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 when unset); returns the new value."""
        current, version = self._read(key)
        while True:
            new = int(current or b"0") + amount
            ok, current, version = self._cas(key, str(new).encode(), version)
            if ok:
                return new

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (empty: unset); returns what torch's Store returns."""
        want = expected.encode() if isinstance(expected, str) else bytes(expected)
        new = desired.encode() if isinstance(desired, str) else bytes(desired)
        current, version = self._read(key)
        while True:
            if (current is None and want == b"") or current == want:
                ok, current, version = self._cas(key, new, version)
                if ok:
                    return new
                continue
            return current if current is not None else want

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Wait until every key of ``keys`` is set (``timeout``, else the store's)."""
        self._poll(list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        """Whether every key of ``keys`` is set."""
        return all(self._read(k)[0] is not None for k in keys)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it was there."""
        current, version = self._read(key)
        while current is not None:
            ok, current, version = self._cas(key, None, version)
            if ok:
                return True
        return False

    def num_keys(self) -> int:
        """Not supported by the master's store (``NotImplementedError``)."""
        raise NotImplementedError("the master's store does not count keys")


def desired_key(run_id: str) -> str:
    """The master's KV key where the job controller keeps how many nodes the job wants (decimal text)."""
    return f"rdzv/{run_id}/desired"


@dataclass
class JoinGate:
    """Holds a group restart for joining nodes back until every node the job wants is waiting, or ``grace`` s.

    torchelastic restarts a node's workers as soon as one node waits to join. Nodes launched together (a
    scale-out 1 -> 3) reach the wait list seconds apart under load: the group re-formed with the first (world
    2), then again with the next, a full restart of every worker each time. ``desired`` says how many nodes the
    job wants (None: nobody says; nothing is held back); ``admit`` is what ``num_nodes_waiting`` then returns.
    Holding back costs no training: the group trains on meanwhile.
    """

    desired: Callable[[], int | None]
    grace: float = 60.0  # free: the group trains on while it holds
    _since: float | None = None

    def admit(self, waiting: int, participants: int, now: float) -> int:
        """How many of ``waiting`` joining nodes to report at ``now``: all once ``participants + waiting`` reach the
        desired count or ``grace`` has passed since they began waiting, else 0.
        """
        if waiting <= 0:
            self._since = None
            return waiting
        if self._since is None:
            self._since = now
        wanted = self.desired()
        if wanted is None or participants + waiting >= wanted or now - self._since >= self.grace:
            return waiting
        return 0


@dataclass
class MembershipWatch:
    """Tells when a node of the round this node's workers run in has gone, so the survivors restart at once.

    torchelastic restarts a group when a node joins, but learns that one left only from its own workers
    failing: a collective erroring on a closed peer. A node that leaves (scale-in, death) before its
    workers connected to the others' leaves nothing to error: the survivors wait in ``init_process_group``
    or their first collective for gloo's 30 min timeout. The rendezvous itself knows sooner: a node
    whose keep-alive stops is dropped from the round's participants within ``keep_alive_interval *
    keep_alive_max_attempt``. ``started`` records the round and its size when this node's workers start;
    ``left`` is true once that round has fewer participants (or a newer round began without them).
    """

    _round: int = -1
    _members: int = 0

    def started(self, round_: int, members: int) -> None:
        """This node's workers start in round ``round_`` of ``members`` nodes."""
        self._round, self._members = round_, members

    def left(self, round_: int, members: int) -> bool:
        """Whether a node of the started round has left it, given the rendezvous's round and participants now."""
        return self._round >= 0 and (round_ != self._round or members < self._members)


class _DesiredNodes:
    """The job's wanted node count from the master's KV store, read at most once a second."""

    def __init__(self, client: ShardClient, run_id: str) -> None:
        self._client, self._key = client, desired_key(run_id)
        self._read_at = -1.0
        self._value: int | None = None

    def __call__(self) -> int | None:
        now = time.monotonic()
        if now - self._read_at >= 1.0:
            self._read_at = now
            try:
                found = self._client.kv_get(self._key)
                self._value = int(found[0]) if found else None
            except (ShardServiceError, ValueError):
                self._value = None  # unknown: hold nothing back
        return self._value


def desired_nodes(client: ShardClient, run_id: str) -> Callable[[], int | None]:
    """The job's wanted node count as the controller publishes it (None: nobody says), read at most once a second."""
    return _DesiredNodes(client, run_id)


def master_client(endpoint: str, token: str | None, name: str) -> ShardClient:
    """A client of the master for an agent: no heartbeat (an agent is not a shard worker)."""
    return ShardClient(endpoint, token=token, name=name, heartbeat=False, timeout=120.0)


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``streamrover`` backend: dynamic rendezvous with its state and store in the job master."""
    if not params.endpoint:
        raise ValueError("--rdzv-endpoint must be the job master's HOST:PORT for --rdzv-backend=streamrover")
    token = params.get("token") or os.environ.get(env.TOKEN, "")
    client = master_client(params.endpoint, token, f"rdzv:{params.run_id}")
    store = MasterStore(client, f"rdzv/{params.run_id}/store")
    backend = MasterRendezvousBackend(client, params.run_id)
    handler = create_handler(store, backend, params)
    gate = JoinGate(_DesiredNodes(client, params.run_id), grace=float(params.get("join_grace", 60.0)))
    watch = MembershipWatch()
    waiting, rendezvous = handler.num_nodes_waiting, handler.next_rendezvous

    def _round() -> tuple[int, int]:  # (round, participants) as this handler last synced them
        state = getattr(getattr(handler, "_state_holder", None), "state", None)
        return (int(state.round), len(state.participants)) if state is not None else (-1, 0)

    def next_rendezvous() -> Any:
        info = rendezvous()
        watch.started(*_round())
        return info

    def num_nodes_waiting() -> int:  # what the agent's monitor asks every interval; > 0 restarts the group
        count = waiting()  # (syncs the state, dropping nodes whose keep-alive expired)
        round_, participants = _round()
        if watch.left(round_, participants):
            log.warning("a node left rendezvous round %d (%d participants now): restarting this node's workers",
                        round_, participants)  # fmt: skip
            return max(count, 1)
        return gate.admit(count, participants, time.monotonic())

    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]
    handler.num_nodes_waiting = num_nodes_waiting  # type: ignore[method-assign]
    return handler


def register() -> None:
    """Make ``--rdzv-backend=streamrover`` known to torch.distributed.elastic (idempotent)."""
    try:
        rendezvous_handler_registry.register(BACKEND_NAME, create_rdzv_handler)
    except ValueError:  # already registered in this process
        pass
