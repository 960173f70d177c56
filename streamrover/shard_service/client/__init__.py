"""What a worker (or a tool) runs to talk to the master: the client side of the shard service.

- :mod:`.shard_client` (``ShardClient``): the gRPC client that keeps the contract of
  :class:`~streamrover.shard_service.api.ShardService`; :mod:`.leased` (``LeasedShard``) the shards it hands out.
- Beside it: :mod:`.transport` (the channel, retries, the worker's session stream), :mod:`.lease_table`
  (leases held and revoked), :mod:`.pacing` (how many shards to lease ahead), :mod:`.client_acks` (the queued
  ack sender), :mod:`.cursor_client` (a worker's part in cuts and cursors) and :mod:`.admin` (``AdminClient``:
  the administrator's calls, datasets, status, committing cuts, the key-value store; a CLI uses it alone).

Nothing here imports :mod:`streamrover.shard_service.master` (an import-linter contract in pyproject.toml
and ``tests/test_layout.py`` keep it so).
"""

from streamrover.shard_service.client.leased import LeasedShard
from streamrover.shard_service.client.shard_client import ShardClient

__all__ = ["LeasedShard", "ShardClient"]
