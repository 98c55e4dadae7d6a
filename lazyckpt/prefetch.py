"""Build the next items on a background thread, within a byte budget.

Reading is a ``Tensor.copy_`` or ``preadv``, both of which release the GIL, so a worker thread
overlaps I/O with whatever the caller does with the current tensor. The budget bounds what the
worker may hold that the caller has not taken yet; one item is always allowed when nothing is
waiting, so a tensor larger than the budget is still built ahead (once), and memory held by the
loader stays below the largest tensor plus the budget.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

__all__ = ["prefetched"]

T = TypeVar("T")
R = TypeVar("R")


class _Slot(Generic[R]):
    __slots__ = ("cost", "error", "value")

    def __init__(self, cost: int) -> None:
        self.cost = cost
        self.value: R | None = None
        self.error: BaseException | None = None


def prefetched(
    items: Sequence[T],
    build: Callable[[T], R],
    cost: Callable[[T], int],
    budget: int,
) -> Iterator[R]:
    """``build(item)`` for each item in order; with ``budget > 0``, items that cost memory are
    built ahead on a thread.

    Items of cost 0 (zero-copy views) are built by the caller when their turn comes: handing
    them over between threads would cost more than building them. An exception from ``build``
    is raised in the caller at the item that failed. Closing the iterator early stops the
    worker before it builds anything more.
    """
    costs = [cost(item) for item in items]
    heavy = [(item, c) for item, c in zip(items, costs) if c > 0]
    if budget <= 0 or not heavy:
        for item in items:
            yield build(item)
        return

    ready: deque[_Slot[R]] = deque()
    cond = threading.Condition()
    state = {"held": 0, "stop": False}

    def work() -> None:
        for item, c in heavy:
            with cond:
                while not state["stop"] and ready and state["held"] + c > budget:
                    cond.wait()
                if state["stop"]:
                    return
            slot: _Slot[R] = _Slot(c)
            try:
                slot.value = build(item)
            except BaseException as exc:  # handed to the caller, who re-raises it
                slot.error = exc
            with cond:
                ready.append(slot)
                state["held"] += c
                cond.notify_all()
            if slot.error is not None:
                return

    worker = threading.Thread(target=work, name="lazyckpt-prefetch", daemon=True)
    worker.start()
    try:
        for item, c in zip(items, costs):
            if c == 0:
                yield build(item)
                continue
            with cond:
                while not ready:
                    cond.wait()
                slot = ready.popleft()
                state["held"] -= slot.cost
                cond.notify_all()
            if slot.error is not None:
                raise slot.error
            value, slot.value = slot.value, None
            yield value  # type: ignore[misc]
            del value
    finally:
        with cond:
            state["stop"] = True
            ready.clear()
            cond.notify_all()
        worker.join()
