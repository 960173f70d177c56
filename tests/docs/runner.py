"""Runs the guide's blocks: bash in a fresh shell per block, Python in one interpreter per session.

A session is a working directory, an environment (what bash blocks ``export`` is kept for the blocks after
them, Python blocks included) and, once a Python block runs, one interpreter that runs its Python blocks in
one namespace (define, then use). Every process a session starts is ended with it: each bash block runs in
a process group of its own, which the session terminates at the end (a master started with ``&`` included).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.docs.blocks import Block

BLOCK_TIMEOUT = 120.0
_DRIVER = r"""
import json, os, sys, traceback
replies = os.fdopen(int(sys.argv[1]), "w")
namespace = {"__name__": "__main__"}
for line in sys.stdin:
    msg = json.loads(line)
    os.environ.clear(); os.environ.update(msg["env"]); os.chdir(msg["cwd"])
    try:
        exec(compile(msg["code"], msg["where"], "exec"), namespace)
        reply = {"ok": True}
    except BaseException:
        reply = {"ok": False, "error": traceback.format_exc()}
    sys.stdout.flush(); sys.stderr.flush()
    replies.write(json.dumps(reply) + "\n"); replies.flush()
"""


class BlockFailed(AssertionError):
    """A block of the guide failed: the message names the page and line and shows the output."""


class Session:
    """The working directory, environment and processes that a page's blocks of one session share."""

    def __init__(self, name: str, cwd: Path, env: dict[str, str]) -> None:
        self.name = name
        self.cwd = cwd
        self.env = dict(env)
        self.log = cwd.parent / f"{cwd.name}.log"
        self._groups: list[int] = []
        self._python: subprocess.Popen[bytes] | None = None
        self._replies: int | None = None

    def run(self, block: Block) -> None:
        """Run one block (or write it, for a ``file`` mark); raises :class:`BlockFailed` naming it."""
        if block.file:
            target = self.cwd / block.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code)
        elif block.lang == "python":
            self._run_python(block)
        else:
            self._run_bash(block)

    def _tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
        except OSError:
            return ""

    def _run_bash(self, block: Block) -> None:
        code = block.code
        if block.lang == "console":  # commands after "$ "; the other lines are their output
            code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ ")) + "\n"
        script = self.cwd.parent / f"{self.cwd.name}-{block.line}.sh"
        env_out, cwd_out = script.with_suffix(".env"), script.with_suffix(".cwd")
        script.write_text(code)
        wrapper = f'set -euo pipefail\nsource "{script}"\nenv -0 > "{env_out}"\npwd > "{cwd_out}"\n'
        with open(self.log, "ab") as log:
            log.write(f"\n### {block.where} (bash)\n".encode())
            log.flush()
            proc = subprocess.Popen(["bash", "-c", wrapper], cwd=self.cwd, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)  # fmt: skip
        self._groups.append(proc.pid)
        try:
            rc = proc.wait(timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise BlockFailed(f"{block.where}: still running after {BLOCK_TIMEOUT:.0f}s\n{self._tail()}") from None
        if rc != 0:
            raise BlockFailed(f"{block.where}: bash exited with {rc}\n{block.code}\n--- output ---\n{self._tail()}")
        self.env = dict(kv.split("=", 1) for kv in env_out.read_text().split("\0") if "=" in kv)
        self.cwd = Path(cwd_out.read_text().strip())

    def _start_python(self) -> None:
        read, write = os.pipe()
        with open(self.log, "ab") as log:
            self._python = subprocess.Popen([sys.executable, "-u", "-c", _DRIVER, str(write)], cwd=self.cwd,
                                            env=self.env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                            pass_fds=(write,), start_new_session=True)  # fmt: skip
        os.close(write)
        self._replies = read

    def _run_python(self, block: Block) -> None:
        if self._python is None:
            self._start_python()
        assert self._python is not None and self._python.stdin is not None and self._replies is not None
        with open(self.log, "ab") as log:
            log.write(f"\n### {block.where} (python)\n".encode())
        msg = {"code": block.code, "env": self.env, "cwd": str(self.cwd), "where": block.where}
        self._python.stdin.write((json.dumps(msg) + "\n").encode())
        self._python.stdin.flush()
        line = b""
        deadline = time.monotonic() + BLOCK_TIMEOUT
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([self._replies], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                raise BlockFailed(f"{block.where}: still running after {BLOCK_TIMEOUT:.0f}s\n{self._tail()}")
            chunk = os.read(self._replies, 65536)
            if not chunk:
                raise BlockFailed(f"{block.where}: the Python interpreter died\n{self._tail()}")
            line += chunk
        reply = json.loads(line)
        if not reply["ok"]:
            raise BlockFailed(f"{block.where}: {reply['error']}\n--- output ---\n{self._tail()}")

    def close(self) -> None:
        """End the interpreter and every process the session's blocks started."""
        if self._python is not None:
            self._groups.append(self._python.pid)
            if self._python.stdin is not None:
                self._python.stdin.close()
        if self._replies is not None:
            os.close(self._replies)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = []
            for pgid in self._groups:
                try:
                    os.killpg(pgid, sig)
                    alive.append(pgid)
                except ProcessLookupError:
                    continue
            if not alive or sig == signal.SIGKILL:
                break
            deadline = time.monotonic() + 10
            while alive and time.monotonic() < deadline:  # wait for the groups to exit (bounded)
                if self._python is not None:
                    self._python.poll()  # reap our own child, or its zombie keeps its group alive
                alive = [g for g in alive if _group_alive(g)]
                if alive:
                    time.sleep(0.05)  # polling process exit: there is no event for another group's end
        if self._python is not None:
            self._python.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
