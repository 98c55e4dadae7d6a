"""Keep Python's cyclic garbage collector out of a load's bookkeeping.

Indexing and planning build tens of small objects per key (header dicts, entries, chunks,
plans), none of them in a cycle. Every 700 of them the collector runs, and every so often it
walks every object the process holds, torch's modules and the caller's model included: for a
15,400-key safetensors folder (an MoE model's experts) two or three such walks took 180-260 ms
of a 350 ms plan. With the collector paused, nothing walks them while they are made. Nothing is
lost: what is freed by reference counting is freed at once, and a cycle made meanwhile is
collected later.

A pause that made many objects (``_PROMOTE_MIN``) ends by moving the young ones to the oldest
generation (``gc.freeze()`` then ``gc.unfreeze()``: two list splices, no walk). Left young,
they are walked by the next young collection and again by the next middle one: 40-65 ms of a
950 ms stream of 15,400 keys here, against 5-8 ms promoted. What is promoted with them (the
caller's young objects: fewer than the collector's thresholds, a few thousand) is collected by
the next full collection instead of a young one. Where the caller keeps objects frozen
(``gc.freeze()``, as a fork server does to spare its children copy-on-write faults), nothing is
promoted, since ``gc.unfreeze()`` would thaw them too.

CPython 3.12's collector files the immortal objects it meets (375 tuples of the built-in types'
bases and MROs) under the permanent generation itself, so there the freeze count is never 0:
what it held when lazyckpt was imported counts as the interpreter's (thawed, the next full
collection files them back), and only objects frozen beyond it as the caller's.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator

__all__ = ["gc_paused"]

_PROMOTE_MIN = 10_000
"""Objects made in a pause past which its end promotes them: a load of a few hundred keys
makes fewer, and leaves the collector's generations as they were."""


def _interpreter_frozen() -> int:
    """Objects in the permanent generation that the interpreter, not the caller, put there.

    On 3.12 the count at import: the immortal objects its collector filed there (a caller's
    ``gc.freeze()`` of a process that imported anything freezes far more than ``_PROMOTE_MIN``;
    such a count is not taken as the interpreter's, and nothing is promoted while it lasts).
    Elsewhere 0: 3.11 and 3.13 file nothing there themselves."""
    if sys.version_info[:2] != (3, 12):
        return 0
    frozen = gc.get_freeze_count()
    return frozen if frozen < _PROMOTE_MIN else 0


_INTERPRETER_FROZEN = _interpreter_frozen()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off for the block, and back on after it if it was on before (a caller who
    turned it off keeps it off; nested blocks leave it to the outermost). Runs no user code
    but key maps and shard-dim callbacks the caller gave. Another thread that turns the
    collector off while the block runs sees it turned back on at the block's end."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        # get_count()[0]: objects made less those freed since the last young collection.
        if gc.get_count()[0] >= _PROMOTE_MIN and gc.get_freeze_count() <= _INTERPRETER_FROZEN:
            gc.freeze()
            gc.unfreeze()
        gc.enable()
