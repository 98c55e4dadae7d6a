"""Pure integer planning: which box a rank receives and which source pieces fill it.

Nothing here touches a file or a tensor, so all of it is tested with integers alone. Errors are
:class:`PlanError` (a ``ValueError``) with a message about the shapes; callers add the file and
key when they turn them into checkpoint errors.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "Box",
    "PlanError",
    "Piece",
    "Runs",
    "Stitch",
    "check_tiling",
    "chunk_bounds",
    "concat_order",
    "contiguous_runs",
    "intersect",
    "mesh_box",
    "middle_run",
    "page_ranges",
    "plan_pieces",
    "plan_stitch",
    "target_box",
]


class PlanError(ValueError):
    """Shapes that cannot be planned: bad dims, gaps, overlaps, mismatched chunks."""


@dataclass(slots=True, unsafe_hash=True)
class Box:
    """A hyper-rectangle of a tensor: ``offsets[d] <= i[d] < offsets[d] + sizes[d]``.

    Equal and hashed by value (planning caches key on boxes), but not frozen: a load makes one
    per key at least, and a frozen ``__init__`` costs five times as much. Treat it as
    read-only."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of ``torch.chunk(range(n), parts)[index]``, empty past the last chunk.

    ``torch.chunk`` gives each chunk ``ceil(n / parts)`` elements and may make fewer than
    ``parts`` chunks (5 over 4 gives 2, 2, 1); a rank past the end gets ``(n, n)``, as DTensor's
    ``Shard`` does.
    """
    if parts < 1 or not 0 <= index < parts:
        raise PlanError(f"chunk index {index} is out of range for {parts} parts")
    step = -(-n // parts)
    start = min(index * step, n)
    return start, min(start + step, n)


def normalize_dim(dim: int, ndim: int) -> int:
    """``dim`` in ``[0, ndim)``, accepting negative dims as torch does."""
    if not -ndim <= dim < ndim:
        raise PlanError(f"shard dim {dim} is out of range for a {ndim}-D tensor")
    return dim % ndim


@functools.lru_cache(maxsize=4096)
def target_box(
    shape: tuple[int, ...],
    shard_dim: int | None,
    tp_size: int,
    tp_rank: int,
    dp_size: int,
    dp_rank: int,
) -> Box:
    """The box of the global tensor that a rank receives (DESIGN.md, "What a target rank
    receives"): TP chunk on ``shard_dim``, then FSDP chunk of that on dim 0.

    A 0-d tensor cannot be chunked, so every rank receives it whole (FSDP2 replicates scalars).
    Cached (``shape`` is a tuple): a model's layers ask it for the same shapes.
    """
    offsets = [0] * len(shape)
    sizes = list(shape)
    if shard_dim is not None and tp_size > 1:
        d = normalize_dim(shard_dim, len(shape))
        start, stop = chunk_bounds(shape[d], tp_size, tp_rank)
        offsets[d], sizes[d] = start, stop - start
    if dp_size > 1 and len(shape) > 0:
        start, stop = chunk_bounds(sizes[0], dp_size, dp_rank)
        offsets[0] += start
        sizes[0] = stop - start
    return Box(tuple(offsets), tuple(sizes))


def mesh_box(
    shape: Sequence[int],
    mesh_sizes: Sequence[int],
    coordinate: Sequence[int],
    shard_dims: Sequence[int | None],
    order: Sequence[int] | None = None,
) -> Box:
    """The box that the rank at ``coordinate`` of a device mesh holds of a tensor of ``shape``
    when mesh dim ``i`` shards tensor dim ``shard_dims[i]`` (``None``: replicated there).

    This is DTensor's ``Shard`` (torch's ``compute_local_shape_and_global_offset``): mesh dims
    apply left to right (or in ``order``), each taking the ``torch.chunk`` of what the previous
    ones left, and an empty shard's offset is the dim's full size. torch builds index tensors to
    work this out, which cost a load of 75 DTensors about a millisecond. ``order`` serves
    FSDP2 over TP on one dim (``_StridedShard`` on the DP mesh dim): TP's chunk is cut first.
    """
    offsets = [0] * len(shape)
    sizes = list(shape)
    steps = list(zip(mesh_sizes, coordinate, shard_dims, strict=True))
    for i in range(len(steps)) if order is None else order:
        parts, index, dim = steps[i]
        if dim is None:
            continue
        d = normalize_dim(dim, len(shape))
        start, stop = chunk_bounds(sizes[d], parts, index)
        sizes[d] = stop - start
        offsets[d] = offsets[d] + start if stop > start else shape[d]
    return Box(tuple(offsets), tuple(sizes))


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b`` (``None`` when it is empty)."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo = ao if ao > bo else bo
        hi = ao + asz if ao + asz < bo + bsz else bo + bsz
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


def check_tiling(shape: Sequence[int], chunks: Sequence[Box]) -> None:
    """Raise :class:`PlanError` unless ``chunks`` cover ``shape`` exactly once.

    Chunks must lie inside the shape and not overlap; then they cover it iff their volumes add
    up. Overlaps are found by a sweep on dim 0, so sets of thousands of chunks stay cheap.
    """
    ndim = len(shape)
    total = 1
    for s in shape:
        if s < 0:
            raise PlanError(f"negative size in shape {tuple(shape)}")
        total *= s
    volume = 0
    for i, c in enumerate(chunks):
        if len(c.offsets) != ndim or len(c.sizes) != ndim:
            raise PlanError(
                f"chunk {i} has {len(c.sizes)} dims but the tensor has {ndim} (shape {tuple(shape)})"
            )
        for d in range(ndim):
            if c.offsets[d] < 0 or c.sizes[d] < 0 or c.offsets[d] + c.sizes[d] > shape[d]:
                raise PlanError(
                    f"chunk {i} (offsets {c.offsets}, sizes {c.sizes}) lies outside the "
                    f"tensor's shape {tuple(shape)}"
                )
        volume += c.numel
    if ndim > 0:
        live = sorted((c for c in chunks if c.numel > 0), key=lambda c: c.offsets[0])
        for i, a in enumerate(live):
            for b in live[i + 1 :]:
                if b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                    break
                if intersect(a, b) is not None:
                    raise PlanError(
                        f"chunks overlap: (offsets {a.offsets}, sizes {a.sizes}) and "
                        f"(offsets {b.offsets}, sizes {b.sizes})"
                    )
    elif len(chunks) > 1:
        raise PlanError(f"a 0-d tensor is stored in {len(chunks)} chunks")
    if volume != total:
        raise PlanError(
            f"chunks cover {volume} of the {total} elements of shape {tuple(shape)}: "
            "part of the tensor is missing"
        )


@dataclass(slots=True, unsafe_hash=True)
class Piece:
    """Copy ``sizes`` elements from chunk ``chunk`` at chunk-local ``src_offsets`` to the
    target box at box-local ``dst_offsets``. Read-only, as :class:`Box`."""

    chunk: int
    src_offsets: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def concat_order(pieces: Sequence[Piece], sizes: Sequence[int]) -> tuple[int, list[int]] | None:
    """``(dim, order)`` when ``pieces`` fill a box of ``sizes`` side by side along one dim,
    each spanning the whole box in every other dim (a model-parallel key split on dim 1, read
    back whole or by rows): the box is the pieces in ``order`` joined along ``dim``, which
    ``torch.cat`` writes row by row. Else None (fewer than two pieces, or any other tiling)."""
    if len(pieces) < 2 or not sizes:
        return None
    first = pieces[0].sizes
    along = [d for d, (n, m) in enumerate(zip(first, sizes)) if n != m]
    if len(along) != 1:
        return None
    (dim,) = along
    for p in pieces:  # a piece lies in the box: as long as it, it starts where it does
        for d, (n, m) in enumerate(zip(p.sizes, sizes)):
            if d != dim and n != m:
                return None
    order = sorted(range(len(pieces)), key=lambda i: pieces[i].dst_offsets[dim])
    at = 0
    for i in order:
        if pieces[i].dst_offsets[dim] != at or pieces[i].sizes[dim] == 0:
            return None
        at += pieces[i].sizes[dim]
    return (dim, order) if at == sizes[dim] else None


def plan_pieces(box: Box, chunks: Sequence[Box]) -> list[Piece]:
    """The pieces of ``chunks`` (already checked to tile the tensor) that fill ``box``.

    An empty box needs no piece. A 0-d box takes the whole of the one chunk.
    """
    if box.numel == 0:
        return []
    pieces = []
    for i, c in enumerate(chunks):
        if len(box.sizes) == 0:
            return [Piece(i, (), (), ())]
        common = intersect(box, c)
        if common is None:
            continue
        pieces.append(
            Piece(
                chunk=i,
                src_offsets=tuple(o - co for o, co in zip(common.offsets, c.offsets)),
                dst_offsets=tuple(o - bo for o, bo in zip(common.offsets, box.offsets)),
                sizes=common.sizes,
            )
        )
    return pieces


@dataclass(slots=True)
class Runs:
    """A strided copy seen as ``count`` runs of ``length`` contiguous elements on both sides.
    Read-only, though not frozen (made per piece read; see :class:`Box`).

    Run ``k`` (the multi-index ``i`` over ``outer_sizes``) starts at element
    ``sum(i * src_strides)`` of the source and ``sum(i * dst_strides)`` of the destination.
    """

    length: int
    outer_sizes: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]

    @property
    def count(self) -> int:
        n = 1
        for s in self.outer_sizes:
            n *= s
        return n

    def starts(self) -> itertools.product[tuple[int, ...]]:
        """Multi-indices of the runs, row-major."""
        return itertools.product(*(range(s) for s in self.outer_sizes))

    def offsets(self) -> list[tuple[int, int]]:
        """``(src, dst)`` element offsets of every run, row-major."""
        out = []
        for index in self.starts():
            src = sum(i * s for i, s in zip(index, self.src_strides))
            dst = sum(i * s for i, s in zip(index, self.dst_strides))
            out.append((src, dst))
        return out


def contiguous_runs(
    sizes: Sequence[int], src_strides: Sequence[int], dst_strides: Sequence[int]
) -> Runs:
    """Merge trailing dims that are contiguous in both source and destination into one run.

    Dims of size 1 are dropped first (their strides never matter). The result is what a reader
    can fetch with one ``pread`` each.
    """
    dims = [(s, a, b) for s, a, b in zip(sizes, src_strides, dst_strides) if s != 1]
    length = 1
    while dims:
        s, a, b = dims[-1]
        if a == length and b == length:
            length *= s
            dims.pop()
        else:
            break
    return Runs(
        length=length,
        outer_sizes=tuple(d[0] for d in dims),
        src_strides=tuple(d[1] for d in dims),
        dst_strides=tuple(d[2] for d in dims),
    )


def span(sizes: Sequence[int], strides: Sequence[int]) -> int:
    """Number of elements from the first to the last one of a strided view, inclusive
    (0 for an empty view). Strides must be non-negative."""
    if 0 in sizes:
        return 0
    n = 1
    for s, st in zip(sizes, strides):  # a loop: no generator frame (called for every piece)
        n += (s - 1) * st
    return n


def repeats_elements(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a strided view reaches one element by several indices (a stride of 0 on a dim
    of size > 1: an expanded tensor). Nothing may be written through such a view: each write
    would land on the same place over and over (``copy_`` refuses it)."""
    return any(st == 0 and n > 1 for n, st in zip(sizes, strides))


def _file_order(
    sizes: Sequence[int], strides: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The dims of a strided piece that place distinct bytes, largest stride first: the same
    bytes, walked in file order (a transposed tensor's rows are its columns in the file).
    Dims of size 1 or stride 0 (expanded) add no bytes and are dropped."""
    dims = sorted(
        ((st, n) for n, st in zip(sizes, strides) if n > 1 and st != 0), key=lambda d: -d[0]
    )
    return tuple(n for _, n in dims), tuple(st for st, _ in dims)


_MAX_RANGES = 1 << 14
"""More runs than this are asked for as their span: a Python loop and a system call per run
would cost more than the bytes between them."""


def page_ranges(
    first: int, sizes: Sequence[int], strides: Sequence[int], itemsize: int, page: int
) -> Iterator[tuple[int, int]]:
    """Byte ranges ``[start, stop)`` of whole pages of a file that hold every element of a
    strided piece whose first element is at byte ``first`` (strides non-negative): what to ask
    the kernel to read.

    One range, the piece's span, where the piece fills at least half of it (a few pages more
    than its bytes at most twice over), or where it has more than ``_MAX_RANGES`` runs; else
    the pages of each run in file order, merged where they meet: exactly the pages that hold
    an element (a TP-4 column slice of a matrix of 16 KiB rows reads 2 of each row's 4
    pages, not all 4)."""
    if any(s == 0 for s in sizes):
        return
    count = span(sizes, strides) * itemsize
    start = first // page * page
    stop = -(-(first + count) // page) * page
    sizes, strides = _file_order(sizes, strides)
    runs = contiguous_runs(sizes, strides, strides)
    if (
        runs.count == 1
        or runs.count > _MAX_RANGES
        or 2 * runs.count * runs.length * itemsize >= count
    ):
        yield start, stop
        return
    run_bytes = runs.length * itemsize
    current: tuple[int, int] | None = None
    for index in runs.starts():
        at = first + element_offset(index, runs.src_strides) * itemsize
        lo, hi = at // page * page, -(-(at + run_bytes) // page) * page
        if current is not None and current[0] <= lo <= current[1]:
            current = (current[0], max(current[1], hi))
            continue
        if current is not None:
            yield current
        current = (lo, hi)
    if current is not None:
        yield current


def middle_run(
    first: int, sizes: Sequence[int], strides: Sequence[int], itemsize: int
) -> tuple[int, int]:
    """Bytes ``[start, stop)`` of the run (in file order) that holds the piece's middle element:
    bytes the piece holds, all of them (the middle of its span may lie in a gap, in another
    rank's columns). Empty for an empty piece."""
    start, length = _middle_run(tuple(sizes), tuple(strides), itemsize)
    return first + start, first + start + length


@functools.lru_cache(maxsize=1024)
def _middle_run(sizes: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """:func:`middle_run` from the piece's first byte: ``(offset, length)`` in bytes. Cached, as
    a model's layers repeat the same pieces (a load probes each piece it maps)."""
    if any(n == 0 for n in sizes):
        return 0, 0
    sizes, strides = _file_order(sizes, strides)
    runs = contiguous_runs(sizes, strides, strides)
    index = runs.count // 2
    at = 0
    for n, st in zip(reversed(runs.outer_sizes), reversed(runs.src_strides)):
        at += (index % n) * st * itemsize
        index //= n
    return at, runs.length * itemsize


def element_offset(index: Sequence[int], strides: Sequence[int]) -> int:
    return sum(map(operator.mul, index, strides))


def is_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """True when a strided view covers one contiguous row-major range of its storage."""
    return _is_dense(tuple(sizes), tuple(strides))


@functools.lru_cache(maxsize=1024)
def _is_dense(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    # Cached: asked of every piece read or compared (an MP-8 load compares 136 norm copies).
    return contiguous_runs(sizes, strides, strides).outer_sizes == () or any(s == 0 for s in sizes)


@dataclass(frozen=True)
class Stitch:
    """How to lay byte ranges of files back to back in one new virtual range, mapping whole
    pages of the files into it and copying only the partial pages at the seams.

    The range is ``size`` bytes (whole pages); the stitched bytes start at ``shift``. Entries of
    ``maps`` and ``copies`` are ``(run, at, file_offset, length)``: bytes ``[at, at + length)``
    of the range come from ``run``'s file at ``file_offset``. Maps are page-aligned on both
    sides; together with the copies they cover ``[shift, shift + total)`` exactly once.
    """

    shift: int
    size: int
    maps: tuple[tuple[int, int, int, int], ...]
    copies: tuple[tuple[int, int, int, int], ...]

    @property
    def mapped_bytes(self) -> int:
        return sum(m[3] for m in self.maps)


def plan_stitch(runs: Sequence[tuple[int, int, int]], page: int) -> Stitch | None:
    """Stitch ``runs``, each ``(dst, src, length)`` in bytes, that tile ``[0, total)`` of the
    destination in order, from file offsets ``src`` (each run its own file).

    A file page can be mapped at a virtual page only when both offsets agree modulo the page
    size, so this is possible only when ``src - dst`` is the same modulo ``page`` for every run
    (``None`` otherwise). That holds where rank files share one layout and shards are whole
    pages, as in Meta's model-parallel checkpoints.
    """
    if not runs or page <= 0:
        return None
    shift = (runs[0][1] - runs[0][0]) % page
    at = 0
    maps: list[tuple[int, int, int, int]] = []
    copies: list[tuple[int, int, int, int]] = []
    for k, (dst, src, length) in enumerate(runs):
        if dst != at or length <= 0 or (src - dst) % page != shift:
            return None
        at += length
        lo, hi = shift + dst, shift + dst + length  # where the run lies in the range
        first = -(-lo // page) * page  # whole pages inside [lo, hi)
        last = hi // page * page
        if last <= first:  # inside one or two pages: copy it all
            copies.append((k, lo, src, length))
            continue
        if lo < first:
            copies.append((k, lo, src, first - lo))
        maps.append((k, first, src + (first - lo), last - first))
        if last < hi:
            copies.append((k, last, src + (last - lo), hi - last))
    size = -(-(shift + at) // page) * page
    return Stitch(shift=shift, size=size, maps=tuple(maps), copies=tuple(copies))
