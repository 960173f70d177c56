"""What runs only in the job master: the shard table, its journal, the gRPC server and the dashboard.

- :mod:`.core` (``ShardCore``): datasets, shards, fenced leases and acks, cuts; over :mod:`.state` (the
  in-memory tables), :mod:`.bookkeeping` (their records) and :mod:`.journal` (SQLite, WAL: the durable copy).
- Planning: :mod:`.planner` (batch epochs), :mod:`.streams` and :mod:`.poller` (stream shards as records
  arrive), :mod:`.upstream` (broker offsets committed after a durable cut), :mod:`.staged` (sinks' files).
- Serving: :mod:`.server` (``ShardServicer``, the gRPC service) with :mod:`.session`, :mod:`.kv_rpc`,
  :mod:`.staged_rpc`, :mod:`.info`; :mod:`.web` and :mod:`.metrics` (dashboard, Prometheus ``/metrics``).
- Security: :mod:`.auth` (the admin and worker tokens, reloaded from files; the role check) and :mod:`.tls`
  (certificates for gRPC and HTTPS, reloaded when their files change; the off-loopback warning), :mod:`.decode`
  (requests decoded by the master: bytes that are no message are INVALID_ARGUMENT).
- :mod:`.process` (``MasterServer``): a master in this process, what ``streamrover master`` runs.

Nothing here is imported by :mod:`streamrover.shard_service.client` (an import-linter contract in
pyproject.toml and ``tests/test_layout.py`` keep it so).
"""

from streamrover.shard_service.master.process import MasterServer, load_or_create_token

__all__ = ["MasterServer", "load_or_create_token"]
