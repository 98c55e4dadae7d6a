"""lazyckpt: load PyTorch checkpoints lazily, one tensor at a time, resharded on the way.

See DESIGN.md for the contract. The pipeline is index (per format, metadata only) -> plan
(pure integers) -> read (only the target's bytes) -> deliver (cast, device, DTensor).
"""

from lazyckpt.errors import (
    CheckpointWarning,
    CorruptModelCheckpointError,
    ModelCheckpointError,
    ShardDimsWarning,
    UnknownCheckpointFormatError,
)
from lazyckpt.layout import Layout
from lazyckpt.loader import ModelCheckpointLoader
from lazyckpt.loaders import get_model_checkpoint_loader
from lazyckpt.model_load import KeyMismatchError, LoadReport, load_into
from lazyckpt.options import ModelCheckpointLoadOptions
from lazyckpt.presets import PRESETS, get_preset, preset_shard_dims
from lazyckpt.reshard import reshard_tensor
from lazyckpt.shard_dims import get_shard_dims
from lazyckpt.stats import LoadStats

__all__ = [
    "CheckpointWarning",
    "CorruptModelCheckpointError",
    "KeyMismatchError",
    "Layout",
    "LoadReport",
    "LoadStats",
    "ModelCheckpointError",
    "ModelCheckpointLoadOptions",
    "ModelCheckpointLoader",
    "PRESETS",
    "ShardDimsWarning",
    "UnknownCheckpointFormatError",
    "get_model_checkpoint_loader",
    "get_preset",
    "get_shard_dims",
    "load_into",
    "preset_shard_dims",
    "reshard_tensor",
]

__version__ = "0.1.0"
