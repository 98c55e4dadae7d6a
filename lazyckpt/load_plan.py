"""Plan a whole load before reading: every key's box, copy and pieces, all checks done.

Planning is cheap (integers only), so doing it for every key up front is what lets ``lazy_load``
validate eagerly: a gap in a DCP tiling or a shard dim out of range fails when ``lazy_load`` is
called, not an hour into the stream.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from lazyckpt import stitch
from lazyckpt.errors import CorruptModelCheckpointError
from lazyckpt.index import MAX_INT64, CheckpointIndex, Chunk, TensorEntry, contiguous_strides
from lazyckpt.layout import Layout
from lazyckpt.plan import (
    Box,
    Piece,
    PlanError,
    check_tiling,
    is_dense,
    normalize_dim,
    plan_pieces,
    target_box,
)

__all__ = ["TensorPlan", "check_shard_dims", "entry_path", "plan_entry", "plan_load"]


@dataclass(slots=True, eq=False)
class TensorPlan:
    """How to build one key's target tensor. Read-only, though not frozen: a load plans every
    key, and a frozen ``__init__`` costs five times as much (see :class:`TensorEntry`)."""

    entry: TensorEntry
    shard_dim: int | None
    """The key's TP dim (normalized), or None when it is replicated across TP ranks."""
    box: Box
    """The target box in global coordinates."""
    copy: int
    """Which of ``entry.copies`` to read."""
    pieces: tuple[Piece, ...]
    verify: tuple[tuple[int, tuple[Piece, ...]], ...] = ()
    """Other copies to read the same box from and compare (replica checks)."""

    @property
    def key(self) -> str:
        return self.entry.key

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return self.entry.copies[self.copy]

    @property
    def nbytes(self) -> int:
        """Bytes of the target box in the source dtype."""
        return self.box.numel * self.entry.dtype.itemsize

    @property
    def may_be_view(self) -> bool:
        """True when the box is all of one chunk's piece; the reader decides if it is dense."""
        return len(self.pieces) == 1 and self.pieces[0].sizes == self.box.sizes and not self.verify

    @property
    def may_stitch(self) -> bool:
        """True when the box spans several chunks whose pieces each fill one contiguous range
        of it: the reader may lay them out as one view (:mod:`lazyckpt.stitch`) when each is
        also contiguous in its file and their offsets agree modulo the page size."""
        if not 1 < len(self.pieces) <= stitch.MAX_RUNS or self.verify:
            return False
        if self.nbytes < stitch.MIN_BYTES:
            return False
        strides = contiguous_strides(self.box.sizes)
        return all(is_dense(p.sizes, strides) for p in self.pieces)

    def files(self) -> set[Path]:
        return _files(self.chunks, self.pieces)


def _files(chunks: tuple[Chunk, ...], pieces: tuple[Piece, ...]) -> set[Path]:
    return {p for p in _paths(chunks, pieces) if p is not None}


def _paths(chunks: tuple[Chunk, ...], pieces: tuple[Piece, ...]) -> list[Path | None]:
    """The file of each piece's chunk (``None``: a chunk in memory), as a list: ``plan_load``
    asks ~200 times in an MP-8 load, and a set per call cost more than the test it serves."""
    return [chunks[piece.chunk].path for piece in pieces]


def check_shard_dims(shard_dims: Mapping[str, int]) -> None:
    """Reject shard dims that are not ints, before anything is read."""
    if not isinstance(shard_dims, Mapping):
        raise ValueError(
            f"shard_dims must be a mapping of key to dim, got {type(shard_dims).__name__}"
        )
    for key, dim in shard_dims.items():
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"shard_dims[{key!r}] must be an int, got {dim!r}")


def entry_path(index_path: Path, entry: TensorEntry) -> Path:
    """The file to blame for ``entry``: its one file, or the checkpoint when it spans several."""
    paths = {c.path for copy in entry.copies for c in copy if c.path is not None}
    return next(iter(paths)) if len(paths) == 1 else index_path


Geometry = tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
"""A copy's chunks as ``(offsets, sizes)`` pairs: all the planner needs to know of them."""


@functools.lru_cache(maxsize=4096)
def _tiling_error(shape: tuple[int, ...], geometry: Geometry) -> str | None:
    try:
        check_tiling(shape, [Box(o, s) for o, s in geometry])
    except PlanError as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=4096)
def _pieces(box: Box, geometry: Geometry) -> tuple[Piece, ...]:
    return tuple(plan_pieces(box, [Box(o, s) for o, s in geometry]))


def plan_entry(
    entry: TensorEntry,
    shard_dims: Mapping[str, int],
    layout: Layout,
    where: Path | Callable[[], Path],
    box: Box | None = None,
) -> tuple[int | None, Box, list[tuple[Piece, ...]]]:
    """Shard dim, target box and the pieces of every copy of ``entry``; checks the tilings.

    ``box`` overrides the layout's box (``load_into`` takes each DTensor's own box). Layers of
    a model repeat the same shapes and replicas repeat one geometry, so tilings and pieces are
    computed once per distinct geometry (pure functions, cached)."""
    shape = entry.shape
    if shape:
        too_large = _too_large(shape)
        if too_large is not None:
            raise _fail(entry, where, f"shape {shape} {too_large}")
    dim = shard_dims.get(entry.key)
    if dim is not None:
        try:
            dim = normalize_dim(dim, len(shape))
        except PlanError:
            raise ValueError(
                f"shard_dims[{entry.key!r}] = {dim} is out of range for its {len(shape)}-D "
                f"tensor of shape {shape}; fix the shard dims"
            ) from None
    # List comprehensions, not generators: this runs for every key of a load.
    geometries = [tuple([(c.offsets, c.sizes) for c in copy]) for copy in entry.copies]
    for geometry in geometries if len(geometries) == 1 else dict.fromkeys(geometries):
        error = _tiling_error(shape, geometry)
        if error is not None:
            raise _fail(entry, where, error)
    if box is None:
        box = target_box(shape, dim, layout.tp_size, layout.tp_rank, layout.dp_size, layout.dp_rank)
    elif len(box.sizes) != len(shape) or any(
        o < 0 or o + s > n for o, s, n in zip(box.offsets, box.sizes, shape)
    ):
        raise ValueError(f"key {entry.display_key}: box {box} lies outside shape {shape}")
    if len(geometries) == 1:
        return dim, box, [_pieces(box, geometries[0])]
    # Replicas (a model-parallel set's copies) repeat one geometry: one lookup for them all.
    found = {g: _pieces(box, g) for g in dict.fromkeys(geometries)}
    return dim, box, [found[g] for g in geometries]


def _too_large(shape: tuple[int, ...]) -> str | None:
    """Why torch cannot hold a tensor of ``shape``, whose sizes, element count and row-major
    strides are 64-bit, or None. A header may declare such a shape with no byte of data (a
    dim of 0), so it passes the byte-span checks; ``torch.empty`` would then fail with a bare
    ``RuntimeError`` ("Stride calculation overflowed") when the tensor is made."""
    if max(shape) > MAX_INT64:
        return "has a dim past 2**63"
    numel = math.prod(shape)
    if numel > MAX_INT64:
        return "has 2**63 elements or more"
    if numel == 0 and contiguous_strides(shape)[0] > MAX_INT64:
        return "has a row-major stride past 2**63 (even empty, torch cannot make it)"
    if numel == 0:  # torch multiplies the sizes from the left, 64-bit, a 0 coming too late
        running = 1
        for n in shape:
            running *= n
            if running >> 64:
                return (
                    "has sizes whose product from the left passes 2**64 before a 0 (even "
                    "empty, torch cannot make it)"
                )
    return None


def _fail(
    entry: TensorEntry, where: Path | Callable[[], Path], message: str
) -> CorruptModelCheckpointError:
    path = where() if callable(where) else where
    return CorruptModelCheckpointError(
        path, f"key {entry.display_key}: {message}", key=entry.checkpoint_key
    )


def check_copies(index: CheckpointIndex, entries: Iterable[TensorEntry]) -> None:
    """Refuse the first of ``entries`` whose copies the index knows to differ
    (:attr:`CheckpointIndex.differing_copies`)."""
    differing = index.differing_copies
    if differing:
        for entry in entries:
            found = differing.get(entry.key)
            if found is not None:
                raise CorruptModelCheckpointError(found[0], found[1], key=entry.checkpoint_key)


def plan_load(
    index: CheckpointIndex,
    shard_dims: Mapping[str, int],
    layout: Layout,
    *,
    verify_replicas: bool = True,
    verify_max_bytes: int = 16 << 20,
    boxes: Mapping[str, Box] | None = None,
) -> list[TensorPlan]:
    """Plan every key of ``index`` for ``layout``.

    A replicated key (several copies) is read from a file this rank reads anyway for its sharded
    keys, so MP-8 into TP-8 rank 3 opens one file; the other copies in such files are compared
    when ``verify_replicas`` is on and the tensor is small enough, and a key whose copies the
    index knows to differ is refused. ``boxes`` gives some keys a box of their own instead of
    the layout's.
    """
    if verify_replicas:
        check_copies(index, index)
    planned = []
    for entry in index:
        own = None if boxes is None else boxes.get(entry.key)
        where = functools.partial(entry_path, index.path, entry)
        dim, box, pieces = plan_entry(entry, shard_dims, layout, where, own)
        planned.append((entry, dim, box, pieces))
    # The files read anyway: asked only where some key has copies to choose from. ``None``, a
    # chunk in memory, is read anyway.
    used: set[Path | None] = {None}
    if any(len(entry.copies) > 1 for entry, *_ in planned):
        for entry, _, _, pieces in planned:
            if len(entry.copies) == 1:
                used.update(_paths(entry.copies[0], pieces[0]))

    plans = []
    for entry, dim, box, pieces in planned:
        if len(entry.copies) == 1:
            plans.append(TensorPlan(entry, dim, box, 0, pieces[0]))
            continue
        inside = [
            i
            for i, p in enumerate(pieces)
            if all([path in used for path in _paths(entry.copies[i], p)])
        ]
        if inside:
            chosen, compare = inside[0], inside
        else:
            # No file is read anyway: every key looks replicated, which for a model-parallel set
            # usually means shard_dims were left out. Spread ranks over the copies, and compare
            # all of them, so a split key is not taken for a replica.
            chosen = layout.tp_rank * len(entry.copies) // layout.tp_size
            compare = list(range(len(entry.copies)))
        verify: tuple[tuple[int, tuple[Piece, ...]], ...] = ()
        if verify_replicas and entry.nbytes <= verify_max_bytes:
            verify = tuple((i, pieces[i]) for i in compare if i != chosen)
        plans.append(TensorPlan(entry, dim, box, chosen, pieces[chosen], verify))
    return plans
