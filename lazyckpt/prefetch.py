"""Build the next items on a background thread, within a byte budget.

Items that cost memory (copies into new buffers) are built on a worker thread in order and
handed over; ``Tensor.copy_`` and ``preadv`` release the GIL, so reading overlaps whatever the
caller does with the current tensor. Items that cost nothing (zero-copy views of a mapped file)
are built by the caller (``lazy_load`` makes them a batch ahead, on the caller's thread):
handing them between threads, or faulting their pages in ahead, measured slower, since the worker
and the caller then contend for the GIL.

The budget bounds how far the worker runs ahead, counting the bytes of built items the caller
has not taken plus the built buffers still alive (with ``watch``, a buffer counts until it is
freed, wherever it went; without, until it is handed over). A tensor larger than the budget is
built ahead only when nothing else waits and the live buffers fit in the budget, or when the
caller waits for it. A caller that frees each tensor before taking the next thus never has more
than the largest tensor plus the budget alive; one that keeps tensors only stops the read-ahead.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Generic, TypeVar

from lazyckpt import forks

__all__ = ["prefetched"]

T = TypeVar("T")
R = TypeVar("R")


class _Slot(Generic[R]):
    __slots__ = ("error", "value", "watched")

    def __init__(self) -> None:
        self.value: R | None = None
        self.error: BaseException | None = None
        self.watched = False


_RECHECK_S = 0.5
"""How long the worker waits before it looks at ``stop`` again without being woken. A stream
closed by the collector on the worker itself, at the allocation ``Condition.wait`` makes after
the worker checked ``stop`` and before it is listed as a waiter, notifies nobody: without a
bound the worker would wait for good, holding the stream's plans, reader and buffers."""


_RUNNING: set[tuple[_State, threading.Thread]] = set()
"""The workers of streams not yet ended, for :func:`_stop_at_exit`."""


def _stop_at_exit() -> None:
    """Stop every stream's worker, and wait for the build it is in, before the interpreter
    finalizes: a stream left suspended at exit (held in a global, or in a cycle) keeps its
    worker, a daemon thread, and one inside a torch call when Python finalizes is ended with
    ``pthread_exit``, which unwinds through torch's C++ frames into ``std::terminate``: the
    process aborted (exit status 134) instead of exiting. A read that hangs (a lost network
    mount) is waited for ``_EXIT_WAIT_S`` at most, so that exit does not hang with it."""
    running = list(_RUNNING)
    for state, _ in running:
        with state.cond:
            state.stop = True
            state.cond.notify_all()
    for _, worker in running:
        if worker is not threading.current_thread():
            worker.join(_EXIT_WAIT_S)


_EXIT_WAIT_S = 30.0
atexit.register(_stop_at_exit)


def _condition() -> threading.Condition:
    return threading.Condition(threading.RLock())


class _State:
    """Shared by the caller and the worker; every field is read and written under ``cond``."""

    def __init__(self) -> None:
        # Reentrant: a buffer's finalizer may run in a thread that already holds the lock.
        self.cond = _condition()
        forks.renew_lock_in_child(self, _condition, "cond")  # a child may free a built tensor
        self.ahead = 0
        """Bytes of items the worker built that the caller has not taken."""
        self.live = 0
        """Bytes of built buffers still alive (watched) or not yet handed over."""
        self.waiting = -1
        """Index of the built item the caller waits for, or -1."""
        self.ready: dict[int, _Slot[object]] = {}
        self.stop = False

    def release(self, nbytes: int) -> None:
        with self.cond:
            self.live -= nbytes
            self.cond.notify_all()


def _watch(owner: object | None, state: _State, size: int) -> bool:
    """Count ``size`` as live until ``owner`` is freed (a function of its own, so that no
    local variable of the worker keeps ``owner`` alive)."""
    if owner is None:
        return False
    weakref.finalize(owner, state.release, size).atexit = False
    return True


def _same_process(parent: int) -> None:
    """Refuse to go on in a forked child. The worker does not come along with ``fork()``
    (``next()`` would wait for it for good); a stream that has none (views, small keys, a
    budget of 0) is refused too, so that whether a child may go on does not depend on the
    dtypes and sizes of the keys."""
    if os.getpid() != parent:
        raise RuntimeError(
            "a lazy_load stream cannot go on in a process forked from the one that started it "
            "(the child may close or drop it); start a new lazy_load there"
        )


def prefetched(
    items: Sequence[T],
    build: Callable[[T], R],
    *,
    nbytes: Callable[[T], int],
    inline: Callable[[T], bool],
    budget: int,
    watch: Callable[[R], object | None] | None = None,
) -> Generator[R, None, None]:
    """``build(item)`` for each item in order.

    ``inline(item)``: the caller builds the item; other items are built on the worker, and an
    exception from ``build`` is raised in the caller at the item that failed. ``watch(value)``
    names an object whose lifetime is that of a built item's memory. With ``budget <= 0``
    everything runs in the caller. Closing the iterator early stops the worker before it starts
    anything more.
    """
    sizes = [nbytes(item) for item in items]
    kinds = [inline(item) for item in items]
    parent = os.getpid()
    if budget <= 0 or all(kinds):
        for item in items:
            _same_process(parent)
            yield build(item)
        return
    state = _State()
    cond = state.cond

    def may_start(i: int, size: int) -> bool:
        if state.waiting == i:
            return True
        if state.live + state.ahead + size <= budget:
            return True
        return state.ahead == 0 and state.live <= budget

    def work() -> None:
        for i, (item, size, is_inline) in enumerate(zip(items, sizes, kinds)):
            if is_inline:
                continue
            with cond:
                while not state.stop and not may_start(i, size):
                    cond.wait(_RECHECK_S)
                if state.stop:
                    return
                state.ahead += size
                state.live += size
            slot: _Slot[object] = _Slot()
            try:
                slot.value = build(item)
            except BaseException as exc:  # handed to the caller, who re-raises it
                slot.error = exc
            if watch is not None and slot.error is None:
                slot.watched = _watch(watch(slot.value), state, size)  # type: ignore[arg-type]
            with cond:
                if state.stop:
                    # The stream ended while this was built: closed on this very thread by the
                    # collector, its ``finally`` has already emptied ``ready`` and will not
                    # again. Kept there, the slot would keep its tensor (and through its
                    # finalizer this state), or its error's frames, for good.
                    return
                state.ready[i] = slot
                cond.notify_all()
            if slot.error is not None:
                return

    worker = threading.Thread(target=work, name="lazyckpt-prefetch", daemon=True)
    running = (state, worker)
    try:
        # Inside the try: a Ctrl-C in start() (it waits for the thread to run) left the worker
        # polling for good, holding what it had built and the files it read.
        _RUNNING.add(running)
        worker.start()
        for i, (item, size, is_inline) in enumerate(zip(items, sizes, kinds)):
            _same_process(parent)
            if is_inline:
                value = build(item)
                yield value
                del value
                continue
            with cond:
                state.waiting = i
                cond.notify_all()
                while i not in state.ready:
                    cond.wait()
                slot = state.ready.pop(i)
                state.waiting = -1
                state.ahead -= size
                if not slot.watched:
                    state.live -= size
                cond.notify_all()
            if slot.error is not None:
                raise slot.error
            built, slot.value = slot.value, None
            yield built  # type: ignore[misc]
            del built
    finally:
        # In a forked child the worker, and whatever lock it held at the fork, stayed behind.
        if os.getpid() == parent:
            with cond:
                state.stop = True
                cond.notify_all()
            # The garbage collector can close a stream dropped in a reference cycle on any thread,
            # the worker included (it allocates the most): it stops at its next check by itself.
            if threading.current_thread() is not worker:
                with contextlib.suppress(RuntimeError):  # start() interrupted before it ran:
                    worker.join()  # the thread, if it runs, stops at its first check
            # After the join: a build the worker was in stores its slot when it ends, and a slot
            # kept here would keep its tensor (and, through its finalizer, this state) for good.
            state.ready.clear()
        _RUNNING.discard(running)
