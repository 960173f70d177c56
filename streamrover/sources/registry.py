"""The built-in source backends: which module serves which URI scheme, imported on first use.

A backend module registers its factory with :func:`streamrover.sources.api.register_source`
when it is imported; :func:`~streamrover.sources.api.open_source` imports the one a URI needs
(named here), so a job that reads files never imports a broker client. This module is data only:
it imports nothing, so the contract can read it without an import circle.
"""

from __future__ import annotations

#: URI scheme -> the module that registers its backend (its broker client is an optional extra).
BUILTIN_SCHEMES: dict[str, str] = {
    "kafka": "streamrover.sources.kafka",
    "pulsar": "streamrover.sources.pulsar",
    "rocketmq": "streamrover.sources.rocketmq",
    "staged": "streamrover.sources.staged",
    "delta": "streamrover.sources.delta",
    "iceberg": "streamrover.sources.iceberg",
}
#: The module of the file source (``file://``, fsspec URLs, plain paths): the fallback of every URI.
FILES_MODULE = "streamrover.sources.files"

#: The module that opens chained datasets (it registers itself with ``register_chain``).
HISTORY_MODULE = "streamrover.sources.history"
#: The option that makes a dataset a chain: its history's files, then its URI's stream (``sources/history.py``).
HISTORY_OPTION = "sr.history"
