"""``python -m streamrover.operator.die_with_parent [--signal NAME] PPID -- COMMAND...``: COMMAND dies with PPID.

The ray platform starts every process of a job (the master, the nodes' agents) through this, in place of a
``preexec_fn``. A ``preexec_fn`` runs Python in the child between ``fork`` and ``exec``, which is not safe in a
process with threads, as a Ray actor is, and makes CPython ``fork`` where it would ``vfork``: a fork runs gRPC's
fork handlers in the child, whose poller's epoll fd ``close_fds`` then closes, and the child aborts before its
``exec`` (grpc/grpc#43055; seen with the test brokers, docs/notes/session18.md).

Here the parent starts this module with no ``preexec_fn`` (``vfork``). It sets ``PR_SET_PDEATHSIG`` to SIGKILL,
or the signal ``--signal`` names (``exec`` keeps it), checks that its parent is still PPID (a parent that ended
before the ``prctl`` would never signal it: it exits 1 then), and execs COMMAND in its own place: the same pid
and session, the process the platform records, watches and kills. Standard library only (``streamrover._libc``).
"""

from __future__ import annotations

import os
import signal
import sys

from streamrover._libc import set_parent_death_signal

MODULE = "streamrover.operator.die_with_parent"


def wrap(command: list[str], parent: int | None = None, sig: signal.Signals = signal.SIGKILL) -> list[str]:
    """``command`` as an argv that runs it under this module: sent ``sig`` when ``parent`` (this process) ends."""
    ppid = str(os.getpid() if parent is None else parent)
    return [sys.executable, "-m", MODULE, "--signal", sig.name, ppid, "--", *command]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    sig = signal.SIGKILL
    if args[:1] == ["--signal"] and len(args) > 1:
        try:
            sig = signal.Signals[args[1]]
        except KeyError:
            print(f"{MODULE}: no signal {args[1]!r} (a name such as SIGKILL or SIGTERM)", file=sys.stderr)
            return 2
        args = args[2:]
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        print(f"usage: python -m {MODULE} [--signal NAME] PPID -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    parent, command = int(args[0]), args[2:]
    set_parent_death_signal(sig)
    if os.getppid() != parent:
        print(f"{MODULE}: parent {parent} ended before {command[0]!r} started; not starting it", file=sys.stderr)
        return 1
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"{MODULE}: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127
    return 0  # not reached: execvp returns only by raising


if __name__ == "__main__":
    sys.exit(main())
