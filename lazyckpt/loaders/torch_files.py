"""``torch.save`` files: one file, a folder of them, or ``pytorch_model.bin.index.json``."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import final

from lazyckpt.index import CheckpointIndex
from lazyckpt.loader import IndexedCheckpointLoader, KeyRules
from lazyckpt.loaders._files import (
    FileSet,
    FileTensor,
    build_file_set_index,
    check_complete,
    find_index_file,
    folder_file_set,
    hf_variant_indexes,
    leave_out_variants,
    read_hf_index,
    variant_index_notes,
)
from lazyckpt.options import ModelCheckpointLoadOptions
from lazyckpt.paths import names_ending
from lazyckpt.readahead import no_readahead
from lazyckpt.torch_zip import ZIP_MAGIC, read_torch_archive

__all__ = ["TorchCheckpointLoader", "read_torch_file"]

SUFFIXES = (".pt", ".pth", ".bin")
INDEX_SUFFIXES = (".bin.index.json", ".pt.index.json", ".pth.index.json")
TRAINER_STATE = re.compile(
    r"training_args\.bin|(optimizer|scheduler|scaler)\.(pt|bin)|rng_state(_\d+)?\.pth"
)
"""What a Hugging Face Trainer saves beside the weights in a ``checkpoint-N`` folder: not
weights, so a folder is never read as a torch checkpoint because of them."""


def read_torch_file(
    path: Path,
    *,
    restrict: bool = True,
    keep: Callable[[str], bool] | None = None,
    notes: list[str] | None = None,
) -> list[FileTensor]:
    """The tensors of one torch file, in pickle order, located but not read (``keep``: see
    :func:`lazyckpt.torch_zip.flatten_state_dict`); what was left out beside the weights is
    noted in ``notes``."""
    archive = read_torch_archive(path, restrict=restrict)
    tensors = [
        FileTensor(key, t.dtype, t.sizes, archive.region(t, key))
        for key, t in archive.state_dict(keep).items()
    ]
    note = archive.left_out()
    if note is not None and notes is not None:
        notes.append(f"{path.name}: {note}")
    return tensors


def _has_zip_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            no_readahead(f.fileno())
            return f.read(4) == ZIP_MAGIC
    except OSError:
        return False


@final
class TorchCheckpointLoader(IndexedCheckpointLoader):
    """``torch.save`` zip files (``.pt``, ``.pth``, ``.bin``), folders and HF index folders."""

    name = "torch"

    def supports_path(self, path: str | os.PathLike[str]) -> bool:
        p = Path(path)
        if p.is_file():
            if p.name.endswith(".distcp"):
                return False
            return p.name.endswith(SUFFIXES + INDEX_SUFFIXES) or _has_zip_magic(p)
        if p.is_dir():
            return bool(names_ending(p, SUFFIXES + INDEX_SUFFIXES))
        return False

    def build_index(
        self, path: Path, rules: KeyRules, options: ModelCheckpointLoadOptions
    ) -> CheckpointIndex:
        notes: list[str] = []

        def read(p: Path) -> list[FileTensor]:
            return read_torch_file(p, restrict=options.restrict, keep=rules.wants, notes=notes)

        file_set = self.file_set(path, options.restrict, rules.wants)
        index = build_file_set_index(file_set, self.name, read, rules)
        index.notes += notes
        return index

    @staticmethod
    def file_set(
        path: Path, restrict: bool = True, keep: Callable[[str], bool] | None = None
    ) -> FileSet:
        """The files to load; ``restrict`` and ``keep`` (the key map's keys) as the load reads
        them, for the keys of variants to be compared as the load would see them."""
        if path.is_file():
            if path.name.endswith(INDEX_SUFFIXES):
                return read_hf_index(path, SUFFIXES)
            return FileSet(path, [path])
        listing = names_ending(path, (*INDEX_SUFFIXES, ".bin"))
        variant_indexes = hf_variant_indexes(listing, ".bin")
        for suffix in INDEX_SUFFIXES:
            index = find_index_file(
                path, suffix, "pytorch_model" + suffix, variant_indexes, listing
            )
            if index is not None:
                file_set = read_hf_index(index, SUFFIXES)
                break
        else:
            file_set = folder_file_set(path, SUFFIXES, skip=TRAINER_STATE)

            def keys(p: Path) -> set[str]:
                return set(read_torch_archive(p, restrict=restrict).state_dict(keep))

            leave_out_variants(file_set, ".bin", keys)
            check_complete(file_set)
        file_set.notes += variant_index_notes(variant_indexes)
        return file_set
