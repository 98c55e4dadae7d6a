"""Work ahead of the caller on a background thread, within a byte budget.

Items are of two kinds:

* **built ahead** (a copy into a new buffer): the worker builds them in order and hands them
  over. ``Tensor.copy_`` and ``preadv`` release the GIL, so reading overlaps whatever the caller
  does with the current tensor.
* **built by the caller** (a zero-copy view of a mapped file, or ``load_into``'s fill of the
  caller's own tensor): handing such an item between threads would cost more than building it,
  so the worker only *prepares* it (locates DCP chunks, faults in the pages a view will read) and
  the caller finds it ready.

The budget bounds what the worker runs ahead by: the bytes of items it prepared or built that
the caller has not taken, plus the buffers it built that are still alive (with ``watch``, a
buffer counts until it is freed, wherever it went; without, until it is handed over). One item
is always allowed when nothing is waiting and the live buffers fit in the budget, so a tensor
larger than the budget is still built ahead; memory held by the loader thus stays below the
largest tensor plus the budget, even while the caller holds the previous large one.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

__all__ = ["prefetched"]

T = TypeVar("T")
R = TypeVar("R")


class _Slot(Generic[R]):
    __slots__ = ("error", "value", "watched")

    def __init__(self) -> None:
        self.value: R | None = None
        self.error: BaseException | None = None
        self.watched = False


class _State:
    """Shared by the caller and the worker; every field is read and written under ``cond``."""

    def __init__(self, n: int) -> None:
        # Reentrant: a buffer's finalizer may run in a thread that already holds the lock.
        self.cond = threading.Condition(threading.RLock())
        self.pos = 0
        """Index of the next item the caller takes."""
        self.ahead = 0
        """Bytes of items the worker prepared or built that the caller has not taken."""
        self.live = 0
        """Bytes of built buffers still alive (watched) or not yet handed over."""
        self.waiting = -1
        """Index of the built item the caller waits for, or -1."""
        self.done = [False] * n
        self.ready: dict[int, _Slot[object]] = {}
        self.stop = False

    def release(self, nbytes: int) -> None:
        with self.cond:
            self.live -= nbytes
            self.cond.notify_all()


def prefetched(
    items: Sequence[T],
    build: Callable[[T], R],
    *,
    nbytes: Callable[[T], int],
    inline: Callable[[T], bool],
    budget: int,
    prepare: Callable[[T], None] | None = None,
    watch: Callable[[R], object | None] | None = None,
) -> Iterator[R]:
    """``build(item)`` for each item in order.

    ``inline(item)``: the caller builds the item, after the worker ran ``prepare(item)`` on it
    if it got there first (an exception from ``prepare`` is dropped: the caller's ``build``
    meets the same problem and raises it at the right item). Other items are built on the
    worker; an exception from ``build`` is raised in the caller at the item that failed.
    ``watch(value)`` names an object whose lifetime is that of a built item's memory. With
    ``budget <= 0`` everything runs in the caller. Closing the iterator early stops the worker
    before it starts anything more.
    """
    sizes = [nbytes(item) for item in items]
    kinds = [inline(item) for item in items]
    if budget <= 0 or (prepare is None and all(kinds)):
        for item in items:
            yield build(item)
        return
    state = _State(len(items))
    cond = state.cond

    def may_start(i: int, size: int) -> bool:
        if state.waiting == i:
            return True
        if state.live + state.ahead + size <= budget:
            return True
        return state.ahead == 0 and state.live <= budget

    def work() -> None:
        for i, (item, size, is_inline) in enumerate(zip(items, sizes, kinds)):
            if is_inline and prepare is None:
                continue
            with cond:
                while not state.stop and i >= state.pos and not may_start(i, size):
                    cond.wait()
                if state.stop:
                    return
                if i < state.pos:  # the caller got there first
                    continue
                state.done[i] = True
                state.ahead += size
                if not is_inline:
                    state.live += size
            if is_inline:
                with contextlib.suppress(Exception):  # the caller's build raises it again
                    prepare(item)  # type: ignore[misc]
                continue
            slot: _Slot[object] = _Slot()
            try:
                slot.value = build(item)
            except BaseException as exc:  # handed to the caller, who re-raises it
                slot.error = exc
            owner = watch(slot.value) if watch is not None and slot.error is None else None  # type: ignore[arg-type]
            if owner is not None:
                finalizer = weakref.finalize(owner, state.release, size)
                finalizer.atexit = False
                slot.watched = True
            with cond:
                state.ready[i] = slot
                cond.notify_all()
            if slot.error is not None:
                return

    worker = threading.Thread(target=work, name="lazyckpt-prefetch", daemon=True)
    worker.start()
    try:
        for i, (item, size, is_inline) in enumerate(zip(items, sizes, kinds)):
            if is_inline:
                value = build(item)
                with cond:
                    state.pos = i + 1
                    if state.done[i]:
                        state.ahead -= size
                    cond.notify_all()
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
                state.pos = i + 1
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
        with cond:
            state.stop = True
            state.ready.clear()
            cond.notify_all()
        worker.join()
