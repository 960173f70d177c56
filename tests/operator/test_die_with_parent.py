"""``operator/die_with_parent.py``: what the ray platform starts its processes through instead of a ``preexec_fn``."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
from pathlib import Path

from streamrover.operator import die_with_parent
from streamrover.operator.local import LocalPlatform

REPO = Path(__file__).resolve().parents[2]


def _exits_within(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (not necessarily a child of ours) ends within ``timeout`` s: a pidfd turns readable."""
    fd = os.pidfd_open(pid)
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def test_the_command_runs_in_the_wrappers_place_and_dies_with_the_parent(tmp_path: Path) -> None:
    # A parent starts a command through the wrapper, as the ray platform's LocalPlatform(die_with_parent=True) does,
    # and prints the pid Popen gave it; the command prints its own pid once it runs. Then the parent is SIGKILLed
    # (no chance to clean up).
    command = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(600)"]
    parent_code = textwrap.dedent(
        f"""
        import subprocess, sys
        from streamrover.operator.local import LocalPlatform
        platform = LocalPlatform({str(tmp_path)!r}, cgroups=False, die_with_parent=True, reap=False)
        proc = subprocess.Popen(platform._argv({command!r}), start_new_session=True)
        print(proc.pid, flush=True)
        sys.stdin.read()
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              cwd=REPO, text=True)  # fmt: skip
    try:
        assert parent.stdout is not None
        started = int(parent.stdout.readline())
        running = int(parent.stdout.readline())
        assert running == started, "the command is not the process the platform started (no exec in place)"
        parent.kill()
        parent.wait()
        assert _exits_within(running, 10), "the command outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", die_with_parent.MODULE, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_a_parent_gone_before_the_prctl_leaves_no_orphan_and_bad_calls_are_clear_errors() -> None:
    gone = _run("1", "--", "true")  # its parent is this test, not pid 1: as if the real parent had already ended
    assert gone.returncode == 1 and "parent 1 ended before 'true' started" in gone.stderr
    missing = _run(str(os.getpid()), "--", "/no/such/command-xyz")
    assert missing.returncode == 127 and "cannot run '/no/such/command-xyz'" in missing.stderr
    usage = _run("sleep", "1")
    assert usage.returncode == 2 and "usage:" in usage.stderr
    no_signal = _run("--signal", "SIGNOPE", str(os.getpid()), "--", "true")
    assert no_signal.returncode == 2 and "no signal 'SIGNOPE'" in no_signal.stderr
    assert _run(str(os.getpid()), "--", "true").returncode == 0


def test_the_local_platform_starts_commands_as_given_unless_told_to_wrap_them(tmp_path: Path) -> None:
    assert LocalPlatform(tmp_path, cgroups=False, reap=False)._argv(["x"]) == ["x"]
    wrapped = LocalPlatform(tmp_path, cgroups=False, die_with_parent=True, reap=False)._argv(["x", "-y"])
    assert wrapped == [sys.executable, "-m", die_with_parent.MODULE, "--signal", "SIGKILL", str(os.getpid()), "--",
                       "x", "-y"]  # fmt: skip
