"""Which bytes of a mapped file a load has handed out as views, and which it is copying now.

A view that ``lazy_load`` yields is a window of the file's copy-on-write mapping, and its consumer
may write into it (or have written into it and dropped it while a live neighbour keeps the written
pages): from then on those bytes of the mapping are not the file's. So a key over bytes a view
covered (tied weights in a ``torch.save`` file, a key saved as a slice of another) must not be a
second view of them, nor a copy from the mapping, but is read with ``pread``; and a view must not
be made over bytes that another thread is copying from the mapping at that moment, which the
consumer could write into before the copy ends. :class:`Claims` keeps both, per file.

Bytes are described by a :class:`Footprint`: a range, or, for a box of a row-major matrix (a
tensor-parallel dim-1 shard; ``q``, ``k``, ``v`` saved as ``qkv.split(..., dim=1)``), the same
window of every row. Boxes side by side in the rows of one storage are told apart; anything else
is taken as its whole span, which can only send a view to ``pread``, never miss an overlap.
Pure integers: no file is touched here.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from lazyckpt import forks

__all__ = ["Claims", "Footprint", "footprint", "overlap"]


class Footprint(NamedTuple):
    """Bytes ``start + k * period + [0, width)`` for every ``k`` that falls inside ``[start,
    stop)``, or, where ``period`` is 0, every byte of ``[start, stop)``. A tuple: one is made
    per view of a stream, and a frozen dataclass costs several times as much to make."""

    start: int
    stop: int
    period: int = 0
    width: int = 0


def footprint(
    first: int, sizes: tuple[int, ...], strides: tuple[int, ...], itemsize: int
) -> Footprint:
    """The bytes a strided piece holds (first element at byte ``first``; element strides)."""
    length, period, width = _shape(sizes, strides, itemsize)
    return Footprint(first, first + length, period, width)


@functools.lru_cache(maxsize=1024)
def _shape(sizes: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int, int]:
    """:func:`footprint` from byte 0, as ``(stop, period, width)``: cached, since the layers of
    a model repeat their shapes and boxes."""
    dims = [(n, st) for n, st in zip(sizes, strides) if n != 1]
    if any(n == 0 for n, _ in dims):
        return 0, 0, 0
    run = 1  # elements of the contiguous block at the innermost dims
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    last = sum((n - 1) * st for n, st in dims)  # the block's offset for the last outer index
    stop = (last + run) * itemsize
    if not dims:
        return stop, 0, 0
    # Outer dims that step one after the other in the same period collapse into one.
    count, step = dims.pop()
    while dims and dims[-1][1] == step * count:
        count *= dims.pop()[0]
    if dims or step < run:  # several periods, or rows that overlap: the whole span
        return stop, 0, 0
    return stop, step * itemsize, run * itemsize


def overlap(a: Footprint, b: Footprint) -> bool:
    """Whether ``a`` and ``b`` may share a byte: exact for ranges and for windows of one
    period, else whether their spans meet."""
    if a.stop <= b.start or b.stop <= a.start or a.start == a.stop or b.start == b.stop:
        return False
    if not a.period and not b.period:
        return True
    if a.period and b.period:
        if a.period != b.period:
            return True
        # Two windows on a circle of one period: disjoint iff each ends before the other starts.
        d = (b.start - a.start) % a.period
        return d < a.width or d + b.width > a.period
    if not a.period:
        a, b = b, a  # a has the windows, b is a range
    lo, hi = max(a.start, b.start), min(a.stop, b.stop)
    if hi - lo >= a.period:
        return True
    d = (lo - a.start) % a.period  # where the range starts within a's period
    return d < a.width or d + (hi - lo) > a.period


class Claims:
    """The footprints of the views made of one file's mapping, and of the copies from it under
    way. Safe to share between the prefetch worker and the caller: a check and the record it
    allows are one step.

    A stream makes most views past every view before them, with no copy under way: such a view
    is only noted (its place and strides) and its footprint worked out when something is first
    asked of bytes before the furthest one (a tied key, a copy): the footprint and its record
    cost a fresh process ~5 us a view, 0.4 ms of a 14 ms Hugging Face load."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        forks.renew_lock_in_child(self)
        self._lo: list[int] = []
        self._hi: list[int] = []
        """Views that hold every byte of their span: sorted, disjoint ``[lo, hi)`` ranges,
        merged where they touch (views are mostly made in file order: one range grows)."""
        self._windows: list[Footprint] = []
        """Views that hold a window of each row, sorted by their start."""
        self._window_starts: list[int] = []
        """Their starts, for ``bisect``."""
        self._window_span = 0
        """The longest span among them: a window that starts this far before a footprint, or
        further, ends before it. A check looks only at the windows in between (a stream of
        many small keys made it a scan of all of them per copy: 15,400 keys of a DCP save took
        8.6 million comparisons)."""
        self._windows_stop = 0
        """The furthest byte any of :attr:`_windows` spans."""
        self._noted: list[tuple[int, tuple[int, ...], tuple[int, ...], int]] = []
        """Views only noted, in the order made: ``(first, sizes, strides, itemsize)``."""
        self._stop = 0
        """The furthest byte any view made spans."""
        self._copying: list[Footprint] = []
        """Copies from the mapping under way."""

    def clean(self, fp: Footprint) -> bool:
        """Whether no view made covers a byte of ``fp``: the mapping still holds the file's."""
        with self._lock:
            return self._clean(fp)

    def _clean(self, fp: Footprint) -> bool:
        if fp.start >= self._stop or fp.start == fp.stop:
            return True
        noted = self._noted
        if noted:
            done = 0
            try:  # each dropped once recorded: an exception (an interrupt) loses none
                for piece in noted:
                    self._record(footprint(*piece))
                    done += 1
            finally:
                del noted[:done]
        hi = self._hi
        if hi and fp.start < hi[-1]:  # else every range ends before it
            j = bisect.bisect_right(hi, fp.start)
            lo = self._lo
            while j < len(lo) and lo[j] < fp.stop:
                if overlap(fp, Footprint(lo[j], hi[j])):
                    return False
                j += 1
        if fp.start < self._windows_stop:
            starts, windows = self._window_starts, self._windows
            j = bisect.bisect_left(starts, fp.stop)  # windows from j on start past it
            first = bisect.bisect_right(starts, fp.start - self._window_span)
            return not any(overlap(fp, windows[i]) for i in range(first, j))
        return True

    def claim(
        self,
        first: int,
        stop: int,
        sizes: tuple[int, ...],
        strides: tuple[int, ...],
        itemsize: int,
    ) -> bool:
        """Record a view of the piece at bytes ``[first, stop)`` (element ``sizes`` and
        ``strides``), if no view made covers a byte of it and no copy under way reads one; else
        False, recording nothing (the caller copies with ``pread``)."""
        with self._lock:
            if first == stop:
                return True
            if first >= self._stop and not self._copying:  # past every view: nothing to check
                self._noted.append((first, sizes, strides, itemsize))
                self._stop = stop
                return True
            fp = footprint(first, sizes, strides, itemsize)
            if not self._clean(fp) or any(overlap(fp, c) for c in self._copying):
                return False
            self._record(fp)
            self._stop = max(self._stop, stop)
            return True

    def _record(self, fp: Footprint) -> None:
        if fp.start == fp.stop:
            return
        if fp.period:
            starts = self._window_starts
            if not starts or fp.start >= starts[-1]:  # made in file order: the usual case
                starts.append(fp.start)
                self._windows.append(fp)
            else:
                j = bisect.bisect_right(starts, fp.start)
                starts.insert(j, fp.start)
                self._windows.insert(j, fp)
            self._window_span = max(self._window_span, fp.stop - fp.start)
            self._windows_stop = max(self._windows_stop, fp.stop)
            return
        lo, hi = self._lo, self._hi
        if hi and fp.start >= hi[-1]:  # past every range: the last grows, or one more
            if hi[-1] == fp.start:
                hi[-1] = fp.stop
            else:
                lo.append(fp.start)
                hi.append(fp.stop)
            return
        j = bisect.bisect_right(hi, fp.start)
        if j and hi[j - 1] == fp.start:  # extends the range before it
            hi[j - 1] = fp.stop
            if j < len(lo) and lo[j] == fp.stop:  # and closes the gap to the next
                hi[j - 1] = hi.pop(j)
                del lo[j]
        elif j < len(lo) and lo[j] == fp.stop:
            lo[j] = fp.start
        else:
            lo.insert(j, fp.start)
            hi.insert(j, fp.stop)

    @contextlib.contextmanager
    def copying(self, fps: Sequence[Footprint]) -> Iterator[bool]:
        """Whether ``fps`` may be copied from the mapping (no view made covers a byte of them);
        while the ``with`` block runs, no view is made over them."""
        with self._lock:
            ok = all(self._clean(fp) for fp in fps)
            if ok:
                self._copying.extend(fps)
        try:
            yield ok
        finally:
            if ok:
                with self._lock:
                    for fp in fps:
                        self._copying.remove(fp)
