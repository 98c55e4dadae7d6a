"""Keep the kernel's read-ahead to the bytes a load asks for.

A read that misses the page cache makes the kernel read ahead of it, by up to the device's
read-ahead window, and a fault on a mapped page that is not cached reads the window around it.
Devices set that window anywhere from 128 KiB to megabytes (8 MiB on the VM this was measured
on, a virtio disk), and a rank that reads 1/8 of each tensor then read 1.15-4x the bytes it
needed from disk, cold: FSDP ``fsdp8-r0`` from Meta's MP-8 files 1,023 MB for its 253 MB,
from Hugging Face safetensors through ``lazy_load`` 822 MB. With this module's advice those
loads read 253-255 MB, and were no slower cold (see benchmarks/README.md, "Cold page cache");
a warm load pays one to three ``cachestat`` calls per piece read through a mapping, or one for
a batch of views within 1 MiB (:func:`all_cached`).

* Every file lazyckpt opens to read is advised ``POSIX_FADV_RANDOM`` (:func:`no_readahead`):
  a ``pread`` then reads exactly its pages, and leaves no read-ahead mark behind it (a later
  read that reaches a marked page starts reading ahead whatever its own advice).
* Before a piece is read through a mapping, or by many short ``pread``s, its pages are asked
  for (``POSIX_FADV_WILLNEED``) when they are not cached (:func:`read_ahead`): a fault on a
  page being read waits for it instead of reading around it, and the ``pread``s do not each
  wait for the disk in turn.
* Whether pages are cached is asked with ``cachestat`` (Linux 6.5+), which reads nothing.
  Elsewhere a 1-byte ``RWF_NOWAIT`` read is the probe; it starts reading a page that is not
  cached, and on a fast device (a virtio disk served from the host's cache) that read can end
  before the probe returns, which then says "cached": about 1 probe in 2,000 here, and a
  load whose probes all came back so read most of a file through read-around.

Advice is advice: pages the kernel reclaims before they are touched (memory pressure, or
proactive reclaim such as DAMON's ``pageout``) are read on the fault with the window around
them, as without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import sys
from collections.abc import Callable, Sequence

from lazyckpt.plan import middle_run, page_ranges

__all__ = ["PAGE", "all_cached", "no_readahead", "read_ahead"]

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_PROBES = [bytearray(1)]
_ADVISE = hasattr(os, "posix_fadvise")
_CALL_BYTES = 128 << 10
"""Bytes per ``POSIX_FADV_WILLNEED``: the kernel reads at most the larger of the read-ahead
window and the device's I/O size per call, 128 KiB where both are at their smallest."""

_CACHESTAT = 451
"""``cachestat``'s number: one for every architecture but alpha (new calls share numbers)."""
_CACHESTAT_MACHINES = {"x86_64", "aarch64", "ppc64le", "s390x", "riscv64", "loongarch64"}
_RANGE_PAGES = 64
"""A run of at most this many pages is counted in one ``cachestat`` call; a longer one is
checked at its first, middle and last page (the walk costs with the pages it covers)."""
_Stat = ctypes.c_uint64 * 7
"""``struct cachestat_range`` (offset, length) then ``struct cachestat`` (``nr_cache`` first):
one buffer made per call, so that threads reading ahead at once do not share it."""


def _load_cachestat() -> Callable[..., int] | None:
    """``syscall`` from the C library when ``cachestat`` may exist here, else None (a call
    that finds no such system call, a kernel before 6.5, turns it off for the process)."""
    if not sys.platform.startswith("linux") or platform.machine() not in _CACHESTAT_MACHINES:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_cachestat()


def _all_cached(fd: int, start: int, stop: int) -> bool | None:
    """Whether every page of bytes ``[start, stop)`` of ``fd`` is in the page cache (or being
    read into it), asked without reading anything; None when ``cachestat`` cannot be asked.

    A refusal holds for this call only: recent kernels (6.18 here) refuse (``EPERM``) a file
    the caller may neither write nor owns, a shared model store's say, and a sandbox may refuse
    every call; the probe answers for those (a refused call costs ~1 us)."""
    global _syscall
    call = _syscall  # once: another thread may turn it off meanwhile
    if call is None:
        return None
    first = start - start % PAGE
    length = stop - first
    buf = _Stat(first, length)
    if call(_CACHESTAT, fd, buf, ctypes.byref(buf, 16), 0) != 0:
        if ctypes.get_errno() == errno.ENOSYS:
            _syscall = None
        return None
    return buf[2] * PAGE >= length


_BATCH_BYTES = 1 << 20
"""Largest range :func:`all_cached` asks about in one call: ``cachestat`` walks the page cache
over it: 11 us for 1 MiB here, 0.1 ms for 16 MiB, several times the probes of the
views in it."""


def all_cached(fd: int, start: int, stop: int) -> bool:
    """Whether every page of bytes ``[start, stop)`` of ``fd`` is known to be cached: one
    ``cachestat`` call, for a range of at most :data:`_BATCH_BYTES` (False: some are not, or
    it cannot be told, or the range is longer)."""
    return stop - start <= _BATCH_BYTES and _all_cached(fd, start, stop) is True


def no_readahead(fd: int) -> None:
    """Make reads of ``fd`` read exactly their own pages from disk. ``POSIX_FADV_RANDOM`` holds
    for this open file only: no other reader of the file is affected, a cached read is
    unchanged."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        with contextlib.suppress(OSError):  # a filesystem without read-ahead: nothing to turn off
            advise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def read_ahead(
    fd: int,
    file_size: int,
    first: int,
    sizes: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    *,
    middle: tuple[int, int] | None = None,
) -> None:
    """Ask the kernel to read the pages of a strided piece (first element at byte ``first``)
    that is about to be read through a mapping, or by ``pread``s of its runs, unless they are
    cached: the pages of its middle run (``middle``, when the caller has it from
    :func:`lazyckpt.plan.middle_run`) are asked about, all of them when the run spans at most
    :data:`_RANGE_PAGES` pages, else those of its first, middle and last byte, pages the piece holds
    (the middle of its span may be a gap another rank read, and a run's end pages may be shared
    with a neighbour that was read: either may be cached while the rest is not). The pages are
    those of :func:`lazyckpt.plan.page_ranges`: the span, or each run's pages where the span is
    mostly gaps.

    They are asked about with one ``cachestat`` call over the run's pages, or one for each of
    the three pages. Without ``cachestat`` the first, middle and last pages are probed with a
    1-byte ``preadv`` that may not wait for the device (``RWF_NOWAIT``): it fails where the page
    is not cached (and starts reading that one page). Where neither can be asked, nothing is
    advised: the kernel's own read-ahead is left alone. A warm load pays the probes for every
    piece (``lazy_load`` makes them back to back for the keys ahead, see ``Reader.find_view``)."""
    start, stop = middle if middle is not None else middle_run(first, sizes, strides, itemsize)
    if stop <= start or not _ADVISE:  # empty, or nothing to advise
        return
    last = stop - 1
    pages = last // PAGE - start // PAGE
    cached = (
        _all_cached(fd, start, stop)
        if pages < _RANGE_PAGES
        else _all_cached(fd, start, start + 1)
        and _all_cached(fd, (start + stop) // 2, (start + stop) // 2 + 1)
        and _all_cached(fd, last, stop)
    )
    if cached is None:
        cached = _probe(fd, start, stop)
        if cached is None:
            return
    if not cached:
        _advise(fd, file_size, first, sizes, strides, itemsize)


def _probe(fd: int, start: int, stop: int) -> bool | None:
    """Whether the first, middle and last pages of bytes ``[start, stop)`` are cached, by
    1-byte ``RWF_NOWAIT`` reads; None where such reads cannot be asked."""
    if not _NOWAIT:
        return None
    last = stop - 1
    pages = last // PAGE - start // PAGE
    try:  # each page once: a run within a page (a norm's weight) is one probe
        for at in (
            (start,)
            if pages == 0
            else (start, last)
            if pages == 1
            else (start, (start + stop) // 2, last)
        ):
            os.preadv(fd, _PROBES, at, _NOWAIT)
        return True
    except BlockingIOError:
        return False
    except OSError:  # RWF_NOWAIT not supported for this file: leave the kernel be
        return None


def _advise(
    fd: int,
    file_size: int,
    first: int,
    sizes: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
) -> None:
    """``POSIX_FADV_WILLNEED`` for the pages of the piece (see :func:`read_ahead`)."""
    for start, stop in page_ranges(first, sizes, strides, itemsize, PAGE):
        stop = min(stop, file_size)
        for at in range(start, stop, _CALL_BYTES):
            try:
                os.posix_fadvise(fd, at, min(_CALL_BYTES, stop - at), os.POSIX_FADV_WILLNEED)
            except OSError:  # advice is advice: the faults read the pages anyway
                return
