"""Zero-copy concatenation: ranges of several files laid back to back in one virtual range.

A target box that spans several source chunks usually needs a new buffer and a copy. Where each
chunk's part is one contiguous byte range of its file and the parts follow one another in the
box (a model-parallel key split on dim 0, read whole or by a TP rank that spans several rank
files), the box can instead be a view: reserve an anonymous range, map each file's whole pages
into it at their place (``MAP_FIXED``, copy-on-write like every other view), and copy only the
partial pages at the seams. The result reads like a copy and costs no memory: pages come
from the page cache when touched.

On this project's VMs a copy into new memory is slow: the host gives the guest a page only when
it is first touched (about 1 GB/s), so a copy of a 500 MB tensor costs far more than reading
it through a mapping.

Linux only (``MAP_FIXED`` through ``ctypes``); elsewhere :func:`available` is false and the
caller copies.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import weakref
from collections.abc import Callable, Sequence

from lazyckpt import forks
from lazyckpt.plan import Stitch

__all__ = ["MAX_RUNS", "MIN_BYTES", "PAGE", "available", "build"]

PAGE = mmap.PAGESIZE
MIN_BYTES = 1 << 20
"""Smaller boxes are copied: copying less than this costs less than setting up mappings."""
MAX_RUNS = 256
"""Boxes of more pieces are copied (each piece costs mappings of its own)."""

_MAP_FIXED = 0x10  # Linux's value; Python's mmap module does not export it
_PROT_RW = getattr(mmap, "PROT_READ", 1) | getattr(mmap, "PROT_WRITE", 2)
_MAP_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0)
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0)


def _load_mmap() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.mmap
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int64,
    ]
    return fn


_mmap = _load_mmap()


def _map_limit() -> int:
    """Mappings stitched views may hold at once: a quarter of the kernel's per-process limit,
    so that they never starve the allocator or other mappings."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 4
    except (OSError, ValueError):
        return 65530 // 4


class _Budget:
    """Counts the kernel mappings (VMAs) that live stitched views hold."""

    def __init__(self) -> None:
        self.limit = _map_limit() if _mmap is not None else 0
        self.live = 0
        self._lock = threading.Lock()
        forks.renew_lock_in_child(self)

    def take(self, n: int) -> bool:
        with self._lock:
            if self.live + n > self.limit:
                return False
            self.live += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.live -= n


_budget = _Budget()


def available() -> bool:
    """Whether stitched views can be built on this platform."""
    return _mmap is not None and bool(_MAP_PRIVATE and _MAP_ANONYMOUS)


def build(
    plan: Stitch, fds: Sequence[int], read: Callable[[int, int, int], bytes]
) -> mmap.mmap | None:
    """The stitched range of ``plan`` (an anonymous mapping with the files' pages mapped into
    it), or ``None`` when the kernel refuses a mapping or the process holds too many already.

    ``fds[run]`` is the open file of each run; ``read(run, offset, length)`` returns bytes of
    that run's file for the seams. The range is unmapped, file pages included, when the last
    reference to the returned object goes (tensors from ``torch.frombuffer`` hold one).
    """
    if not available():
        return None
    # Each map splits the anonymous range: at most two mappings per map, plus the range.
    cost = 2 * len(plan.maps) + 1
    if not _budget.take(cost):
        return None
    try:
        region = mmap.mmap(-1, plan.size, flags=_MAP_PRIVATE | _MAP_ANONYMOUS)
    except OSError:
        _budget.give(cost)
        return None
    weakref.finalize(region, _budget.give, cost).atexit = False
    anchor = (ctypes.c_char * 1).from_buffer(region)  # the range's address; nothing is read
    base = ctypes.addressof(anchor)
    del anchor  # a buffer export would keep the range from being unmapped
    assert _mmap is not None
    for run, at, offset, length in plan.maps:
        got = _mmap(base + at, length, _PROT_RW, _MAP_PRIVATE | _MAP_FIXED, fds[run], offset)
        if got != base + at:
            return None  # dropping ``region`` unmaps what was mapped so far
    for run, at, offset, length in plan.copies:
        region[at : at + length] = read(run, offset, length)
    return region
