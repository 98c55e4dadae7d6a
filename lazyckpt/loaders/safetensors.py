"""safetensors: one file, a folder of ``*.safetensors``, or a Hugging Face index folder.

The header (8-byte little-endian length, then JSON) is the whole index. We parse it ourselves so
every malformed field becomes an error naming the file and key, and check what the Rust library
checks: offsets in bounds, tensors packed with no hole or overlap, byte spans matching shapes.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any, final

import torch

from lazyckpt.errors import CorruptModelCheckpointError, UnknownCheckpointFormatError
from lazyckpt.index import (
    MAX_INT64,
    CheckpointIndex,
    FileRegion,
    contiguous_strides,
    note_stamp,
)
from lazyckpt.loader import IndexedCheckpointLoader, KeyRules
from lazyckpt.loaders._files import (
    ADAPTER,
    FileSet,
    FileTensor,
    beside_hf_weights,
    build_file_set_index,
    check_complete,
    find_index_file,
    folder_file_set,
    hf_variant_indexes,
    leave_out_variants,
    read_hf_index,
    variant_index_notes,
)
from lazyckpt.loaders.torch_files import INDEX_SUFFIXES as TORCH_INDEX_SUFFIXES
from lazyckpt.loaders.torch_files import SUFFIXES as TORCH_SUFFIXES
from lazyckpt.loaders.torch_files import TRAINER_STATE
from lazyckpt.options import ModelCheckpointLoadOptions
from lazyckpt.paths import names_ending
from lazyckpt.readahead import no_readahead

__all__ = ["SafetensorsCheckpointLoader", "read_safetensors_header"]

SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
"""The format's dtypes (``safetensors``' own list: no ``C128``, which its reader refuses)."""
for _name, _attr in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_PACKED = "F4"
"""Two 4-bit values a byte: the header's shape counts values, and torch's
``float4_e2m1fn_x2`` counts bytes, so the last dim is halved (as ``safetensors.torch`` does)."""
if hasattr(torch, "float4_e2m1fn_x2"):
    _DTYPES[_PACKED] = torch.float4_e2m1fn_x2


def _packed_sizes(shape: list[int]) -> list[int] | None:
    """An ``F4`` shape in bytes of two values, or None where its last dim cannot be halved."""
    if not shape or shape[-1] % 2:
        return None
    return [*shape[:-1], shape[-1] // 2]


class _Twice(dict[str, Any]):
    """A JSON object of the header that lists a name twice (``twice``: the first such), its
    last value kept, as safetensors' reader keeps it. Refused once the whole header is read,
    when it is known whose the name is: a key's, or a field of one key's entry (the hook sees
    each object alone, innermost first). Made only for such an object: every other is a plain
    ``dict``, which the fast check of an entry (:func:`_valid_entry`) takes."""

    twice: str = ""
    listed: tuple[Any, ...] = ()
    """Every value it lists, the ones later values hide included (``__metadata__``'s must all
    be strings, as safetensors' reader checks each)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) == len(pairs):
        return out
    marked = _Twice(out)
    marked.listed = tuple(v for _, v in pairs)
    seen: set[str] = set()
    for k, _ in pairs:
        if k in seen:
            marked.twice = k
            break
        seen.add(k)
    return marked


def _refuse_duplicates(path: Path, header: dict[str, Any]) -> None:
    """Refuse a key listed twice, or a field listed twice in a key's entry (which of its values
    holds is a guess). A name twice in ``__metadata__`` is taken, its last value, as
    safetensors takes it: no tensor depends on it."""
    if type(header) is _Twice:
        raise CorruptModelCheckpointError(
            path, f"header lists key {header.twice!r} twice", key=header.twice
        )
    for key, entry in header.items():
        if type(entry) is _Twice and key != "__metadata__":
            raise CorruptModelCheckpointError(
                path, f"header's entry for key {key!r} lists {entry.twice!r} twice", key=key
            )


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sizes_ok(values: list[Any], limit: int | None) -> bool:
    """Every value a non-negative integer (not a bool), at most ``limit``. A loop, not
    ``all()`` of a generator: it runs for every key of every header."""
    for v in values:  # noqa: SIM110 (all() of a generator is the slower form)
        if not _int(v) or v < 0 or (limit is not None and v > limit):
            return False
    return True


_FIRST_READ = 16 << 10
"""Bytes of a safetensors file read first: its header length and, for most files, its header
(a Llama shard's is a few KiB)."""


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """The parsed header, the byte offset where data starts, and the file size."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        no_readahead(fd)  # no read-ahead mark for the data reads to hit
        st = os.fstat(fd)
        note_stamp(path, st)
        size = st.st_size
        if size < 8:
            raise CorruptModelCheckpointError(
                path,
                f"is {size} bytes, shorter than the 8-byte safetensors header length; "
                "it is empty or truncated",
            )
        head = os.pread(fd, _FIRST_READ, 0)  # the length and, usually, the whole header
        (n,) = struct.unpack("<Q", head[:8])
        if n > MAX_HEADER_BYTES:
            raise CorruptModelCheckpointError(
                path,
                f"declares a {n}-byte header, over the {MAX_HEADER_BYTES}-byte limit; "
                "the file is not safetensors or is damaged",
            )
        if 8 + n > size:
            raise CorruptModelCheckpointError(
                path,
                f"declares a {n}-byte header but the file has only {size - 8} bytes after "
                "the length; it is truncated",
            )
        raw = head[8 : 8 + n]
        while len(raw) < n:  # a long header, or a short read
            more = os.pread(fd, n - len(raw), 8 + len(raw))
            if not more:
                raise CorruptModelCheckpointError(path, "was truncated while its header was read")
            raw += more
    finally:
        os.close(fd)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError:
        raise CorruptModelCheckpointError(path, "header is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise CorruptModelCheckpointError(path, f"header is not valid JSON ({exc})") from None
    except (ValueError, RecursionError) as exc:  # an int of too many digits, nesting too deep
        raise CorruptModelCheckpointError(path, f"header cannot be read as JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptModelCheckpointError(
            path, f"header is a JSON {type(header).__name__}, not an object"
        )
    _refuse_duplicates(path, header)
    return header, 8 + n, size


_DCP_PIECES = "DCP_SHARDING_INFO"
"""The ``__metadata__`` entry of a safetensors file from DCP's ``HuggingFaceStorageWriter``:
where each of its tensors lies in the full one. Every file of that writer has it; only those
of ``save_distributed=True`` hold pieces."""
_PIECES_FILE = re.compile(r"shard-\d+-model-\d+-of-\d+\.safetensors")
"""How that writer names a rank's file of pieces (rank 0's pieces all lie at offset 0)."""


def _holds_pieces(path: Path, meta: dict[str, str]) -> bool:
    info = meta.get(_DCP_PIECES)
    if info is None:
        return False
    if _PIECES_FILE.fullmatch(path.name):
        return True
    try:
        where = json.loads(info)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return False  # not the writer's: the file's own shapes stand
    if not isinstance(where, dict):
        return False
    for entry in where.values():
        offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if isinstance(offsets, list) and any(o != 0 for o in offsets):
            return True
    return False


def _keys(path: Path) -> set[str]:
    """The tensor names a safetensors file's header lists."""
    header, _, _ = read_safetensors_header(path)
    return {k for k in header if k != "__metadata__"}


def _read_file(path: Path) -> list[FileTensor]:
    header, data_start, size = read_safetensors_header(path)
    data_len = size - data_start
    meta = header.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict)
        and all(isinstance(v, str) for v in meta.values())
        and all(isinstance(v, str) for v in getattr(meta, "listed", ()))
    ):
        raise CorruptModelCheckpointError(
            path, "header's __metadata__ must be an object of strings"
        )
    if meta is not None and _holds_pieces(path, meta):
        raise UnknownCheckpointFormatError(
            path,
            "holds one rank's pieces of a torch.distributed.checkpoint save written by "
            f"HuggingFaceStorageWriter(save_distributed=True): its __metadata__'s {_DCP_PIECES} "
            "gives their offsets in tensors whose shapes no file records, so a rank's file is "
            "not a checkpoint, nor are its files together; save with enable_consolidation=True, "
            "or join the files with torch.distributed.checkpoint._consolidate_hf_safetensors."
            "consolidate_safetensors_files and load what it writes",
        )
    parsed = []
    bad: list[CorruptModelCheckpointError] = []
    for order, (key, info) in enumerate(header.items()):
        valid = _valid_entry(info, data_len)
        if valid is not None:  # the common case, checked inline
            dtype, sizes, begin, end = valid
            region = FileRegion(path, data_start + begin, contiguous_strides(sizes))
            parsed.append((begin, end, order, FileTensor(key, dtype, sizes, region)))
            continue
        try:  # says what is wrong (or accepts what the quick check left to it)
            begin, end, tensor = _parse_entry(path, key, info, data_start, data_len)
        except CorruptModelCheckpointError as exc:
            bad.append(exc)
            continue
        parsed.append((begin, end, order, tensor))
    if bad:
        raise _all_of(path, bad)
    # Physical order: reads run forward through the file, as the safetensors writer laid it out.
    parsed.sort(key=lambda t: t[:3])
    out = []
    cursor = 0
    for begin, end, _, tensor in parsed:
        if begin != cursor:
            what = (
                "overlaps the tensor before it"
                if begin < cursor
                else (f"leaves a hole of {begin - cursor} bytes before it")
            )
            raise CorruptModelCheckpointError(
                path,
                f"key {tensor.key!r} (data_offsets [{begin}, {end}]) {what}; the header is damaged",
                key=tensor.key,
            )
        cursor = end
        out.append(tensor)
    if cursor != data_len:
        raise CorruptModelCheckpointError(
            path,
            f"tensors end at byte {cursor} of the data but the data has {data_len} bytes; "
            "the file has trailing bytes or a truncated header",
        )
    return out


_LISTED = 5


def _all_of(path: Path, bad: list[CorruptModelCheckpointError]) -> CorruptModelCheckpointError:
    """One error for every bad header entry (a truncated file has one per key past the cut),
    so that none hides the others: the first few in full, the rest by key. It carries the
    first key."""
    if len(bad) == 1:
        return bad[0]
    listed = "; ".join(e.detail for e in bad[:_LISTED])
    rest = [repr(e.key) for e in bad[_LISTED:]]
    more = f"; and {len(rest)} more: {', '.join(rest)}" if rest else ""
    return CorruptModelCheckpointError(
        path, f"{len(bad)} keys have bad header entries: {listed}{more}", key=bad[0].key
    )


def _valid_entry(info: Any, data_len: int) -> tuple[torch.dtype, tuple[int, ...], int, int] | None:
    """``(dtype, sizes, begin, end)`` of a well-formed entry, else None (then
    :func:`_parse_entry` says what is wrong). Exact types, one pass: this runs for every key of
    every header, and a valid entry is all it must be fast for."""
    if type(info) is not dict:
        return None
    name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if type(name) is not str or type(shape) is not list or type(offsets) is not list:
        return None
    dtype = _DTYPES.get(name)
    if dtype is None or len(offsets) != 2:
        return None
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= data_len:
        return None
    numel = 1
    for n in shape:
        if type(n) is not int or not 0 <= n <= MAX_INT64:
            return None
        numel *= n
    if name == _PACKED:
        packed = _packed_sizes(shape)
        if packed is None:
            return None
        shape, numel = packed, numel // 2
    if numel * dtype.itemsize != end - begin:
        return None
    return dtype, tuple(shape), begin, end


def _parse_entry(
    path: Path, key: str, info: Any, data_start: int, data_len: int
) -> tuple[int, int, FileTensor]:
    def bad(msg: str) -> CorruptModelCheckpointError:
        return CorruptModelCheckpointError(path, f"key {key!r}: {msg}", key=key)

    if not isinstance(info, dict):
        raise bad("entry is not an object with dtype, shape and data_offsets")
    dtype_name = info.get("dtype")
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise bad(f"unknown dtype {dtype_name!r} (known: {', '.join(_DTYPES)})")
    shape = info.get("shape")
    if not isinstance(shape, list) or not _sizes_ok(shape, MAX_INT64):
        raise bad(f"shape {shape!r} is not a list of integers in [0, 2**63)")
    offsets = info.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not _sizes_ok(offsets, None):
        raise bad(f"data_offsets {offsets!r} is not a pair of non-negative integers")
    begin, end = offsets
    if end < begin:
        raise bad(f"data_offsets [{begin}, {end}] end before they begin")
    if end > data_len:
        raise bad(
            f"data_offsets [{begin}, {end}] run past the {data_len} data bytes; the file is truncated"
        )
    dtype = _DTYPES[dtype_name]
    if dtype_name == _PACKED:
        packed = _packed_sizes(shape)
        if packed is None:
            raise bad(f"shape {shape} of {dtype_name} (two values a byte) has no even last dim")
        numel = math.prod(packed)
    else:
        packed, numel = None, math.prod(shape)
    if numel * dtype.itemsize != end - begin:
        raise bad(
            f"shape {shape} of {dtype_name} needs {numel * dtype.itemsize} bytes but data_offsets "
            f"span {end - begin}"
        )
    sizes = tuple(shape if packed is None else packed)
    region = FileRegion(path, data_start + begin, contiguous_strides(sizes))
    return begin, end, FileTensor(key, dtype, sizes, region)


@final
class SafetensorsCheckpointLoader(IndexedCheckpointLoader):
    """safetensors files, folders and Hugging Face ``model.safetensors.index.json`` folders."""

    name = "safetensors"

    def supports_path(self, path: str | os.PathLike[str]) -> bool:
        p = Path(path)
        if p.is_file():
            return p.name.endswith((SUFFIX, INDEX_SUFFIX))
        if p.is_dir():
            return bool(names_ending(p, (SUFFIX, INDEX_SUFFIX)))
        return False

    def build_index(
        self, path: Path, rules: KeyRules, options: ModelCheckpointLoadOptions
    ) -> CheckpointIndex:
        return build_file_set_index(self.file_set(path), self.name, _read_file, rules)

    @staticmethod
    def file_set(path: Path) -> FileSet:
        if path.is_file():
            if path.name.endswith(INDEX_SUFFIX):
                return read_hf_index(path, (SUFFIX,))
            return FileSet(path, [path])
        listing = names_ending(path, (SUFFIX, INDEX_SUFFIX))
        variant_indexes = hf_variant_indexes(listing, SUFFIX)
        index = find_index_file(
            path,
            INDEX_SUFFIX,
            ("model" + INDEX_SUFFIX, "diffusion_pytorch_model" + INDEX_SUFFIX),
            variant_indexes,
            listing,
        )
        file_set = read_hf_index(index, (SUFFIX,)) if index is not None else None
        notes = variant_index_notes(variant_indexes)
        if file_set is None:
            file_set = folder_file_set(path, (SUFFIX,))
            leave_out_variants(file_set, SUFFIX, _keys)
            check_complete(file_set)
            twins = sorted(
                n
                for n in os.listdir(path)
                if n.endswith(TORCH_SUFFIXES + TORCH_INDEX_SUFFIXES)
                and not TRAINER_STATE.fullmatch(n)
                # noted by folder_file_set as an adapter beside Hugging Face weights
                and not (ADAPTER.fullmatch(n) and beside_hf_weights(f.name for f in file_set.files))
            )
            notes += [  # detection chose these files over the torch ones (torch_twins)
                f"ignored {n}: the safetensors files beside it are loaded, as Hugging Face "
                "loads them where a model is saved in both formats"
                for n in twins
            ]
        file_set.notes += notes
        return file_set
