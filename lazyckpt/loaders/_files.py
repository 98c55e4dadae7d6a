"""Shared by the one-chunk-per-key formats (safetensors, torch files): single file, folder of
files, or a Hugging Face ``*.index.json`` naming the file of every key."""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lazyckpt.errors import CorruptModelCheckpointError, ModelCheckpointError
from lazyckpt.index import CheckpointIndex, Chunk, FileRegion, TensorEntry, add_entry
from lazyckpt.loader import KeyRules
from lazyckpt.paths import list_files, member_path, names_ending

__all__ = [
    "FileSet",
    "FileTensor",
    "adapter_files",
    "beside_hf_weights",
    "build_file_set_index",
    "check_complete",
    "find_index_file",
    "leave_out_variants",
    "read_hf_index",
    "variant_index_notes",
]

_HF_TORCH = re.compile(r"(diffusion_)?pytorch_model(.*)\.bin(\.index\.json)?")
"""The names of the torch files Hugging Face saves beside ``model*.safetensors`` (diffusers:
``diffusion_pytorch_model*`` beside ``diffusion_pytorch_model*.safetensors``), and their index;
the rest of the name (shard numbers, a variant such as ``.fp16``) is the same in both formats."""
_SHARDS = re.compile(r"(-\d+-of-\d+)?")
_HF_FAMILIES = {
    ".safetensors": "model|diffusion_pytorch_model",
    ".bin": "pytorch_model|diffusion_pytorch_model",
}
"""The names Hugging Face saves a model's default weights under, by the suffix of the format."""
_HF_VARIANT = {
    suffix: re.compile(rf"({families})\.([^.]+?)(?:-\d+-of-\d+)?{re.escape(suffix)}")
    for suffix, families in _HF_FAMILIES.items()
}
"""A variant of a Hugging Face weights file (``model.fp16.safetensors``, diffusers'
``diffusion_pytorch_model.non_ema.safetensors``, ``pytorch_model.fp16.bin``), by the suffix of
its format: loaded only where asked for by name."""
_HF_VARIANT_INDEX = {
    suffix: re.compile(rf"({families})\.[^.]+{re.escape(suffix)}\.index\.json")
    for suffix, families in _HF_FAMILIES.items()
}
"""A variant's own index (``diffusion_pytorch_model.fp16.safetensors.index.json``)."""
ADAPTER = re.compile(r"adapter_model\.(safetensors|bin)")
"""The file PEFT saves an adapter (LoRA, ...) in, beside the model's weights or alone."""
_HF_WEIGHTS = re.compile(
    r"(model|pytorch_model|diffusion_pytorch_model)([-.].*)?\.(safetensors|bin)"
)
"""Hugging Face's names for a model's weights, beside which an adapter is not part of them
(``non_lora_trainables.bin`` beside a LLaVA adapter is, and such a folder stays ambiguous)."""
_NUMBERED = re.compile(r"(.+)-(\d+)-of-(\d+)(\.[^-]+)")
"""A file of a sharded set (``model-00001-of-00004.safetensors``): its prefix, its number, the
set's count and its suffix; Hugging Face's writers pad the number to the count's width, which
tells their sets from names such as ``ckpt-epoch-3-of-10.pt``."""


def torch_twins(safetensors_names: Sequence[str], torch_names: Sequence[str]) -> bool:
    """Whether every one of ``torch_names`` (torch files and indexes) repeats weights that
    ``safetensors_names`` hold, as transformers and diffusers decide without a variant asked
    for: where a torch index is among them, its single-file counterpart is there
    (``model.safetensors`` for ``pytorch_model.bin.index.json``) and the rest bear Hugging
    Face's names; else each file's counterpart is there (``model-00001-of-00002.safetensors``
    for ``pytorch_model-00001-of-00002.bin``, ``model.safetensors`` for ``model.bin``), a
    variant's (``pytorch_model.fp16.bin``) being its family's default file. A variant is no
    counterpart: ``diffusion_pytorch_model.fp16.safetensors`` is not the weights of
    ``diffusion_pytorch_model.bin``."""
    have = set(safetensors_names)
    indexes = [n for n in torch_names if n.endswith(".index.json")]
    if indexes:
        return all(_counterpart(n) in have for n in indexes) and all(
            _HF_TORCH.fullmatch(n) for n in torch_names
        )
    return bool(torch_names) and all(_counterpart(n) in have for n in torch_names)


def _counterpart(torch_name: str) -> str:
    """The safetensors file Hugging Face saves the same weights as ``torch_name`` in, or, for
    a variant, the file loaded where no variant is asked for."""
    hf = _HF_TORCH.fullmatch(torch_name)
    if hf is None:
        return os.path.splitext(torch_name)[0] + ".safetensors"
    diffusers, rest, _ = hf.groups()
    family = "diffusion_pytorch_model" if diffusers else "model"
    return f"{family}{rest if _SHARDS.fullmatch(rest) else ''}.safetensors"


def hf_variants(names: Sequence[str], suffix: str) -> dict[tuple[str, str], list[str]]:
    """Of a folder's ``names`` ending in ``suffix`` (``.safetensors`` or ``.bin``), the Hugging
    Face variants whose family's default file is there too (``model.fp16.safetensors`` beside
    ``model.safetensors``, as a Stable Diffusion ``unet/`` ships them): ``(default, variant) ->
    its files`` (one, or its shards). Variants by name, which :func:`leave_out_variants`
    confirms by their keys (``model.vision.safetensors`` may be another part of the model)."""
    have = set(names)
    found: dict[tuple[str, str], list[str]] = {}
    for n in names:
        m = _HF_VARIANT[suffix].fullmatch(n)
        if m is not None and f"{m.group(1)}{suffix}" in have:
            found.setdefault((f"{m.group(1)}{suffix}", m.group(2)), []).append(n)
    return found


def leave_out_variants(file_set: FileSet, suffix: str, keys: Callable[[Path], set[str]]) -> None:
    """Take the Hugging Face variants of the default weights out of a folder's ``file_set``
    (noted), as transformers and diffusers load the default where no variant is asked for:
    those of :func:`hf_variants` whose keys (``keys`` of a file) equal the default file's, the
    same weights in another dtype, say, not another part of the model. ``keys`` of a file that
    cannot be read leave it in, for the load to say what is wrong with it."""
    folder = file_set.path
    known: dict[str, set[str] | None] = {}

    def keys_of(name: str) -> set[str] | None:  # None: unreadable, so it is loaded and told
        if name not in known:
            try:
                known[name] = keys(folder / name)
            except (ModelCheckpointError, OSError):
                known[name] = None
        return known[name]

    def same_keys(default: str, names: list[str]) -> bool:
        want, union = keys_of(default), set()
        for n in names:
            found = keys_of(n)
            if found is None:
                return False
            union |= found
        return want is not None and union == want

    variants = sorted(
        name
        for (default, _), names in hf_variants([f.name for f in file_set.files], suffix).items()
        if same_keys(default, names)
        for name in names
    )
    file_set.files = [f for f in file_set.files if f.name not in variants]
    file_set.notes += [
        f"ignored {n}: a variant of the default weights beside it, loaded only where asked for "
        "(as Hugging Face does): pass the file to load it"
        for n in variants
    ]


def adapter_files(names: Sequence[str]) -> list[str]:
    """Of a folder's weights files ``names``, the PEFT adapter files (``adapter_model.*``) where
    a model's weights under Hugging Face's names are there too: that model (the base, or the
    merged one) is the checkpoint, and the adapter's keys (``base_model.model....lora_A``) are
    not its. An adapter alone, or beside files of other names, is left in (none returned)."""
    return [n for n in names if ADAPTER.fullmatch(n)] if beside_hf_weights(names) else []


def beside_hf_weights(names: Iterable[str]) -> bool:
    """Whether ``names`` hold a model's weights file under Hugging Face's names."""
    return any(_HF_WEIGHTS.fullmatch(n) for n in names)


def check_complete(file_set: FileSet) -> None:
    """Refuse a folder set without an index whose numbered files (``model-00001-of-00002``)
    are not all there: a download that stopped, or a shard deleted, would load part of the
    model and deliver it as the whole. Run on the files that will be loaded."""
    groups: dict[tuple[str, str, str], set[int]] = {}
    for f in file_set.files:
        m = _NUMBERED.fullmatch(f.name)
        if m is not None and len(m.group(2)) == len(m.group(3)) and m.group(2).isascii():
            prefix, number, count, suffix = m.groups()
            groups.setdefault((prefix, count, suffix), set()).add(int(number))
    for (prefix, count, suffix), numbers in sorted(groups.items()):
        total, width = int(count), len(count)
        outside = sorted(n for n in numbers if not 1 <= n <= total)
        if outside:
            raise CorruptModelCheckpointError(
                file_set.path,
                f"holds {prefix}-{outside[0]:0{width}d}-of-{count}{suffix}, numbered outside "
                f"the set of {total}: rename or remove it",
            )
        if len(numbers) == total:
            continue
        missing = list(itertools.islice((n for n in range(1, total + 1) if n not in numbers), 3))
        more = " ..." if total - len(numbers) > len(missing) else ""
        raise CorruptModelCheckpointError(
            file_set.path,
            f"holds {len(numbers)} of the {total} files of {prefix}-*-of-{count}{suffix}, "
            f"and no index: {', '.join(f'{prefix}-{n:0{width}d}-of-{count}{suffix}' for n in missing)}"
            f"{more} {'is' if total - len(numbers) == 1 else 'are'} missing, so the model would "
            "load in part. Download the missing files (the download may have stopped), or pass "
            "one file to load it alone",
        )


def hf_variant_indexes(names: Sequence[str], suffix: str) -> set[str]:
    """Of a folder's ``names``, the index files of Hugging Face variants in the format of
    ``suffix`` (``diffusion_pytorch_model.fp16.safetensors.index.json``) where their family's
    default (``diffusion_pytorch_model.safetensors`` or its index) is there too: the default is
    the checkpoint, as Hugging Face loads it where no variant is asked for."""
    have = set(names)
    out = set()
    for n in names:
        m = _HF_VARIANT_INDEX[suffix].fullmatch(n)
        if m is not None and (
            f"{m.group(1)}{suffix}" in have or f"{m.group(1)}{suffix}.index.json" in have
        ):
            out.add(n)
    return out


def variant_index_notes(names: Iterable[str]) -> list[str]:
    """The notes on the variant indexes :func:`hf_variant_indexes` found, which the folder's
    load leaves out."""
    return [
        f"ignored {n}: the index of a variant of the default weights beside it, loaded only "
        "where asked for (as Hugging Face does): pass the index to load it"
        for n in sorted(names)
    ]


_MAX_INDEX_BYTES = 256 << 20


@dataclass(slots=True, eq=False)
class FileTensor:
    """One tensor found in a file's metadata (read-only; not frozen, see
    :class:`lazyckpt.index.TensorEntry`)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    region: FileRegion


@dataclass
class FileSet:
    """The files of a checkpoint and, when an index names them, the keys wanted from each."""

    path: Path
    files: list[Path]
    wanted: dict[Path, list[str]] | None = None
    notes: list[str] = field(default_factory=list)
    metadata: dict[str, str] | None = None


def find_index_file(
    folder: Path,
    suffix: str,
    preferred: str | tuple[str, ...],
    variants: Collection[str] = (),
    names: Sequence[str] | None = None,
) -> Path | None:
    """The folder's index file ending in ``suffix`` (``preferred`` wins among several; the
    ``variants``' indexes are left out, and with them nothing else is taken). ``names``: the
    folder's listing, where the caller has it."""
    listed = names_ending(folder, suffix) if names is None else names
    found = [n for n in listed if n.endswith(suffix) and n not in variants]
    if not found:
        return None
    if len(found) == 1:
        return folder / found[0]
    for name in (preferred,) if isinstance(preferred, str) else preferred:
        if name in found:
            return folder / name
    raise CorruptModelCheckpointError(
        folder,
        f"has {len(found)} index files ({', '.join(sorted(found))}); pass the index file you mean",
    )


def read_hf_index(index_path: Path, data_suffixes: tuple[str, ...]) -> FileSet:
    """Parse a Hugging Face ``*.index.json``: ``{"metadata": {...}, "weight_map": {key: file}}``."""
    folder = index_path.parent
    try:
        if index_path.stat().st_size > _MAX_INDEX_BYTES:
            raise CorruptModelCheckpointError(index_path, "is too large to be an index file")
        doc = json.loads(index_path.read_bytes())
    except (ValueError, RecursionError) as exc:  # also an int too long, nesting too deep
        raise CorruptModelCheckpointError(index_path, f"is not valid JSON: {exc}") from None
    except IsADirectoryError:
        raise CorruptModelCheckpointError(
            index_path, "is a folder, not an index file: remove or rename it"
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise CorruptModelCheckpointError(
            index_path, 'has no "weight_map" object mapping each key to its file'
        )
    if not doc["weight_map"]:
        raise CorruptModelCheckpointError(
            index_path, 'has an empty "weight_map": it lists no tensor; download it again'
        )
    wanted: dict[Path, list[str]] = {}
    by_name: dict[str, Path] = {}
    for key, name in doc["weight_map"].items():
        if name not in by_name:
            by_name[name] = member_path(folder, name, cited_by=index_path)
        wanted.setdefault(by_name[name], []).append(key)
    files = sorted(wanted, key=lambda p: p.name)
    listed = {p.name for p in files}
    notes = [
        f"ignored {name}: not listed in {index_path.name}"
        for name in sorted(os.listdir(folder))
        if name.endswith(data_suffixes) and name not in listed and (folder / name).is_file()
    ]
    metadata = doc.get("metadata")
    meta = {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}
    return FileSet(index_path, files, wanted, notes, meta)


def folder_file_set(
    folder: Path, suffixes: tuple[str, ...], skip: re.Pattern[str] | None = None
) -> FileSet:
    """Every file of ``folder`` ending in one of ``suffixes``, but those whose name ``skip``
    matches (ignored, and noted)."""
    files = list_files(folder, suffixes)
    skipped = [f for f in files if skip is not None and skip.fullmatch(f.name)]
    files = [f for f in files if f not in skipped]
    # PEFT adapters beside the weights, of this format (left out) or the other (noted only).
    adapters = set(adapter_files([f.name for f in files]))
    files = [f for f in files if f.name not in adapters]
    if beside_hf_weights(f.name for f in files):
        adapters.update(
            n for n in names_ending(folder, (".safetensors", ".bin")) if ADAPTER.fullmatch(n)
        )
    if not files:
        raise CorruptModelCheckpointError(
            folder,
            f"holds no {'/'.join(suffixes)} file"
            + (
                f" but {', '.join(f.name for f in skipped)}, which are not weights"
                if skipped
                else ""
            ),
        )
    notes = [f"ignored {f.name}: training state, not weights" for f in skipped]
    notes += [
        f"ignored {n}: a PEFT adapter beside the model's weights, not part of them: pass the "
        "file to load the adapter"
        for n in sorted(adapters)
    ]
    return FileSet(folder, files, notes=notes)


def build_file_set_index(
    file_set: FileSet,
    fmt: str,
    read_file: Callable[[Path], Sequence[FileTensor]],
    rules: KeyRules,
) -> CheckpointIndex:
    """Index every file of ``file_set`` (keys in file order, files in name order)."""
    entries: dict[str, TensorEntry] = {}
    seen: dict[str, Path] = {}
    metadata = dict(file_set.metadata or {})
    notes = list(file_set.notes)
    for path in file_set.files:
        tensors = read_file(path)
        if file_set.wanted is not None:
            wanted = file_set.wanted[path]
            found = {t.key for t in tensors}
            missing = [k for k in wanted if k not in found]
            if missing:
                raise CorruptModelCheckpointError(
                    path,
                    f"lacks key {missing[0]!r} that {file_set.path.name} places in it"
                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                    + "; the index and the files disagree: download them again",
                    key=missing[0],
                )
            keep = set(wanted)
            unlisted = [t.key for t in tensors if t.key not in keep]
            if unlisted:  # the index decides; what it leaves out is said, not dropped unsaid
                more = f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else ""
                notes.append(
                    f"ignored {len(unlisted)} key(s) of {path.name} that {file_set.path.name} "
                    f"does not place there: {', '.join(map(repr, unlisted[:3]))}{more}"
                )
            tensors = [t for t in tensors if t.key in keep]
        for t in tensors:
            if t.key in seen:
                raise CorruptModelCheckpointError(
                    path,
                    f"key {t.key!r} is in both {seen[t.key].name} and {path.name}; a folder "
                    "without an index must hold each key once. Files of one rank each (as "
                    "`lazyckpt reshard --format safetensors --tp N` writes) are loaded one file "
                    "at a time: pass the rank's file; otherwise one of the two is a stray copy",
                    key=t.key,
                )
            seen[t.key] = path
            target = rules.target(t.key)
            if target is None:
                continue
            chunk = Chunk((0,) * len(t.shape), t.shape, t.region)
            add_entry(entries, TensorEntry(target, t.dtype, t.shape, ((chunk,),), t.key))
    return CheckpointIndex(
        path=file_set.path,
        format=fmt,
        entries=entries,
        files=list(file_set.files),
        source_layout=f"{len(file_set.files)} file(s)" + (" via index" if file_set.wanted else ""),
        notes=notes,
        metadata=metadata,
    )
