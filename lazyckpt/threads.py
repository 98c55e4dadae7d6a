"""Run torch's CPU kernels on the calling thread alone, without touching other threads.

``load_into`` copies short strided rows from the mappings while its reader thread is still
running ``preadv``s. Split over torch's intra-op (OpenMP) threads, those copies contend with the
reader for the same cores; on the caller alone they overlap with it (on a 2-core VM, MP-8
into one process: 22 of ~300 ms less at the median of paired runs; see benchmarks/HISTORY.md).

``torch.set_num_threads`` would change the whole process, and a thread that first runs a torch
kernel meanwhile would keep the smaller count for good. The OpenMP runtime's own
``omp_set_num_threads`` changes only the calling thread's setting, which torch reads back
through ``omp_get_max_threads``; so this module calls the runtime torch loaded (found by its
usual name, else among the process's mapped libraries; never loaded), and checks that torch
sees the change.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator

import torch

__all__ = ["one_intraop_thread"]

_RUNTIMES = ("libgomp", "libiomp5", "libomp")
"""GNU, Intel and LLVM OpenMP: ``omp_set_num_threads`` sets the calling thread's ICV in each."""
_SONAME = "libgomp.so.1"
"""The runtime Linux builds of torch ship: found by name (~0.1 ms) before the process's maps
are scanned (~0.7 ms, paid by the first load of a process)."""


def _bind(path: str) -> ctypes.CDLL | None:
    """The OpenMP runtime at ``path`` if this process has already loaded it (never loads one)."""
    try:
        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0))
        lib.omp_set_num_threads.argtypes = [ctypes.c_int]
        lib.omp_set_num_threads.restype = None
        lib.omp_get_max_threads.argtypes = []
        lib.omp_get_max_threads.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


@functools.cache
def _mapped_runtimes() -> tuple[ctypes.CDLL, ...]:
    """Every OpenMP runtime among the process's mapped libraries."""
    try:
        with open("/proc/self/maps") as f:
            lines = [line for line in f if "omp" in line]  # thousands of lines; a few match
    except OSError:  # not Linux
        return ()
    paths = {
        parts[5].strip() for parts in (line.split(None, 5) for line in lines) if len(parts) == 6
    }
    found = []
    for path in sorted(paths):
        name = os.path.basename(path)
        if name.startswith(_RUNTIMES) and ".so" in name:
            lib = _bind(path)
            if lib is not None:
                found.append(lib)
    return tuple(found)


@functools.cache
def _by_name() -> ctypes.CDLL | None:
    return _bind(_SONAME) if hasattr(os, "RTLD_NOLOAD") else None


def _runtimes() -> Iterator[ctypes.CDLL]:
    """The OpenMP runtimes torch may use, the likeliest first: the one loaded under its usual
    name, then those found in the process's maps (another name, or a second runtime)."""
    lib = _by_name()
    if lib is not None:
        yield lib
    yield from _mapped_runtimes()


@contextlib.contextmanager
def one_intraop_thread() -> Iterator[bool]:
    """Within the block, torch kernels called from this thread run on it alone; other threads
    keep their own settings. Yields whether that holds (False: nothing was changed, as where
    torch's OpenMP runtime cannot be reached)."""
    before = torch.get_num_threads()
    if before == 1:
        yield True
        return
    for lib in _runtimes():
        own = lib.omp_get_max_threads()
        lib.omp_set_num_threads(1)
        if torch.get_num_threads() == 1:
            try:
                yield True
            finally:
                lib.omp_set_num_threads(own)
            return
        lib.omp_set_num_threads(own)  # not the runtime torch uses
    yield False
