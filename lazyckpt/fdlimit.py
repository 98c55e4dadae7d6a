"""Open more files than the soft limit on descriptors allows, up to the hard one.

A load keeps each file it reads open until it ends, and a mapped file holds a second descriptor
(Python's ``mmap`` duplicates it). A DCP folder of one file per tensor
(``FileSystemWriter(single_file_per_rank=False)``) or a save from hundreds of ranks then needs
more than the soft limit many systems start processes with (1,024): such a load stopped halfway
with a bare ``[Errno 24] Too many open files``. As Go's runtime does at start, the soft limit is
raised to the hard one, here only when an open fails for want of descriptors; past the hard
limit the error names the file and the fix.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

try:
    import resource
except ImportError:  # Windows: no limit to raise
    resource = None  # type: ignore[assignment]

__all__ = ["opening"]

T = TypeVar("T")


_UNLIMITED_TARGET = 1 << 20
"""The soft limit asked for where the hard one is unlimited (macOS): kernels refuse an unlimited
soft one for descriptors."""


def _raise_soft_limit() -> bool:
    """Raise the soft limit on open descriptors to the hard one; whether it rose."""
    if resource is None:
        return False
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = _UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return True
    except (OSError, ValueError):  # refused: the error below says what to do
        pass
    return False


def opening(path: Path, call: Callable[[], T], mapped: bool = True) -> T:
    """``call()`` (an open or a mapping of ``path``), once more after raising the soft limit
    where it failed with EMFILE; past the hard limit an ``OSError`` that says what to do
    (``mapped``: whether the load maps its files, so that ``mmap=False`` would help)."""
    try:
        return call()
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            raise
        if _raise_soft_limit():
            try:
                return call()
            except OSError as again:
                if again.errno != errno.EMFILE:
                    raise
    limit = (
        f"its limit of {resource.getrlimit(resource.RLIMIT_NOFILE)[0]} open files"
        if resource is not None
        else "its limit on open files"
    )
    advice = (
        "raise it (ulimit -n), or load with mmap=False, which takes one descriptor per file"
        if mapped
        else "raise it (ulimit -n)"
    )
    raise OSError(
        errno.EMFILE,
        f"cannot open {path}: the load keeps each file it reads open (two descriptors where it "
        f"is mapped) and the process reached {limit}; {advice}",
    )
