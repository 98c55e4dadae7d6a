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
from dataclasses import dataclass, field, replace

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
    _folded: float = field(default=0.0, repr=False, compare=False)
    """Seconds of finished loads that no load running now or later can overlap."""
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )
    _running: list[list[float]] = field(default_factory=list, init=False, repr=False, compare=False)
    """Each running load's ``[start, last tensor]`` (``perf_counter``)."""
    _finished: list[list[float]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )
    """Finished loads' spans that a running load may still overlap."""

    def __post_init__(self) -> None:
        forks.renew_lock_in_child(self)

    def __copy__(self) -> LoadStats:
        """A snapshot: the counts copied and the time so far in one number, nothing shared
        (``dataclasses.replace`` keeps the time of the loads that ended)."""
        with self._lock:
            new = replace(self, bytes_read=dict(self.bytes_read), _folded=self._seconds_locked())
        return new

    def add_read(self, path: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_read[path] = self.bytes_read.get(path, 0) + nbytes

    def add_verified(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_verified += nbytes

    def add_delivered(self, nbytes: int, *, view: bool, span: list[float] | None = None) -> None:
        """A tensor delivered by the load whose :meth:`begin` gave ``span``."""
        with self._lock:
            self.bytes_delivered += nbytes
            self.tensors += 1
            self.views += int(view)
            if span is not None:
                span[1] = time.perf_counter()

    def begin(self) -> list[float]:
        """A load starts: its time runs from now to its last tensor. Returns its span, to
        pass to :meth:`add_delivered` and, once the load is over, to :meth:`end`."""
        now = time.perf_counter()
        span = [now, now]
        with self._lock:
            self._running.append(span)
        return span

    def end(self, span: list[float]) -> None:
        """The load of ``span`` is over: its time is kept, and the time of the loads before
        that nothing running can overlap is folded into one number (a LoadStats given a
        million loads holds a few spans, not a million)."""
        with self._lock:
            at = next((i for i, s in enumerate(self._running) if s is span), None)
            if at is not None:
                self._finished.append(self._running.pop(at))
            first = min((a for a, _ in self._running), default=float("inf"))
            kept = []
            for a, b in _union(self._finished):
                if b <= first:
                    self._folded += b - a
                else:
                    kept.append([a, b])
            self._finished = kept

    @contextmanager
    def timing(self, *, whole: bool = False) -> Iterator[list[float]]:
        """:meth:`begin` and, however the load ends, :meth:`end`: the span runs to the last
        tensor delivered, or, ``whole``, to the end of the block (work that delivers none:
        indexing and planning)."""
        span = self.begin()
        try:
            yield span
        finally:
            if whole:
                span[1] = time.perf_counter()
            self.end(span)

    @property
    def seconds(self) -> float:
        """Wall time of the loads given this object: a ``load_into``'s whole call; a
        ``lazy_load``'s metadata work (indexing and planning, done when it is called) and its
        stream's time from its first tensor asked for to its last. Loads that run at once
        (threads) count the time they share once; neither the time between two loads, nor
        between ``lazy_load``'s return and the stream's first tensor asked for, nor a stream
        left suspended after its last tensor counts."""
        with self._lock:
            return self._seconds_locked()

    def _seconds_locked(self) -> float:
        return self._folded + sum(b - a for a, b in _union(self._finished + self._running))

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
        seconds = self.seconds
        rate = self.bytes_delivered / seconds / gb if seconds > 0 else 0.0
        return (
            f"{self.tensors} tensors, {self.bytes_delivered / gb:.3f} GB delivered, "
            f"{self.total_bytes_read / gb:.3f} GB read from {self.files_read} file(s) "
            f"(amplification {self.read_amplification:.3f}), {rate:.2f} GB/s"
        )


def _union(spans: list[list[float]]) -> list[tuple[float, float]]:
    """``spans`` (``[start, end]``) merged where they overlap, in order; empty ones left out."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted((a, b) for a, b in spans if b > a):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged
