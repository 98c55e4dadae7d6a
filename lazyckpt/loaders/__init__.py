"""Format loaders and the one that detects the format and delegates.

Detection reads names and magic bytes only. In a folder, a model-parallel set (DCP ``.metadata``,
fairscale ``consolidated.NN.pth``, fairseq2 ``tp_XX/``) or a Hugging Face index file says what
the folder is; loose ``*.safetensors`` or torch files say it otherwise. Where two answers are
possible and neither is a known convention, detection refuses instead of guessing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import final

import torch

from lazyckpt.errors import UnknownCheckpointFormatError
from lazyckpt.loader import IndexedCheckpointLoader, ModelCheckpointLoader, check_path
from lazyckpt.loaders import dcp, fairscale, fairseq2
from lazyckpt.loaders._files import adapter_files, torch_twins
from lazyckpt.loaders.dcp import DcpCheckpointLoader
from lazyckpt.loaders.fairscale import FILE_RE as _CONSOLIDATED
from lazyckpt.loaders.fairscale import FairscaleCheckpointLoader
from lazyckpt.loaders.fairseq2 import Fairseq2CheckpointLoader
from lazyckpt.loaders.safetensors import INDEX_SUFFIX as _ST_INDEX
from lazyckpt.loaders.safetensors import SUFFIX as _ST
from lazyckpt.loaders.safetensors import SafetensorsCheckpointLoader
from lazyckpt.loaders.torch_files import INDEX_SUFFIXES as _PT_INDEX
from lazyckpt.loaders.torch_files import SUFFIXES as _PT
from lazyckpt.loaders.torch_files import TRAINER_STATE as _TRAINER_STATE
from lazyckpt.loaders.torch_files import TorchCheckpointLoader
from lazyckpt.options import ModelCheckpointLoadOptions

__all__ = [
    "DcpCheckpointLoader",
    "DelegatingCheckpointLoader",
    "FairscaleCheckpointLoader",
    "Fairseq2CheckpointLoader",
    "SafetensorsCheckpointLoader",
    "TorchCheckpointLoader",
    "detect_loader",
    "get_model_checkpoint_loader",
]

SAFETENSORS = SafetensorsCheckpointLoader()
TORCH = TorchCheckpointLoader()
FAIRSCALE = FairscaleCheckpointLoader()
FAIRSEQ2 = Fairseq2CheckpointLoader()
DCP = DcpCheckpointLoader()

_SETS = ((DCP, dcp.holds_set), (FAIRSCALE, fairscale.holds_set), (FAIRSEQ2, fairseq2.holds_set))
"""The model-parallel formats, with how each is recognised in a folder's listing (listed once
for all of them)."""


def detect_loader(path: str | os.PathLike[str]) -> IndexedCheckpointLoader:
    """The loader for ``path``; raises ``FileNotFoundError`` or
    :class:`UnknownCheckpointFormatError` (a ``CorruptModelCheckpointError``)."""
    p = check_path(path)
    if p.is_file():
        if p.name.endswith(".distcp"):  # starts with a torch zip, but is only one chunk's file
            raise UnknownCheckpointFormatError(
                p, "is one data file of a torch.distributed.checkpoint save: pass its folder"
            )
        for loader in (DCP, SAFETENSORS, TORCH):
            if loader.supports_path(p):
                return loader
        if p.name.endswith(".index.json"):  # its name says which files it lists
            raise UnknownCheckpointFormatError(
                p,
                "is an index whose name does not say its shards' format: name it "
                "*.safetensors.index.json (safetensors shards) or *.bin.index.json, "
                "*.pt.index.json or *.pth.index.json (torch.save shards), as Hugging Face does",
            )
        raise UnknownCheckpointFormatError(
            p,
            "is not a checkpoint lazyckpt knows: expected .safetensors, a torch zip "
            "(.pt/.pth/.bin), or an index *.safetensors.index.json or *.bin.index.json",
        )
    if not p.is_dir():
        raise UnknownCheckpointFormatError(p, "is neither a file nor a folder")
    return _detect_folder(p)


def _detect_folder(p: Path) -> IndexedCheckpointLoader:
    names = [n for n in os.listdir(p) if not n.startswith(".") or n == ".metadata"]
    sets = [loader for loader, holds in _SETS if holds(p, names)]
    st_index = any(n.endswith(_ST_INDEX) for n in names)
    pt_indexes = [n for n in names if n.endswith(_PT_INDEX)]
    loose_st = [n for n in names if n.endswith(_ST)]
    # A Hugging Face Trainer's state files (optimizer.pt, training_args.bin, ...) are not weights.
    loose_pt = [
        n
        for n in names
        if n.endswith(_PT) and not _CONSOLIDATED.fullmatch(n) and not _TRAINER_STATE.fullmatch(n)
    ]
    if sets and sets[0] is DCP:  # Megatron's torch_dist: its common state is not weights
        megatron = dcp.megatron_files(names)
        loose_pt = [n for n in loose_pt if n not in megatron]
    if not sets:  # a PEFT adapter beside the weights is not among them (loaded by name)
        adapters = set(adapter_files(loose_st + loose_pt))
        loose_st = [n for n in loose_st if n not in adapters]
        loose_pt = [n for n in loose_pt if n not in adapters]
    if len(sets) > 1:
        raise UnknownCheckpointFormatError(
            p, f"holds both a {sets[0].name} and a {sets[1].name} checkpoint; keep one per folder"
        )
    # An index names its files explicitly; anything else beside it is ignored (and noted). But
    # safetensors files that Hugging Face ships beside its torch files (and their index) win,
    # as transformers and diffusers load them: the .bin files may be stale, or not downloaded.
    if st_index:
        return SAFETENSORS
    if pt_indexes:
        if not sets and torch_twins(loose_st, pt_indexes + loose_pt):
            return SAFETENSORS
        return TORCH
    distcp = sorted(n for n in names if n.endswith(".distcp"))
    if distcp and not sets:
        raise UnknownCheckpointFormatError(
            p,
            f"holds DCP data files ({distcp[0]}{' ...' if len(distcp) > 1 else ''}) but no "
            ".metadata: the save did not finish (DCP writes .metadata last, after every rank's "
            "data; Megatron also writes metadata.json after it), or its metadata was moved; "
            "save again",
        )
    if sets:
        loose = loose_st + loose_pt
        if loose:
            raise UnknownCheckpointFormatError(
                p,
                f"holds a {sets[0].name} checkpoint and also {loose[0]}; which one is meant "
                "is unclear: move the other files out or pass a file",
            )
        return sets[0]
    if loose_st and loose_pt:
        if torch_twins(loose_st, loose_pt):
            return SAFETENSORS
        raise UnknownCheckpointFormatError(
            p,
            f"holds both safetensors ({loose_st[0]}) and torch ({loose_pt[0]}) files with no "
            "index to say which are the checkpoint; pass a file or an index",
        )
    if loose_st:
        return SAFETENSORS
    if loose_pt:
        return TORCH
    if _MEGATRON_TRACKER in names:
        raise UnknownCheckpointFormatError(
            p, f"is a Megatron-LM checkpoint root: pass one of its iteration folders{_latest(p)}"
        )
    raise UnknownCheckpointFormatError(
        p,
        "holds no checkpoint files: expected *.safetensors, *.pt/.pth/.bin, an index "
        "(*.safetensors.index.json, *.bin.index.json), "
        "consolidated.NN.pth, tp_XX/ shards or a DCP .metadata"
        + (" (the folder is empty)" if not names else ""),
    )


_MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
"""What Megatron-LM writes at the root of its checkpoints, beside an ``iter_NNNNNNN`` folder per
save: the iteration of the latest (or ``release``)."""


def _latest(root: Path) -> str:
    """`` (the latest: FOLDER)`` as the root's tracker names it, if that folder is there."""
    try:
        text = (root / _MEGATRON_TRACKER).read_text(errors="replace").strip()
    except OSError:
        return ""
    # An iteration of more digits than any run has is not one (int() refuses 4,300 and more).
    name = f"iter_{int(text):07d}" if text.isdecimal() and len(text) < 20 else text
    try:
        there = bool(name) and (root / name).is_dir()
    except (OSError, ValueError):  # a name too long, or with a NUL: not a folder of it
        there = False
    return f" (the latest: {root / name})" if there else ""


@final
class DelegatingCheckpointLoader(ModelCheckpointLoader):
    """Detects the format of each path and hands it to that format's loader."""

    def lazy_load(
        self,
        path: str | os.PathLike[str],
        shard_dims: Mapping[str, int],
        options: ModelCheckpointLoadOptions | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return detect_loader(path).lazy_load(path, shard_dims, options)

    def supports_path(self, path: str | os.PathLike[str]) -> bool:
        try:
            detect_loader(path)
        except (FileNotFoundError, UnknownCheckpointFormatError):
            return False
        return True


def get_model_checkpoint_loader() -> ModelCheckpointLoader:
    """The loader that detects the format of each path and delegates."""
    return DelegatingCheckpointLoader()
