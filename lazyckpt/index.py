"""The index: what a checkpoint holds and where each byte lies, built from metadata alone.

Per-format loaders produce a :class:`CheckpointIndex`; everything after (planning, reading,
delivery) works from it and knows nothing of formats. A tensor is a global shape and dtype plus
one or more *copies*, each a set of chunks that tiles the global shape. Every chunk says where its
elements lie: a region of a file (byte offset and element strides), a region still to be located
(DCP chunks are small torch zips whose layout is read only when a rank needs that chunk), or a
tensor already in memory (``reshard_tensor``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "CheckpointIndex",
    "Chunk",
    "FileRegion",
    "LazyRegion",
    "MAX_INT64",
    "TensorEntry",
    "add_entry",
    "contiguous_strides",
]


MAX_INT64 = (1 << 63) - 1
"""The largest size, stride or element count a torch tensor holds (they are int64)."""


@functools.lru_cache(maxsize=4096)
def contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of a tensor of ``sizes`` (cached: asked for every key a load
    indexes and plans, whose layers repeat the same shapes)."""
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(sizes[d + 1], 1)
    return tuple(strides)


@dataclass(slots=True, eq=False)
class FileRegion:
    """Where a chunk's elements lie in a file: element ``i`` (a multi-index) is at byte
    ``byte_offset + itemsize * sum(i[d] * strides[d])``."""

    path: Path
    byte_offset: int
    strides: tuple[int, ...]


@dataclass
class LazyRegion:
    """A region found only when first needed, so that planning never opens the file.

    ``locate`` validates what it finds (and raises ``CorruptModelCheckpointError``); its result
    is kept. It is given the file's descriptor and size when the caller has it open (a reader
    does), so that locating a chunk opens and stats nothing: a DCP load locates one chunk per
    key.
    """

    path: Path
    locate: Callable[[int | None, int | None], FileRegion]
    window: tuple[int, int] | None = None
    """``(offset, length)`` of the zip of its own that holds the region (a DCP chunk's
    ``torch.save`` record), whose CRC-32s ``lazyckpt verify --read`` checks."""
    _found: FileRegion | None = field(default=None, repr=False)

    def resolve(self, fd: int | None = None, size: int | None = None) -> FileRegion:
        """The region; ``fd``, if given, is ``path`` opened for reading, and ``size`` its size."""
        if self._found is None:
            self._found = self.locate(fd, size)
        return self._found


ChunkData = FileRegion | LazyRegion | torch.Tensor


@dataclass(slots=True, eq=False)
class Chunk:
    """A box of the global tensor: ``offsets`` and ``sizes`` per dim, and where it is stored.

    The index's records are plain slotted classes, not frozen dataclasses: a fairscale MP-8 set
    makes thousands of them and a frozen ``__init__`` costs three times as much. Treat them as
    read-only all the same."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: ChunkData

    @property
    def path(self) -> Path | None:
        """The file holding the chunk (``None`` for an in-memory tensor). Asked per copy of
        every key a load plans: tested against the region classes, whose ``isinstance`` is a
        plain one (``torch.Tensor``'s goes through its metaclass)."""
        data = self.data
        return data.path if isinstance(data, (FileRegion, LazyRegion)) else None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


@dataclass(slots=True, eq=False)
class TensorEntry:
    """One key: dtype, global shape, and the copies that each tile it.

    ``copies`` has one element for ordinary checkpoints; model-parallel sources give a replicated
    key one copy per rank file, so a reader can pick the copy in a file it reads anyway and
    compare the others.

    Not frozen, as :class:`Chunk`: every load makes one per key, and a frozen ``__init__`` cost
    1 us against 0.2. Treat it as read-only all the same.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    copies: tuple[tuple[Chunk, ...], ...]
    source_key: str | None = None
    """The key's name in the checkpoint when ``key_map`` renamed it."""

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return self.copies[0]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def checkpoint_key(self) -> str:
        """The key as the checkpoint names it (before ``key_map``)."""
        return self.source_key if self.source_key is not None else self.key

    @property
    def display_key(self) -> str:
        if self.source_key is not None and self.source_key != self.key:
            return f"{self.key!r} (checkpoint key {self.source_key!r})"
        return repr(self.key)


@dataclass
class CheckpointIndex:
    """Everything known about a checkpoint before any tensor byte is read."""

    path: Path
    """What the user passed (file or folder)."""
    format: str
    """Loader name, e.g. ``safetensors``, ``torch``, ``fairscale``, ``dcp``."""
    entries: dict[str, TensorEntry]
    """Keys in checkpoint order."""
    files: list[Path]
    """Every file the checkpoint consists of, in a stable order."""
    metadata_files: list[Path] = field(default_factory=list)
    """Those of :attr:`files` that hold no tensor data (DCP's ``.metadata``): read whole while
    indexing, never by a load, so ``plan`` does not count them among the files left unread."""
    source_layout: str = ""
    """Human description of how the source is split (``MP-8``, ``3 files``, ...)."""
    notes: list[str] = field(default_factory=list)
    """Things worth telling a user who inspects it (ignored files, guesses made)."""
    metadata: Mapping[str, str] = field(default_factory=dict)
    """Free-form format metadata (safetensors ``__metadata__``, ``params.json`` ...); may be
    read only when first asked for."""
    stamps: dict[Path, FileStamp] = field(default_factory=dict)
    """Each file's :func:`file_stamp` when it was indexed: a load refuses a file that changed
    since (see ``Reader``), whose bytes the index's offsets no longer describe."""
    differing_copies: dict[str, tuple[Path, str]] = field(default_factory=dict)
    """Keys read as replicas whose copies the index already knows to differ (their zip
    records' CRC-32s): key -> (the file to blame, what to say). Refused where a load would
    compare copies (``verify_replicas``), not by the index, which ``inspect`` shows whole."""

    def __iter__(self) -> Iterator[TensorEntry]:
        return iter(self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


FileStamp = tuple[int, int, int, int]
"""A file's device, inode, size and modification time (ns)."""


def file_stamp(st: os.stat_result) -> FileStamp:
    """What tells a file replaced (``os.replace`` of a new one: another inode) or rewritten in
    place (another size or modification time) from the one indexed."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


_SEEN: contextvars.ContextVar[dict[Path, FileStamp] | None] = contextvars.ContextVar(
    "lazyckpt_seen_stamps", default=None
)


def note_stamp(path: Path, st: os.stat_result) -> None:
    """A metadata reader's ``fstat`` of the descriptor it reads ``path`` through: while an index
    is built (:func:`stamped`), the file's stamp is the one its metadata came from, so that a
    file replaced while the index is built (a large header takes seconds) is caught too."""
    seen = _SEEN.get()
    if seen is not None:
        seen.setdefault(path, file_stamp(st))


def stamped(index_of: Callable[[], CheckpointIndex]) -> CheckpointIndex:
    """``index_of()`` with ``stamps`` filled for its data files: as their metadata was read
    (:func:`note_stamp`), else (files indexed without being opened, as a DCP folder's
    ``.distcp``) as they are now; a file gone meanwhile is left out, and its load says so."""
    seen: dict[Path, FileStamp] = {}
    token = _SEEN.set(seen)
    try:
        index = index_of()
    finally:
        _SEEN.reset(token)
    metadata = set(index.metadata_files)
    for f in index.files:
        if f not in metadata:
            stamp = seen.get(f)
            if stamp is None:
                with contextlib.suppress(OSError):
                    stamp = file_stamp(os.stat(f))
            if stamp is not None:
                index.stamps[f] = stamp
    return index


def replica_differs(entry: TensorEntry, a: object, b: object, proof: str = "") -> str:
    """What to say of a key read as a replica whose copies in ``a`` and ``b`` differ
    (``proof``: how that is known, where not by reading them). A 0-d key cannot be split: one
    of the files is damaged, or of another checkpoint."""
    said = f"key {entry.display_key} should be a replica but its copies in {a} and {b} differ"
    said += f" ({proof})" if proof else ""
    if not entry.shape:
        return f"{said}; a 0-d key is never split: one of the files is damaged or of another save"
    return (
        f"{said}; if the key is split across model-parallel ranks, add it to shard_dims (see "
        "lazyckpt.presets), otherwise one of the files is damaged"
    )


def differing_note(differing: Mapping[str, tuple[Path, str]]) -> str:
    """The index's note on :attr:`CheckpointIndex.differing_copies`: one line for them all
    (without shard dims, every split key of a model-parallel set is one)."""
    keys = list(differing)
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return (
        f"{len(keys)} key(s) read as replicas have copies whose zip CRC-32s differ "
        f"({', '.join(repr(k) for k in keys[:4])}{more}): split keys left out of shard_dims, "
        "or damaged files; a load that compares replicas refuses them"
    )


def add_entry(entries: dict[str, TensorEntry], entry: TensorEntry) -> None:
    """Add ``entry``, refusing two checkpoint keys that ``key_map`` sent to one name."""
    old = entries.get(entry.key)
    if old is not None:
        raise ValueError(
            f"the key_map (options.key_map; --key-map on the command line) maps both "
            f"{old.source_key!r} and {entry.source_key!r} to "
            f"{entry.key!r}; each key must keep a name of its own"
        )
    entries[entry.key] = entry
