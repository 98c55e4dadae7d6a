"""Named shard-dim rules for well-known checkpoints.

Model-parallel sources do not record how each key was split; the rules live in the model code.
These presets carry the rules of Meta's fairscale Llama reference code, so a user can load
``consolidated.NN.pth`` files without the model at hand.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["PRESETS", "ShardDimPreset", "get_preset", "preset_shard_dims"]


@dataclass(frozen=True)
class ShardDimPreset:
    """Rules ``(pattern, dim)``: a key whose last dotted components match ``pattern`` is split
    along ``dim``; the first matching rule wins; a key matching none is replicated."""

    name: str
    description: str
    rules: tuple[tuple[str, int], ...]

    def shard_dims(self, keys: Iterable[str]) -> dict[str, int]:
        compiled = [(re.compile(rf"(?:^|\.){pattern}$"), dim) for pattern, dim in self.rules]
        out = {}
        for key in keys:
            for regex, dim in compiled:
                if regex.search(key):
                    out[key] = dim
                    break
        return out


_LLAMA_LAYERS = (
    (r"attention\.w[qkv]\.weight", 0),  # ColumnParallelLinear
    (r"attention\.wo\.weight", 1),  # RowParallelLinear
    (r"feed_forward\.w[13]\.weight", 0),  # ColumnParallelLinear
    (r"feed_forward\.w2\.weight", 1),  # RowParallelLinear
    (r"output\.weight", 0),  # ColumnParallelLinear
)

PRESETS: dict[str, ShardDimPreset] = {
    p.name: p
    for p in (
        ShardDimPreset(
            "llama2-fairscale",
            "Meta Llama 1 and 2 (fairscale): tok_embeddings is a ParallelEmbedding, split on dim 1",
            ((r"tok_embeddings\.weight", 1), *_LLAMA_LAYERS),
        ),
        ShardDimPreset(
            "llama3-fairscale",
            "Meta Llama 3 (fairscale): tok_embeddings is a VocabParallelEmbedding, split on dim 0",
            ((r"tok_embeddings\.weight", 0), *_LLAMA_LAYERS),
        ),
    )
}


def get_preset(name: str) -> ShardDimPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown shard-dim preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
        ) from None


def preset_shard_dims(preset: str | ShardDimPreset, keys: Iterable[str]) -> dict[str, int]:
    """``shard_dims`` for ``keys`` under a preset (by name or object)."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    return p.shard_dims(keys)
