"""streamrover: continuous training on data streams with exactly-once shards.

Heavy frameworks are optional extras and are imported lazily by the modules that
need them; importing ``streamrover`` imports only the standard library. It chooses gRPC's
poll-based I/O for the process (:mod:`streamrover._grpc_io`) before grpc is imported.
"""

from streamrover._grpc_io import choose_poll_io

choose_poll_io()

__version__ = "0.1.0"
