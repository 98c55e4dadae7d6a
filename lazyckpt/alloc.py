"""Destination buffers that are cheap to fill and give their memory back at once.

A fresh ``torch.empty`` of tens of MB costs as much as the copy into it: the kernel faults in and
zeroes it 4 KiB at a time, and glibc keeps freed blocks of up to 32 MiB in its arenas, so a
stream of large tensors leaves the process holding memory it no longer uses. Buffers of 2 MiB and
more are therefore private anonymous mappings advised to use transparent huge pages (one fault
per 2 MiB) and unmapped as soon as the tensor is freed.

Even huge pages are zeroed by the kernel on first touch, which costs about as much as the copy
that follows (about half the speed of copying into memory already faulted in, here). A
:class:`BufferPool` therefore takes back the mapping of a tensor the caller has freed and gives
it to the next tensor that fits, within a bounded footprint.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
import weakref
from collections.abc import Sequence

import torch

from lazyckpt import forks

__all__ = ["BufferPool", "empty", "owner"]

_HUGE_PAGE = 2 << 20
_ANON_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def _numel(sizes: Sequence[int]) -> int:
    numel = 1
    for s in sizes:
        numel *= s
    return numel


def _mapping(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes, flags=_ANON_FLAGS)
    with contextlib.suppress(OSError):  # no huge pages: still a mapping freed on release
        buf.madvise(_MADV_HUGEPAGE)  # type: ignore[arg-type]
    return buf


_OWNERS: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
"""The holder of each live buffer, by the address of its memory. Not an attribute of the tensor:
``torch.save``, ``pickle`` and ``copy.deepcopy`` take a tensor's ``__dict__`` along, and a ctypes
array or a mapping cannot be pickled. An entry goes when its holder does. No lock: the garbage
collector can close a dropped stream on a thread inside this module, and closing joins that
stream's worker, which may be here too (a lock held across the collection deadlocked them)."""


def _wrap(holder: object, sizes: Sequence[int], dtype: torch.dtype, numel: int) -> torch.Tensor:
    # The tensor's storage keeps ``holder`` alive (``frombuffer`` holds a reference until the
    # memory is freed), through any view of it: ``owner`` finds it again by the address.
    tensor = torch.frombuffer(holder, dtype=dtype, count=numel).view(tuple(sizes))
    _OWNERS[tensor.untyped_storage().data_ptr()] = holder
    return tensor


def _mappable(nbytes: int) -> bool:
    return nbytes >= _HUGE_PAGE and _MADV_HUGEPAGE is not None and bool(_ANON_FLAGS)


def empty(sizes: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor; huge-page backed when it is at least 2 MiB."""
    numel = _numel(sizes)
    nbytes = numel * dtype.itemsize
    if not _mappable(nbytes):
        return torch.empty(tuple(sizes), dtype=dtype, device="cpu")
    # The mapping goes when the last view of the tensor does.
    return _wrap(_mapping(nbytes), sizes, dtype, numel)


def owner(tensor: object) -> object | None:
    """The object behind a tensor from :func:`empty` or :meth:`BufferPool.empty` (None for
    small ones and for other tensors): it lives exactly as long as the tensor's memory, through
    any view of it, so a ``weakref.finalize`` on it tells when that memory is given back."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return None
    return _OWNERS.get(tensor.untyped_storage().data_ptr())


class BufferPool:
    """Mappings of freed tensors, kept for the next tensors of one load.

    Each tensor gets a *lease* on a mapping (a ``ctypes`` array over it, which the tensor keeps
    alive); when the caller drops the last view of the tensor, the lease's finalizer puts the
    mapping back here, already faulted in, and the next tensor that fits reuses it (the
    smallest free mapping at least as large). Every byte a tensor covers is overwritten before
    it is handed out again, since the planned pieces tile the target box.

    ``capacity`` bounds the pool's whole footprint, leased and free: a freed mapping is kept
    only while the total stays within it, and free mappings are unmapped before a new one
    would cross it. Only tensors the caller keeps alive can take the footprint past it.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, mmap.mmap]] = []
        self._free_bytes = 0
        self._leased = 0
        self._lock = threading.RLock()  # a finalizer may run in a thread inside ``empty``
        forks.renew_lock_in_child(self, threading.RLock)
        self._closed = False

    def empty(self, sizes: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Like :func:`empty`, from a freed mapping when one fits."""
        numel = _numel(sizes)
        nbytes = numel * dtype.itemsize
        if not _mappable(nbytes) or self.capacity <= 0:
            return empty(sizes, dtype)
        need = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
        with self._lock:
            fits = [i for i, (size, _) in enumerate(self._free) if size >= need]
            if fits:
                size, buf = self._free.pop(min(fits, key=lambda i: self._free[i][0]))
                self._free_bytes -= size
            else:
                size, buf = need, None
                self._free.sort(key=lambda entry: entry[0])
                while self._free and self._leased + self._free_bytes + need > self.capacity:
                    dropped, _ = self._free.pop()  # the largest: unmapped once dropped
                    self._free_bytes -= dropped
            self._leased += size
        if buf is None:
            buf = _mapping(size)
        lease = (ctypes.c_char * nbytes).from_buffer(buf)
        weakref.finalize(lease, self._give_back, buf, size).atexit = False
        return _wrap(lease, sizes, dtype, numel)

    @property
    def free_bytes(self) -> int:
        """Bytes of freed mappings waiting for reuse."""
        return self._free_bytes

    def _give_back(self, buf: mmap.mmap, size: int) -> None:
        with self._lock:
            self._leased -= size
            if self._closed or self._leased + self._free_bytes + size > self.capacity:
                return  # dropped: unmapped once nothing else refers to it
            self._free.append((size, buf))
            self._free_bytes += size

    def close(self) -> None:
        """Unmap every free mapping; tensors still alive keep theirs until they go."""
        with self._lock:
            self._closed = True
            self._free.clear()
            self._free_bytes = 0
