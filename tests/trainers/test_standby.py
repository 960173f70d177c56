"""Warm standby workers: a script started in a standby behaves as one ``python -u script.py`` started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from streamrover.trainers.standby import StandbyPool
from tests.helpers import wait_until

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import helper_mod  # found next to the script: the script's directory is on sys.path
    print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "rank": os.environ.get("RANK"),
                      "gone": os.environ.get("ONLY_IN_AGENT"), "helper": helper_mod.VALUE,
                      "torch": "torch" in sys.modules, "dynamo": "torch._dynamo" in sys.modules}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if len(sys.argv) > 1 and sys.argv[1] == "raise":
        raise RuntimeError("boom from the script")
    if len(sys.argv) > 1 and sys.argv[1] == "hang":
        import threading
        threading.Event().wait()
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    """
)


LIGHT = ("json",)  # most tests need no torch in their standbys: importing it costs seconds of CPU


@pytest.fixture()
def pool() -> Iterator[StandbyPool]:
    pool = StandbyPool(1, interpreter=sys.executable, flags=("-u",), warm=LIGHT)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    code = tmp_path / "code"
    code.mkdir()
    (code / "helper_mod.py").write_text("VALUE = 42\n")
    path = code / "train.py"
    path.write_text(SCRIPT)
    return path


def _run(pool: StandbyPool, tmp_path: Path, args: list[str], env: dict[str, str]) -> tuple[int, str, str, int]:
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = pool.start(args, env, out, err)
    assert proc is not None, "a standby serves the command"
    code = proc.wait(timeout=120)
    return code, out_path.read_text(), err_path.read_text(), proc.pid


def test_a_script_runs_as_main_with_the_given_argv_env_cwd_and_logs(script: Path, tmp_path: Path) -> None:
    pool = StandbyPool(1, interpreter=sys.executable, flags=("-u",))  # the default warm set: torch & co
    request_close = pool.close
    pool.fill()
    wait_until(lambda: pool.ready() == 1, 120, "a warm standby")
    env = {k: v for k, v in os.environ.items() if k != "ONLY_IN_AGENT"}
    env["RANK"] = "3"
    os.environ["ONLY_IN_AGENT"] = "x"  # in the agent's environment, not in the one given: must not leak
    try:
        code, out, err, _ = _run(pool, tmp_path, [sys.executable, "-u", str(script), "7"], env)
    finally:
        del os.environ["ONLY_IN_AGENT"]
        request_close()
    assert code == 7
    import json

    seen = json.loads(out.splitlines()[0])
    assert seen == {"name": "__main__", "argv": [str(script), "7"], "cwd": os.getcwd(), "rank": "3", "gone": None,
                    "helper": 42, "torch": True, "dynamo": True}  # fmt: skip
    assert err == "to stderr\n"
    assert pool.served == 1


def test_an_uncaught_exception_exits_1_with_its_traceback(pool: StandbyPool, script: Path, tmp_path: Path) -> None:
    pool.fill()
    code, _, err, _ = _run(pool, tmp_path, [sys.executable, "-u", str(script), "raise"], dict(os.environ))
    assert code == 1
    assert "RuntimeError: boom from the script" in err


def test_a_standby_still_importing_takes_the_work_when_it_is_ready(
    pool: StandbyPool, script: Path, tmp_path: Path
) -> None:
    pool.fill()  # and use them at once, long before their imports are done
    assert pool.ready() == 0
    code, out, _, _ = _run(pool, tmp_path, [sys.executable, "-u", str(script), "5"], dict(os.environ))
    assert code == 5
    assert '"name": "__main__"' in out


def test_modules_run_with_dash_m(pool: StandbyPool, tmp_path: Path) -> None:
    pool.fill()
    code, out, _, _ = _run(pool, tmp_path, [sys.executable, "-u", "-m", "json.tool", "--help"], dict(os.environ))
    assert code == 0
    assert "usage:" in out


def test_the_agent_stops_a_worker_with_killpg(pool: StandbyPool, script: Path, tmp_path: Path) -> None:
    pool.fill()
    with open(tmp_path / "out.txt", "w") as out:
        proc = pool.start([sys.executable, "-u", str(script), "hang"], dict(os.environ), out, None)
    assert proc is not None
    wait_until(lambda: "helper" in (tmp_path / "out.txt").read_text(), 120, "the script to start")
    assert os.getpgid(proc.pid) == proc.pid, "a worker leads its own process group, as torchelastic's are"
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM


def test_commands_a_standby_cannot_run_start_fresh_and_close_stops_the_pool(tmp_path: Path) -> None:
    pool = StandbyPool(1, interpreter=sys.executable, flags=("-u",), warm=LIGHT)
    pool.fill()
    standby = psutil.Process(pool._standbys[0].proc.pid)
    assert pool.start(["/bin/echo", "hi"], dict(os.environ), None, None) is None
    assert pool.start([sys.executable, "-X", "dev", "x.py"], dict(os.environ), None, None) is None
    assert pool.start([sys.executable, "x.py"], dict(os.environ), None, None) is None, "flags differ (no -u)"
    assert pool.served == 0
    pool.close()
    assert not standby.is_running() or standby.status() == psutil.STATUS_ZOMBIE
    assert pool.start([sys.executable, "-u", "x.py"], dict(os.environ), None, None) is None


def test_an_unused_standby_dies_with_its_agent(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from streamrover.trainers.standby import StandbyPool
        pool = StandbyPool(1, interpreter=sys.executable, warm=("json",))
        pool.fill()
        import time
        while not pool.ready():  # armed its parent-death signal and imported: then the agent dies
            time.sleep(0.01)
        print(pool._standbys[0].proc.pid, flush=True)
        import threading
        threading.Event().wait()
        """
    )
    agent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None
        pid = int(agent.stdout.readline())
        standby = psutil.Process(pid)
    finally:
        agent.kill()
        agent.wait()
    standby.wait(timeout=60)  # raises if it outlives the agent


def test_a_warm_standby_whose_ready_was_never_read_runs_the_work(
    pool: StandbyPool, script: Path, tmp_path: Path
) -> None:
    """Regression: closing our end with its "ready" unread reset the standby before it read the work (exit 0)."""
    import socket

    pool.fill()
    assert pool._standbys[0].sock.recv(16, socket.MSG_PEEK) == b"ready"  # warm; the message stays unread
    code, out, _, _ = _run(pool, tmp_path, [sys.executable, "-u", str(script), "4"], dict(os.environ))
    assert code == 4
    assert '"name": "__main__"' in out


EXITING = textwrap.dedent(
    """
    import atexit, threading

    class Resident:  # a module global: freed in the interpreter's module teardown, if that runs
        def __del__(self):
            print("module teardown", flush=True)

    kept = Resident()
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (threading.Event().wait(0.2), print("thread done", flush=True))).start()
    raise RuntimeError("boom from the script")
    """
)


def test_an_uncaught_exception_exits_without_the_module_teardown(pool: StandbyPool, tmp_path: Path) -> None:
    """A worker whose collective failed raises; a torch worker's module teardown takes 0.6-0.75 s, and a group restart
    waits for the survivors' exits. The threads are waited for and atexit runs, as at any exit; the teardown not."""
    script = tmp_path / "exiting.py"
    script.write_text(EXITING)
    pool.fill()
    code, out, err, _ = _run(pool, tmp_path, [sys.executable, "-u", str(script)], dict(os.environ))
    assert code == 1
    assert "RuntimeError: boom from the script" in err
    assert out == "thread done\natexit ran\n"
