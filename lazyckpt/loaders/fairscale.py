"""Meta fairscale model-parallel checkpoints: ``consolidated.00.pth`` ... ``consolidated.NN.pth``.

Rank ``r``'s file holds rank ``r``'s shard of every key: keys in ``shard_dims`` are concatenated
along that dim in rank order, the others are replicas that every file holds whole (their shapes
must agree; their bytes are compared among the files a rank reads anyway). Only the zip
directories and pickles of the files are read to build the index.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import final

from lazyckpt.assemble import Cell, assemble_alike, assemble_grid, check_split_order
from lazyckpt.errors import CheckpointWarning, CorruptModelCheckpointError, warn
from lazyckpt.index import (
    CheckpointIndex,
    FileRegion,
    TensorEntry,
    add_entry,
    differing_note,
    replica_differs,
)
from lazyckpt.loader import IndexedCheckpointLoader, KeyRules
from lazyckpt.options import ModelCheckpointLoadOptions
from lazyckpt.paths import member_path
from lazyckpt.plan import PlanError
from lazyckpt.torch_zip import (
    CRC_PROOF,
    StoredTensor,
    TorchArchive,
    copied_files,
    differing_copy,
    read_torch_set,
)

__all__ = ["FairscaleCheckpointLoader", "rank_files"]

FILE_RE = re.compile(r"consolidated\.(\d+)\.pth")


def _copy_note(archives: list[TorchArchive], entries: Mapping[str, TensorEntry]) -> str | None:
    """What to say of rank files with one serialization id (:func:`copied_files`: the same
    values), where the later one holds a non-empty shard of a split key: a copy repeats that
    rank's rows, but shards may be equal by design (zeros), so the set loads as written. Equal
    files whose split shards are all empty (ranks past the last rows) say nothing."""
    for original, copy in copied_files(archives):
        split_rows = any(
            c.path == copy and c.numel
            for e in entries.values()
            if len(e.copies[0]) > 1
            for c in e.copies[0]
        )
        if split_rows:
            return (
                f"{copy.name} holds the same bytes as {original.name} (one torch.save's "
                "records), split keys included, so those keys repeat that rank's shard. If it "
                "is a copy (cp consolidated.07.pth consolidated.08.pth), remove it; shards "
                "that are equal by design (zero-initialised adapters) load as they are"
            )
    return None


_CHECKLIST = "checklist.chk"
"""What Meta's downloads ship beside the rank files: ``md5sum`` lines, one per file."""


def _checklisted(folder: Path) -> list[str]:
    """The file names ``checklist.chk`` lists (none where it is missing or unreadable)."""
    try:
        with open(folder / _CHECKLIST, "rb") as f:
            text = f.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return []
    return [line.split()[-1].lstrip("*") for line in text.splitlines() if len(line.split()) >= 2]


def rank_files(folder: Path) -> list[Path]:
    """The rank files of ``folder`` in rank order, checked to be numbered 0..N-1 without gaps,
    and to be all that Meta's ``checklist.chk`` lists where it is there (a lost last rank leaves
    no gap: the set would load as a smaller one)."""
    numbered: dict[int, list[str]] = {}
    for name in os.listdir(folder):
        m = FILE_RE.fullmatch(name)
        if m:
            numbered.setdefault(int(m.group(1)), []).append(name)
    if not numbered:
        raise CorruptModelCheckpointError(folder, "holds no consolidated.NN.pth file")
    for rank, names in numbered.items():
        if len(names) > 1:
            raise CorruptModelCheckpointError(
                folder, f"has several files for rank {rank} ({', '.join(sorted(names))}); keep one"
            )
    listed = _checklisted(folder)
    absent = sorted(
        n for n in listed if (m := FILE_RE.fullmatch(n)) and int(m.group(1)) not in numbered
    )
    if absent:  # the last ranks lost leave no gap in the numbers: Meta's list tells
        raise CorruptModelCheckpointError(
            folder,
            f"lacks {absent[0]}{f' and {len(absent) - 1} more' if len(absent) > 1 else ''}, "
            f"which {_CHECKLIST} lists: the set is incomplete (the download stopped, or a "
            "file was lost); download it again",
        )
    n = max(numbered) + 1
    # One writer numbers its files one way: padded with zeros to one width (Meta's 00, 01, ...),
    # past which a larger number runs longer (100 after 99), or not at all (0, 1, ..., 10).
    digits = {r: names[0][len("consolidated.") : -len(".pth")] for r, names in numbered.items()}
    width = min(len(d) for d in digits.values())
    missing = [r for r in range(n) if r not in numbered]
    if missing:
        raise CorruptModelCheckpointError(
            folder,
            f"has files up to rank {n - 1} but lacks consolidated.{missing[0]:0{width}d}.pth"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}; the set is incomplete",
        )
    if any(d != f"{r:0{width}d}" for r, d in digits.items()):
        raise CorruptModelCheckpointError(
            folder,
            f"mixes rank numbers of different widths ({', '.join(numbered[r][0] for r in range(n))}); "
            "the files come from different sets",
        )
    return [member_path(folder, numbered[r][0], cited_by=folder) for r in range(n)]


def holds_set(folder: Path, names: list[str]) -> bool:
    """Whether ``folder``, whose entries are ``names``, holds a fairscale rank file."""
    return any(FILE_RE.fullmatch(n) for n in names)


@final
class FairscaleCheckpointLoader(IndexedCheckpointLoader):
    """A folder of Meta fairscale ``consolidated.NN.pth`` rank files (MP-N)."""

    name = "fairscale"

    def supports_path(self, path: str | os.PathLike[str]) -> bool:
        p = Path(path)
        return p.is_dir() and holds_set(p, os.listdir(p))

    def build_index(
        self, path: Path, rules: KeyRules, options: ModelCheckpointLoadOptions
    ) -> CheckpointIndex:
        files = rank_files(path)
        ranks = [
            (f, archive, flat)
            for f, (archive, flat) in zip(
                files,
                read_torch_set(files, restrict=options.restrict, keep=rules.wants, serial=True),
            )
        ]
        first_file, _, first = ranks[0]
        for f, _, flat in ranks[1:]:
            extra = [] if flat is first else [k for k in flat if k not in first]
            if extra:
                raise CorruptModelCheckpointError(
                    f,
                    f"holds key {extra[0]!r} that {first_file.name} lacks; the rank files "
                    "come from different checkpoints",
                    key=extra[0],
                )
        entries: dict[str, TensorEntry] = {}
        if _alike(ranks):
            self._index_alike(ranks, rules, entries)
        else:
            self._index_each(path, ranks, rules, entries)
        differing = _differing_replicas(path, ranks, rules, entries)
        archives = [archive for _, archive, _ in ranks]
        notes = _left_out(archives)
        if differing:
            notes.append(differing_note(differing))
        copied = _copy_note(archives, entries)
        if copied is not None:
            notes.append(copied)
            warn(f"{path}: {copied}", CheckpointWarning)
        return CheckpointIndex(
            path=path,
            format=self.name,
            entries=entries,
            files=files,
            source_layout=f"MP-{len(files)}",
            notes=notes,
            metadata=_Params(path),
            differing_copies=differing,
        )

    @staticmethod
    def _index_alike(
        ranks: list[tuple[Path, TorchArchive, dict[str, StoredTensor]]],
        rules: KeyRules,
        entries: dict[str, TensorEntry],
    ) -> None:
        """Index files saved alike (see :func:`_alike`): a key's shard has one shape, dtype and
        offset in every file, so it is checked once, in the first."""
        first_file, archive, first = ranks[0]
        path = first_file.parent
        others = [f for f, _, _ in ranks[1:]]
        for key, stored in first.items():
            target = rules.target(key)
            if target is None:
                continue
            region = archive.region(stored, key)
            at, strides = region.byte_offset, region.strides
            datas = [region, *(FileRegion(f, at, strides) for f in others)]
            shape = stored.sizes
            dim = rules.shard_dim(key, [shape] * len(datas))
            try:
                dtype, shape, copies = assemble_alike(shape, stored.dtype, datas, dim)
            except ValueError as exc:
                raise ValueError(f"{path}: key {key!r}: {exc}") from None
            add_entry(entries, TensorEntry(target, dtype, shape, copies, key))

    @staticmethod
    def _index_each(
        path: Path,
        ranks: list[tuple[Path, TorchArchive, dict[str, StoredTensor]]],
        rules: KeyRules,
        entries: dict[str, TensorEntry],
    ) -> None:
        """Index files that differ in what they hold or where: each shard checked on its own."""
        first_file, _, first = ranks[0]
        named = [(f, f.name, archive, flat) for f, archive, flat in ranks]
        for key in first:
            target = rules.target(key)
            if target is None:
                continue
            grid = []
            for f, name, archive, flat in named:
                stored = flat.get(key)
                if stored is None:
                    raise CorruptModelCheckpointError(
                        f,
                        f"lacks key {key!r}, which {first_file.name} holds; every rank file "
                        "must hold every key",
                        key=key,
                    )
                region = archive.region(stored, key)
                grid.append([Cell(stored.sizes, stored.dtype, region, name)])
            try:
                dim = rules.shard_dim(key, [row[0].shape for row in grid])
                check_split_order(grid, dim)
                dtype, shape, copies = assemble_grid(grid, dim)
            except PlanError as exc:
                rules.refuse_misnamed(path, key, first)
                raise CorruptModelCheckpointError(path, f"key {key!r}: {exc}", key=key) from None
            except ValueError as exc:
                raise ValueError(f"{path}: key {key!r}: {exc}") from None
            add_entry(entries, TensorEntry(target, dtype, shape, copies, key))


def _differing_replicas(
    path: Path,
    ranks: list[tuple[Path, TorchArchive, dict[str, StoredTensor]]],
    rules: KeyRules,
    entries: dict[str, TensorEntry],
) -> dict[str, tuple[Path, str]]:
    """The replicated keys whose copies' zip CRC-32s prove them different (see
    :func:`differing_copy`), for :attr:`CheckpointIndex.differing_copies`: a split key left out
    of ``shard_dims`` would otherwise come out as rank 0's shard where it is too large to be
    compared by reading. Free: the CRCs are in the directories already read."""
    found: dict[str, tuple[Path, str]] = {}
    for entry in entries.values():
        if len(entry.copies) < 2:
            continue
        key = entry.checkpoint_key
        odd = differing_copy([(archive, flat[key]) for _, archive, flat in ranks])
        if odd is None:
            continue
        rules.refuse_misnamed(path, key, ranks[0][2])
        found[entry.key] = (
            ranks[odd][0],
            replica_differs(entry, ranks[0][0].name, ranks[odd][0].name, CRC_PROOF),
        )
    return found


def _left_out(archives: list[TorchArchive]) -> list[str]:
    """What the rank files hold beside their weights (see ``TorchArchive.left_out``): noted
    once where every file says the same."""
    notes = [(a.path.name, note) for a in archives if (note := a.left_out()) is not None]
    if len(notes) == len(archives) > 1 and len({note for _, note in notes}) == 1:
        return [f"every rank file: {notes[0][1]}"]
    return [f"{name}: {note}" for name, note in notes]


def _alike(ranks: list[tuple[Path, TorchArchive, dict[str, StoredTensor]]]) -> bool:
    """Whether the files hold one pickle (``read_torch_set`` then gives them one flat dict) and
    their storages at the same offsets: the usual case, files written by one ``torch.save``
    loop."""
    _, archive, flat = ranks[0]
    return all(f is flat and a.storage_offsets == archive.storage_offsets for _, a, f in ranks[1:])


class _Params(Mapping[str, str]):
    """``params.json`` (model hyper-parameters Meta ships beside the weights), read when first
    asked for (``lazyckpt inspect``): a load never looks at it, and reading it cost a fresh
    process 0.3-0.4 ms before the first read. Unreadable or not an object: empty."""

    def __init__(self, folder: Path) -> None:
        self._path = folder / "params.json"

    @functools.cached_property
    def _doc(self) -> dict[str, str]:
        try:
            doc = json.loads(self._path.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): json.dumps(v) for k, v in doc.items()} if isinstance(doc, dict) else {}

    def __getitem__(self, key: str) -> str:
        return self._doc[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._doc)

    def __len__(self) -> int:
        return len(self._doc)
