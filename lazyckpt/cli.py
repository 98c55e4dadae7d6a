"""The ``lazyckpt`` command: inspect, plan, verify and reshard checkpoints, and a demo.

Every command is a thin layer over the library: ``inspect`` prints the index, ``plan`` the load
plan of one rank, ``verify`` runs every check the index, the planner and (with ``--read``) the
reader make, collecting all problems instead of stopping at the first, and ``reshard`` streams
each rank through :func:`lazyckpt.writers.reshard`.

Exit codes: 0 ok, 1 a checkpoint problem (or a failed write), 2 a usage problem, 130 interrupted.
Errors are one line on stderr; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import os
import signal
import sys
import traceback
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import torch

from lazyckpt.build import output_dtype
from lazyckpt.claims import Claims
from lazyckpt.errors import (
    CheckpointWarning,
    CorruptModelCheckpointError,
    ModelCheckpointError,
    ShardDimsWarning,
)
from lazyckpt.index import CheckpointIndex, FileRegion, LazyRegion
from lazyckpt.layout import Layout
from lazyckpt.load_plan import TensorPlan, check_copies, entry_path, plan_entry
from lazyckpt.loader import IndexedCheckpointLoader, read_as_replicas
from lazyckpt.loaders import detect_loader
from lazyckpt.options import KeyMap, ModelCheckpointLoadOptions, apply_key_map
from lazyckpt.plan import element_offset, span
from lazyckpt.presets import PRESETS, ShardDimPreset
from lazyckpt.stats import LoadStats, byte_bar

__all__ = ["ShardDimsChoice", "build_parser", "main", "resolve_shard_dims"]

EXIT_OK, EXIT_CHECKPOINT, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PIPE = 0, 1, 2, 130, 141

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DEFAULT_PREFETCH = ModelCheckpointLoadOptions().prefetch_bytes


class UsageError(ValueError):
    """A bad argument found after parsing (an unknown preset, a malformed JSON file ...)."""


# -- output helpers ----------------------------------------------------------------------------


def human(n: int | float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _shape(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape) if shape else "()"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _progress_enabled() -> bool:
    """Bars only for a person watching: quiet when stderr is a file or a pipe."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _note(text: str) -> None:
    print(f"lazyckpt: note: {text}", file=sys.stderr)


def _one_line(exc: BaseException) -> str:
    text = " ".join((str(exc) or type(exc).__name__).split())
    # The library's ways out, as the command line spells them.
    if "restrict=False" in text:
        text += " (on the command line: --no-restrict)"
    if "shard_dims" in text:
        text += " (on the command line: --shard-dims, a preset or a JSON file {key: dim}"
        text += ", naming keys as --key-map leaves them)" if "key_map" in text else ")"
    return text


# -- shard dims ----------------------------------------------------------------------------


class PresetShardDims(Mapping[str, int]):
    """A preset's rules as a mapping over whatever keys the loader asks about.

    Model-parallel loaders need a key's shard dim while they build the index, before the keys
    are known to us, so the rules are applied on demand; iteration lists the keys seen so far.
    """

    def __init__(self, preset: ShardDimPreset, key_map: KeyMapFile | None = None) -> None:
        self.preset = preset
        self.key_map = key_map
        """``--key-map``: keys are asked about under their new names. The preset's rule for
        the new name holds (a map to Meta's names, so that a preset splits them), else its
        rule for the checkpoint's name (``output.weight`` renamed ``lm_head.weight`` is still
        split as ``output.weight`` is)."""
        self._seen: dict[str, int | None] = {}

    def _lookup(self, key: str) -> int | None:
        if key not in self._seen:
            dim = self.preset.shard_dims([key]).get(key)
            if dim is None and self.key_map is not None:
                source = self.key_map.source_of(key)
                if source != key:
                    dim = self.preset.shard_dims([source]).get(source)
            self._seen[key] = dim
        return self._seen[key]

    def __getitem__(self, key: str) -> int:
        dim = self._lookup(key) if isinstance(key, str) else None
        if dim is None:
            raise KeyError(key)
        return dim

    def __iter__(self) -> Iterator[str]:
        return iter([k for k, d in self._seen.items() if d is not None])

    def __len__(self) -> int:
        return sum(1 for d in self._seen.values() if d is not None)


@dataclass
class ShardDimsChoice:
    """The shard dims a command uses and where they came from (for the user to see)."""

    dims: Mapping[str, int]
    source: str
    """``none``, ``preset NAME``, ``detected NAME`` or ``file PATH``."""

    def concrete(self, keys: Sequence[str]) -> dict[str, int]:
        return {k: self.dims[k] for k in keys if k in self.dims}


def load_shard_dims(spec: str, key_map: KeyMapFile | None = None) -> ShardDimsChoice:
    """``--shard-dims``: a preset name (its rules applied to keys as the checkpoint names them,
    before ``key_map``) or a JSON file ``{key: dim}`` (keys as ``key_map`` leaves them)."""
    if spec in PRESETS:
        return ShardDimsChoice(PresetShardDims(PRESETS[spec], key_map), f"preset {spec}")
    path = Path(spec)
    if not path.exists() or path.is_dir():  # a pipe (<(...)) is not a regular file, but reads
        raise UsageError(
            f"--shard-dims {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
            "JSON file mapping keys to dims"
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--shard-dims {spec}: cannot read it as JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"--shard-dims {spec}: expected a JSON object {{key: dim}}")
    for key, dim in doc.items():
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise UsageError(f"--shard-dims {spec}: the dim of {key!r} is {dim!r}, not an integer")
    return ShardDimsChoice(dict(doc), f"file {path}")


class KeyMapFile:
    """``--key-map FILE.json``: ``{checkpoint key: new name, or null to drop it}``, as
    ``options.key_map``. A function rather than the mapping itself so that it can say which of
    its keys no checkpoint key was looked up under (a typo renames nothing)."""

    def __init__(self, spec: str, mapping: dict[str, str | None]) -> None:
        self.spec = spec
        self.mapping = mapping
        self.seen: set[str] = set()
        self._sources: dict[str, str] | None = None

    def __call__(self, key: str) -> str | None:
        if key in self.mapping:
            self.seen.add(key)
            return self.mapping[key]
        return key

    def unused(self) -> list[str]:
        return [k for k in self.mapping if k not in self.seen]

    def source_of(self, name: str) -> str:
        """The checkpoint key that ``name``, a name after the map, comes from."""
        if self._sources is None:
            self._sources = {new: old for old, new in self.mapping.items() if new is not None}
        return self._sources.get(name, name)

    def renamed(self, key: str) -> str | None:
        """What a checkpoint key is called after the map (without counting it as used)."""
        return self.mapping.get(key, key)


def load_key_map(spec: str) -> KeyMapFile:
    """``--key-map``: a JSON file ``{key: new name or null}``."""
    path = Path(spec)
    if not path.exists() or path.is_dir():
        raise UsageError(
            f"--key-map {spec!r} is not a file: expected a JSON file mapping checkpoint keys to "
            "new names (null drops a key)"
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UsageError(f"--key-map {spec}: cannot read it as JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"--key-map {spec}: expected a JSON object {{key: new name or null}}")
    for key, new in doc.items():
        if new == "":
            raise UsageError(f"--key-map {spec}: {key!r} maps to an empty name; give a name")
        if new is not None and not isinstance(new, str):
            raise UsageError(
                f"--key-map {spec}: {key!r} maps to {new!r}; give a new name (a string), or "
                "null to drop the key"
            )
    return KeyMapFile(spec, doc)


def _warn_unused_key_map(options: ModelCheckpointLoadOptions) -> None:
    """A note naming the ``--key-map`` keys the checkpoint lacks (after an index is built)."""
    key_map = options.key_map
    if not isinstance(key_map, KeyMapFile):
        return
    unused = key_map.unused()
    if unused:
        shown = ", ".join(repr(k) for k in unused[:5]) + (" ..." if len(unused) > 5 else "")
        _note(
            f"--key-map {key_map.spec}: {len(unused)} key(s) the checkpoint lacks, ignored: "
            f"{shown}; name keys as the checkpoint does (lazyckpt inspect lists them)"
        )


def detect_preset(
    loader: IndexedCheckpointLoader, path: Path, base: ModelCheckpointLoadOptions | None = None
) -> str | None:
    """The one Llama fairscale preset under which the checkpoint is consistent, if any.

    Llama's ``tok_embeddings`` and ``output`` weights are both (vocab, dim); only the right rule
    for ``tok_embeddings`` (dim 0 in Llama 3, dim 1 in Llama 1/2) reassembles them to the same
    shape. With one rank file both rules agree and nothing is detected.
    """
    if loader.name != "fairscale":
        return None
    key_map = _key_map_file(base)
    # Under their Meta names (the checkpoint's, or a --key-map's to them), else as --key-map
    # renames them.
    names = ("tok_embeddings.weight", "output.weight")
    renamed = names if key_map is None else tuple(key_map.renamed(k) for k in names)
    found = []
    for name, preset in PRESETS.items():
        dims = PresetShardDims(preset, key_map)
        try:
            # Bad keys are dropped, so one damaged tensor does not hide the layout.
            index, _ = index_collecting(loader, path, dims, Problems(), base)
        except ValueError:
            continue
        if index is None:
            continue
        emb, out = (
            index.entries[k] if k in index.entries else index.entries.get(r or "")
            for k, r in zip(names, renamed)
        )
        if emb is not None and out is not None and emb.shape == out.shape and len(index.files) > 1:
            found.append(name)
    return found[0] if len(found) == 1 else None


def resolve_shard_dims(
    spec: str | None,
    loader: IndexedCheckpointLoader,
    path: Path,
    base: ModelCheckpointLoadOptions | None = None,
) -> ShardDimsChoice:
    """``--shard-dims`` if given; for a fairscale MP-N folder without it, a preset detected
    from the shapes; else none (every key replicated)."""
    if spec is not None:
        choice = load_shard_dims(spec, _key_map_file(base))
        if spec in PRESETS:
            name = detect_preset(loader, path, base)
            if name is not None and name != spec:
                _note(
                    f"--shard-dims {spec}: the shapes fit preset {name} (under {spec}, "
                    "tok_embeddings and output do not reassemble to one shape); check the "
                    "model's version"
                )
        return choice
    name = detect_preset(loader, path, base)
    if name is not None:
        _note(f"shard dims: detected preset {name} from the shapes; pass --shard-dims to override")
        return ShardDimsChoice(
            PresetShardDims(PRESETS[name], _key_map_file(base)), f"detected {name}"
        )
    return ShardDimsChoice({}, "none")


def _key_map_file(options: ModelCheckpointLoadOptions | None) -> KeyMapFile | None:
    key_map = None if options is None else options.key_map
    return key_map if isinstance(key_map, KeyMapFile) else None


def _warn_no_dims(choice: ShardDimsChoice, index: CheckpointIndex, tp: int = 1) -> None:
    """Notes on shard dims that cannot be what the user meant: keys of a ``--shard-dims`` file
    that the checkpoint lacks (a typo splits nothing), or none for a model-parallel set."""
    if choice.source.startswith("file "):
        unknown = [k for k in choice.dims if k not in index.entries]
        if unknown:
            shown = ", ".join(repr(k) for k in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
            _note(
                f"--shard-dims {choice.source[5:]}: {len(unknown)} key(s) the checkpoint lacks, "
                f"ignored: {shown}"
            )
    if choice.concrete(list(index.entries)):
        return
    if read_as_replicas(index):
        _note(
            f"no shard dims: {index.format} files do not record how keys are split, so each "
            "key is taken as a replica; pass --shard-dims "
            f"{'|'.join(sorted(PRESETS))}|FILE.json"
        )
    elif tp > 1:
        _note(f"no shard dims: every key is replicated whole on all {tp} TP ranks")


# -- inspect -------------------------------------------------------------------------------


def _file_sizes(index: CheckpointIndex) -> list[tuple[Path, int]]:
    out = []
    for f in index.files:
        try:
            out.append((f, f.stat().st_size))
        except OSError:
            out.append((f, -1))
    return out


def cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.path)
    base = _base_options(args)
    loader = detect_loader(path)
    choice = resolve_shard_dims(args.shard_dims, loader, path, base)
    index = loader.index(path, choice.dims, base)
    _warn_no_dims(choice, index)
    _warn_unused_key_map(base)
    keys = list(index.entries)
    dims = choice.concrete(keys)
    files = _file_sizes(index)
    chunks = sum(len(e.chunks) for e in index)
    if args.json:
        doc = {
            "path": str(index.path),
            "format": index.format,
            "source_layout": index.source_layout,
            "files": [{"path": str(f), "bytes": n} for f, n in files],
            "shard_dims": {"source": choice.source, "dims": dims},
            "notes": index.notes,
            "metadata": dict(index.metadata),
            "keys": [
                {
                    "key": e.key,
                    "dtype": _dtype(e.dtype),
                    "shape": list(e.shape),
                    "chunks": len(e.chunks),
                    "copies": len(e.copies),
                    "bytes": e.nbytes,
                    "shard_dim": dims.get(e.key),
                }
                for e in index
            ],
            "total_keys": len(index),
            "total_chunks": chunks,
            "total_bytes": index.nbytes,
            "total_file_bytes": sum(max(n, 0) for _, n in files),
        }
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    print(f"path:        {index.path}")
    print(f"format:      {index.format}")
    on_disk = sum(max(n, 0) for _, n in files)
    print(f"layout:      {index.source_layout}")
    print(f"files:       {len(files)}, {human(on_disk)} on disk; {chunks} chunk(s)")
    print(f"shard dims:  {choice.source} ({len(dims)} of {len(index)} keys split)")
    for note in index.notes:
        print(f"note:        {note}")
    print()
    rows = [["key", "dtype", "shape", "chunks", "copies", "bytes"]]
    for e in index:
        rows.append(
            [
                e.key,
                _dtype(e.dtype),
                _shape(e.shape),
                str(len(e.chunks)),
                str(len(e.copies)),
                human(e.nbytes),
            ]
        )
    rows.append([f"total: {len(index)} keys", "", "", str(chunks), "", human(index.nbytes)])
    print(_table(rows, right=(3, 4, 5)))
    return EXIT_OK


# -- plan ----------------------------------------------------------------------------------


@dataclass
class PlanSummary:
    read: dict[Path, int]
    verified: dict[Path, int]
    delivered: int
    largest: int
    peak: int


def summarize_plans(
    plans: Sequence[TensorPlan],
    *,
    dtype: torch.dtype | None = None,
    mmap: bool = True,
    prefetch_bytes: int = _DEFAULT_PREFETCH,
) -> PlanSummary:
    """Bytes each file gives this rank, and the memory the load needs at its peak.

    The peak is the tensor the caller holds plus what the prefetch thread may have built ahead
    under its budget (always at least the next tensor); zero-copy views of mapped files count
    nothing, since their pages belong to the page cache. It is a bound: a key counts as a view
    only where the load is sure to make one (not a DCP chunk, located at load time and copied
    where its bytes are not aligned to its dtype; not a key over bytes that an earlier view
    holds, see :mod:`lazyckpt.claims`), and a stitched view counts as the copy it may be.
    """
    read: dict[Path, int] = {}
    verified: dict[Path, int] = {}
    mem, cost = [], []
    claims: dict[Path, Claims] = {}
    for p in plans:
        item = p.entry.dtype.itemsize
        for piece in p.pieces:
            path = p.chunks[piece.chunk].path
            if path is not None:
                read[path] = read.get(path, 0) + piece.numel * item
        for copy, pieces in p.verify:
            for piece in pieces:
                path = p.entry.copies[copy][piece.chunk].path
                if path is not None:
                    verified[path] = verified.get(path, 0) + piece.numel * item
        out = output_dtype(p.entry.dtype, dtype)
        # A box inside one chunk of a mapped file, not cast, is yielded as a (strided) view.
        view = (
            mmap
            and p.may_be_view
            and out == p.entry.dtype
            and bool(p.pieces)
            and _sure_view(p, claims)
        )
        extra = p.nbytes if p.verify else 0  # a replica copy read alongside, to compare
        mem.append(0 if view else p.box.numel * out.itemsize + extra)
        cost.append(0 if p.may_be_view and mmap else p.nbytes)
    peak = 0
    for i in range(len(plans)):
        ahead, budget_used = 0, 0
        for j in range(i + 1, len(plans)):
            if j > i + 1 and budget_used + cost[j] > prefetch_bytes:
                break
            budget_used += cost[j]
            ahead += mem[j]
        peak = max(peak, mem[i] + ahead)
    return PlanSummary(
        read=read,
        verified=verified,
        delivered=sum(p.nbytes for p in plans),
        largest=max(mem, default=0),
        peak=peak,
    )


def _sure_view(p: TensorPlan, claims: dict[Path, Claims]) -> bool:
    """Whether the load is sure to yield ``p``'s box (in one chunk) as a view: its chunk's place
    is known and aligned, and no view before it holds its bytes (the views recorded in
    ``claims``, per file, as a stream records them)."""
    piece = p.pieces[0]
    region = p.chunks[piece.chunk].data
    itemsize = p.entry.dtype.itemsize
    if not isinstance(region, FileRegion) or region.byte_offset % itemsize:
        return False
    first = region.byte_offset + element_offset(piece.src_offsets, region.strides) * itemsize
    stop = first + span(piece.sizes, region.strides) * itemsize
    files = claims.setdefault(region.path, Claims())
    return files.claim(first, stop, piece.sizes, region.strides, itemsize)


def _layout_of(args: argparse.Namespace) -> Layout:
    for rank, size, flag in ((args.tp_rank, args.tp, "tp"), (args.dp_rank, args.dp, "dp")):
        if rank >= size:
            raise UsageError(
                f"--{flag}-rank {rank} needs --{flag} {rank + 1} or more (ranks count from 0)"
            )
    return Layout(tp_size=args.tp, tp_rank=args.tp_rank, dp_size=args.dp, dp_rank=args.dp_rank)


def cmd_plan(args: argparse.Namespace) -> int:
    path = Path(args.path)
    layout = _layout_of(args)
    base = _base_options(args)
    loader = detect_loader(path)
    choice = resolve_shard_dims(args.shard_dims, loader, path, base)
    dtype = DTYPES[args.dtype] if args.dtype else None
    options = replace(base, layout=layout, dtype=dtype)
    index, plans = loader.plan(path, choice.dims, options)
    _warn_no_dims(choice, index, layout.tp_size)
    _warn_unused_key_map(base)
    for note in index.notes:
        _note(note)
    s = summarize_plans(plans, dtype=dtype, prefetch_bytes=options.prefetch_bytes)
    # Replica copies are read to be compared, so they count as read (as LoadStats counts them).
    per_file = dict(s.read)
    for f, n in s.verified.items():
        per_file[f] = per_file.get(f, 0) + n
    data_files = [f for f in index.files if f not in index.metadata_files]
    unread = [f for f in data_files if f not in per_file]
    total_read = sum(per_file.values())
    if args.json:
        doc = {
            "path": str(index.path),
            "format": index.format,
            "source_layout": index.source_layout,
            "layout": {
                "tp_size": layout.tp_size,
                "tp_rank": layout.tp_rank,
                "dp_size": layout.dp_size,
                "dp_rank": layout.dp_rank,
            },
            "shard_dims": {"source": choice.source, "dims": choice.concrete(list(index.entries))},
            "files": [{"path": str(f), "bytes": n} for f, n in per_file.items()],
            "files_not_read": [str(f) for f in unread],
            "notes": index.notes,
            "bytes_read": total_read,
            "bytes_verified": sum(s.verified.values()),
            "bytes_delivered": s.delivered,
            "largest_tensor_bytes": s.largest,
            "peak_memory_bytes": s.peak,
            "prefetch_bytes": options.prefetch_bytes,
            "keys": [
                {
                    "key": p.key,
                    "dtype": _dtype(output_dtype(p.entry.dtype, dtype)),
                    "shape": list(p.box.sizes),
                    "offsets": list(p.box.offsets),
                    # The tensor the rank gets, in its output dtype (bytes_delivered counts
                    # the boxes in the checkpoint's dtypes, as LoadStats does).
                    "bytes": p.box.numel * output_dtype(p.entry.dtype, dtype).itemsize,
                    "files": sorted(str(f) for f in p.files()),
                }
                for p in plans
            ],
        }
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    print(f"plan for {layout} of {index.path} ({index.format}, {index.source_layout})")
    n_split = len(choice.concrete(list(index.entries)))
    print(f"shard dims: {choice.source} ({n_split} of {len(index)} keys split)")
    print(f"reads {len(per_file)} of {len(data_files)} data file(s):")
    root = _root(index)
    rows = [
        [f"  {f.relative_to(root) if f.is_relative_to(root) else f}", human(n)]
        for f, n in per_file.items()
    ]
    if rows:
        print(_table(rows, right=(1,)))
    print(f"bytes read:     {human(total_read)} ({total_read} B) for {len(plans)} tensors")
    if s.verified:
        print(
            f"                of which {human(sum(s.verified.values()))} replica copies, "
            "compared then dropped"
        )
    print(
        f"peak memory:    up to {human(s.peak)} (largest tensor {human(s.largest)}, prefetch up "
        f"to {human(options.prefetch_bytes)}; zero-copy views of mapped files not counted)"
    )
    return EXIT_OK


def _root(index: CheckpointIndex) -> Path:
    return index.path if index.path.is_dir() else index.path.parent


# -- verify --------------------------------------------------------------------------------


def key_of(exc: BaseException) -> str | None:
    """The checkpoint key an error is about, when it is about one."""
    return getattr(exc, "key", None)


class Problems:
    """Every problem found, once each, in the order found."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, exc: BaseException | str) -> None:
        text = exc if isinstance(exc, str) else _one_line(exc)
        if text not in self.items:
            self.items.append(text)

    def __bool__(self) -> bool:
        return bool(self.items)


def _drop(keys: frozenset[str], base: ModelCheckpointLoadOptions | None) -> KeyMap | None:
    """The caller's ``key_map`` (``--key-map``) with ``keys``, checkpoint keys (as errors and
    the checks here name them), dropped as well."""
    user = base.key_map if base is not None else None
    if not keys:
        return user
    return lambda k: None if k in keys else apply_key_map(user, k)


def index_collecting(
    loader: IndexedCheckpointLoader,
    path: Path,
    dims: Mapping[str, int],
    problems: Problems,
    base: ModelCheckpointLoadOptions | None = None,
) -> tuple[CheckpointIndex | None, set[str]]:
    """Index ``path``; when a key is bad, note it, drop it and index again, so one bad key does
    not hide the next. Returns the index (``None`` when a problem names no key) and the
    dropped keys."""
    dropped: set[str] = set()
    while True:
        options = replace(
            base or ModelCheckpointLoadOptions(), key_map=_drop(frozenset(dropped), base)
        )
        try:
            return loader.index(path, dims, options), dropped
        except OSError as exc:  # unreadable (permissions, I/O error): a problem like the rest
            problems.add(exc)
            return None, dropped
        except ModelCheckpointError as exc:
            problems.add(exc)
            key = key_of(exc)
            if key is None or key in dropped:
                return None, dropped
            dropped.add(key)


def check_entries(index: CheckpointIndex, dims: Mapping[str, int], problems: Problems) -> set[str]:
    """Coverage, overlap and bounds of every chunk of every key; returns the bad keys, as the
    checkpoint names them."""
    bad: set[str] = set()
    sizes: dict[Path, int] = {}

    def size_of(path: Path) -> int:
        if path not in sizes:
            sizes[path] = path.stat().st_size
        return sizes[path]

    for entry in index:
        try:
            plan_entry(entry, dims, Layout(), entry_path(index.path, entry))
            check_copies(index, (entry,))
        except ModelCheckpointError as exc:
            problems.add(exc)
            bad.add(entry.checkpoint_key)
            continue
        for copy in entry.copies:
            for chunk in copy:
                data = chunk.data
                try:
                    if isinstance(data, LazyRegion):
                        data = data.resolve()
                    if not isinstance(data, FileRegion) or chunk.numel == 0:
                        continue
                    stop = data.byte_offset + entry.dtype.itemsize * span(chunk.sizes, data.strides)
                    if data.byte_offset < 0 or stop > size_of(data.path):
                        raise CorruptModelCheckpointError(
                            data.path,
                            f"key {entry.display_key}: its chunk at {chunk.offsets} needs bytes "
                            f"[{data.byte_offset}, {stop}) but the file has {size_of(data.path)} "
                            "bytes; it is truncated: copy it again",
                        )
                except (ModelCheckpointError, OSError) as exc:
                    problems.add(exc)
                    bad.add(entry.checkpoint_key)
    return bad


def read_collecting(
    loader: IndexedCheckpointLoader,
    path: Path,
    dims: Mapping[str, int],
    skip: set[str],
    problems: Problems,
    stats: LoadStats,
    progress: bool,
    base: ModelCheckpointLoadOptions | None = None,
) -> int:
    """Read every byte of every key not in ``skip`` (whole tensors, every replica copy compared,
    with ``pread`` so an I/O error is an error and not a crash); after a bad key, go on from
    the next one. Returns the number of keys read cleanly."""
    done: list[str] = []
    skipped = set(skip)
    while True:
        drop = frozenset(skipped | set(done))
        options = replace(
            base or ModelCheckpointLoadOptions(),
            key_map=_drop(drop, base),
            mmap=False,
            verify_replicas=True,
            verify_replicas_max_bytes=1 << 62,
            stats=stats,
            progress=progress,
        )
        order: list[tuple[str, str]] = []  # (name, checkpoint key), in the order yielded
        yielded = 0
        try:
            index, _ = loader.plan(path, dims, options)
            order = [(k, e.checkpoint_key) for k, e in index.entries.items()]
            if not order:
                return len(done)
            for _key, tensor in loader.lazy_load(path, dims, options):
                del tensor
                done.append(order[yielded][1])
                yielded += 1
            return len(done)
        except (ModelCheckpointError, OSError) as exc:
            name, failed = order[yielded] if yielded < len(order) else (None, key_of(exc))
            message = _one_line(exc)
            if isinstance(exc, OSError) and failed is not None:
                message = f"{path}: key {name or failed!r}: read failed: {message}"
            problems.add(message)
            if failed is None or failed in skipped:
                return len(done)
            skipped.add(failed)


def check_zip_crcs(
    index: CheckpointIndex, problems: Problems, progress: bool, only_keyed: bool = False
) -> int:
    """Check the CRC-32 that ``torch.save`` stores for every record of every zip: the files of
    torch formats, and each DCP chunk's record (a zip of its own inside a ``.distcp`` file).
    Names the keys whose bytes a bad record holds. Returns the bytes checked."""
    owners: dict[Path, list[tuple[int, int, str]]] = {}
    windows: dict[tuple[Path, int, int], list[tuple[int, int, str]]] = {}
    for entry in index:
        for copy in entry.copies:
            for chunk in copy:
                data = chunk.data
                if isinstance(data, LazyRegion) and data.window is not None:
                    offset, length = data.window
                    windows.setdefault((data.path, offset, length), []).append(
                        (0, length, entry.key)
                    )
                elif isinstance(data, FileRegion) and chunk.numel:
                    stop = data.byte_offset + entry.dtype.itemsize * span(chunk.sizes, data.strides)
                    owners.setdefault(data.path, []).append((data.byte_offset, stop, entry.key))
    zips: list[tuple[Path, int, int, list[tuple[int, int, str]], str]] = []
    if index.format in _TORCH_ZIP_FORMATS:
        zips += [
            (f, 0, f.stat().st_size, owners.get(f, []), "")
            for f in index.files
            if zipfile.is_zipfile(f)
        ]
    zips += [
        (f, offset, length, keys, f"the chunk at byte {offset}: ")
        for (f, offset, length), keys in windows.items()
    ]
    if not zips:
        return 0
    checked = 0
    with byte_bar(sum(z[2] for z in zips), "checking CRC-32", enabled=progress) as bar:
        for f, offset, length, keyed, where in zips:
            with open(f, "rb") as raw:
                try:
                    zf = zipfile.ZipFile(_Window(raw, offset, length))
                except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
                    named = ", ".join(sorted({f"key {k!r}" for _, _, k in keyed})) or "no tensor"
                    problems.add(
                        f"{f}: {named}: {where}its zip cannot be read to check its CRC-32s "
                        f"({exc}); the file is damaged: copy it again"
                    )
                    bar.update(length)
                    continue
                with zf:
                    done = _check_records(
                        f, zf, keyed, where, problems, bar, raw.fileno(), offset, length, only_keyed
                    )
                checked += done
            bar.update(length - done)  # its headers, directory and records without CRC-32s
    return checked


def _check_records(
    f: Path,
    zf: zipfile.ZipFile,
    keyed: list[tuple[int, int, str]],
    where: str,
    problems: Problems,
    bar: Any,
    fd: int,
    offset: int,
    length: int,
    only_keyed: bool,
) -> int:
    """Read every record of ``zf`` against its CRC-32; a bad one is a problem naming the keys
    whose bytes it holds. Returns the bytes checked. ``fd``: the file, where the zip is bytes
    ``[offset, offset + length)``: stored records (all of torch's) are read from it straight,
    several times faster than through ``zipfile``'s copies. ``only_keyed``: only the records
    that hold bytes of ``keyed``'s keys (those a load reads; not what its key_map drops)."""
    checked = 0
    for info in zf.infolist():
        if info.CRC == 0 or info.file_size == 0:
            continue  # written without CRC-32s: nothing to compare with
        start = _record_start(zf.fp, info)  # from the zip's start
        if only_keyed and not any(a < start + info.file_size and b > start for a, b, _ in keyed):
            continue
        try:
            if info.compress_type == zipfile.ZIP_STORED:
                with zf.open(info):  # checks the record's header, reads none of its bytes
                    pass
                checked += _stored_crc(fd, offset + start, offset + length, info, bar)
                continue
            with zf.open(info) as member:
                while block := member.read(16 << 20):
                    bar.update(len(block))
                    checked += len(block)
        except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
            stop = start + info.file_size
            keys = sorted({k for a, b, k in keyed if a < stop and b > start})
            named = ", ".join(f"key {k!r}" for k in keys) or "no tensor"
            what = "fails its CRC-32 check" if isinstance(exc, zipfile.BadZipFile) else "is damaged"
            problems.add(
                f"{f}: {named}: {where}record {info.filename} {what} ({exc}); the bytes are "
                "damaged: copy the file again"
            )
    return checked


_CRC_BLOCK = 16 << 20


def _stored_crc(fd: int, start: int, stop_limit: int, info: zipfile.ZipInfo, bar: Any) -> int:
    """Sum a stored record's bytes, read with ``pread`` into one reused buffer (a mapping would
    end the process with SIGBUS if the file were cut meanwhile), against its CRC-32:
    ``zipfile``'s error where they differ, or where the record runs past ``stop_limit``, the
    end of its zip (a DCP chunk's, inside its ``.distcp``). Returns the bytes summed."""
    stop = start + info.file_size
    if stop > stop_limit:
        raise EOFError(f"its {info.file_size} bytes run past the end of its zip")
    view = memoryview(bytearray(min(_CRC_BLOCK, info.file_size)))
    crc, pos = 0, start
    while pos < stop:
        n = os.preadv(fd, [view[: min(len(view), stop - pos)]], pos)
        if n <= 0:
            raise EOFError("the file ends inside it: it was cut")
        crc = zlib.crc32(view[:n], crc)  # the GIL is released while it sums
        bar.update(n)
        pos += n
    if crc != info.CRC:
        raise zipfile.BadZipFile(f"Bad CRC-32 for file {info.filename!r}")
    return info.file_size


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a file of their own (a DCP
    chunk's zip, which ``zipfile`` reads with its offsets from its own start)."""

    def __init__(self, raw: Any, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self._pos = raw.fileno(), offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(base + pos, 0)
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(min(len(buf), self._length - self._pos), 0)
        data = os.pread(self._fd, n, self._offset + self._pos) if n else b""
        buf[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _record_start(raw: Any, info: zipfile.ZipInfo) -> int:
    raw.seek(info.header_offset)
    header = raw.read(30)
    name_len = int.from_bytes(header[26:28], "little")
    extra_len = int.from_bytes(header[28:30], "little")
    return int(info.header_offset) + 30 + name_len + extra_len


_TORCH_ZIP_FORMATS = ("torch", "fairscale", "fairseq2")


def _data_files(loader: IndexedCheckpointLoader, path: Path) -> list[Path]:
    """The data files of a checkpoint, to check one by one (each as a checkpoint of its own)
    when the whole set cannot be indexed."""
    if loader.name not in ("safetensors", *_TORCH_ZIP_FORMATS):
        return []
    if path.is_file() and not path.name.endswith(".index.json"):
        return []
    folder = path if path.is_dir() else path.parent
    suffixes = (".safetensors",) if loader.name == "safetensors" else (".pt", ".pth", ".bin")
    found = []
    for p in sorted(folder.rglob("*")):
        hidden = any(part.startswith(".") for part in p.relative_to(folder).parts)
        if p.is_file() and p.name.endswith(suffixes) and not hidden:
            found.append(p)
    return found


def cmd_verify(args: argparse.Namespace) -> int:
    path = Path(args.path)
    progress = _progress_enabled() and not args.json
    problems = Problems()
    base = _base_options(args)
    try:
        loader = detect_loader(path)
    except (ModelCheckpointError, OSError) as exc:
        problems.add(exc)
        return _verify_report(args, path, None, problems, 0, 0, 0, 0, [])
    choice = resolve_shard_dims(args.shard_dims, loader, path, base)
    dims = choice.dims
    index, dropped = index_collecting(loader, path, dims, problems, base)
    targets: list[tuple[IndexedCheckpointLoader, Path, CheckpointIndex, set[str]]] = []
    if index is not None:
        _warn_no_dims(choice, index)
        _warn_unused_key_map(base)
        targets.append((loader, path, index, dropped))
    else:
        for f in _data_files(loader, path):
            try:
                floader = detect_loader(f)
            except (ModelCheckpointError, OSError) as exc:
                problems.add(exc)
                continue
            findex, fdropped = index_collecting(floader, f, dims, problems, base)
            if findex is not None:
                targets.append((floader, f, findex, fdropped))
    stats = LoadStats()
    keys = files = crc_bytes = 0
    for tloader, tpath, tindex, tdropped in targets:
        keys += len(tindex) + len(tdropped)
        files += len(tindex.files)
        bad = check_entries(tindex, dims, problems) | tdropped
        if args.read:
            read_collecting(tloader, tpath, dims, bad, problems, stats, progress, base)
            crc_bytes += check_zip_crcs(tindex, problems, progress)
    # Replica copies read to be compared are in total_bytes_read already.
    notes = [note for _, _, tindex, _ in targets for note in tindex.notes]
    return _verify_report(
        args, path, loader.name, problems, keys, files, stats.total_bytes_read, crc_bytes, notes
    )


def _verify_report(
    args: argparse.Namespace,
    path: Path,
    fmt: str | None,
    problems: Problems,
    keys: int,
    files: int,
    loaded: int,
    crc_read: int,
    notes: Sequence[str],
) -> int:
    """The verdict, with the index's notes: what it leaves out (files an index does not list,
    keys it does not place, training state) is not checked, and not a problem. ``loaded``:
    the bytes the load pass read; ``crc_read``: those the CRC-32 pass read again (torch zips,
    DCP chunks), said apart so that neither reads as the checkpoint's size."""
    ok = not problems
    if args.json:
        doc = {
            "path": str(path),
            "format": fmt,
            "ok": ok,
            "problems": problems.items,
            "keys": keys,
            "files": files,
            "read": bool(args.read),
            "bytes_read": loaded + crc_read,
            "bytes_loaded": loaded,
            "bytes_crc_checked": crc_read,
            "notes": list(notes),
        }
        print(json.dumps(doc, indent=2))
    else:
        what = f"{keys} tensors in {files} file(s) checked"
        for note in notes:
            print(f"note: {note}")
        for p in problems.items:
            print(f"FAIL {p}")
        if ok:
            if not args.read:
                how = "metadata only; pass --read to read every byte"
            elif crc_read:
                how = (
                    f"read every byte: {human(loaded)} loaded, and {human(crc_read)} read again "
                    "for the CRC-32s"
                )
            else:
                how = f"read every byte: {human(loaded)}"
            print(f"OK: {path}: {what}, no problem found ({how})")
        else:
            print(f"{len(problems.items)} problem(s) found in {path} ({what})")
    return EXIT_OK if ok else EXIT_CHECKPOINT


# -- reshard -------------------------------------------------------------------------------


def _check_source_crcs(src: Path, progress: bool, index: CheckpointIndex) -> None:
    """Refuse a source whose zip records fail their CRC-32s before anything is written: a
    rank reads only its part of a record, so no read checks it, and the writer would give the
    damaged bytes a fresh, valid CRC-32 that hides the damage from any later check. Only the
    records of keys written are checked (not what ``--key-map`` drops)."""
    problems = Problems()
    check_zip_crcs(index, problems, progress, only_keyed=True)
    if problems:
        first = problems.items[0].removeprefix(f"{src}: ")  # the file is src itself
        more = f" (and {len(problems.items) - 1} more)" if len(problems.items) > 1 else ""
        raise CorruptModelCheckpointError(
            src,
            f"is damaged, so nothing was written: {first}{more}. `lazyckpt verify --read` lists "
            "every problem; --no-crc-check writes it as it is",
        )


def _tree_bytes(folder: Path) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, n)).st_size
    return total


def cmd_reshard(args: argparse.Namespace) -> int:
    from lazyckpt.writers import (
        DEFAULT_MAX_SHARD_SIZE,
        RESHARD_OPTIONS,
        parse_size,
        reshard,
        stale_work_folders,
    )

    src = Path(args.src)
    if args.max_shard_size is not None and (args.format, args.tp, args.dp) != ("safetensors", 1, 1):
        raise UsageError(
            "--max-shard-size applies to --format safetensors --tp 1 --dp 1 only: other layouts "
            "write one file per rank"
        )
    max_shard = (
        DEFAULT_MAX_SHARD_SIZE if args.max_shard_size is None else parse_size(args.max_shard_size)
    )
    base = _base_options(args)
    loader = detect_loader(src)
    choice = resolve_shard_dims(args.shard_dims, loader, src, base)
    index = loader.index(src, choice.dims, base)
    if args.format == "consolidated" and args.tp > 1 and not choice.concrete(list(index.entries)):
        if args.shard_dims is not None:  # given, but naming none of the checkpoint's keys
            first = ", ".join(repr(k) for k in list(index.entries)[:3])
            raise UsageError(
                f"--shard-dims {args.shard_dims} names none of the checkpoint's "
                f"{len(index.entries)} keys ({first} ...), so no key would be split and every "
                "rank file would hold whole tensors; name the keys as the checkpoint does"
            )
        raise UsageError(
            f"--format consolidated --tp {args.tp} needs --shard-dims: without it no key is split "
            "and every rank file would hold whole tensors; pass "
            f"{'|'.join(sorted(PRESETS))}|FILE.json"
        )
    _warn_no_dims(choice, index, args.tp)
    _warn_unused_key_map(base)
    for note in index.notes:  # what the index leaves out is not written either
        _note(note)
    progress = _progress_enabled() and not args.json
    for stale in stale_work_folders(args.dst):
        _note(
            f"{stale} ({human(_tree_bytes(stale))}) looks like the work folder of an earlier "
            f"reshard to {args.dst} that was killed; it is not used: if no other reshard to it "
            "is running, remove it (rm -rf)"
        )
    try:
        was_cwd = os.path.samefile(args.dst, os.getcwd())
    except OSError:
        was_cwd = False
    result = reshard(
        src,
        args.dst,
        choice.dims,
        tp=args.tp,
        dp=args.dp,
        fmt=args.format,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        max_shard_size=max_shard,
        force=args.force,
        progress=progress,
        options=replace(RESHARD_OPTIONS, restrict=base.restrict, key_map=base.key_map),
        loader=loader,
        before_writing=None if args.no_crc_check else partial(_check_source_crcs, src, progress),
    )
    if was_cwd:  # the shell stays in the folder the rename replaced, which looks empty
        _note(f"{result.dst} was the current folder and is now a new one: cd into it again")
    if args.json:
        doc = {
            "src": str(src),
            "dst": str(result.dst),
            "format": result.format,
            "layout": result.layout,
            "shard_dims": {"source": choice.source, "dims": choice.concrete(list(index.entries))},
            "files": [{"name": n, "bytes": b} for n, b in result.files],
            "index": result.index_file,
            "sidecars": result.sidecars,
            "tensors": result.tensors,
            "bytes_written": result.bytes_written,
            "bytes_read": result.stats.total_bytes_read,
            "seconds": result.stats.seconds,
        }
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    print(
        f"wrote {result.dst}: {result.layout} {result.format}, {len(result.files)} file(s), "
        f"{result.tensors} tensors, {human(result.bytes_written)}"
    )
    rows = [[f"  {n}", human(b)] for n, b in result.files]
    rows += [[f"  {result.index_file}", "(index)"]] if result.index_file else []
    rows += [[f"  {n}", "(copied)"] for n in result.sidecars]
    print(_table(rows, right=(1,)))
    print(f"read {human(result.stats.total_bytes_read)} from {result.stats.files_read} file(s)")
    return EXIT_OK


# -- demo ----------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from lazyckpt.demo import run_demo

    return run_demo(
        keep=Path(args.keep) if args.keep else None,
        as_json=args.json,
        progress=_progress_enabled() and not args.json,
    )


# -- the parser and main -------------------------------------------------------------------


def _add_common(p: argparse.ArgumentParser, *, json_help: str = "machine-readable output") -> None:
    p.add_argument("--json", action="store_true", help=json_help)
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )


def _add_reading(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--key-map",
        metavar="FILE.json",
        help="rename or drop keys before anything is read: a JSON file {checkpoint key: new "
        "name, or null to drop it} (options.key_map); --shard-dims names keys after it",
    )
    p.add_argument(
        "--no-restrict",
        action="store_true",
        help="unpickle torch files and DCP .metadata with any global, not only tensors, "
        "containers and dtypes (restrict=False: this runs code from the file; only for files "
        "you trust)",
    )


def _base_options(args: argparse.Namespace) -> ModelCheckpointLoadOptions:
    """The options every command starts from: the unpickling rule of ``--no-restrict``, the
    ``--key-map``."""
    spec = getattr(args, "key_map", None)
    return ModelCheckpointLoadOptions(
        restrict=not getattr(args, "no_restrict", False),
        key_map=load_key_map(spec) if spec is not None else None,
    )


def _add_shard_dims(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shard-dims",
        metavar="PRESET|FILE.json",
        help=f"how keys are split across TP ranks: a preset ({', '.join(sorted(PRESETS))}) "
        "or a JSON file {key: dim}; fairscale Llama folders are detected when left out",
    )


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be at least {low}")
        return value

    return parse


_positive, _rank = _int_at_least(1), _int_at_least(0)


def _path(text: str) -> str:
    """A path argument, never empty: ``""`` (an unset shell variable, ``"$OUT"``) would be the
    current folder, which ``reshard --force`` would replace."""
    if not text:
        raise argparse.ArgumentTypeError("the path is empty (an unset shell variable?)")
    return text


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other error (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from lazyckpt import __version__

    parser = _Parser(
        prog="lazyckpt",
        description="Inspect, check and reshard PyTorch checkpoints lazily, one tensor at a time.",
    )
    parser.add_argument("--version", action="version", version=f"lazyckpt {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("inspect", help="format, source layout and every key (metadata only)")
    p.add_argument("path", metavar="PATH", type=_path)
    _add_shard_dims(p)
    _add_reading(p)
    _add_common(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("plan", help="dry run: the files, bytes and memory one rank's load needs")
    p.add_argument("path", metavar="PATH", type=_path)
    p.add_argument("--tp", type=_positive, required=True, metavar="N", help="TP size")
    p.add_argument("--tp-rank", type=_rank, default=0, metavar="R", help="TP rank (default 0)")
    p.add_argument("--dp", type=_positive, default=1, metavar="N", help="FSDP size (default 1)")
    p.add_argument("--dp-rank", type=_rank, default=0, metavar="R", help="FSDP rank (default 0)")
    _add_shard_dims(p)
    _add_reading(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating-point tensors")
    _add_common(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("verify", help="every check that can be made; exit 1 naming each problem")
    p.add_argument("path", metavar="PATH", type=_path)
    _add_shard_dims(p)
    _add_reading(p)
    p.add_argument(
        "--read",
        action="store_true",
        help="also read every byte: compare replicas, check torch.save CRC-32s",
    )
    _add_common(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("reshard", help="write the checkpoint for another TP size, atomically")
    p.add_argument("src", metavar="SRC", type=_path)
    p.add_argument("dst", metavar="DST", type=_path)
    p.add_argument("--tp", type=_positive, required=True, metavar="N", help="target TP size")
    p.add_argument("--dp", type=_positive, default=1, metavar="N", help="FSDP size (safetensors)")
    _add_shard_dims(p)
    _add_reading(p)
    p.add_argument(
        "--format",
        choices=("consolidated", "safetensors"),
        default="consolidated",
        help="consolidated.NN.pth per TP rank (default), or safetensors",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating-point tensors")
    p.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="largest safetensors file with --format safetensors --tp 1 --dp 1, e.g. 5GB or "
        "500MiB (default 5GB)",
    )
    p.add_argument("--force", action="store_true", help="replace a DST that is not empty")
    p.add_argument(
        "--no-crc-check",
        action="store_true",
        help="skip checking the CRC-32s of the source's zip records (torch files, DCP chunks) "
        "before writing: a pass over every byte, which also warms the page cache",
    )
    _add_common(p)
    p.set_defaults(func=cmd_reshard)

    p = sub.add_parser(
        "demo", help="build a small Llama MP-8 checkpoint and stream it to TP-2 and FSDP-4"
    )
    p.add_argument(
        "--keep", type=_path, metavar="DIR", help="build the checkpoint in DIR and keep it"
    )
    _add_common(p)
    p.set_defaults(func=cmd_demo)
    return parser


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (the terminal closed, ssh dropped) clean up like Ctrl-C (temporary
    folders removed) instead of killing outright."""
    from lazyckpt.writers import TERMINATING

    old: dict[int, Any] = {}
    try:
        for s in TERMINATING:
            if signal.getsignal(s) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                old[s] = signal.signal(s, _raise_interrupt)
    except ValueError:  # not the main thread: leave signals alone
        pass
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _escape(exc: UnicodeError) -> tuple[str | bytes, int]:
    """Print what cannot be encoded: a file name's undecodable bytes (``surrogateescape``'s
    surrogates) as those bytes, any other lone surrogate (a key ``torch.save`` stored) as
    ``\\udXXX``, instead of stopping the output halfway with a UnicodeEncodeError."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    out = bytearray()
    for c in exc.object[exc.start : exc.end]:
        n = ord(c)
        out += (
            bytes([n - 0xDC00]) if 0xDC80 <= n <= 0xDCFF else c.encode("ascii", "backslashreplace")
        )
    return bytes(out), exc.end


_ESCAPE = "lazyckpt.escape"
codecs.register_error(_ESCAPE, _escape)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 checkpoint, 2 usage, 130 Ctrl-C,
    141 stdout closed early)."""
    for stream in (sys.stdout, sys.stderr):  # file names need not be text: print their bytes
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors=_ESCAPE)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help, --version, or a usage error it printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    debug = bool(getattr(args, "debug", False))

    def fail(code: int, exc: BaseException, prefix: str = "") -> int:
        if debug:
            traceback.print_exc()
        print(f"lazyckpt: error: {prefix}{_one_line(exc)}", file=sys.stderr)
        return code

    try:
        with _sigterm_as_interrupt(), warnings.catch_warnings():
            for said in (ShardDimsWarning, CheckpointWarning):  # the commands' notes say them
                warnings.simplefilter("ignore", said)
            return int(args.func(args))
    except KeyboardInterrupt as exc:
        if debug:
            traceback.print_exc()
        late = str(exc) if str(exc).startswith("after ") else ""  # the work was done first
        print(f"lazyckpt: interrupted{' ' + late if late else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ModelCheckpointError as exc:
        return fail(EXIT_CHECKPOINT, exc)
    except ValueError as exc:
        return fail(EXIT_USAGE, exc)
    except FileNotFoundError as exc:
        return fail(EXIT_CHECKPOINT, exc)
    except BrokenPipeError:  # the reader of stdout is gone (| head): stop quietly, as tools do
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
        return EXIT_PIPE
    except OSError as exc:
        return fail(EXIT_CHECKPOINT, exc)
    except Exception as exc:
        hint = "" if debug else " (rerun with --debug for the traceback)"
        return fail(EXIT_CHECKPOINT, exc, f"unexpected {type(exc).__name__}{hint}: ")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
