"""``reshard_tensor``: fairseq2's function for loader authors, on lazyckpt's planner.

fairseq2 concatenates every source shard and re-slices, and drops rows when sizes do not divide;
here the target box is planned against the source shards and only its pieces are copied into one
buffer, with ``torch.chunk`` semantics for uneven sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from lazyckpt.assemble import Cell, assemble_grid
from lazyckpt.index import TensorEntry
from lazyckpt.layout import Layout
from lazyckpt.load_plan import plan_entry
from lazyckpt.read import Reader

__all__ = ["reshard_tensor"]


def reshard_tensor(
    key: str,
    source_splits: Sequence[Sequence[torch.Tensor]],
    source_shard_sizes: tuple[int, int],
    target_shard_sizes: tuple[int, int],
    target_shard_ranks: tuple[int, int],
    shard_dims: Mapping[str, int],
) -> torch.Tensor:
    """The target rank's part of ``key`` from a ``[tp][dp]`` grid of source shards.

    ``source_splits[tp][dp]`` holds source TP rank ``tp``'s shard, split on dim 0 across
    ``dp``; ``*_shard_sizes`` are ``(tp_size, dp_size)`` and ``target_shard_ranks`` is
    ``(tp_rank, dp_rank)``. A key in ``shard_dims`` is concatenated along its dim across TP
    shards; other keys are replicated and read from TP rank 0. The result is a new tensor on the
    sources' device, ``torch.chunk(torch.chunk(full, tp, dim)[tp_rank], dp, 0)[dp_rank]``.
    """
    src_tp, src_dp = _pair(source_shard_sizes, "source_shard_sizes")
    if len(source_splits) != src_tp or any(len(row) != src_dp for row in source_splits):
        raise ValueError(
            f"{key}: source_splits must be a {src_tp} x {src_dp} grid (source_shard_sizes), got "
            f"{len(source_splits)} rows of {[len(row) for row in source_splits]}"
        )
    tgt_tp, tgt_dp = _pair(target_shard_sizes, "target_shard_sizes")
    tp_rank, dp_rank = _pair(target_shard_ranks, "target_shard_ranks", low=0)
    layout = Layout(tp_size=tgt_tp, tp_rank=tp_rank, dp_size=tgt_dp, dp_rank=dp_rank)
    for i, row in enumerate(source_splits):
        for j, t in enumerate(row):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"{key}: source_splits[{i}][{j}] is a {type(t).__name__}, not a tensor"
                )
            if t.layout != torch.strided or t.is_quantized:
                what, fix = (
                    ("quantized", "dequantize") if t.is_quantized else (t.layout, "to_dense")
                )
                raise TypeError(
                    f"{key}: source_splits[{i}][{j}] is a {what} tensor; reshard_tensor takes "
                    f"dense ones: pass t.{fix}()"
                )
    dim = shard_dims.get(key)
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
        raise ValueError(f"shard_dims[{key!r}] must be an int, got {dim!r}")
    grid = [
        [Cell(tuple(t.shape), t.dtype, t, f"source_splits[{i}][{j}]") for j, t in enumerate(row)]
        for i, row in enumerate(source_splits)
    ]
    try:
        dtype, shape, copies = assemble_grid(grid, dim)
    except ValueError as exc:  # PlanError included: the caller's tensors do not fit together
        raise ValueError(f"{key}: {exc}") from None
    entry = TensorEntry(key, dtype, shape, copies[:1])
    _, box, pieces = plan_entry(entry, shard_dims, layout, Path("<source_splits>"))
    device = source_splits[0][0].device
    out = torch.empty(box.sizes, dtype=dtype, device=device)
    with Reader() as reader:
        for piece in pieces[0]:
            reader.copy(entry.chunks[piece.chunk], dtype, piece, out, f"key {key!r}")
    return out


def _pair(value: object, name: str, low: int = 1) -> tuple[int, int]:
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value)
    ):
        raise ValueError(f"{name} must be a pair of ints >= {low}, got {value!r}")
    return int(value[0]), int(value[1])
