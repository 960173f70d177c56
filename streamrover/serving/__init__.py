"""Fresh models to serving: versions exported from durable checkpoints, with lineage and table deltas.

The contract is in :mod:`streamrover.serving.api` (what a version is, the repository layout, the rules).
Importing this package does not import torch; the exporter and the tracker import it when used.
"""

from streamrover.serving.api import (
    BrokenChainError,
    CheckpointGoneError,
    ExportConfig,
    ExportError,
    ServingError,
    VersionInfo,
)
from streamrover.serving.export import TorchExporter, triton_config
from streamrover.serving.repository import ModelRepository
from streamrover.serving.tables import RowTracker, read_tables

__all__ = [
    "BrokenChainError",
    "CheckpointGoneError",
    "ExportConfig",
    "ExportError",
    "ModelRepository",
    "RowTracker",
    "ServingError",
    "TorchExporter",
    "VersionInfo",
    "read_tables",
    "triton_config",
]
