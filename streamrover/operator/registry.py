"""The platform registry: ``streamrover run --platform NAME`` finds its platform here.

The built-in backends (``local``, ``ray``) are imported on first use, so a job that runs locally never
imports Ray. Kept apart from :mod:`streamrover.operator.api` so that the contract does not import its
backends (they import it): no import circle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streamrover.operator.api import Platform, PlatformError, PlatformUnavailableError

PlatformFactory = Callable[..., Platform]
_registry: dict[str, PlatformFactory] = {}


def register_platform(name: str, factory: PlatformFactory) -> None:
    """Make a platform available to ``streamrover run --platform NAME``."""
    _registry[name] = factory


def create_platform(name: str, **kwargs: Any) -> Platform:
    """A platform instance by name; the built-in ones import their engine only now."""
    if name not in _registry:
        if name == "local":
            from streamrover.operator import local

            register_platform("local", local.LocalPlatform)
        elif name == "ray":
            from streamrover.operator import ray

            register_platform("ray", ray.RayPlatform)
        elif name == "k8s":
            raise PlatformUnavailableError(
                "the k8s platform runs inside the operator (python -m streamrover.operator.k8s_operator, one per "
                "StreamTrainJob): `streamrover run job.yaml --platform k8s` creates the resource")
    try:
        factory = _registry[name]
    except KeyError:
        known = ", ".join(sorted({"local", "ray", "k8s", *_registry}))
        raise PlatformError(f"unknown platform {name!r} (known: {known})") from None
    return factory(**kwargs)
