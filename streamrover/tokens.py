"""Job tokens: made so they can never be taken for a command-line flag, and read from files.

``secrets.token_urlsafe`` starts with ``-`` about 1.6% of the time (its alphabet holds ``-``): then
``--token "$(cat STATE_DIR/token)"`` fails with "argument --token: expected one argument". New tokens are
hex (:func:`new_token`); every command that takes ``--token`` also takes ``--token-file`` (:func:`read_token`),
which reads any token, one starting with ``-`` included. ``--token=VALUE`` (with ``=``) takes one too.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

TOKEN_BYTES = 24


def new_token() -> str:
    """A new job token: 48 hex digits (192 random bits), never starting with ``-``."""
    return secrets.token_hex(TOKEN_BYTES)


def worker_token(admin_token: str) -> str:
    """The worker token of a job whose admin token is ``admin_token``: 48 hex digits of an HMAC of it.

    What the operator hands workers: it may lease, ack, cut and use the key-value store, not administer the job
    (``shard_service/api.py``, **Roles**). The master derives it too, so a rotated admin token rotates it.
    """
    return hmac.new(admin_token.encode(), b"streamrover worker token v1", hashlib.sha256).hexdigest()[:2 * TOKEN_BYTES]


def read_token(path: str | Path) -> str:
    """The token in file ``path`` (surrounding whitespace stripped). ValueError naming the file when it has none."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the token file {str(path)!r}: {exc.strerror or exc}") from exc
    if not token:
        raise ValueError(f"the token file {str(path)!r} is empty")
    return token


def resolve_token(token: str | None, token_file: str | None) -> str | None:
    """``--token-file`` when given (it wins over ``--token`` and the environment's default), else ``token``."""
    return read_token(token_file) if token_file else token


__all__ = ["new_token", "read_token", "resolve_token", "worker_token"]
