"""torch.distributed.checkpoint folders: ``.metadata`` plus ``*.distcp`` data files.

``.metadata`` is a pickle; we read it with an allow-list of the DCP metadata classes, so a
hostile file cannot run code. It gives every tensor's global shape and its chunks' global
offsets, and for each chunk the file, byte offset and length of a small ``torch.save`` zip
holding it. That inner zip is opened only when a rank needs the chunk, and then only the bytes of
the target box are copied out of its storage record. Megatron's ``torch_dist`` format is this.
"""

from __future__ import annotations

import functools
import io
import itertools
import math
import os
import pathlib
import pickle
import re
import reprlib
from pathlib import Path
from typing import Any, final

import torch

from lazyckpt.errors import CorruptModelCheckpointError, UnknownCheckpointFormatError
from lazyckpt.index import CheckpointIndex, Chunk, FileRegion, LazyRegion, TensorEntry, add_entry
from lazyckpt.loader import IndexedCheckpointLoader, KeyRules
from lazyckpt.options import ModelCheckpointLoadOptions
from lazyckpt.paths import member_path
from lazyckpt.plan import Box, intersect
from lazyckpt.torch_zip import (
    PickleMemo,
    ShapeMemo,
    StoredTensor,
    Unsupported,
    layout_by_name,
    read_torch_archive,
    restricted_find_class,
)

__all__ = ["DcpCheckpointLoader", "read_dcp_metadata"]

METADATA = ".metadata"
MEGATRON_FILES = ("common.pt", "metadata.json")
"""What Megatron-core's ``dist_checkpointing`` writes beside a ``torch_dist`` save: the state
that is not sharded (``common.pt``: the iteration, the arguments, and any plain tensor given to
the save, as an optimizer's scalars; the model's weights are sharded tensors, in the save) and
which backend wrote the folder. Both present mark the folder as Megatron's. Megatron writes
``common.pt`` first and these two last."""
_MAX_METADATA_BYTES = 1 << 30


class _Record:
    """A DCP metadata object as its pickle gives it: its fields as attributes, read without
    importing ``torch.distributed.checkpoint`` (0.9 s of a fresh process here, more than the
    rest of a load of a small checkpoint; ``dcp.load``'s callers have paid it, lazyckpt's need
    not). A field the pickle leaves out (``_StorageInfo`` drops those that are None) reads as
    None. The classes stand for torch's of the same name; nothing else is ever built."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots), as pickle writes
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise TypeError(f"a {type(self).__name__[1:]} with state {state!r}")
        self.__dict__.update(state)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probing for protocols
            raise AttributeError(name)
        return None

    @reprlib.recursive_repr()
    def __repr__(self) -> str:  # a damaged pickle can make a record hold itself
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{type(self).__name__[1:]}({fields})"


class _Metadata(_Record):
    pass


class _TensorStorageMetadata(_Record):
    pass


class _BytesStorageMetadata(_Record):
    pass


class _ChunkStorageMetadata(_Record):
    pass


class _MetadataIndex(_Record):
    pass


class _StorageMeta(_Record):
    pass


class _StorageInfo(_Record):
    pass


class _TensorProperties(_Record):
    def __setstate__(self, state: Any) -> None:
        # torch writes (dtype, layout, requires_grad, memory format's code, pin_memory).
        if isinstance(state, tuple) and len(state) == 5:
            self.dtype, self.layout, self.requires_grad, _, self.pin_memory = state
            return
        super().__setstate__(state)


class _SavePlan(_Record):
    pass


class _WriteItem(_Record):
    pass


class _TensorWriteData(_Record):
    pass


class _BytesIOWriteData(_Record):
    pass


def _enum_value(value: Any) -> Any:
    """An enum member as pickle rebuilds it, ``WriteItemType(value)``: the value itself."""
    return value


def _memory_format_code(value: Any) -> Any:
    """``_MEM_FORMAT_ENCODING(code)``: the code itself (the field is deprecated and unused)."""
    return value


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_PLANNER_MODULE = "torch.distributed.checkpoint.planner"
_DCP_CLASSES: dict[tuple[str, str], Any] = {
    (_METADATA_MODULE, "Metadata"): _Metadata,
    (_METADATA_MODULE, "TensorStorageMetadata"): _TensorStorageMetadata,
    (_METADATA_MODULE, "BytesStorageMetadata"): _BytesStorageMetadata,
    (_METADATA_MODULE, "ChunkStorageMetadata"): _ChunkStorageMetadata,
    (_METADATA_MODULE, "TensorProperties"): _TensorProperties,
    (_METADATA_MODULE, "MetadataIndex"): _MetadataIndex,
    (_METADATA_MODULE, "StorageMeta"): _StorageMeta,
    (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): _memory_format_code,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    # Megatron-core's torch_dist saves keep every rank's save plan in the metadata
    # (``all_local_plans``, for its cached-metadata saves); lazyckpt reads none of it.
    (_PLANNER_MODULE, "SavePlan"): _SavePlan,
    (_PLANNER_MODULE, "WriteItem"): _WriteItem,
    (_PLANNER_MODULE, "WriteItemType"): _enum_value,
    (_PLANNER_MODULE, "TensorWriteData"): _TensorWriteData,
    (_PLANNER_MODULE, "BytesIOWriteData"): _BytesIOWriteData,
}


_PATHLIB_MODULES = ("pathlib", "pathlib._local")
"""Where a pickle finds pathlib's classes: Python 3.13 defines them in ``pathlib._local``, so a
save whose ``checkpoint_id`` was a ``Path`` names that module when written there."""
_PATH_CLASSES = ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: Path, restrict: bool) -> None:
        super().__init__(io.BytesIO(data))
        self._path = path
        self._restrict = restrict

    def find_class(self, module: str, name: str) -> Any:
        found = _DCP_CLASSES.get((module, name))
        if found is not None:
            return found
        if module == "torch.serialization" and name == "_get_layout":
            return layout_by_name
        if module in _PATHLIB_MODULES and name in _PATH_CLASSES:
            return getattr(pathlib, name)
        found = restricted_find_class(module, name)
        if found is not None and module in ("torch", "builtins", "collections", "_codecs"):
            return found
        if self._restrict:
            raise CorruptModelCheckpointError(
                self._path,
                f"refers to the global '{module}.{name}', which is not a DCP metadata class; "
                "unpickling it could run code from the file. If you trust the checkpoint, load "
                "with restrict=False",
            )
        return super().find_class(module, name)


def read_dcp_metadata(path: Path, *, restrict: bool = True) -> Any:
    """The ``Metadata`` of a DCP ``.metadata`` file, unpickled with an allow-list: an object
    with the same fields as torch's, but not of its class (see :class:`_Record`)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CorruptModelCheckpointError(path, "is missing: the DCP save did not finish") from None
    if size > _MAX_METADATA_BYTES:
        raise CorruptModelCheckpointError(path, f"is {size} bytes, too large for DCP metadata")
    data = path.read_bytes()
    try:
        meta = _MetadataUnpickler(data, path, restrict).load()
    except CorruptModelCheckpointError:
        raise
    except Exception as exc:  # any malformed pickle is a file problem, never a crash
        raise CorruptModelCheckpointError(
            path, f"cannot be unpickled ({type(exc).__name__}: {exc}); the file is damaged"
        ) from None
    if not isinstance(meta, _Metadata):
        raise CorruptModelCheckpointError(path, f"holds a {type(meta).__name__}, not DCP Metadata")
    return meta


def _fqn(index: Any) -> str:
    """A storage index's key, for a message (``repr`` of what a damaged pickle put there)."""
    fqn = getattr(index, "fqn", None)
    return fqn if isinstance(fqn, str) else reprlib.repr(index)


def _check_disjoint(meta_path: Path, folder: Path, storage: dict[Any, Any]) -> None:
    """Every storage entry has its own bytes: two entries of one file whose windows overlap
    would read one chunk as another (of the same shape and dtype, nothing else would tell)."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for k, info in storage.items():
        rel = getattr(info, "relative_path", None)
        span = _ints((getattr(info, "offset", None), getattr(info, "length", None)))
        if isinstance(rel, str) and span is not None and span[1] > 0:
            by_file.setdefault(rel, []).append((span[0], span[0] + span[1], _fqn(k)))
    for rel, windows in by_file.items():
        windows.sort()
        for (a0, a1, a), (b0, b1, b) in itertools.pairwise(windows):
            # The SAFETENSORS format points every tensor at its file's safetensors blob (after
            # any pickled items): the windows overlap where the blob starts.
            if b0 < a1 and any(_is_safetensors(folder / rel, at) for at in (a0, b0)):
                raise _safetensors_format(folder / rel)
            if b0 < a1:
                raise CorruptModelCheckpointError(
                    meta_path,
                    f"the storage entries of {a!r} (bytes [{a0}, {a1})) and {b!r} (bytes "
                    f"[{b0}, {b1})) overlap in {rel}; the metadata is damaged",
                    key=b,
                )


def _safetensors_format(path: Path) -> UnknownCheckpointFormatError:
    return UnknownCheckpointFormatError(
        path,
        "is a safetensors file: the DCP folder was saved with "
        "FileSystemWriter(serialization_format=SAFETENSORS), whose .metadata does not say where "
        "each tensor lies (torch 2.13's own FileSystemReader cannot read it either); save with "
        "the default format (TORCH_SAVE)",
    )


def _is_safetensors(path: Path, at: int = 0) -> bool:
    """Whether ``path`` holds at byte ``at`` what starts a safetensors file: a header length,
    then ``{"``."""
    try:
        with open(path, "rb") as f:
            head = os.pread(f.fileno(), 10, at)
    except OSError:
        return False
    return len(head) == 10 and head[8:10] == b'{"' and int.from_bytes(head[:8], "little") > 1


def _ints(value: Any) -> tuple[int, ...] | None:
    """``value`` as a tuple of ints (not bools), or None. A loop, not ``all()`` of a generator:
    it runs for every chunk's offsets and sizes and every storage key."""
    if not isinstance(value, (tuple, list)):
        return None
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool):
            return None
    return tuple(value)


def megatron_files(names: list[str]) -> tuple[str, ...]:
    """Megatron-core's own files among the names of a DCP folder, if it wrote the folder."""
    return MEGATRON_FILES if all(n in names for n in MEGATRON_FILES) else ()


_RANK_METADATA = re.compile(r"__(0|[1-9]\d*)\.metadata")
"""What each rank writes instead of ``.metadata`` when saved with ``use_collectives=False``:
the metadata of its own chunks."""


def _rank_metadata(folder: Path, names: list[str]) -> list[tuple[int, str]]:
    """Each rank's ``__N.metadata`` file among ``names``, as (rank, name) in rank order."""
    return sorted(
        (int(m.group(1)), n)
        for n in names
        if (m := _RANK_METADATA.fullmatch(n)) is not None and (folder / n).is_file()
    )


def metadata_paths(folder: Path, names: list[str] | None = None) -> list[Path]:
    """The metadata files of the DCP save in ``folder``: its ``.metadata``, else every rank's
    ``__N.metadata`` in rank order; none if it holds neither. ``names``: the folder's listing,
    where the caller has it (a folder's format is told from one listing: no file is asked
    after that the listing does not hold)."""
    if (names is None or METADATA in names) and (folder / METADATA).is_file():
        return [folder / METADATA]
    local = _rank_metadata(folder, os.listdir(folder) if names is None else names)
    return [folder / n for _, n in local]


_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")
"""``FileSystemWriter``'s data files: ``__{rank}_{n}.distcp``."""


def _check_rank_metadata(folder: Path, local: list[tuple[int, str]], names: list[str]) -> None:
    """A save's metadata must be whole and of one save. Each rank of a ``use_collectives=False``
    save writes its own ``__N.metadata``: a gap in their numbers (a rank that died) would drop
    that rank's keys without a word. And torch saves into a folder over an earlier save without
    removing its metadata: a ``.metadata`` beside ``__N.metadata`` files is two saves' metadata,
    and the files cannot tell which is current (file times are not evidence: copies,
    downloads and archives rewrite or round them), so that is refused too. ``local``: the
    folder's :func:`_rank_metadata`."""
    if not local:
        return
    if (folder / METADATA).is_file():
        shown = local[0][1] + (" ..." if len(local) > 1 else "")
        raise CorruptModelCheckpointError(
            folder,
            f"holds a .metadata and {shown}: the metadata of two saves (torch saves into a "
            "folder over an earlier save without removing its metadata; each rank writes its "
            "own __N.metadata with use_collectives=False), and which one is current the files "
            "cannot tell; remove the stale one(s), or save into an empty folder",
        )
    gap = next((i for i, (rank, _) in enumerate(local) if i != rank), None)
    if gap is not None:
        raise CorruptModelCheckpointError(
            folder,
            f"lacks __{gap}.metadata, rank {gap}'s part of a save made with "
            f"use_collectives=False (each rank writes its own; {len(local)} of them are here): "
            "the save did not finish, or a file was lost; save again",
        )
    # The last rank's metadata lost leaves no gap; its data files tell (its keys were dropped).
    orphans = sorted(
        (int(m.group(1)), n)
        for n in names
        if (m := _DATA_FILE.fullmatch(n)) and int(m[1]) >= len(local)
    )
    if orphans:
        rank, name = orphans[0]
        raise CorruptModelCheckpointError(
            folder,
            f"holds {name}, rank {rank}'s data, but no __{rank}.metadata, its part of a save made "
            f"with use_collectives=False (each rank writes its own; {len(local)} of them are "
            "here): the save did not finish, or a file was lost; save again",
        )


def holds_set(folder: Path, names: list[str]) -> bool:
    """Whether ``folder``, whose entries are ``names``, holds a DCP save's metadata."""
    return bool(metadata_paths(folder, names))


def _chunk_place(chunk: Any) -> tuple[Any, ...]:
    return _ints(getattr(chunk, "offsets", None)), _ints(getattr(chunk, "sizes", None))


def _merged(metas: list[Any], paths: list[Path]) -> Any:
    """One ``Metadata`` for the rank-local ones of a save made with ``use_collectives=False``.
    Each rank listed its own chunks, and a replicated tensor's chunk is in every rank's file
    that holds it: each chunk is taken once, from the lowest rank's file that has it."""
    out: Any = _Metadata()
    out.state_dict_metadata, out.storage_data = {}, {}
    first: dict[str, Path] = {}
    taken: set[tuple[Any, ...]] = set()
    owners: dict[str, dict[tuple[Any, ...], Path]] = {}  # each key's chunk places, by file
    for meta, path in zip(metas, paths):
        tensors, storage = meta.state_dict_metadata, meta.storage_data
        if not isinstance(tensors, dict) or not isinstance(storage, dict):
            raise CorruptModelCheckpointError(path, "lacks state_dict_metadata or storage_data")
        md: Any
        for fqn, md in tensors.items():
            for c in getattr(md, "chunks", None) or ():
                owners.setdefault(fqn, {}).setdefault(_chunk_place(c), path)
            have = out.state_dict_metadata.get(fqn)
            if have is None:
                if isinstance(getattr(md, "chunks", None), list):  # extended below: a copy
                    md.__dict__["chunks"] = list(md.chunks)
                out.state_dict_metadata[fqn] = md
                first[fqn] = path
                continue
            if isinstance(md, _BytesStorageMetadata) and isinstance(have, _BytesStorageMetadata):
                continue
            same = (
                isinstance(md, _TensorStorageMetadata)
                and isinstance(have, _TensorStorageMetadata)
                and _ints(md.size) == _ints(have.size)
                and getattr(md.properties, "dtype", None) == getattr(have.properties, "dtype", None)
            )
            if not same or not isinstance(md.chunks, list) or not isinstance(have.chunks, list):
                raise CorruptModelCheckpointError(
                    path,
                    f"key {fqn!r} is described otherwise than in {first[fqn].name} ({md!r} "
                    f"against {have!r}); the ranks' metadata do not belong to one save",
                    key=fqn,
                )
            known = {_chunk_place(c) for c in have.chunks}
            have.chunks += [c for c in md.chunks if _chunk_place(c) not in known]
        for k, info in storage.items():
            where = (getattr(k, "fqn", None), _ints(getattr(k, "offset", None)))
            if where not in taken:
                taken.add(where)
                out.storage_data[k] = info
    for fqn, places in owners.items():
        _check_one_save(fqn, places, paths[0].parent)
    return out


def _uneven_keys_note(metas: list[Any], paths: list[Path]) -> list[str]:
    """A note where the ranks' metadata list different keys: pipeline stages do, but FSDP and
    TP ranks list every key (an empty shard too), and the files an earlier save with more
    ranks left behind add keys that only its ranks list, loaded without a word otherwise."""
    listed = [set(getattr(m, "state_dict_metadata", None) or ()) for m in metas]
    everywhere = set.intersection(*listed)
    uneven = sorted(set.union(*listed) - everywhere)
    if not uneven:
        return []
    key = uneven[0]
    having = [p.name for p, keys in zip(paths, listed) if key in keys]
    more = f" (and {len(uneven) - 1} more keys)" if len(uneven) > 1 else ""
    return [
        f"the ranks' metadata list different keys: {key!r}{more} is in "
        f"{', '.join(having[:4])}{' ...' if len(having) > 4 else ''} only, as pipeline stages "
        "save; in a save of one stage, the files of an earlier save with more ranks are left "
        "in the folder: remove them"
    ]


def _check_one_save(fqn: str, places: dict[tuple[Any, ...], Path], folder: Path) -> None:
    """Refuse chunks of one key from two ranks' metadata that overlap without being one chunk:
    no save writes that, but a save with fewer ranks over an earlier one does, overwriting
    ``__0.metadata`` ... and leaving the earlier save's higher ranks' files. (The plan would
    refuse the overlap too, as damaged metadata.)"""
    live = [
        (offsets, sizes, path)
        for (offsets, sizes), path in places.items()
        if offsets and sizes and len(offsets) == len(sizes) and all(n > 0 for n in sizes)
    ]
    live = [c for c in live if len(c[0]) == len(live[0][0])] if live else live
    if len(live) < 2:
        return
    # Swept along the dim the chunks are cut on most (dim 1 for a TP split of a weight's
    # columns), so that each chunk meets only its neighbours there.
    d = max(range(len(live[0][0])), key=lambda i: len({off[i] for off, _, _ in live}))
    spans = sorted(live, key=lambda c: c[0][d])
    for i, (a_off, a_size, a_path) in enumerate(spans):
        for b_off, b_size, b_path in spans[i + 1 :]:
            if b_off[d] >= a_off[d] + a_size[d]:
                break
            if b_path != a_path and intersect(Box(a_off, a_size), Box(b_off, b_size)):
                raise CorruptModelCheckpointError(
                    folder,
                    f"key {fqn!r}: {b_path.name} places a chunk (offsets {b_off}, sizes "
                    f"{b_size}) over one of {a_path.name} (offsets {a_off}, sizes {a_size}): "
                    "the ranks' metadata are of two saves. A save with use_collectives=False "
                    "into a folder that held one with more ranks overwrites __0.metadata ... "
                    "and leaves the others' __N.metadata and __N_*.distcp behind: remove the "
                    "earlier save's files, or save into an empty folder",
                    key=fqn,
                )


@final
class DcpCheckpointLoader(IndexedCheckpointLoader):
    """A ``torch.distributed.checkpoint`` folder (FSDP2, 2-D FSDP2+TP, Megatron ``torch_dist``)."""

    name = "dcp"

    def supports_path(self, path: str | os.PathLike[str]) -> bool:
        p = Path(path)
        if p.is_file():
            return p.name == METADATA or _RANK_METADATA.fullmatch(p.name) is not None
        return p.is_dir() and bool(metadata_paths(p))

    def build_index(
        self, path: Path, rules: KeyRules, options: ModelCheckpointLoadOptions
    ) -> CheckpointIndex:
        folder = path.parent if path.is_file() else path
        names = os.listdir(folder)
        local = _rank_metadata(folder, names)
        # So ranks' files are there only without .metadata, and every rank's is there.
        _check_rank_metadata(folder, local, names)
        meta_paths = [folder / n for _, n in local] or [folder / METADATA]  # (missing: when read)
        metas = [read_dcp_metadata(p, restrict=options.restrict) for p in meta_paths]
        # Errors about the metadata name its file, or the folder for the ranks' files together.
        meta_path = meta_paths[0] if len(meta_paths) == 1 else folder
        meta = metas[0] if len(metas) == 1 else _merged(metas, meta_paths)
        notes = [] if len(metas) == 1 else _uneven_keys_note(metas, meta_paths)
        tensors = meta.state_dict_metadata
        storage = meta.storage_data
        if not isinstance(tensors, dict) or not isinstance(storage, dict):
            raise CorruptModelCheckpointError(
                meta_path, "lacks state_dict_metadata or storage_data"
            )
        where: dict[tuple[str, tuple[int, ...]], Any] = {}
        for k, info in storage.items():
            fqn, offset = getattr(k, "fqn", None), _ints(getattr(k, "offset", None))
            if isinstance(fqn, str) and offset is not None:
                where[(fqn, offset)] = info
        _check_disjoint(meta_path, folder, storage)
        files: dict[str, tuple[Path, int]] = {}
        entries: dict[str, TensorEntry] = {}
        memo: PickleMemo = {}  # chunks of one shape and dtype share their data.pkl
        shapes: ShapeMemo = {}  # ... and all their bytes but the data and its CRC
        megatron = bool(megatron_files(names))  # as detection tells it
        if megatron:
            notes.append(
                f"ignored {MEGATRON_FILES[0]}: Megatron-core's state that is not sharded "
                "(iteration, arguments, any plain tensor given to its save), not read; "
                "torch.load it for those"
            )
        pickled = [fqn for fqn, md in tensors.items() if isinstance(md, _BytesStorageMetadata)]
        if pickled and len(pickled) == len(tensors):
            shown = ", ".join(repr(f) for f in pickled[:5]) + (" ..." if len(pickled) > 5 else "")
            why = (
                "Megatron's ShardedObjects, with its common state in common.pt"
                if megatron
                else "DCP pickles what its planner does not flatten, so a state dict saved with "
                "DefaultSavePlanner(flatten_state_dict=False) is one object; save with the "
                "default planner, or convert the folder with torch.distributed.checkpoint."
                "format_utils.dcp_to_torch_save and load the file it writes"
            )
            raise CorruptModelCheckpointError(
                meta_path, f"holds no tensor, only pickled objects ({shown}): {why}"
            )
        what = "Megatron's ShardedObject" if megatron else "a pickled object"
        for fqn, md in tensors.items():
            if isinstance(md, _BytesStorageMetadata):
                notes.append(f"skipped {fqn!r}: {what}, not a tensor")
                continue
            target = rules.target(fqn) if isinstance(fqn, str) else None
            if target is None:
                continue
            if not isinstance(md, _TensorStorageMetadata):
                raise CorruptModelCheckpointError(
                    meta_path, f"key {fqn!r} has metadata of type {type(md).__name__}", key=fqn
                )
            dtype = getattr(md.properties, "dtype", None)
            shape = _ints(md.size)
            if not isinstance(dtype, torch.dtype) or shape is None or any(s < 0 for s in shape):
                raise CorruptModelCheckpointError(
                    meta_path,
                    f"key {fqn!r} has a bad dtype or size ({dtype!r}, {md.size!r})",
                    key=fqn,
                )
            if not isinstance(md.chunks, list):
                raise CorruptModelCheckpointError(
                    meta_path, f"key {fqn!r} has no chunk list", key=fqn
                )
            chunks = []
            for ch in md.chunks:
                offsets, sizes = (
                    _ints(getattr(ch, "offsets", None)),
                    _ints(getattr(ch, "sizes", None)),
                )
                if offsets is None or sizes is None:
                    raise CorruptModelCheckpointError(
                        meta_path,
                        f"key {fqn!r} has a chunk without integer offsets and sizes",
                        key=fqn,
                    )
                info = where.get((fqn, offsets))
                if info is None:
                    raise CorruptModelCheckpointError(
                        meta_path,
                        f"key {fqn!r}: the chunk at offsets {list(offsets)} has no "
                        "storage entry; the metadata is damaged",
                        key=fqn,
                    )
                chunks.append(
                    Chunk(
                        offsets,
                        sizes,
                        self._chunk_data(
                            folder,
                            meta_path,
                            files,
                            fqn,
                            info,
                            dtype,
                            sizes,
                            options.restrict,
                            memo,
                            shapes,
                        ),
                    )
                )
            add_entry(entries, TensorEntry(target, dtype, shape, (tuple(chunks),), fqn))
        return CheckpointIndex(
            path=folder,
            format=self.name,
            entries=entries,
            files=[*meta_paths, *(p for p, _ in files.values())],
            metadata_files=meta_paths,
            source_layout=f"{len(files)} .distcp file(s), "
            f"{sum(len(e.chunks) for e in entries.values())} chunks",
            notes=notes,
        )

    @staticmethod
    def _chunk_data(
        folder: Path,
        meta_path: Path,
        files: dict[str, tuple[Path, int]],
        fqn: str,
        info: Any,
        dtype: torch.dtype,
        sizes: tuple[int, ...],
        restrict: bool,
        memo: PickleMemo,
        shapes: ShapeMemo,
    ) -> LazyRegion:
        rel = getattr(info, "relative_path", None)
        span = _ints((getattr(info, "offset", None), getattr(info, "length", None)))
        if not isinstance(rel, str) or span is None or min(span) < 0:
            raise CorruptModelCheckpointError(
                meta_path, f"key {fqn!r} has a malformed storage entry", key=fqn
            )
        offset, length = span
        if getattr(info, "transform_descriptors", None):
            raise UnknownCheckpointFormatError(
                meta_path,
                f"key {fqn!r} is stored with transforms {info.transform_descriptors} (the "
                "writer's _extensions: compression or encryption), which lazyckpt cannot read in "
                "place; save without _extensions, or convert the folder with torch.distributed."
                "checkpoint.format_utils.dcp_to_torch_save and load the file it writes",
                key=fqn,
            )
        if rel not in files:
            p = member_path(folder, rel, cited_by=meta_path)
            files[rel] = (p, p.stat().st_size)
        file, size = files[rel]
        if offset + length > size:
            raise CorruptModelCheckpointError(
                file,
                f"key {fqn!r} needs bytes [{offset}, {offset + length}) but the file has "
                f"{size}; it is truncated: copy it again",
                key=fqn,
            )
        locate = functools.partial(
            _locate, file, offset, length, fqn, dtype, sizes, restrict, memo, shapes
        )
        return LazyRegion(file, locate, (offset, length))


def _locate(
    file: Path,
    offset: int,
    length: int,
    fqn: str,
    dtype: torch.dtype,
    sizes: tuple[int, ...],
    restrict: bool,
    memo: PickleMemo,
    shapes: ShapeMemo,
    fd: int | None,
    size: int | None,
) -> FileRegion:
    """Open the chunk's inner torch zip and find its storage record (header reads only);
    ``fd``: ``file`` already open, or None; ``size``: its size, if known."""
    try:
        archive = read_torch_archive(
            file,
            restrict=restrict,
            window=(offset, length),
            fd=fd,
            size=size,
            memo=memo,
            shapes=shapes,
        )
    except CorruptModelCheckpointError as exc:
        if _is_safetensors(file, offset):
            raise _safetensors_format(file) from None
        raise CorruptModelCheckpointError(
            file, f"key {fqn!r}: the chunk at byte {offset}: {exc.detail}", key=fqn
        ) from None
    if archive.forbidden:
        raise CorruptModelCheckpointError(
            file, f"key {fqn!r}: the chunk at byte {offset}: {archive.forbidden_message()}", key=fqn
        )
    stored = archive.obj
    if isinstance(stored, Unsupported):  # quantized, sparse, a subclass: say which, and the fix
        raise CorruptModelCheckpointError(
            file,
            f"key {fqn!r}: the chunk at byte {offset} holds {stored.what}, which lazyckpt "
            f"cannot load; {stored.hint}",
            key=fqn,
        )
    if not isinstance(stored, StoredTensor):
        raise CorruptModelCheckpointError(
            file,
            f"key {fqn!r}: the chunk at byte {offset} holds a {type(stored).__name__}, "
            "not a tensor",
            key=fqn,
        )
    # A chunk of no elements may be stored in any empty shape: FSDP2 saves the shards of a
    # (4, 0) parameter as (0, 0) tensors under chunks of (2, 0). Nothing is read from it.
    empty = math.prod(stored.sizes) == 0 and math.prod(sizes) == 0
    if stored.dtype != dtype or (stored.sizes != sizes and not empty):
        raise CorruptModelCheckpointError(
            file,
            f"key {fqn!r}: the chunk at byte {offset} is {stored.dtype} {list(stored.sizes)} "
            f"but .metadata says {dtype} {list(sizes)}",
            key=fqn,
        )
    return archive.region(stored, fqn)
