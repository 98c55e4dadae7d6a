"""Build one target tensor from its plan: a zero-copy view, one CPU buffer, or a CUDA tensor
filled through a small pool of pinned staging buffers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from lazyckpt import alloc
from lazyckpt.errors import CorruptModelCheckpointError
from lazyckpt.index import Chunk, replica_differs
from lazyckpt.load_plan import TensorPlan
from lazyckpt.options import castable
from lazyckpt.plan import Box, Piece, plan_pieces
from lazyckpt.read import Reader
from lazyckpt.threads import one_intraop_thread

__all__ = [
    "PinnedPool",
    "build_tensor",
    "fill",
    "fill_all",
    "output_dtype",
    "same_bits",
]


def output_dtype(src: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """Only floating-point tensors are cast: integer ids and bool masks keep their dtype (and
    so do packed float4 tensors, which torch cannot convert)."""
    if requested is None or not (castable(src) and castable(requested)):
        return src
    return requested


def build_tensor(
    plan: TensorPlan,
    reader: Reader,
    out_dtype: torch.dtype,
    *,
    device: torch.device | None = None,
    pool: PinnedPool | None = None,
    contiguous: bool = False,
    buffers: alloc.BufferPool | None = None,
    try_view: bool = True,
) -> tuple[torch.Tensor, bool]:
    """The target tensor of ``plan`` and whether it is a view of mapped files.

    A box inside one chunk, with no cast, is a view (strided unless ``contiguous``); a box that
    several chunks fill with contiguous pieces may be a stitched view of them
    (:mod:`lazyckpt.stitch`); anything else is copied into one new buffer (from ``buffers``
    when given). ``try_view=False``: a copy, where the caller already found that no view fits."""
    on_cpu = device is None or device.type == "cpu"
    if try_view and on_cpu and out_dtype == plan.entry.dtype:
        view = None
        key = plan.entry.checkpoint_key
        if plan.may_be_view:
            piece = plan.pieces[0]
            view = reader.view(
                plan.chunks[piece.chunk], plan.entry.dtype, piece, key, strided=not contiguous
            )
        elif plan.may_stitch:
            view = reader.stitch(plan.chunks, plan.entry.dtype, plan.pieces, plan.box.sizes, key)
        if view is not None:
            return view, True
    if on_cpu:
        make = alloc.empty if buffers is None else buffers.empty
        dst = make(plan.box.sizes, out_dtype)
    else:
        dst = torch.empty(plan.box.sizes, dtype=out_dtype, device=device)
    fill(plan, reader, dst, pool=pool)
    return dst, False


def fill(
    plan: TensorPlan, reader: Reader, dst: torch.Tensor, *, pool: PinnedPool | None = None
) -> None:
    """Write the target box of ``plan`` into ``dst`` (its shape; any dtype, strides, device).

    This is how ``load_into`` fills a parameter in place: no second buffer on the CPU, and a
    CUDA destination is filled through ``pool``'s pinned buffers.
    """
    key = plan.entry.checkpoint_key
    src_dtype = plan.entry.dtype
    _check_box(plan, dst)
    if plan.verify:
        dst.copy_(_verified(plan, reader))
    elif dst.device.type == "cuda":
        if pool is None:
            raise ValueError("a CUDA destination needs a PinnedPool")
        _fill_cuda(plan, reader, dst, pool, key)
    else:
        _fill(reader, plan.chunks, src_dtype, plan.pieces, dst, key)


_BATCH_BYTES = 256 << 20
""":func:`fill_all` reads this much between progress updates."""


def fill_all(
    plans: Sequence[TensorPlan],
    destinations: Mapping[str, torch.Tensor],
    reader: Reader,
    *,
    pool: PinnedPool | None = None,
    done: Callable[[TensorPlan], None] | None = None,
) -> None:
    """:func:`fill` for every plan (``load_into``), with what can be read straight into place
    read by ``preadv`` on two threads (:meth:`Reader.direct_reads`), in batches of about
    ``_BATCH_BYTES``; ``done(plan)`` is called as each batch completes.

    Pieces of many short strided rows, replicas to compare and CUDA destinations go through
    :func:`fill`'s copies; the strided pieces are copied while the reads still run where they
    can be (see :func:`_fill_batch`)."""
    batch: list[TensorPlan] = []
    size = 0
    for plan in plans:
        batch.append(plan)
        size += plan.nbytes
        if size >= _BATCH_BYTES:
            _fill_batch(batch, destinations, reader, pool, done)
            batch, size = [], 0
    if batch:
        _fill_batch(batch, destinations, reader, pool, done)


def _fill_batch(
    plans: Sequence[TensorPlan],
    destinations: Mapping[str, torch.Tensor],
    reader: Reader,
    pool: PinnedPool | None,
    done: Callable[[TensorPlan], None] | None,
) -> None:
    # Direct reads start on a helper thread as soon as the first is worked out, while this
    # thread works out the rest (for DCP that means finding each chunk's zip) and then checks
    # replicas (small preads and byte compares). Then this thread copies what is not read
    # directly (short strided rows, from the mappings) on itself alone while the helper goes on
    # reading: split over torch's OpenMP threads those copies would contend with the helper for
    # the cores. Once the queue runs dry, both threads finish the reads, and what is left to copy
    # is copied on all of torch's threads.
    verified: list[TensorPlan] = []
    copies: list[tuple[TensorPlan, list[Piece]]] = []
    elsewhere: list[TensorPlan] = []
    with reader.read_queue() as queue:
        for plan in plans:
            dst = destinations[plan.key]
            _check_box(plan, dst)
            if dst.device.type != "cpu":
                elsewhere.append(plan)
                continue
            if plan.verify:
                verified.append(plan)
                continue
            key = plan.entry.checkpoint_key
            copied: list[Piece] = []
            for piece in plan.pieces:
                chunk = plan.chunks[piece.chunk]
                direct = reader.direct_reads(chunk, plan.entry.dtype, piece, dst, key)
                if direct is None:
                    copied.append(piece)
                else:
                    queue.put(direct)
            if copied:
                copies.append((plan, copied))
        for plan in verified:
            fill(plan, reader, destinations[plan.key], pool=pool)
        done_copies = 0
        if copies and queue.reading():
            with one_intraop_thread() as alone:
                while alone and done_copies < len(copies) and queue.reading():
                    _copy(copies[done_copies], destinations, reader)
                    done_copies += 1
    for item in copies[done_copies:]:
        _copy(item, destinations, reader)
    for plan in elsewhere:
        fill(plan, reader, destinations[plan.key], pool=pool)
    if done is not None:
        for plan in plans:
            done(plan)


def _copy(
    item: tuple[TensorPlan, list[Piece]], destinations: Mapping[str, torch.Tensor], reader: Reader
) -> None:
    plan, pieces = item
    dst = destinations[plan.key]
    _fill(reader, plan.chunks, plan.entry.dtype, pieces, dst, plan.entry.checkpoint_key)


def _check_box(plan: TensorPlan, dst: torch.Tensor) -> None:
    if tuple(dst.shape) != plan.box.sizes:
        raise ValueError(
            f"key {plan.entry.checkpoint_key!r}: destination shape {tuple(dst.shape)} is not the "
            f"box {plan.box.sizes}"
        )


def _whole(plan: TensorPlan, copy: int, pieces: Sequence[Piece]) -> tuple[Chunk, Piece] | None:
    """The chunk and piece when ``copy`` gives the whole target box as one piece."""
    if len(pieces) != 1 or pieces[0].sizes != plan.box.sizes:
        return None
    return plan.entry.copies[copy][pieces[0].chunk], pieces[0]


def _replica(plan: TensorPlan, reader: Reader, copy: int, pieces: Sequence[Piece]) -> torch.Tensor:
    """The target box as ``copy`` holds it: a view of the mapped file when the copy gives the
    box as one piece, else a new tensor. Never a view in a stream (``reader.consumer_views``):
    it would claim bytes that no consumer gets, and a later key over them would be copied
    (see :mod:`lazyckpt.claims`); a copy is checked against the views made instead."""
    dtype, key = plan.entry.dtype, plan.entry.checkpoint_key
    whole = None if reader.consumer_views else _whole(plan, copy, pieces)
    if whole is not None:
        chunk, piece = whole
        view = reader.view(chunk, dtype, piece, key)
        if view is not None:
            return view
    out = torch.empty(plan.box.sizes, dtype=dtype, device="cpu")
    _fill(reader, plan.entry.copies[copy], dtype, pieces, out, key)
    return out


def _verified(plan: TensorPlan, reader: Reader) -> torch.Tensor:
    """The box as the chosen copy of a replicated key holds it, after comparing every other
    copy with it.

    Replicas are small (bounded by ``verify_replicas_max_bytes``): compared in the source
    dtype, as bytes read in one loop of ``pread``s where each copy gives the box as one small
    range of its file (norms: nothing mapped, no tensor per copy; an MP-8 set's 17 norms are
    read from its 8 files while ``load_into``'s helper thread reads the rest), else as views of
    the mapped files or copies."""
    copies = ((plan.copy, plan.pieces), *plan.verify)
    wholes = [_whole(plan, copy, pieces) for copy, pieces in copies]
    parts = [whole for whole in wholes if whole is not None]
    raws = None
    if len(parts) == len(wholes):
        raws = reader.raws(parts, plan.entry.dtype, plan.entry.checkpoint_key)
    if raws is not None:
        first_raw = raws[0]
        for (copy, pieces), raw in zip(plan.verify, raws[1:]):
            _verified_one(plan, reader, copy, pieces, raw == first_raw)
        return torch.frombuffer(first_raw, dtype=plan.entry.dtype).view(plan.box.sizes)
    first = _replica(plan, reader, plan.copy, plan.pieces)
    for copy, pieces in plan.verify:
        _verified_one(
            plan, reader, copy, pieces, same_bits(first, _replica(plan, reader, copy, pieces))
        )
    return first


def _verified_one(
    plan: TensorPlan, reader: Reader, copy: int, pieces: Sequence[Piece], same: bool
) -> None:
    """Count ``copy`` as verified (it was counted as read when read), or say it differs."""
    if reader.stats is not None:
        reader.stats.add_verified(plan.nbytes)
    if not same:
        a = plan.chunks[plan.pieces[0].chunk].path if plan.pieces else None
        b = plan.entry.copies[copy][pieces[0].chunk].path if pieces else None
        raise CorruptModelCheckpointError(
            b or a or "<memory>",
            replica_differs(plan.entry, a, b),
            key=plan.entry.checkpoint_key,
        )


def _fill(
    reader: Reader,
    chunks: Sequence[object],
    src_dtype: torch.dtype,
    pieces: Sequence[Piece],
    dst: torch.Tensor,
    key: str,
) -> None:
    if len(pieces) > 1 and reader.concat(chunks, src_dtype, pieces, dst, key):  # type: ignore[arg-type]
        return
    for piece in pieces:
        reader.copy(chunks[piece.chunk], src_dtype, piece, dst, key)  # type: ignore[arg-type]


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and -0.0 included, unlike ``torch.equal`` on floats),
    for tensors of any strides, without copying either side."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = _BITS.get(a.element_size())
    if as_int is None:  # 16-byte complex: compare the raw bytes of dense copies
        return torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    return torch.equal(a.view(as_int), b.view(as_int))


class PinnedPool:
    """A few pinned host buffers reused for host-to-GPU copies.

    Each buffer remembers the CUDA event recorded after the last copy out of it; it is reused
    only once that event has completed, so a non-blocking copy never reads a buffer that is
    being refilled. A buffer taken is another thread's to take only once released: the
    stream's prefetch thread and its consumer (which builds small keys itself) fill buffers of
    one pool at once.
    """

    def __init__(self, *, buffers: int = 2, nbytes: int = 32 << 20) -> None:
        self.nbytes = nbytes
        self._buffers = [
            torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
            for _ in range(buffers)
        ]
        self._events: list[torch.cuda.Event | None] = [None] * buffers
        self._taken = [False] * buffers
        self._lock = threading.Lock()
        self._next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A buffer slot of at least ``nbytes``, waiting for its previous copy to finish (slot
        -1: a buffer of its own, where ``nbytes`` is larger or every slot is taken)."""
        with self._lock:
            slot = -1
            if nbytes <= self.nbytes:
                for _ in self._buffers:
                    at = self._next
                    self._next = (at + 1) % len(self._buffers)
                    if not self._taken[at]:
                        slot = at
                        self._taken[at] = True
                        break
            event = self._events[slot] if slot >= 0 else None
        if slot < 0:
            return -1, torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
        if event is not None:
            event.synchronize()
        return slot, self._buffers[slot][:nbytes]

    def release(self, slot: int, buffer: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Mark the copy out of ``slot`` as issued on ``stream`` (the destination device's
        current stream, which the copy went on), and the slot free to take again."""
        event = torch.cuda.Event()
        event.record(stream)
        if slot >= 0:
            with self._lock:
                self._events[slot] = event
                self._taken[slot] = False
        else:
            event.synchronize()  # a one-off buffer: keep it alive until its copy is done
            del buffer

    def synchronize(self) -> None:
        for event in self._events:
            if event is not None:
                event.synchronize()


def _fill_cuda(
    plan: TensorPlan, reader: Reader, dst: torch.Tensor, pool: PinnedPool, key: str
) -> None:
    """Fill a CUDA tensor slab by slab (along dim 0) through pinned buffers."""
    box, src_dtype = plan.box, plan.entry.dtype
    if box.numel == 0:
        return
    chunk_boxes = [Box(c.offsets, c.sizes) for c in plan.chunks]
    if not box.sizes:
        slabs: list[tuple[Box, slice | None]] = [(box, None)]
    else:
        row_bytes = max(1, box.numel // box.sizes[0] * src_dtype.itemsize)
        rows = max(1, pool.nbytes // row_bytes)
        slabs = []
        for r0 in range(0, box.sizes[0], rows):
            r1 = min(box.sizes[0], r0 + rows)
            sub = Box((box.offsets[0] + r0, *box.offsets[1:]), (r1 - r0, *box.sizes[1:]))
            slabs.append((sub, slice(r0, r1)))
    stream = torch.cuda.current_stream(dst.device)  # what copy_ to dst issues on
    for sub, rows_slice in slabs:
        slot, raw = pool.take(sub.numel * src_dtype.itemsize)
        try:
            staging = raw.view(src_dtype).view(sub.sizes)
            _fill(reader, plan.chunks, src_dtype, plan_pieces(sub, chunk_boxes), staging, key)
            target = dst if rows_slice is None else dst[rows_slice]
            if dst.dtype == src_dtype:
                target.copy_(staging, non_blocking=True)
            else:
                target.copy_(staging.to(dst.device, non_blocking=True))
        finally:
            pool.release(slot, raw, stream)
