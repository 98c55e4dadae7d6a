"""fairseq2 native sharded checkpoints: ``pp_XX/tp_XX/sdp_XX.pt``.

Pipeline stages hold disjoint keys (united here); within a stage, tensor-parallel shards are
concatenated along each key's shard dim and sharded-data-parallel shards along dim 0 of the TP
shard. The ``pp_XX`` level may be left out when there is one stage.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import final

from lazyckpt.assemble import Cell, assemble_grid, check_split_order
from lazyckpt.errors import CorruptModelCheckpointError
from lazyckpt.index import CheckpointIndex, TensorEntry, add_entry, differing_note, replica_differs
from lazyckpt.loader import IndexedCheckpointLoader, KeyRules
from lazyckpt.options import ModelCheckpointLoadOptions
from lazyckpt.paths import member_path
from lazyckpt.plan import PlanError
from lazyckpt.torch_zip import (
    CRC_PROOF,
    StoredTensor,
    TorchArchive,
    differing_copy,
    read_torch_set,
)

__all__ = ["Fairseq2CheckpointLoader"]

_PP = re.compile(r"pp_(\d+)")
_TP = re.compile(r"tp_(\d+)")
_SDP = re.compile(r"sdp_(\d+)\.pt")


def _numbered(folder: Path, pattern: re.Pattern[str], want_dir: bool) -> list[Path]:
    """Entries of ``folder`` matching ``pattern``, checked to be numbered 0..N-1."""
    found: dict[int, str] = {}
    for name in os.listdir(folder):
        m = pattern.fullmatch(name)
        if m and (folder / name).is_dir() == want_dir:
            n = int(m.group(1))
            if n in found:
                raise CorruptModelCheckpointError(
                    folder, f"has both {found[n]} and {name} for rank {n}; keep one"
                )
            found[n] = name
    if not found:
        raise CorruptModelCheckpointError(
            folder, f"holds no {pattern.pattern} {'folder' if want_dir else 'file'}"
        )
    size = max(found) + 1
    if size != len(found):  # a gap (checked without a range as long as the largest number)
        first = next(i for i, r in enumerate(sorted(found)) if i != r)
        raise CorruptModelCheckpointError(
            folder,
            f"has ranks up to {size - 1} but lacks rank {first} "
            f"({pattern.pattern}); the set is incomplete",
        )
    return [
        member_path(folder, found[r], cited_by=folder) if not want_dir else folder / found[r]
        for r in range(size)
    ]


def holds_set(folder: Path, names: list[str]) -> bool:
    """Whether ``folder``, whose entries are ``names``, holds fairseq2 ``pp_XX``/``tp_XX``
    shard folders."""
    return any((_PP.fullmatch(n) or _TP.fullmatch(n)) and (folder / n).is_dir() for n in names)


@final
class Fairseq2CheckpointLoader(IndexedCheckpointLoader):
    """A fairseq2 folder of ``[pp_XX/]tp_XX/sdp_XX.pt`` shards."""

    name = "fairseq2"

    def supports_path(self, path: str | os.PathLike[str]) -> bool:
        p = Path(path)
        if not p.is_dir():
            return False
        return holds_set(p, os.listdir(p))

    @staticmethod
    def _stages(path: Path) -> list[Path]:
        """The pipeline stages' folders (``pp_XX``), or ``path`` itself where it holds the TP
        folders. Both at once is refused: the stages would be loaded and the top-level
        ``tp_XX`` keys dropped without a word."""
        names = os.listdir(path)
        pp = sorted(n for n in names if _PP.fullmatch(n) and (path / n).is_dir())
        tp = sorted(n for n in names if _TP.fullmatch(n) and (path / n).is_dir())
        if pp and tp:
            raise CorruptModelCheckpointError(
                path,
                f"holds both pipeline-stage folders ({pp[0]}{' ...' if len(pp) > 1 else ''}) "
                f"and {tp[0]}{' ...' if len(tp) > 1 else ''} beside them; a fairseq2 checkpoint "
                "keeps its TP folders in its stages, or has no stages: move the stray ones out",
            )
        return _numbered(path, _PP, True) if pp else [path]

    def build_index(
        self, path: Path, rules: KeyRules, options: ModelCheckpointLoadOptions
    ) -> CheckpointIndex:
        stages = self._stages(path)
        entries: dict[str, TensorEntry] = {}
        owner: dict[str, Path] = {}
        files: list[Path] = []
        notes: list[str] = []
        differing: dict[str, tuple[Path, str]] = {}
        tp_size = sdp_size = 0
        for stage in stages:
            tp_dirs = _numbered(stage, _TP, True)
            grid_files = [_numbered(tp, _SDP, False) for tp in tp_dirs]
            _check_grid(path, stage, tp_dirs, grid_files, stages[0], tp_size, sdp_size)
            tp_size, sdp_size = len(grid_files), len(grid_files[0])
            stage_files = [f for row in grid_files for f in row]
            read = iter(read_torch_set(stage_files, restrict=options.restrict, keep=rules.wants))
            grid = [[next(read) for _ in row] for row in grid_files]
            files += stage_files
            note = grid[0][0][0].left_out()  # shards of a stage are saved alike
            if note is not None:
                notes.append(f"{stage_files[0].relative_to(path)}: {note}")
            first_file, (_, first) = grid_files[0][0], grid[0][0]
            for row_files, row in zip(grid_files, grid):
                for f, (_, flat) in zip(row_files, row):
                    if flat.keys() != first.keys():
                        odd = next(iter(set(flat) ^ set(first)))
                        raise CorruptModelCheckpointError(
                            f,
                            f"key {odd!r} is in only one of {first_file} and {f}; every shard "
                            "of a pipeline stage must hold the same keys",
                            key=odd,
                        )
            for key in first:
                if key in owner:
                    raise CorruptModelCheckpointError(
                        stage, f"key {key!r} is also in pipeline stage {owner[key]}", key=key
                    )
                owner[key] = stage
                target = rules.target(key)
                if target is None:
                    continue
                cells = [
                    [
                        Cell(
                            flat[key].sizes,
                            flat[key].dtype,
                            archive.region(flat[key], key),
                            str(f.relative_to(path)),
                        )
                        for f, (archive, flat) in zip(row_files, row)
                    ]
                    for row_files, row in zip(grid_files, grid)
                ]
                try:
                    dim = rules.shard_dim(key, [_tp_shape(row) for row in cells])
                    check_split_order(cells, dim)
                    dtype, shape, copies = assemble_grid(cells, dim)
                except PlanError as exc:
                    rules.refuse_misnamed(path, key, first)
                    raise CorruptModelCheckpointError(
                        stage, f"key {key!r}: {exc}", key=key
                    ) from None
                except ValueError as exc:
                    raise ValueError(f"{path}: key {key!r}: {exc}") from None
                entry = TensorEntry(target, dtype, shape, copies, key)
                if len(copies) > 1:
                    copy = _differing_replica(key, grid)
                    if copy is not None:
                        rules.refuse_misnamed(path, key, first)
                        differing[target] = _differing_message(path, entry, grid_files, *copy)
                add_entry(entries, entry)
        if differing:
            notes.append(differing_note(differing))
        return CheckpointIndex(
            path=path,
            format=self.name,
            entries=entries,
            files=files,
            source_layout=f"PP-{len(stages)} x TP-{tp_size} x SDP-{sdp_size}",
            notes=notes,
            differing_copies=differing,
        )


def _differing_replica(
    key: str, grid: list[list[tuple[TorchArchive, dict[str, StoredTensor]]]]
) -> tuple[int, int] | None:
    """``(TP row, SDP shard)`` of a replicated key's copy (one in every TP row) whose zip
    CRC-32s prove it differs from the first row's shard cut alike (see :func:`differing_copy`):
    a split key left out of ``shard_dims``, past the size replicas are compared by reading;
    None where none does. A 0-d key is not cut: every shard file holds a copy, each compared
    with the first (a data-parallel rank gets its own file's)."""
    first = grid[0]
    if not first[0][1][key].sizes:
        cells = [(r, s) for r, row in enumerate(grid) for s in range(len(row))]
        odd = differing_copy([(grid[r][s][0], grid[r][s][1][key]) for r, s in cells])
        return None if odd is None else cells[odd]
    for r, row in enumerate(grid[1:], 1):
        if any(a[key].sizes != b[key].sizes for (_, a), (_, b) in zip(first, row)):
            continue  # SDP shards cut otherwise: no shard to compare with its twin
        for s, ((archive0, a), (archive, b)) in enumerate(zip(first, row)):
            if differing_copy([(archive0, a[key]), (archive, b[key])]) is not None:
                return r, s
    return None


def _differing_message(
    path: Path, entry: TensorEntry, grid_files: list[list[Path]], r: int, s: int
) -> tuple[Path, str]:
    """:attr:`CheckpointIndex.differing_copies`' entry for copy ``(r, s)`` of ``entry``,
    against the first row's shard cut alike (a 0-d key's: the first file's)."""
    first = grid_files[0][s if entry.shape else 0].relative_to(path)
    odd = grid_files[r][s].relative_to(path)
    return grid_files[r][s], replica_differs(entry, first, odd, CRC_PROOF)


def _check_grid(
    root: Path,
    stage: Path,
    tp_dirs: list[Path],
    grid_files: list[list[Path]],
    first_stage: Path,
    tp_size: int,
    sdp_size: int,
) -> None:
    """Every TP rank of a stage holds as many SDP shards, and every stage has the first one's
    TP x SDP sizes: a set with a shard missing at the end of a rank would otherwise assemble
    with rows missing, since nothing else records the sizes."""
    counts = [len(row) for row in grid_files]
    most = max(counts)
    short = next((i for i, n in enumerate(counts) if n < most), None)
    if short is not None:
        raise CorruptModelCheckpointError(
            tp_dirs[short],
            f"holds {counts[short]} sdp_XX.pt file(s) but {tp_dirs[counts.index(most)].name} "
            f"holds {most}: sdp_{counts[short]:02d}.pt is missing; the set is incomplete",
        )
    if tp_size and (len(grid_files), most) != (tp_size, sdp_size):
        # The stage with fewer shard files is the one that lost some.
        sizes = {stage: (len(grid_files), most), first_stage: (tp_size, sdp_size)}
        lacking, whole = sorted(sizes, key=lambda st: sizes[st][0] * sizes[st][1])
        raise CorruptModelCheckpointError(
            lacking,
            f"is TP-{sizes[lacking][0]} x SDP-{sizes[lacking][1]} but {whole.relative_to(root)} "
            f"is TP-{sizes[whole][0]} x SDP-{sizes[whole][1]}; every pipeline stage has the same "
            "sizes, so the set is incomplete",
        )


def _tp_shape(row: list[Cell]) -> tuple[int, ...]:
    """One TP rank's shape: its SDP shards stacked on dim 0."""
    shape = row[0].shape
    return (sum(c.shape[0] for c in row), *shape[1:]) if shape else shape
