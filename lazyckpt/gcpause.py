"""Keep Python's cyclic garbage collector out of a load's bookkeeping.

Indexing and planning build tens of small objects per key (header dicts, entries, chunks,
plans), none of them in a cycle. Every 700 of them the collector runs, and every so often it
walks every object the process holds, torch's modules and the caller's model included: for a
15,400-key safetensors folder (an MoE model's experts) two or three such walks took 180-260 ms
of a 350 ms plan. With the collector paused, the objects are looked at once, when it next runs
after the pause. Nothing is lost: what is freed by reference counting is freed at once, and
any cycle made meanwhile is collected then.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


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
        gc.enable()
