"""Destination buffers that are cheap to fill and give their memory back at once.

A fresh ``torch.empty`` of tens of MB costs as much as the copy into it: the kernel faults in and
zeroes it 4 KiB at a time, and glibc keeps freed blocks of up to 32 MiB in its arenas, so a
stream of large tensors leaves the process holding memory it no longer uses. Buffers of 2 MiB and
more are therefore private anonymous mappings advised to use transparent huge pages (one fault
per 2 MiB) and unmapped as soon as the tensor is freed.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Sequence

import torch

__all__ = ["empty", "owner"]

_HUGE_PAGE = 2 << 20
_ANON_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def empty(sizes: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor; huge-page backed when it is at least 2 MiB."""
    numel = 1
    for s in sizes:
        numel *= s
    nbytes = numel * dtype.itemsize
    if nbytes < _HUGE_PAGE or _MADV_HUGEPAGE is None or not _ANON_FLAGS:
        return torch.empty(tuple(sizes), dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=_ANON_FLAGS)
    with contextlib.suppress(OSError):  # no huge pages: still a mapping freed on release
        buf.madvise(_MADV_HUGEPAGE)
    # The tensor keeps ``buf`` alive; the mapping goes when the last view of it does.
    tensor = torch.frombuffer(buf, dtype=dtype, count=numel).view(tuple(sizes))
    tensor._lazyckpt_buffer = buf  # type: ignore[attr-defined]
    return tensor


def owner(tensor: object) -> mmap.mmap | None:
    """The mapping behind a tensor from :func:`empty` (None for small ones): it lives exactly
    as long as the tensor's memory, through any view of it, so a ``weakref.finalize`` on it
    tells when that memory is given back."""
    return getattr(tensor, "_lazyckpt_buffer", None)
