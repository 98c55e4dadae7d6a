"""Locks that a forked child makes anew.

``fork()`` copies the process with one thread, the one that forked, and every lock as it was.
A lock that another thread held at that moment (the prefetch worker inside the reader, the
buffer pool or the stats) stays held in the child, where nobody will release it: the child's
first use of it waits for good. A child that closed a stream it inherited (``gen.close()``, or
the garbage collector at exit) hung so in 1-2 of ~450 forks made in the middle of a stream (an
earlier session's test; the tests here hold each lock across the fork instead).

Objects whose lock a child may need register here, and in the child each gets a new lock. What
the lock guarded is as the parent left it: Python's own operations (a dict's, a list's) are
whole at any instant, and a child only closes what it inherited or starts anew.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["renew_lock_in_child"]

_HOLDERS: dict[int, tuple[weakref.ref[Any], Callable[[], Any], str]] = {}
"""By ``id``: a weak reference to each holder, what makes its lock, and the attribute that holds
it. Plain dict operations, atomic under the GIL: a weak reference's callback may run on any
thread, in any code."""


def renew_lock_in_child(
    holder: object, make: Callable[[], Any] = threading.Lock, attr: str = "_lock"
) -> None:
    """Give ``holder`` a new lock (``make()``, in its attribute ``attr``) in every child forked
    while it lives."""
    key = id(holder)

    def forget(_: weakref.ref[Any]) -> None:
        _HOLDERS.pop(key, None)

    _HOLDERS[key] = (weakref.ref(holder, forget), make, attr)


def _after_fork_in_child() -> None:
    for ref, make, attr in list(_HOLDERS.values()):
        holder = ref()
        if holder is not None:
            setattr(holder, attr, make())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
