"""Which Ray cluster ``--platform ray`` joins, and joining it within a deadline.

The way Ray's own tools choose (``ray.init()``, ``ray status``), and said in the log:

1. ``RAY_ADDRESS`` (or the platform's ``address``) when set: that cluster. An address that does not
   answer fails within :data:`CONNECT_TIMEOUT` seconds with an error naming it (``ray.init`` alone
   retries for minutes).
2. Else the cluster ``ray start`` started on this machine (the address it records in Ray's temp
   directory, ``$RAY_TMPDIR/ray/ray_current_cluster``: Ray's ``address="auto"``), if it still answers.
3. Else a local Ray instance for this job alone (it ends with the job).

A cluster ``ray start`` made has token authentication on by default (Ray 2.5x+), one made otherwise may not:
the first call to the cluster's GCS says which (:func:`answers`), and the token Ray keeps (``~/.ray/auth_token``,
``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``) is sent exactly when it wants one, unless ``RAY_AUTH_MODE`` is set.

Ray's processes are started without streamrover's ``GRPC_EXPERIMENTS`` (:mod:`streamrover._grpc_io`):
Ray's own gRPC core does not know those experiments and logs ``Unknown experiment`` in every process.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from streamrover._grpc_io import leave_grpc_to_ray
from streamrover.operator.api import PlatformUnavailableError

log = logging.getLogger(__name__)
CONNECT_TIMEOUT = 30.0  # seconds for ray.init to join a cluster that answers on its port
PROBE_TIMEOUT = 5.0  # seconds for the cluster's GCS to answer one call


def _ray_temp_dir() -> Path:
    """Ray's temp directory, where ``ray start`` records its address.

    Ray's own rule (``ray._common.utils.get_default_system_temp_dir``): ``$RAY_TMPDIR``, else ``$TMPDIR`` on Linux,
    else ``/tmp``; then ``ray`` under it.
    """
    base = os.environ.get("RAY_TMPDIR")
    if base is None and sys.platform.startswith("linux"):
        base = os.environ.get("TMPDIR")
    return Path(base or "/tmp") / "ray"


def recorded_cluster() -> str | None:
    """The address the last ``ray start --head`` on this machine recorded, or None."""
    try:
        return (_ray_temp_dir() / "ray_current_cluster").read_text().strip() or None
    except OSError:
        return None


def answers(address: str, timeout: float = PROBE_TIMEOUT) -> tuple[str | None, bool]:
    """(None, whether it wants a token) if Ray's GCS answers at ``host:port``, else (why not, False).

    One gRPC call (``GetClusterId``) with a deadline: it tells a GCS from a port nothing (or something else)
    answers on, and a cluster with token authentication (UNAUTHENTICATED) from one without. A driver must use
    the token exactly when the cluster does: in token mode against an open cluster Ray connects, then
    cancels every actor it creates.
    """
    import grpc

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return f"{address!r} is not HOST:PORT", False
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)  # fmt: skip
        try:
            call(b"", timeout=timeout, wait_for_ready=True)  # a GCS still starting gets the whole deadline
        except grpc.RpcError as exc:
            code = exc.code()
            if code is grpc.StatusCode.UNAUTHENTICATED:
                return None, True
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return f"no Ray GCS answers there within {timeout:.0f} s ({code.name}: {exc.details()})", False
            return None, False  # something answered in gRPC: not a token refusal
    return None, False


def choose_address(address: str | None = None) -> tuple[str, str]:
    """The address to pass ``ray.init`` and a sentence for the log saying why (see the module docstring)."""
    given = address or os.environ.get("RAY_ADDRESS") or ""
    if given:
        source = "RAY_ADDRESS" if not address else "the platform's address"
        if given in ("auto", "local") or given.startswith("ray://"):
            return given, f"Ray at {given} ({source})"
        why, token = answers(given)
        if why is not None:
            raise PlatformUnavailableError(
                f"cannot reach the Ray cluster at {given} ({source}): {why}. Is it running (`ray status --address "
                f"{given}`)? Unset RAY_ADDRESS to join the cluster `ray start --head` started on this machine, or to "
                "run on a local Ray instance of the job's own")  # fmt: skip
        _token_mode(given, token)
        return given, f"joining the Ray cluster at {given} ({source})"
    recorded = recorded_cluster()
    if recorded is not None:
        why, token = answers(recorded)
        if why is None:
            _token_mode(recorded, token)
            return recorded, (f"joining the running Ray cluster at {recorded} (the one `ray start` recorded in "
                              f"{_ray_temp_dir()}; Ray's address=\"auto\")")  # fmt: skip
        log.info("the Ray cluster %s that `ray start` recorded does not answer (%s): not joining it", recorded, why)
    return "local", ("no running Ray cluster (RAY_ADDRESS is not set, and no `ray start --head` cluster on this "
                     "machine answers): starting a local Ray instance for this job")  # fmt: skip


def _token_mode(address: str, wanted: bool) -> None:
    """Send Ray's token to a cluster that wants one (``ray start``'s default), unless RAY_AUTH_MODE says otherwise."""
    if "RAY_AUTH_MODE" in os.environ or not wanted:
        return
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not os.environ.get("RAY_AUTH_TOKEN") and not token_file.is_file():
        raise PlatformUnavailableError(
            f"the Ray cluster at {address} wants a token (token authentication, `ray start`'s default) and none is "
            f"here: copy {token_file} from its head node, or set RAY_AUTH_TOKEN")  # fmt: skip
    os.environ["RAY_AUTH_MODE"] = "token"
    try:  # Ray read its configuration when it was imported: it reads it again, as its own token set-up does
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")
    except (ImportError, AttributeError):  # a Ray without token authentication
        pass


def connect(ray: Any, address: str | None = None, namespace: str | None = None,
            timeout: float = CONNECT_TIMEOUT) -> str:  # fmt: skip
    """``ray.init`` on the chosen cluster within ``timeout`` seconds; the address used.

    :class:`PlatformUnavailableError` names the address when it cannot be reached or joined.
    """
    target, why = choose_address(address)
    log.warning("%s", why)  # the user's first question on Ray: which cluster is this job on?
    leave_grpc_to_ray()
    errors: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(address=target, namespace=namespace, include_dashboard=False, log_to_driver=False)
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)

    # ray.init runs in a thread (to have a deadline), where Ray says it leaves SIGTERM alone: the controller
    # installs its own handler (run_controller), so that warning is noise
    logging.getLogger("ray._private.worker").addFilter(lambda r: "SIGTERM handler is not set" not in r.getMessage())
    thread = threading.Thread(target=init, name="ray-init", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise PlatformUnavailableError(f"Ray at {target} did not let this job join within {timeout:.0f} s "
                                       f"({why}); check it with `ray status --address {target}`")  # fmt: skip
    if errors:
        hint = ""
        if "auth" in str(errors[0]).lower():
            hint = " (a `ray start` cluster wants its token: RAY_AUTH_MODE=token, and ~/.ray/auth_token as on its head)"
        raise PlatformUnavailableError(f"cannot join Ray at {target}: {errors[0]}{hint}") from errors[0]
    return target
