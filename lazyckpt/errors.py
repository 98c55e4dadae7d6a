"""The library's exceptions and warnings.

Every error raised for a bad checkpoint is a :class:`CorruptModelCheckpointError` carrying the
path at fault, so a caller can tell "this file is broken" apart from "I called the API wrong"
(``ValueError``) and "the disk is gone" (``OSError``).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from types import FrameType
from typing import Any, cast

__all__ = [
    "CorruptModelCheckpointError",
    "ModelCheckpointError",
    "ShardDimsWarning",
    "UnknownCheckpointFormatError",
    "warn",
]


class ModelCheckpointError(Exception):
    """Base of every error lazyckpt raises about a checkpoint."""


class CorruptModelCheckpointError(ModelCheckpointError):
    """The checkpoint's data or metadata is bad or inconsistent.

    ``path`` is the file (or folder) at fault; ``key`` the checkpoint key at fault, when one
    is. The message names both and says what to do.
    """

    path: Path
    key: str | None
    detail: str
    """The message without the path in front, for an error that wraps this one."""

    def __init__(
        self, path: str | os.PathLike[str], message: str, *, key: str | None = None
    ) -> None:
        self.path = Path(path)
        self.key = key
        # Prefixed unless the message already starts with the path (a rebuilt error): a path
        # that merely occurs inside the message ("checkpoint") must not hide which file it is.
        prefix = f"{self.path}: "
        self.detail = message.removeprefix(prefix)
        super().__init__(prefix + self.detail)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps the error picklable across spawned processes.
        return (_rebuild, (type(self), self.path, str(self), self.key))


def _rebuild(
    cls: type[CorruptModelCheckpointError], path: Path, message: str, key: str | None
) -> CorruptModelCheckpointError:
    return cls(path, message, key=key)


class UnknownCheckpointFormatError(CorruptModelCheckpointError):
    """No loader recognises the path, the folder mixes formats with no rule to pick one, or the
    checkpoint is stored in a way lazyckpt does not read (a DCP save's compressed chunks)."""


class ShardDimsWarning(UserWarning):
    """``shard_dims`` name none of a checkpoint's keys where splitting matters (a TP target, or
    a model-parallel set): rarely meant, as when a preset's Meta names meet Hugging Face's."""


class CheckpointWarning(UserWarning):
    """The checkpoint loads as written, but something in it looks like a mistake that its
    bytes cannot tell from a legitimate save (a rank file that is a byte-for-byte copy of
    another): the message says what to check."""


_INSIDE = ("lazyckpt", "contextlib")
"""Modules whose frames a warning skips: lazyckpt's own, and those of the context managers it
decorates functions with."""


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn``, pointed at the first caller outside lazyckpt (whichever way the
    library was entered: the detecting loader or a format's, ``load_into``'s decorators)."""
    level, frame = 1, cast("FrameType | None", sys._getframe())
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _INSIDE:
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)
