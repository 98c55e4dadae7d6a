"""Give back the private pages of a view the caller has dropped.

A view that ``lazy_load`` yields is a window of the file's copy-on-write mapping (one mapping per
file, for the whole load). Writing into it (``t.mul_(0.5)``, a quantizer working in place) makes
private copies of the pages it touches, and those belonged to the mapping, not to the view: they
stayed until the load ended, so a stream that rescaled every tensor in place grew to the size of
the checkpoint (401 MiB for 20 tensors of 20 MiB, holding one at a time). Each view's window is
now watched, and when the last tensor on it is freed, its pages that no other live view touches
are dropped (``MADV_DONTNEED``): a later read of them reads the file again. Pages shared with a
live view (at the seams between neighbours) are kept, so no write a live tensor can see is lost.
No two views cover the same bytes: a key over bytes a view covered is copied with ``pread``
instead (:mod:`lazyckpt.claims`), so a write into one key never shows in another.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterable

from lazyckpt import forks

__all__ = ["STREAM_DEFER", "PrivatePages", "private_pages", "sweep"]

_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


def _load_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    # Linux only: elsewhere MADV_DONTNEED may keep the private pages (macOS) or mean nothing.
    if not sys.platform.startswith("linux") or _MADV_DONTNEED is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def private_pages(
    start: int, stop: int, others: Iterable[tuple[int, int]], page: int
) -> list[tuple[int, int]]:
    """The pages that hold a byte of ``[start, stop)`` and none of the ranges ``others``, as
    ``[lo, hi)`` byte ranges in order: what may be dropped when a view of ``[start, stop)``
    goes while views of ``others`` live on. The pages at its ends go too when no live view
    touches them (pages it shares with a neighbour that went)."""
    if stop <= start:
        return []
    lo, hi = start // page * page, -(-stop // page) * page
    free = [(lo, hi)]
    for s, e in others:
        if e <= s:
            continue
        cut_lo, cut_hi = s // page * page, -(-e // page) * page
        kept = []
        for a, b in free:
            if cut_hi <= a or b <= cut_lo:
                kept.append((a, b))
                continue
            if a < cut_lo:
                kept.append((a, cut_lo))
            if cut_hi < b:
                kept.append((cut_hi, b))
        free = kept
    return free


STREAM_DEFER = 16 << 20
"""Bytes of views that went which ``lazy_load`` gathers before checking them for writes (see
:class:`PrivatePages`) when a view is made. The stream also checks them all before each batch
of views it makes ahead (:meth:`PrivatePages.settle`): a consumer that writes each view in place
holds the written pages of at most one batch (``lazyckpt.loader._AHEAD_BYTES``, or one tensor
past it)."""

_pagemap: list[int] = []
"""``/proc/self/pagemap`` opened once per process (an entry of 8 bytes per page of the address
space). A forked child inherits the descriptor, which still reads its parent's map: it is
closed there at the fork (:func:`_after_fork_in_child`), not looked up by pid, as ``getpid``
is a system call per view."""
_PAGEMAP_LOCK = threading.Lock()
_ANON = 1 << 63 | 1 << 61
"""Pagemap bits: present, and file page (clear for a private copy written into)."""


def _private_copy(entry: int) -> bool:
    """Whether a page map entry is a present page that is not a file page: a private copy."""
    return entry & _ANON == 1 << 63


_ONE_READ_PAGES = 512
"""Views that went whose probe pages lie within this many pages are checked with one read of
the page map (4 KiB of it), not one each: a stream of small keys checks a batch of them."""


def _written_many(addresses: list[int]) -> list[bool]:
    """:func:`_written` for each of ``addresses``, with one read of the page map where they
    lie close together (a ``pread`` each cost a stream of small keys ~1.5 us a key)."""
    if len(addresses) < 2:
        return [_written(at) for at in addresses]
    page = mmap.PAGESIZE
    first, last = min(addresses) // page, max(addresses) // page
    if last - first >= _ONE_READ_PAGES:
        return [_written(at) for at in addresses]
    try:
        fd = _pagemap_fd()
        entries = os.pread(fd, (last - first + 1) * 8, first * 8)
    except (OSError, ValueError):
        return [True] * len(addresses)
    if len(entries) != (last - first + 1) * 8:
        return [True] * len(addresses)
    out = []
    for at in addresses:
        k = (at // page - first) * 8
        out.append(_private_copy(int.from_bytes(entries[k : k + 8], "little")))
    return out


def _pagemap_fd() -> int:
    """The page map's descriptor, opened on first use (raises ``OSError`` where it cannot be)."""
    if not _pagemap:
        with _PAGEMAP_LOCK:  # views of two files may go on two threads at once
            if not _pagemap:
                _pagemap.append(os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC))
    return _pagemap[0]


def _written(at: int) -> bool:
    """Whether the page at address ``at`` (one the view holds, in the middle of it) is a private
    copy: written into through the view (in-place ops write every page; a view written only in
    part keeps its pages until the load ends). One 8-byte read of the page map instead of
    dropping pages that were only read, which costs as much as unmapping them (68 ms for 2 GB
    of views here). Where the page map cannot be read, the answer is yes."""
    try:
        entry = int.from_bytes(os.pread(_pagemap_fd(), 8, at // mmap.PAGESIZE * 8), "little")
    except (OSError, ValueError):
        return True
    return _private_copy(entry)


class PrivatePages:
    """The live views of one mapping (its ``lease``, :func:`lazyckpt.unmap.lease`); drops a
    view's pages when it goes.

    Holds the lease, so the mapping stays while a finalizer of a view may still run: a
    memoryview lets go of its buffer *before* its finalizers are called, and without this the
    last view could hand the mapping to the unmapping thread, and the address to the next
    mapping, while its pages were being dropped.

    While a stream runs (``defer``), the views that went are checked for writes in batches: when
    the stream is about to make its next batch of views or to build a key it copies
    (:meth:`settle`), when a view is made
    once ``defer`` bytes of them have gone, before a new view is made over their pages, and when
    the stream ends (:meth:`flush`). Each check is a read of the page map, and one between the
    consumer's kernels cost 4-7 us here against ~1.5 back to back; views that went whose pages
    lie close together are checked with one read (:func:`_written_many`). Meanwhile a view that goes
    runs no Python: its weak reference's callback is a deque's ``append``, read when views are
    next made or checked (the consumer's ``del`` cost 7 us a view in a fresh process with a
    Python callback). Written pages then outlive their view by at most one batch of the stream,
    or until the end of the stream."""

    def __init__(
        self, lease: ctypes.Array[ctypes.c_char], defer: int = 0, owner: object | None = None
    ) -> None:
        self._lease = lease
        self._owner = None if owner is None else weakref.ref(owner)
        """What calls :meth:`flush` when it closes (the reader's open file): if it went without
        (a Ctrl-C inside its close), :func:`sweep` flushes instead."""
        self._flushed = False
        self.address = ctypes.addressof(lease)
        self._live: dict[int, tuple[int, int, int, weakref.ref[memoryview]]] = {}
        self._died: collections.deque[weakref.ref[memoryview]] = collections.deque()
        """Weak references of views that went while ``defer`` was set, not yet read."""
        self._died_append = self._died.append
        """Their callback (one bound method for all of them)."""
        self._gone: list[tuple[int, int, int]] = []
        """Views that went and were not checked yet: ``(start, stop, probe)``."""
        self._gone_bytes = 0
        self._gone_span = (0, 0)
        """Bytes from the first page of those views to the end of the last (0, 0: none)."""
        self.defer = defer
        """Bytes of views that went to gather before they are checked (0: each at once)."""
        self.written = False
        """Whether a view that went was found written into (the consumer writes in place)."""
        # Reentrant: a callback may run (garbage collection) while this thread is inside.
        self._lock = threading.RLock()
        forks.renew_lock_in_child(self, threading.RLock)

    def watch(self, window: memoryview, start: int, stop: int, probe: int) -> None:
        """Track ``window`` (bytes ``[start, stop)`` of the mapping; ``probe``, a byte of its
        middle that the view holds, not a gap between its rows): the tensors made from it keep
        it alive, and its pages are dropped when it goes."""
        if _madvise is None:
            return
        with self._lock:
            if self.defer:
                ref = weakref.ref(window, self._died_append)
                if self._died:
                    self._collect()
            else:
                ref = weakref.ref(window, self._release)  # cheaper than weakref.finalize
            lo, hi = self._gone_span
            if lo < stop and start < hi:
                # Views that went over its pages first: their written pages shared with this
                # view are given back now, not kept while it lives (its own bytes there are
                # the file's either way: no two views cover the same bytes).
                self._flush(start, stop)
            self._live[id(ref)] = (start, stop, probe, ref)
            _ACTIVE.add(self)  # reachable while a view lives, though the reader has let go

    def settle(self) -> None:
        """Count the views that went meanwhile as gone and check every view that went, whatever
        ``defer`` says: a stream that makes views in batches does it before each batch, so the
        written pages of the last batch are given back before the next one is made."""
        if self._died or self._gone:
            with self._lock:
                self._collect()
                if self._gone:
                    self._flush()

    def _collect(self) -> None:
        """Count the views that went meanwhile (``_died``) as gone; check them once ``defer``
        bytes of views have gone."""
        died = self._died
        while died:
            entry = self._live.pop(id(died.popleft()), None)
            if entry is not None:
                self._went(*entry[:3])
        if not self._live:
            _ACTIVE.discard(self)
        if self._gone_bytes >= self.defer:
            self._flush()

    def _went(self, start: int, stop: int, probe: int) -> None:
        self._gone.append((start, stop, probe))
        self._gone_bytes += stop - start
        page = mmap.PAGESIZE
        lo, hi = start // page * page, -(-stop // page) * page
        span_lo, span_hi = self._gone_span
        if span_hi:
            lo, hi = min(lo, span_lo), max(hi, span_hi)
        self._gone_span = (lo, hi)

    def _release(self, ref: weakref.ref[memoryview]) -> None:
        # All under the lock: a view registered meanwhile (on another thread, where the
        # collector freed this one) could be written into before the pages are dropped.
        with self._lock:
            entry = self._live.pop(id(ref), None)
            if self._died:  # views of the stream that went after it ended: read by nobody now
                self._died.clear()
            if not self._live:
                _ACTIVE.discard(self)
            if entry is not None:
                self._went(*entry[:3])
            self._flush()

    def flush(self) -> None:
        """Check every view that went, and each one that goes from now on at once (the stream
        ended): the views still alive get a callback of their own."""
        with self._lock:
            self._collect()
            self.defer = 0
            for key, (start, stop, probe, ref) in list(self._live.items()):
                if ref.__callback__ == self._release:
                    continue
                view = ref()
                del self._live[key]
                if view is None:  # going right now: its callback comes too late to be read
                    self._went(start, stop, probe)
                    continue
                own = weakref.ref(view, self._release)
                self._live[id(own)] = (start, stop, probe, own)
                del view
            if not self._live:
                _ACTIVE.discard(self)
            self._flush()
            self._flushed = True

    def orphaned(self) -> bool:
        """Whether its owner went without flushing it: its views that went are read by nobody,
        and it stays in ``_ACTIVE`` (with its mapping) for good."""
        return not self._flushed and self._owner is not None and self._owner() is None

    def _flush(self, start: int = 0, stop: int = -1) -> None:
        """Check the views that went (those that share a page with ``[start, stop)``, if
        given) and drop the pages of those written into."""
        assert _madvise is not None
        gone, kept = self._gone, []
        if stop >= 0:
            page = mmap.PAGESIZE
            lo, hi = start // page, -(-stop // page)
            near = [s // page < hi and lo < -(-e // page) for s, e, _ in gone]
            gone, kept = (
                [v for v, n in zip(gone, near) if n],
                [v for v, n in zip(gone, near) if not n],
            )
        self._gone, self._gone_bytes = kept, sum(e - s for s, e, _ in kept)
        self._gone_span = _span(kept)
        # Nothing written: dropping clean pages costs the caller, frees nothing.
        address = self.address
        marks = _written_many([address + probe for _, _, probe in gone])
        written = [(s, e) for (s, e, _), mark in zip(gone, marks) if mark]
        if not written:
            return
        self.written = True
        others = [(s, e) for s, e, _, _ in self._live.values()]
        for s, e in written:
            for lo, hi in private_pages(s, e, others, mmap.PAGESIZE):
                # The mapping is still there: self holds its lease.
                _madvise(self.address + lo, hi - lo, _MADV_DONTNEED)


def _span(views: list[tuple[int, int, int]]) -> tuple[int, int]:
    """From the first page of ``views`` to the end of the last, in bytes ((0, 0) for none)."""
    if not views:
        return 0, 0
    page = mmap.PAGESIZE
    return min(s for s, _, _ in views) // page * page, -(
        -max(e for _, e, _ in views) // page
    ) * page


_ACTIVE: set[PrivatePages] = set()
"""Every :class:`PrivatePages` with a live view. Without this, once the reader closed, the only
references to one were its own (its views' callbacks): a collection freed it, and with it the
callbacks, and no page was given back from then on."""


def sweep() -> None:
    """Flush every :class:`PrivatePages` whose owner went without flushing it (a Ctrl-C in a
    reader's close): its mapping and descriptor are then let go once its views are. Each load
    sweeps when it starts, so an interrupted load keeps them until the next one."""
    for pages in list(_ACTIVE):  # a copy made at once: other threads' views come and go
        if pages.orphaned():
            pages.flush()


def _after_fork_in_child() -> None:
    # A lock held by another thread of the parent (dropping pages) would stay held here.
    global _PAGEMAP_LOCK
    _PAGEMAP_LOCK = threading.Lock()  # each PrivatePages' own lock: see lazyckpt.forks
    # The parent's page map: this process reads its own.
    for fd in _pagemap:
        with contextlib.suppress(OSError):
            os.close(fd)
    _pagemap.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
