"""``streamrover jobs list|status|stop|scale --platform k8s``: the same commands, on ``StreamTrainJob`` resources.

Locally these commands read and write the job's directory (:mod:`streamrover.operator.jobs`); on
Kubernetes the job is its custom resource, so they read and patch that, with the same meaning:

* ``status``: the resource's status subresource (what the operator's job controller writes);
* ``scale N``: checked against the spec's ``trainer.nodes`` bounds, then the **scale subresource**
  (as ``kubectl scale stj/NAME --replicas=N``); the operator's supervisor applies it;
* ``stop``: a graceful stop, as locally: ``spec.stop: true``; the operator's controller lets the
  nodes leave (leases handed back, acks flushed), then stops the master, and the phase becomes
  ``stopped``. The resource stays (its status readable, like a local job's directory);
  ``kubectl delete`` removes it and the garbage collector its pods. A stop is not undone.
"""

from __future__ import annotations

import time
from typing import Any

from streamrover.operator.api import PlatformUnavailableError
from streamrover.operator.jobs import JobNotFoundError
from streamrover.operator.k8s import GROUP, PLURAL, VERSION

ENDED = ("succeeded", "failed", "stopped")
START_TIMEOUT = 60.0  # seconds for an operator to take a new job (it writes a status at once)
STALL_TIMEOUT = 300.0  # seconds without a status write from the operator (it rewrites it every few seconds)
OPERATOR_HINT = ("Install it with `kubectl apply -f deploy/k8s/` (or, on a cluster without cluster DNS, a volume "
                 "provisioner or mounted service-account tokens, `kubectl apply -k deploy/k8s-overlays/plain-cluster`: "
                 "docs/guide/kubernetes.md); see it with `kubectl -n streamrover-system get pods` and its log with "
                 "`kubectl -n streamrover-system logs deploy/streamrover-operator`")  # fmt: skip


class OperatorMissingError(PlatformUnavailableError):
    """No operator took the job, or the one that had stopped writing its status."""


def _custom(api: Any) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(api)


def _call(what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, with an unreachable or refusing API server as a :class:`PlatformError`."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    try:
        return fn(*args)
    except ApiException as exc:
        if exc.status in (401, 403):
            raise PlatformUnavailableError(f"cannot {what}: {exc.reason}: {exc.body}") from None
        raise
    except (OSError, urllib3.exceptions.HTTPError) as exc:
        raise PlatformUnavailableError(f"cannot reach the Kubernetes API server: {exc}") from None


def list_jobs(api: Any, namespace: str) -> list[dict[str, Any]]:
    """Every ``StreamTrainJob`` in ``namespace``."""
    from kubernetes.client.exceptions import ApiException

    try:
        found = _call("list StreamTrainJobs", _custom(api).list_namespaced_custom_object, GROUP, VERSION, namespace,
                      PLURAL)  # fmt: skip
    except ApiException as exc:
        if exc.status == 404:
            raise PlatformUnavailableError("the StreamTrainJob resource is not installed: "
                                           "`kubectl apply -f deploy/k8s/`") from None  # fmt: skip
        raise
    return list(found.get("items", []))


def get_job(api: Any, namespace: str, name: str) -> dict[str, Any]:
    """The resource ``namespace/name``; :class:`JobNotFoundError` naming the jobs there if there is none."""
    from kubernetes.client.exceptions import ApiException

    try:
        return dict(_call(f"read StreamTrainJob {name}", _custom(api).get_namespaced_custom_object, GROUP, VERSION,
                          namespace, PLURAL, name))  # fmt: skip
    except ApiException as exc:
        if exc.status != 404:
            raise
    known = ", ".join(j["metadata"]["name"] for j in list_jobs(api, namespace)) or "none"
    raise JobNotFoundError(f"no StreamTrainJob {name!r} in namespace {namespace!r} (jobs: {known})")


def phase(body: dict[str, Any]) -> str:
    """A StreamTrainJob's phase from its status (``pending`` before the operator set one)."""
    return str((body.get("status") or {}).get("phase") or "pending")


def scale(api: Any, namespace: str, name: str, nodes: int) -> None:
    """Ask for ``nodes`` nodes through the scale subresource (ValueError outside the bounds or if it ended)."""
    from streamrover.operator.spec import parse_spec

    body = get_job(api, namespace, name)
    lo, hi = parse_spec((body.get("spec") or {}).get("job"), f"{namespace}/{name} spec.job").scale_bounds
    if not lo <= nodes <= hi:
        raise ValueError(f"{nodes} nodes is outside job {name!r}'s bounds {lo}:{hi}")
    if phase(body) in ENDED:
        raise ValueError(f"job {name!r} is not running ({phase(body)})")
    _call(f"scale StreamTrainJob {name}", _custom(api).patch_namespaced_custom_object_scale, GROUP, VERSION,
          namespace, PLURAL, name, {"spec": {"replicas": nodes}})  # fmt: skip


def stop(api: Any, namespace: str, name: str) -> str | None:
    """Ask the operator to stop the job gracefully (``spec.stop``); the phase it had if it had already ended."""
    body = get_job(api, namespace, name)
    if phase(body) in ENDED:
        return phase(body)
    _call(f"stop StreamTrainJob {name}", _custom(api).patch_namespaced_custom_object, GROUP, VERSION, namespace,
          PLURAL, name, {"spec": {"stop": True}})  # fmt: skip
    return None


def stop_requested(body: Any) -> bool:
    """Whether ``streamrover stop`` (or a user's patch) asked the resource's job to stop."""
    return bool((body.get("spec") or {}).get("stop"))


def follow(name: str, namespace: str, api: Any, report: Any, interval: float = 1.0,
           start_timeout: float = START_TIMEOUT, stall_timeout: float = STALL_TIMEOUT) -> str:  # fmt: skip
    """Poll the job's resource until its phase ends (``report(status)`` on every change); the final phase.

    :class:`OperatorMissingError` (saying how to install one) when no operator wrote the job's status within
    ``start_timeout`` seconds, or the status stopped changing for ``stall_timeout`` seconds. The resource stays:
    an operator that comes (back) runs the job.
    """
    from kubernetes.client.exceptions import ApiException

    custom, last, seen = _custom(api), None, None
    started = changed_at = time.monotonic()
    stays = (f"The StreamTrainJob stays and runs once an operator does (`kubectl delete streamtrainjob {name} -n "
             f"{namespace}` withdraws it).")  # fmt: skip
    while True:
        try:
            found: Any = _call(f"read StreamTrainJob {name}", custom.get_namespaced_custom_object, GROUP, VERSION,
                               namespace, PLURAL, name)  # fmt: skip
            status = found.get("status") or {}
        except ApiException as exc:
            if exc.status == 404:
                return "deleted"
            raise
        key = (status.get("phase"), status.get("replicas"), tuple(status.get("events") or [])[-1:])
        if key != last:
            report(status)
            last = key
        if status.get("phase") in ENDED:
            return str(status["phase"])
        now = time.monotonic()
        if status != seen:
            seen, changed_at = status, now
        if not status and now - started > start_timeout:
            raise OperatorMissingError(f"no operator took StreamTrainJob {name!r} in namespace {namespace!r} within "
                                       f"{start_timeout:.0f} s: is the streamrover operator installed, and watching "
                                       f"this namespace? {OPERATOR_HINT}. {stays}")  # fmt: skip
        if status and now - changed_at > stall_timeout:
            raise OperatorMissingError(f"the operator has not updated StreamTrainJob {name!r} for {stall_timeout:.0f}"
                                       f" s (phase {phase({'status': status})}, updated {status.get('updatedAt')}): "
                                       f"is it still running? {OPERATOR_HINT}. {stays}")  # fmt: skip
        time.sleep(interval)  # a status poll for the user's terminal
