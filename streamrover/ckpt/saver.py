"""The saver: a process (or an agent's thread) that persists trainers' snapshots and outlives them.

One saver serves every rank of one checkpoint namespace on a node. Each trainer
connection is a *session* with its own thread: it persists the buffers the trainer
names, one at a time, and when the connection reaches EOF without a ``close`` (the
trainer died) it persists every snapshot still in that rank's buffers that is not on
storage yet, oldest first, at once.

Run it in-process (``CheckpointSaver(address).serve_forever()`` in the elastic agent)
or as a subprocess: ``python -m streamrover.ckpt --address ADDR [--linger S]``,
which prints ``READY`` (or ``BUSY`` if another saver serves ADDR) on stdout.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import select
import socket
import sys
import threading
from typing import Any

from streamrover.ckpt import wire
from streamrover.ckpt.api import RetentionPolicy
from streamrover.ckpt.persist import PersistTarget, SupersededError, already_persisted, persist_buffer
from streamrover.ckpt.shm import SharedBuffer, shm_path, unlink_buffer
from streamrover.ckpt.storage import CHECKSUM_ALGO, Storage

log = logging.getLogger(__name__)


class _Session:
    """One trainer rank connected to the saver."""

    def __init__(self, saver: CheckpointSaver, sock: socket.socket) -> None:
        self.saver = saver
        self.sock = sock
        self.key: tuple[str, int] | None = None
        self.names: list[str] = []
        self.buffers: dict[str, SharedBuffer] = {}
        self.target: PersistTarget | None = None
        self.persist_on_exit = True

    def run(self) -> None:
        lower_thread_priority(self.saver.nice)  # persists (and the hash threads they start) yield to training
        try:
            self._serve()
        except Exception:  # a session must never take the saver down; the trainer sees EOF
            log.exception("checkpoint saver session failed")
        finally:
            self.sock.close()
            for buf in self.buffers.values():
                buf.close()
            self.saver._session_ended(self)

    def _serve(self) -> None:
        hello = wire.recv(self.sock)
        if hello is None or hello.get("kind") != "hello":
            return
        self.key = (str(hello["namespace"]), int(hello["rank"]))
        self.saver._adopt(self)
        self.names = list(hello["buffers"])
        retention = RetentionPolicy(**hello.get("retention", {}))
        storage = Storage(hello["url"], hello.get("storage_options"))
        self.target = PersistTarget(
            storage, int(hello["rank"]), int(hello["world_size"]), retention, hello.get("checksum", CHECKSUM_ALGO)
        )
        self.persist_on_exit = bool(hello.get("persist_on_exit", True))
        wire.send(self.sock, "ready", pid=os.getpid())
        while True:
            msg = wire.recv(self.sock)
            if msg is None:
                self._trainer_died()
                return
            if msg["kind"] == "persist":
                self._persist(msg)
            elif msg["kind"] == "close":
                if msg.get("keep"):
                    self.saver._orphan(self)  # the snapshots stay for a restart; freed if none comes
                wire.send(self.sock, "closed")
                return

    def _buffer(self, name: str) -> SharedBuffer | None:
        buf = self.buffers.get(name)
        try:
            size = os.stat(shm_path(name)).st_size
        except FileNotFoundError:
            return None
        if buf is None or buf.size < size:  # new, or grown by the trainer: map it again
            if buf is not None:
                buf.close()
            opened = SharedBuffer.open(name)
            if opened is None:
                return None
            self.buffers[name] = buf = opened
        return buf

    def _persist(self, msg: dict[str, Any]) -> None:
        assert self.target is not None
        buf = self._buffer(str(msg["name"]))
        try:
            if buf is None:
                raise SupersededError(f"snapshot buffer {msg['name']} does not exist")
            result = persist_buffer(self.target, buf, int(msg["generation"]))
            wire.send(
                self.sock,
                "done",
                index=msg["index"],
                step=result.step,
                ok=True,
                published=result.manifest_published,
                cut_id=result.cut_id,
                error=None,
            )
        except Exception as exc:  # report any failure to the trainer, which raises it from wait()
            log.warning("persist of %s failed: %s", msg.get("name"), exc)
            wire.send(
                self.sock,
                "done",
                index=msg["index"],
                step=msg.get("step"),
                ok=False,
                published=False,
                cut_id=None,
                error=f"{type(exc).__name__}: {exc}",
            )

    def _trainer_died(self) -> None:
        """Persist, oldest first, every complete snapshot of this rank that storage does not hold yet."""
        if not self.persist_on_exit or self.target is None:
            return
        snaps = []
        for name in self.names:
            buf = self._buffer(name)
            found = buf.read_header() if buf is not None else None
            if buf is not None and found is not None:
                snaps.append((int(found[1]["seq"]), int(found[1]["step"]), found[0], buf))
        for seq, step, gen, buf in sorted(snaps, key=lambda s: s[0]):
            if already_persisted(self.target, step, seq):
                continue
            try:
                result = persist_buffer(self.target, buf, gen, yield_to_saves=False)
                log.info(
                    "trainer rank %d died: persisted its snapshot of step %d (manifest published: %s)",
                    self.target.rank,
                    result.step,
                    result.manifest_published,
                )
            except Exception as exc:  # keep going with the next snapshot
                log.warning("persisting step %d after the trainer died failed: %s", step, exc)
        self.saver._orphan(self)


def lower_thread_priority(increment: int) -> None:
    """Raise the calling thread's nice value by ``increment`` (Linux: nice is per thread, inherited by the
    threads it starts); a no-op where that is not supported."""
    if increment <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError as exc:  # a sandbox may forbid it: persists then run at the trainer's priority
        log.debug("cannot lower the persist thread's priority: %s", exc)


class CheckpointSaver:
    """Serves trainer sessions on ``address`` until stopped or idle for ``linger`` seconds.

    ``linger=None`` serves until :meth:`stop` (an agent hosting it). On an idle exit the
    shared-memory buffers of trainers that died and never came back are unlinked.

    ``nice``: each session's thread (it persists, and its checksum thread) runs this much
    nicer than the thread that serves, so on a node short of cores a persist takes CPU time
    the trainers leave rather than slowing their steps and their copies into shared memory.
    0 keeps persists at the saver's priority.

    :meth:`wait_idle` tells an agent when every session has ended: after it stopped its
    workers, that is when their persists on death are done and their buffers may be freed
    (:func:`~streamrover.ckpt.purge_shared_memory`) or a new generation of workers started.
    """

    def __init__(self, address: str, linger: float | None = 600.0, *, nice: int = 10) -> None:
        if nice < 0:
            raise ValueError(f"nice must be >= 0 (a persist never runs above the trainers' priority), got {nice}")
        self.address = address
        self.linger = linger
        self.nice = nice
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._sessions: dict[tuple[str, int], threading.Thread] = {}
        self._threads: set[threading.Thread] = set()
        self._orphans: dict[tuple[str, int], list[str]] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False

    def bind(self) -> None:
        """Take the address; raises OSError(EADDRINUSE) when another saver serves it."""
        self._listener = wire.listen(self.address)

    def serve_forever(self) -> None:
        """Serve trainer sessions until :meth:`stop`, or until no trainer was connected for ``linger`` seconds; then
        wait for the sessions and remove orphaned buffers.
        """
        if self._listener is None:
            self.bind()
        assert self._listener is not None
        try:
            while not self._stopping:
                with self._lock:
                    idle = not self._threads
                timeout = self.linger if idle else None
                ready, _, _ = select.select([self._listener.fileno(), self._wake_r], [], [], timeout)
                if not ready:
                    break  # idle for `linger` seconds
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                if self._listener.fileno() in ready:
                    sock, _ = self._listener.accept()
                    session = _Session(self, sock)
                    thread = threading.Thread(target=session.run, name="ckpt-session", daemon=True)
                    with self._lock:
                        self._threads.add(thread)
                    thread.start()
        finally:
            self._listener.close()
            self._listener = None
            with self._lock:
                threads = list(self._threads)
            for thread in threads:
                thread.join()
            self._unlink_orphans()

    def stop(self) -> None:
        """Make :meth:`serve_forever` return (after the sessions it serves end)."""
        self._stopping = True
        os.write(self._wake_w, b"x")

    @property
    def sessions(self) -> int:
        """Trainer connections being served now (including sessions persisting after their trainer died)."""
        with self._lock:
            return len(self._threads)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no session is served: every connected trainer closed or died, and every persist those
        sessions were running (a persist on death included) has finished. True once idle; False if
        ``timeout`` seconds passed first. Trainers that are still connected keep the saver busy, so an agent
        calls this after its workers stopped. A trainer that connects afterwards makes it busy again."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._threads, timeout)

    # -- called by sessions --------------------------------------------------------
    def _adopt(self, session: _Session) -> None:
        """A rank (re)connects: wait for its previous session (e.g. persisting after a death) to finish."""
        assert session.key is not None
        with self._lock:
            previous = self._sessions.get(session.key)
            self._sessions[session.key] = threading.current_thread()
            self._orphans.pop(session.key, None)
        if previous is not None and previous is not threading.current_thread():
            previous.join()

    def _orphan(self, session: _Session) -> None:
        assert session.key is not None
        with self._lock:
            if self._sessions.get(session.key) is threading.current_thread():
                self._orphans[session.key] = list(session.names)

    def _session_ended(self, session: _Session) -> None:
        with self._lock:
            self._threads.discard(threading.current_thread())
            if session.key is not None and self._sessions.get(session.key) is threading.current_thread():
                del self._sessions[session.key]
            self._idle.notify_all()
        os.write(self._wake_w, b"x")

    def _unlink_orphans(self) -> None:
        with self._lock:
            names = [n for names in self._orphans.values() for n in names]
            self._orphans.clear()
        for name in names:
            unlink_buffer(name)


def main(argv: list[str] | None = None) -> int:
    """Run a checkpoint saver process (``python -m streamrover.ckpt``); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m streamrover.ckpt", description=__doc__)
    parser.add_argument("--address", required=True, help="abstract socket address (a leading '@' means NUL)")
    parser.add_argument("--linger", type=float, default=600.0, help="seconds to stay up with no trainer connected")
    parser.add_argument(
        "--nice", type=int, default=10, help="how much nicer than the saver persists run (0: the same priority)"
    )
    args = parser.parse_args(argv)
    address = "\0" + args.address[1:] if args.address.startswith("@") else args.address
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ckpt-saver %(levelname)s %(message)s")
    saver = CheckpointSaver(address, linger=args.linger, nice=args.nice)
    try:
        saver.bind()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            print("BUSY", flush=True)
            return 0
        raise
    print("READY", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the trainer that started us may die: never write to its pipe again
    os.close(devnull)
    saver.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
