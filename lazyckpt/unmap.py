"""Unmap file mappings on a thread of their own, once nothing uses them.

Removing a mapping costs the kernel time in proportion to the pages that were touched through
it (about 12 ms for 2 GB of page cache here, a quarter of the time it takes to stream those 2 GB
as views), and nobody waits for it: the bytes stay in the page cache. So a mapping's last
reference is dropped on a daemon thread (CPython releases the GIL while it unmaps) and the
caller carries on with the next tensor or whatever follows the load.

Tensors reach a mapping through a *lease* (a ``ctypes`` buffer over it). When the lease goes
(the reader closed and the last view freed) its finalizer hands the mapping to the thread.
Only file mappings go this way: they hold page cache, not memory of the process, so dropping
them a little later costs nothing.
"""

from __future__ import annotations

import _thread
import ctypes
import mmap
import os
import queue
import threading
import weakref

from lazyckpt import forks

__all__ = ["lease", "wait"]


class _Reaper:
    """One daemon thread that drops what it is given, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        forks.renew_lock_in_child(self)
        self._queue: queue.SimpleQueue[object] | None = None

    def drop(self, holder: list[object]) -> None:
        """Take the one object in ``holder`` (the last reference to it) and drop it on the
        thread."""
        obj = holder.pop()
        self._get().put(obj)
        del obj

    def wait(self) -> None:
        """Return once everything handed over so far is dropped."""
        done = threading.Event()
        self._get().put(done)
        done.wait()

    def _get(self) -> queue.SimpleQueue[object]:
        q = self._queue
        if q is None:
            with self._lock:
                q = self._queue
                if q is None:
                    q = self._queue = queue.SimpleQueue()
                    # Not threading.Thread.start(): it waits until the new thread runs, which
                    # on a busy 2-core machine (torch's OpenMP workers spin after each copy)
                    # took milliseconds. Like a daemon thread, this one is not joined at exit.
                    _thread.start_new_thread(_run, (q,))
        return q

    def forget(self) -> None:
        """In a forked child: the thread did not come along; start a new one when needed (its
        lock is new there too: see :mod:`lazyckpt.forks`)."""
        self._queue = None


def _run(q: queue.SimpleQueue[object]) -> None:
    threading.current_thread().name = "lazyckpt-unmap"
    while True:
        obj = q.get()
        if isinstance(obj, threading.Event):
            obj.set()
        del obj  # the mapping's last reference: unmapped here


_reaper = _Reaper()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reaper.forget)


def lease(region: mmap.mmap) -> ctypes.Array[ctypes.c_char]:
    """A writable buffer over all of ``region`` for ``torch.frombuffer``: tensors made from it
    keep it alive, and when it goes, ``region`` is unmapped on the unmapping thread.

    The caller must drop its own references to ``region`` after this call."""
    buffer = (ctypes.c_char * len(region)).from_buffer(region)
    weakref.finalize(buffer, _reaper.drop, [region]).atexit = False
    return buffer


def wait() -> None:
    """Block until every mapping released so far is unmapped (tests; a caller that must know
    the address space is clean)."""
    _reaper.wait()
