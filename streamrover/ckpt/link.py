"""The trainer's link to its saver: start or find it, hand it buffers to persist, collect its reports.

Persist requests coalesce: at most one is outstanding per rank; a save that asks for a
persist while one is running marks the *newest* snapshot as wanted, and it is sent
when the running one is done. So the saver never falls behind by more than one
snapshot, and the trainer never waits for it.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from streamrover.ckpt import wire
from streamrover.ckpt.api import PersistResult, SaverError
from streamrover.ckpt.saver import CheckpointSaver

log = logging.getLogger(__name__)

SAVER_START_TIMEOUT = 60.0


def start_saver_process(address: str, linger: float) -> None:
    """Start a detached saver on ``address`` and wait until it serves it (or another saver does)."""
    printable = "@" + address[1:] if address.startswith("\0") else address
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrover.ckpt", "--address", printable, "--linger", str(linger)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        start_new_session=True,  # signals to the trainer's process group do not reach it
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()  # blocks until the saver has bound its socket, or died
    proc.stdout.close()
    if line not in (b"READY", b"BUSY"):
        code = proc.wait(timeout=SAVER_START_TIMEOUT)
        raise SaverError(f"the checkpoint saver did not start (exit code {code}, said {line!r}); see its stderr")


class SaverLink:
    """Connection of one rank to its saver, with a reader thread for the saver's reports."""

    def __init__(
        self,
        hello: dict[str, Any],
        mode: str,
        address: str,
        linger: float,
        on_ready: Callable[[], None],
        on_done: Callable[[int, PersistResult], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self.hello = hello
        self.mode = mode
        self.address = address
        self.linger = linger
        self._on_ready = on_ready
        self._on_done = on_done
        self._on_lost = on_lost
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self.error: str | None = None
        self.saver_pid: int | None = None
        self._closing = False
        self._thread_saver: CheckpointSaver | None = None
        # A forked child (a DataLoader worker) must not hold the connection open: the saver learns
        # of the trainer's death by EOF, which a child's copy of the socket would delay.
        ref = weakref.WeakMethod(self._close_in_child)
        os.register_at_fork(after_in_child=lambda: (method := ref()) is not None and method())
        self._reader = threading.Thread(target=self._run, name="ckpt-saver-link", daemon=True)
        self._reader.start()

    # -- connection ------------------------------------------------------------------
    def _connect(self) -> socket.socket:
        if self.mode == "thread":
            saver = CheckpointSaver(self.address, linger=None)
            saver.bind()
            threading.Thread(target=saver.serve_forever, name="ckpt-saver", daemon=True).start()
            self._thread_saver = saver
            return wire.connect(self.address)
        try:
            return wire.connect(self.address)
        except (ConnectionRefusedError, FileNotFoundError):
            if self.mode != "auto":
                raise SaverError(
                    f"no checkpoint saver serves {self.address!r} (is the agent hosting it running?)"
                ) from None
        start_saver_process(self.address, self.linger)
        return wire.connect(self.address)

    def _run(self) -> None:
        try:
            sock = self._connect()
            wire.send(sock, "hello", **self.hello)
            reply = wire.recv(sock)
            if reply is None or reply.get("kind") != "ready":
                raise SaverError(f"the checkpoint saver closed the connection during the handshake ({reply!r})")
            self._sock = sock
            self.saver_pid = int(reply.get("pid", 0)) or None
        except (OSError, SaverError) as exc:
            self.error = f"cannot reach the checkpoint saver: {exc}"
            self._ready.set()
            self._on_lost(self.error)
            return
        self._ready.set()
        self._on_ready()
        while True:
            msg = wire.recv(sock)
            if msg is None:
                if not self._closing:
                    self.error = "the checkpoint saver went away"
                    self._on_lost(self.error)
                return
            if msg["kind"] == "done":
                result = PersistResult(
                    step=int(msg["step"]) if msg.get("step") is not None else -1,
                    ok=bool(msg["ok"]),
                    manifest_published=bool(msg["published"]),
                    cut_id=msg.get("cut_id"),
                    error=msg.get("error"),
                )
                self._on_done(int(msg["index"]), result)
            elif msg["kind"] == "closed":
                return

    def _close_in_child(self) -> None:
        if self._sock is not None:
            self._sock.close()  # only this process's descriptor; the parent's connection is untouched
            self._sock = None

    def ready(self) -> bool:
        """Whether the saver is connected and has said it is ready."""
        return self._ready.is_set() and self._sock is not None

    def send_persist(self, index: int, name: str, generation: int, step: int) -> None:
        """Ask the saver to persist buffer ``index`` (``name``) holding ``step`` at seqlock ``generation``."""
        assert self._sock is not None
        with self._send_lock:
            wire.send(self._sock, "persist", index=index, name=name, generation=generation, step=step)

    def close(self, keep: bool = True) -> None:
        """Say goodbye (no persist-on-exit), wait for the saver's acknowledgement, stop a thread saver."""
        self._ready.wait()
        self._closing = True
        if self._sock is not None:
            try:
                with self._send_lock:
                    wire.send(self._sock, "close", keep=keep)
            except OSError:
                pass
            self._reader.join()
            self._sock.close()
        if self._thread_saver is not None:
            self._thread_saver.stop()
