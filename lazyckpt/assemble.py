"""Reassemble a key from a ``[tp][dp]`` grid of shards into a global shape and chunks.

Model-parallel sources (fairscale ``consolidated.NN.pth``, fairseq2 ``tp_XX/sdp_XX.pt``) and
``reshard_tensor``'s ``source_splits`` all store a key as a grid: TP shards concatenated along the
key's shard dim, each TP shard split on dim 0 across data-parallel ranks. This module turns such a
grid into what the planner needs: the global shape and, per copy, chunks with global offsets. It
only does integer work on shapes; ``data`` is carried through untouched.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lazyckpt.index import Chunk, ChunkData
from lazyckpt.plan import PlanError, normalize_dim

__all__ = ["Cell", "assemble_grid", "assemble_alike", "check_split_order"]


@dataclass(slots=True, eq=False)
class Cell:
    """One shard of the grid: its local shape, dtype and where its elements are."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    data: ChunkData
    where: str
    """Names the shard in errors (a file, or ``source_splits[1][0]``)."""


def assemble_grid(
    grid: Sequence[Sequence[Cell]], shard_dim: int | None
) -> tuple[torch.dtype, tuple[int, ...], tuple[tuple[Chunk, ...], ...]]:
    """Global dtype, shape and copies of a key stored as ``grid[tp][dp]``.

    With a ``shard_dim``, TP shards are concatenated along it (one copy). Without one the key is a
    replica: every TP row holds the whole tensor, so each row is a copy, and their shapes must
    agree. Within a TP shard, DP shards are concatenated on dim 0. A 0-d key cannot be split, so
    every cell is a copy of it.
    """
    cells = [c for row in grid for c in row]
    if not cells or any(len(row) == 0 for row in grid):
        raise PlanError("no shards given")
    first = cells[0]
    for c in cells[1:]:
        if c.dtype != first.dtype:
            raise PlanError(
                f"dtypes disagree: {first.dtype} in {first.where}, {c.dtype} in {c.where}"
            )
        if len(c.shape) != len(first.shape):
            raise PlanError(
                f"ranks disagree: shape {first.shape} in {first.where}, {c.shape} in {c.where}"
            )
    ndim = len(first.shape)
    if ndim == 0:
        return first.dtype, (), tuple((Chunk((), (), c.data),) for c in cells)

    if shard_dim is None:
        rows = [_stack_dp(row, ndim) for row in grid]  # per TP rank: shape, chunks
        shape = rows[0][0]
        for (row_shape, _), row in zip(rows[1:], grid[1:]):
            if row_shape != shape:
                raise PlanError(
                    f"the copies differ in shape ({shape} in {grid[0][0].where}, {row_shape} in "
                    f"{row[0].where}), so the key is split across ranks: add it to shard_dims"
                )
        return first.dtype, shape, tuple(tuple(chunks) for _, chunks in rows)

    dim = _shard_dim(shard_dim, ndim)
    # Runs once per key and rank file of every model-parallel index: plain loops, and each
    # chunk made once, at its global offsets (TP offset on ``dim``, DP offset on dim 0).
    if all(len(row) == 1 for row in grid):
        return first.dtype, *_concat(grid, dim, ndim)
    shape0: tuple[int, ...] | None = None
    offset = 0
    chunks: list[Chunk] = []
    for row in grid:
        row_shape, row_chunks = _stack_dp(row, ndim, dim, offset)
        if shape0 is None:
            shape0 = row_shape
        for d in range(ndim):
            if d != dim and row_shape[d] != shape0[d]:
                raise _off_dim(dim, shape0, grid[0][0].where, row_shape, row[0].where)
        chunks.extend(row_chunks)
        offset += row_shape[dim]
    assert shape0 is not None
    shape = (*shape0[:dim], offset, *shape0[dim + 1 :])
    return first.dtype, shape, (tuple(chunks),)


def assemble_alike(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    datas: Sequence[ChunkData],
    shard_dim: int | None,
) -> tuple[torch.dtype, tuple[int, ...], tuple[tuple[Chunk, ...], ...]]:
    """:func:`assemble_grid` for one shard per TP rank, every shard of ``shape`` and ``dtype``
    (``datas[r]`` is rank ``r``'s): the rank files of a model-parallel set saved from one
    pickle. Nothing is left to compare, so each key costs a chunk per rank and no checks; an
    MP-8 index makes 600 of them."""
    ndim = len(shape)
    zeros = (0,) * ndim
    if ndim == 0 or shard_dim is None:
        return dtype, shape, tuple((Chunk(zeros, shape, d),) for d in datas)
    dim = _shard_dim(shard_dim, ndim)
    before, step, after = zeros[:dim], shape[dim], zeros[dim + 1 :]
    chunks = tuple(Chunk((*before, r * step, *after), shape, d) for r, d in enumerate(datas))
    return dtype, (*shape[:dim], step * len(datas), *shape[dim + 1 :]), (chunks,)


def _shard_dim(shard_dim: int, ndim: int) -> int:
    """``shard_dim`` normalized for an ``ndim``-D key. Out of range, the caller's shard_dims
    are wrong, not the checkpoint: a ValueError, not a PlanError."""
    try:
        return normalize_dim(shard_dim, ndim)
    except PlanError:
        raise ValueError(
            f"shard dim {shard_dim} is out of range for a {ndim}-D tensor; fix shard_dims"
        ) from None


def _off_dim(
    dim: int, a: tuple[int, ...], where_a: str, b: tuple[int, ...], where_b: str
) -> PlanError:
    """Two TP shards whose shapes differ off the shard dim ``dim``: files that disagree, or
    where they agree on ``dim`` and differ on one other dim, as likely a key split unevenly on
    that one while ``shard_dims`` names another; the message says both."""
    differ = [d for d in range(len(a)) if a[d] != b[d]]
    message = f"shard shapes disagree off the shard dim {dim}: {a} in {where_a}, {b} in {where_b}"
    if len(differ) == 1 and a[dim] == b[dim]:
        message += (
            f"; if the key is split on dim {differ[0]}, fix shard_dims, else the rank files "
            "disagree"
        )
    return PlanError(message)


def _concat(
    grid: Sequence[Sequence[Cell]], dim: int, ndim: int
) -> tuple[tuple[int, ...], tuple[tuple[Chunk, ...], ...]]:
    """:func:`assemble_grid` for one shard per TP rank (fairscale files): concatenate on
    ``dim``."""
    base = grid[0][0].shape
    before, after = base[:dim], base[dim + 1 :]
    chunks = []
    offset = 0
    for (c,) in grid:
        shape = c.shape
        if shape[:dim] != before or shape[dim + 1 :] != after:
            raise _off_dim(dim, base, grid[0][0].where, shape, c.where)
        offsets = [0] * ndim
        offsets[dim] = offset
        chunks.append(Chunk(tuple(offsets), shape, c.data))
        offset += shape[dim]
    return (*before, offset, *after), (tuple(chunks),)


def _stack_dp(
    row: Sequence[Cell], ndim: int, dim: int = 0, shift: int = 0
) -> tuple[tuple[int, ...], list[Chunk]]:
    """Concatenate one TP rank's DP shards on dim 0: its local shape, and its chunks with
    ``shift`` added to their offset on ``dim`` (the TP rank's place in the global tensor)."""
    base = row[0].shape
    offset = 0
    chunks = []
    for c in row:
        if c.shape[1:] != base[1:]:
            raise PlanError(
                f"data-parallel shards disagree off dim 0: {base} in {row[0].where}, {c.shape} in "
                f"{c.where}"
            )
        offsets = [0] * ndim
        offsets[0] = offset
        offsets[dim] += shift
        chunks.append(Chunk(tuple(offsets), c.shape, c.data))
        offset += c.shape[0]
    return (offset, *base[1:]), chunks


def check_split_order(grid: Sequence[Sequence[Cell]], shard_dim: int | None) -> None:
    """Refuse a model-parallel set's grid whose shards grow from one rank to a later one: along
    the shard dim from TP rank to TP rank, or along dim 0 from data-parallel shard to shard
    within a TP rank. A split (``torch.chunk``, ``tensor_split``, Meta's even ones) gives the
    larger shards to the first ranks, so such a set mixes files of different checkpoints, or
    a damaged one: joined, the rows of one file would be handed out as another's. Checked for
    files only (``reshard_tensor``'s ``source_splits`` are the caller's own cuts)."""
    ndim = len(grid[0][0].shape) if grid and grid[0] else 0
    if ndim == 0:
        return  # every cell is a copy
    if any(len(c.shape) != ndim for row in grid for c in row):
        return  # refused by assemble_grid, with the shards named
    for row in grid:
        sizes = [c.shape[0] for c in row]
        if any(a < b for a, b in itertools.pairwise(sizes)):
            raise PlanError(_growing(sizes, "dim 0 from one data-parallel shard to a later one"))
    if shard_dim is None or not -ndim <= shard_dim < ndim:
        return  # a replica; a dim out of range is refused where the shards are joined
    dim = shard_dim % ndim
    sizes = [sum(c.shape[0] for c in row) if dim == 0 else row[0].shape[dim] for row in grid]
    if any(a < b for a, b in itertools.pairwise(sizes)):
        raise PlanError(_growing(sizes, f"dim {dim} from one rank to a later one"))


def _growing(sizes: list[int], where: str) -> str:
    return (
        f"its shards' sizes are {sizes}, growing along {where}, which no split gives: a file of "
        "another checkpoint, or a damaged one"
    )
