"""Accounting of what a load read and delivered.

The numbers are the ones a user needs to trust "only the bytes this rank needs": bytes read per
file against bytes delivered, so read amplification is visible, not claimed.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from lazyckpt import forks

__all__ = ["LoadStats", "byte_bar"]


class _NoBar:
    """Stands in for a disabled bar without tqdm's per-bar bookkeeping."""

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, desc: str, refresh: bool = True) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def byte_bar(total: int, desc: str, *, enabled: bool) -> tqdm | _NoBar:
    """A progress bar in bytes (with bytes/s) on stderr; a no-op when not ``enabled``."""
    if not enabled:
        return _NoBar()
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        disable=not enabled,
        leave=False,
        file=sys.stderr,
    )


@dataclass
class LoadStats:
    """Filled in place while a load runs; pass one in ``ModelCheckpointLoadOptions(stats=...)``.

    ``bytes_read`` counts the source bytes copied out of each file or handed out as views of it
    (the bytes of the target box, plus any gap bytes a coalesced read took along),
    ``bytes_delivered`` the bytes of the tensors handed to the caller, before any dtype cast.
    Neither counts metadata (headers, zip directories, a DCP chunk's inner zip records, read
    when first needed) or what the kernel reads beyond the bytes asked: whole pages, and from a
    cold page cache the pages a mapped load asks for ahead (see :mod:`lazyckpt.readahead`: the
    views of up to 64 MiB ahead, which a stream stopped early never hands out, and the whole
    span of a strided box that fills at least half of it).
    """

    bytes_read: dict[str, int] = field(default_factory=dict)
    """Source bytes read, per file path."""
    bytes_delivered: int = 0
    """Bytes of the target boxes, in source dtype."""
    bytes_verified: int = 0
    """Bytes read only to compare copies (a model-parallel set's replicas; for ``load_into``,
    a tied key the checkpoint also holds); already counted in ``bytes_read``, which holds
    every byte read."""
    tensors: int = 0
    """Tensors yielded so far."""
    views: int = 0
    """Of those, how many were zero-copy views of the mapped file."""
    seconds: float = 0.0
    """Wall time from a load's start to its last tensor, summed over the loads given this
    object; loads that run at once (threads) count the time they share once, and the time
    between two loads one after the other is not counted."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _started: float | None = field(default=None, repr=False, compare=False)
    """When the loads running now started (the first of them)."""
    _before: float = field(default=0.0, repr=False, compare=False)
    """:attr:`seconds` before the loads running now."""
    _running: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        forks.renew_lock_in_child(self)

    def add_read(self, path: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_read[path] = self.bytes_read.get(path, 0) + nbytes

    def add_verified(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_verified += nbytes

    def add_delivered(self, nbytes: int, *, view: bool) -> None:
        with self._lock:
            self.bytes_delivered += nbytes
            self.tensors += 1
            self.views += int(view)
            if self._started is not None:
                self.seconds = self._before + time.perf_counter() - self._started

    @contextmanager
    def running(self) -> Iterator[None]:
        """A load runs: its time adds to that of the loads before it, or counts with that of
        the loads it overlaps from the first one's start (one clock for them all: a second
        load's start does not reset the first's)."""
        with self._lock:
            if self._running == 0:
                self._before = self.seconds
                self._started = time.perf_counter()
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1

    @property
    def total_bytes_read(self) -> int:
        return sum(self.bytes_read.values())

    @property
    def files_read(self) -> int:
        return sum(1 for n in self.bytes_read.values() if n > 0)

    @property
    def read_amplification(self) -> float:
        """Bytes read over bytes delivered (1.0 is ideal; 0 delivered reads as 1.0)."""
        if self.bytes_delivered == 0:
            return 1.0 if self.total_bytes_read == 0 else float("inf")
        return self.total_bytes_read / self.bytes_delivered

    def summary(self) -> str:
        gb = 1e9
        rate = self.bytes_delivered / self.seconds / gb if self.seconds > 0 else 0.0
        return (
            f"{self.tensors} tensors, {self.bytes_delivered / gb:.3f} GB delivered, "
            f"{self.total_bytes_read / gb:.3f} GB read from {self.files_read} file(s) "
            f"(amplification {self.read_amplification:.3f}), {rate:.2f} GB/s"
        )
