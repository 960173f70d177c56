"""streamrover: continuous training on data streams with exactly-once shards.

Heavy frameworks are optional extras and are imported lazily by the modules that
need them; importing ``streamrover`` imports only the standard library.
"""

__version__ = "0.1.0"
