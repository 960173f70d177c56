"""A rank's leave on SIGTERM (``StreamSession._leave_and_exit``) says what happened to its leases and acks."""

from __future__ import annotations

import logging
import os
from typing import Any, cast

import pytest

from streamrover.shard_service import AckFailedError, AckFailure, FailedPreconditionError
from streamrover.trainers.torch import StreamSession


class LeavingClient:
    """The shard client's two calls a leave makes; ``leave`` raises what it is given (after the leases went back)."""

    def __init__(self, leave_raises: BaseException | None) -> None:
        self.leave_raises = leave_raises
        self.calls: list[str] = []

    def flush(self, timeout: float) -> None:
        self.calls.append("flush")

    def leave(self) -> int:
        self.calls.append("leave")
        if self.leave_raises is not None:
            raise self.leave_raises
        return 2


class Exited(Exception):
    pass


@pytest.mark.parametrize("refused", [False, True], ids=["acks-recorded", "earlier-acks-refused"])
def test_a_leave_says_its_leases_went_back_and_whether_acks_were_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, refused: bool
) -> None:
    failure = AckFailure("s7", 1, 640, 12, FailedPreconditionError("lease revoked"))
    client = LeavingClient(AckFailedError([failure]) if refused else None)
    session = StreamSession.__new__(StreamSession)  # only what a leave uses: no master, no model
    session.rank, session.client = 1, cast(Any, client)

    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setattr(logging, "shutdown", lambda: None)  # pytest's own handlers stay open
    with caplog.at_level(logging.WARNING), pytest.raises(Exited):
        session._leave_and_exit()
    said = caplog.text
    assert client.calls == ["flush", "leave"]
    assert "did not take the leases back" not in said, "the leases did go back: leave() raised only afterwards"
    if refused:
        assert "rank 1 left on SIGTERM, its leases handed back" in said and "'s7'" in said and "replayed" in said
    else:
        assert "rank 1 left on SIGTERM: acks flushed, 2 lease(s) handed back" in said
