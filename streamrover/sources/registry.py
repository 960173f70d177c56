"""The built-in source backends: which module serves which URI scheme, imported on first use.

A backend module registers its factory with :func:`streamrover.sources.api.register_source`
when it is imported; :func:`~streamrover.sources.api.open_source` asks this module to import
the one a URI needs, so a job that reads files never imports a broker client.
"""

from __future__ import annotations

import importlib

from streamrover.sources import api

#: URI scheme -> the module that registers its backend (its broker client is an optional extra).
BUILTIN_SCHEMES: dict[str, str] = {
    "kafka": "streamrover.sources.kafka",
    "pulsar": "streamrover.sources.pulsar",
    "rocketmq": "streamrover.sources.rocketmq",
    "staged": "streamrover.sources.staged",
}
#: The module of the file source (``file://``, fsspec URLs, plain paths): the fallback of every URI.
FILES_MODULE = "streamrover.sources.files"


def load_builtin_backends(scheme: str = "") -> None:
    """Import the backend for ``scheme`` (and the file source) unless registered already.

    Raises :class:`~streamrover.sources.api.SourceError` naming the extra to install when the
    backend's client library is missing.
    """
    module = BUILTIN_SCHEMES.get(scheme)
    if module is not None and not api.is_registered(scheme=scheme):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            hint = f"pip install 'streamrover[{scheme}]'"
            raise api.SourceError(f"{scheme}:// needs the {scheme!r} extra: {hint} ({exc})") from exc
    if not api.is_registered(format="files"):
        importlib.import_module(FILES_MODULE)
