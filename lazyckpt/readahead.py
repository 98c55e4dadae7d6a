"""Keep the kernel's read-ahead to the bytes a load asks for.

A read that misses the page cache makes the kernel read ahead of it, by up to the device's
read-ahead window, and a fault on a mapped page that is not cached reads the window around it.
Devices set that window anywhere from 128 KiB to megabytes (8 MiB on the VM this was measured
on, a virtio disk), and a rank that reads 1/8 of each tensor then read 1.15-4x the bytes it
needed from disk, cold: FSDP ``fsdp8-r0`` from Meta's MP-8 files 1,023 MB for its 253 MB,
from Hugging Face safetensors through ``lazy_load`` 822 MB. With this module's advice those
loads read 253-255 MB, and were no slower cold (see benchmarks/README.md, "Cold page cache");
a warm load pays up to three probes (one per page) per piece read through a mapping.

* Every file lazyckpt opens to read is advised ``POSIX_FADV_RANDOM`` (:func:`no_readahead`):
  a ``pread`` then reads exactly its pages, and leaves no read-ahead mark behind it (a later
  read that reaches a marked page starts reading ahead whatever its own advice).
* Before a piece is read through a mapping, or by many short ``pread``s, its pages are asked
  for (``POSIX_FADV_WILLNEED``) when they are not cached (:func:`read_ahead`): a fault on a
  page being read waits for it instead of reading around it, and the ``pread``s do not each
  wait for the disk in turn.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

from lazyckpt.plan import middle_run, page_ranges

__all__ = ["PAGE", "no_readahead", "read_ahead"]

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_PROBES = [bytearray(1)]
_ADVISE = hasattr(os, "posix_fadvise")
_CALL_BYTES = 128 << 10
"""Bytes per ``POSIX_FADV_WILLNEED``: the kernel reads at most the larger of the read-ahead
window and the device's I/O size per call, 128 KiB where both are at their smallest."""


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
    cached: the first, middle and last byte of its middle run (``middle``, when the caller has
    it from :func:`lazyckpt.plan.middle_run`) are probed, each page once, pages the piece holds
    (the middle of its span may be a gap another rank read, and a run's end pages may be shared
    with a neighbour that was read: either may be cached while the rest is not). The pages are
    those of :func:`lazyckpt.plan.page_ranges`: the span, or each run's pages where the span is
    mostly gaps.

    A probe is a 1-byte ``preadv`` that may not wait for the device (``RWF_NOWAIT``): it fails
    where the page is not cached (and starts reading that one page). Where that cannot be asked,
    nothing is advised: the kernel's own read-ahead is left alone. The probes are inline, not a
    function called three times: a warm load pays them for every piece (``lazy_load`` makes
    them back to back for the keys ahead, see ``Reader.find_view``)."""
    start, stop = middle if middle is not None else middle_run(first, sizes, strides, itemsize)
    if stop <= start or not _ADVISE or not _NOWAIT:  # empty, or nothing to ask or advise
        return
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
        return
    except BlockingIOError:
        pass
    except OSError:  # RWF_NOWAIT not supported for this file: leave the kernel be
        return
    for start, stop in page_ranges(first, sizes, strides, itemsize, PAGE):
        stop = min(stop, file_size)
        for at in range(start, stop, _CALL_BYTES):
            try:
                os.posix_fadvise(fd, at, min(_CALL_BYTES, stop - at), os.POSIX_FADV_WILLNEED)
            except OSError:  # advice is advice: the faults read the pages anyway
                return
