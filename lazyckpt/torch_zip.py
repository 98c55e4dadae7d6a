"""Index a ``torch.save`` zip archive without reading tensor data or running pickle code.

A torch file is a zip (always *stored*, never compressed) holding ``<archive>/data.pkl`` and one
record ``<archive>/data/<key>`` per storage. We read the zip directory, unpickle ``data.pkl``
with an allow-list unpickler whose tensor-rebuild functions return :class:`StoredTensor`
placeholders, and check every storage record against what the pickle declares, so a truncated
or hand-edited file fails here instead of yielding wrong bytes (``torch.load(mmap=True)`` trusts
the sizes and can read past a short record).

This module is shared by every format built on ``torch.save``: plain files, fairscale
``consolidated.NN.pth``, fairseq2 shards, and the chunks inside DCP ``.distcp`` files (a zip at an
offset of a larger file, hence the ``window``).
"""

from __future__ import annotations

import collections
import functools
import io
import os
import pickle
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from lazyckpt.errors import CorruptModelCheckpointError
from lazyckpt.index import MAX_INT64, FileRegion, note_stamp
from lazyckpt.readahead import no_readahead
from lazyckpt.zipdir import (
    HEAD_BLOCK,
    ZipError,
    ZipShape,
    ZipSpan,
    check_layout,
    read_directory,
    record_data,
    zip_shape,
)

__all__ = [
    "PickleMemo",
    "ShapeMemo",
    "StoredTensor",
    "TorchArchive",
    "Unsupported",
    "copied_files",
    "flatten_state_dict",
    "layout_by_name",
    "read_torch_archive",
    "read_torch_set",
    "restricted_find_class",
]

ZIP_MAGIC = b"PK\x03\x04"
_MAX_PICKLE_BYTES = 1 << 30


@dataclass(slots=True, eq=False)
class _StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(slots=True, eq=False)
class StoredTensor:
    """A tensor of the pickle, located in its storage but not read (read-only by convention:
    slotted, not frozen, since one is made per tensor of every file indexed)."""

    storage: _StorageRef
    storage_offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    end: int = -1
    """One past the last storage element the view reaches, once :meth:`TorchArchive.region`
    has checked sizes and strides (-1 before). Rank files that share a ``data.pkl`` share
    their tensors (see ``PickleMemo``), so this is worked out once per set."""

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype


class Unsupported:
    """A value we refuse to load (sparse, quantized, subclass tensors, objects of globals off
    the allow-list); the error comes when the key holding it is flattened, so it can name the
    key. It absorbs ``BUILD`` state so unpickling can go on to find that key."""

    def __init__(self, what: str, hint: str = "convert it to a dense tensor before saving") -> None:
        self.what = what
        self.hint = hint

    def __setstate__(self, state: Any) -> None:
        pass

    # ... and the items pickle adds to an object of a dict or list subclass (SETITEMS, APPENDS).
    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"Unsupported({self.what!r})"


class _Forbidden:
    """Base of the stand-ins for globals off the allow-list (one subclass per global, made by
    :func:`_forbidden`): nothing is imported, and calling one, or building an object of it the
    way pickle does (``NEWOBJ``: ``cls.__new__(cls, ...)``, which needs a class), runs nothing
    and gives an :class:`Unsupported` that names the global."""

    qualname: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Unsupported:  # type: ignore[misc]
        return Unsupported(
            f"an object of the global '{cls.qualname}'",
            "that global is off the allow-list and unpickling it could run code from the file; "
            "if you trust the file, load with restrict=False",
        )


def _forbidden(module: str, name: str, seen: list[str]) -> type[_Forbidden]:
    qualname = f"{module}.{name}"
    seen.append(qualname)
    return type(name, (_Forbidden,), {"qualname": qualname, "__module__": __name__})


# -- the allow-list unpickler --------------------------------------------------------------

_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
    "UntypedStorage": torch.uint8,
}
_QUANTIZED_STORAGES = {
    "QInt8Storage",
    "QInt32Storage",
    "QUInt8Storage",
    "QUInt4x2Storage",
    "QUInt2x4Storage",
}


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype | None
    """``None`` for quantized storages, which lazyckpt does not load."""


class _TensorType:
    """Stands for ``torch.Tensor`` / ``nn.Parameter`` in ``_rebuild_from_type_v2``."""


def _as_sizes(value: Any, what: str) -> tuple[int, ...]:
    # Runs once per tensor of every file indexed: plain loops, no generators.
    if type(value) is not tuple and type(value) is not list and not isinstance(value, tuple):
        raise _PickleError(f"tensor {what} {value!r:.80} is not a tuple of ints")
    for v in value:
        if type(v) is not int:
            raise _PickleError(f"tensor {what} {value!r:.80} is not a tuple of ints")
    return tuple(value)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> Any:
    """``torch._utils._rebuild_tensor`` (torch's own signature, no argument more or fewer: a
    damaged pickle that shifted its opcodes is refused, not read as other keys)."""
    return _stored(storage, storage_offset, size, stride, None)


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    metadata: Any = None,
) -> Any:
    _check_grad_and_hooks(requires_grad, hooks)
    return _stored(storage, storage_offset, size, stride, metadata)


def _check_grad_and_hooks(requires_grad: Any, hooks: Any) -> None:
    """What torch writes for them: a bool, and its (empty) ``OrderedDict`` of hooks."""
    if type(requires_grad) is not bool:
        raise _PickleError(f"tensor requires_grad {requires_grad!r:.80} is not a bool")
    if hooks is not None and not isinstance(hooks, Mapping):
        raise _PickleError(f"tensor backward hooks {hooks!r:.80} are not a dict")


def _stored(storage: Any, storage_offset: Any, size: Any, stride: Any, metadata: Any) -> Any:
    if metadata and isinstance(metadata, dict) and (metadata.get("conj") or metadata.get("neg")):
        # torch.save keeps a conjugate or negative view's bit here and its raw storage:
        # torch.load sets the bit again, and the values are the conjugate (or negation) of
        # the bytes. Refused rather than handed out as the bytes say.
        kind, op = (
            ("conjugate", "conjugates") if metadata.get("conj") else ("negative", "negations")
        )
        return Unsupported(
            f"a {kind} view (its values are the {op} of the values its bytes hold)",
            "save t.resolve_conj().resolve_neg() instead",
        )
    if type(storage) is not _StorageRef:
        if isinstance(storage, Unsupported):
            return storage
        raise _PickleError(f"tensor storage is {type(storage).__name__}, not a stored record")
    if type(storage_offset) is not int:
        raise _PickleError(f"tensor storage offset {storage_offset!r:.80} is not an int")
    return StoredTensor(
        storage, storage_offset, _as_sizes(size, "size"), _as_sizes(stride, "stride")
    )


def _rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> Any:
    if not isinstance(dtype, torch.dtype):
        raise _PickleError(f"tensor dtype {dtype!r} is not a torch.dtype")
    _check_grad_and_hooks(requires_grad, hooks)
    if isinstance(storage, _StorageRef):
        # torch writes v3 for dtypes without a typed storage class (uint16/32/64, complex32):
        # the storage is an UntypedStorage whose numel counts bytes.
        nbytes = storage.numel * storage.dtype.itemsize
        if nbytes % dtype.itemsize:
            raise _PickleError(
                f"storage {storage.key} of {nbytes} bytes is not a whole number of {dtype} elements"
            )
        storage = _StorageRef(storage.key, dtype, nbytes // dtype.itemsize)
    return _stored(storage, storage_offset, size, stride, metadata)


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> Any:
    _check_grad_and_hooks(requires_grad, hooks)
    return data


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, hooks: Any, state: Any) -> Any:
    _check_grad_and_hooks(requires_grad, hooks)
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if new_type is not _TensorType:
        name = getattr(new_type, "qualname", getattr(new_type, "__name__", new_type))
        return Unsupported(f"a tensor subclass ({name})")
    if not callable(func) or not isinstance(args, tuple):
        raise _PickleError("malformed _rebuild_from_type_v2 call")
    return func(*args)


def _unsupported(what: str) -> Callable[..., Unsupported]:
    def make(*_: Any, **__: Any) -> Unsupported:
        return Unsupported(what)

    return make


_TORCH_UTILS: dict[str, Any] = {
    "_rebuild_tensor": _rebuild_tensor,
    "_rebuild_tensor_v2": _rebuild_tensor_v2,
    "_rebuild_tensor_v3": _rebuild_tensor_v3,
    "_rebuild_parameter": _rebuild_parameter,
    "_rebuild_parameter_with_state": _rebuild_parameter_with_state,
    "_rebuild_sparse_tensor": _unsupported("a sparse tensor"),
    "_rebuild_sparse_csr_tensor": _unsupported("a sparse tensor"),
    "_rebuild_qtensor": _unsupported("a quantized tensor"),
    "_rebuild_nested_tensor": _unsupported("a nested tensor"),
    "_rebuild_wrapper_subclass": _unsupported("a tensor subclass"),
    "_rebuild_meta_tensor_no_storage": _unsupported("a meta tensor without data"),
    "_rebuild_device_tensor_from_numpy": _unsupported("a tensor stored as a numpy array"),
    "_rebuild_xla_tensor": _unsupported("an XLA tensor"),
    "_rebuild_mtia_tensor": _unsupported("an MTIA tensor"),
}

_BUILTINS = {
    name: getattr(__import__("builtins"), name)
    for name in (
        "dict",
        "list",
        "tuple",
        "set",
        "frozenset",
        "int",
        "float",
        "complex",
        "bool",
        "str",
        "bytes",
        "bytearray",
        "slice",
    )
}


_LAYOUTS = (
    "strided",
    "sparse_coo",
    "sparse_csr",
    "sparse_csc",
    "sparse_bsr",
    "sparse_bsc",
    "jagged",
)


def layout_by_name(name: str) -> torch.layout:
    """``torch.serialization._get_layout`` for the layouts pickles name (every DCP chunk's
    ``TensorProperties`` holds one). torch's own scans all of ``torch.__dict__`` on its first
    call in a process: 0.5 ms of a fresh process's DCP index."""
    layout = _layouts().get(name)
    if layout is not None:
        return layout
    from torch.serialization import _get_layout

    return _get_layout(name)


@functools.cache
def _layouts() -> dict[str, torch.layout]:
    found = (getattr(torch, attr, None) for attr in _LAYOUTS)
    return {str(v): v for v in found if isinstance(v, torch.layout)}


def restricted_find_class(module: str, name: str) -> Any:
    """The allow-list: containers, tensors, storages, dtypes. Anything else returns None."""
    if module == "collections" and name in ("OrderedDict", "Counter"):
        return getattr(collections, name)  # both on torch.load(weights_only=True)'s list too
    if module in ("builtins", "__builtin__"):  # protocol 2 (torch.save's) names Python 2's
        return _BUILTINS.get(name)
    if module == "_codecs" and name == "encode":
        import codecs

        return codecs.encode  # protocol 2 stores bytes as encode(str, "latin1")
    if module == "torch._utils":
        return _TORCH_UTILS.get(name)
    if module == "torch._tensor" and name == "_rebuild_from_type_v2":
        return _rebuild_from_type_v2
    if (module, name) in {
        ("torch", "Tensor"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.nn.parameter", "Buffer"),
        ("torch.nn", "Parameter"),
    }:
        return _TensorType
    if module in ("torch", "torch.storage") and name in _STORAGE_DTYPES:
        return _StorageType(_STORAGE_DTYPES[name])
    if module == "torch" and name in _QUANTIZED_STORAGES:
        return _StorageType(None)
    if module == "torch.serialization" and name == "_get_layout":
        return layout_by_name  # maps a layout's name to the torch.layout
    if module == "torch":
        if name == "Size":
            return torch.Size
        if name == "device":
            return torch.device
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format, torch.qscheme)):
            return value
    return None


class _PickleError(Exception):
    """Malformed pickle content; becomes a CorruptModelCheckpointError naming the file."""


class _IndexUnpickler(pickle.Unpickler):
    """With ``restrict``, a global off the allow-list becomes a :class:`_Forbidden` stand-in
    (recorded in ``forbidden``), so the error can name the key that holds it; nothing from the
    file is ever imported or called."""

    def __init__(self, data: bytes, *, restrict: bool) -> None:
        super().__init__(io.BytesIO(data))
        self._restrict = restrict
        self.forbidden: list[str] = []
        self.storages: dict[str, _StorageRef | Unsupported] = {}
        """Every storage the pickle refers to, by record key."""

    def find_class(self, module: str, name: str) -> Any:
        found = restricted_find_class(module, name)
        if found is not None:
            return found
        if self._restrict:
            return _forbidden(module, name, self.forbidden)
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise _PickleError(f"unknown persistent id {pid!r:.80}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise _PickleError(f"storage type {storage_type!r} is not a torch storage class")
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise _PickleError(f"storage record {pid!r:.80} is malformed")
        ref: _StorageRef | Unsupported = (
            Unsupported("a quantized tensor")
            if storage_type.dtype is None
            else _StorageRef(key, storage_type.dtype, numel)
        )
        seen = self.storages.setdefault(key, ref)
        # torch.save refuses to save one storage as two types ("Cannot save multiple tensors
        # or storages that view the same data as different types"; an empty one excepted):
        # read as the second, the bytes would give other values than torch.load's.
        if seen is not ref and _declared(seen) != _declared(ref) and numel:
            raise _PickleError(
                f"storage record data/{key} is declared twice, as {_declared(seen)} and as "
                f"{_declared(ref)}; torch.save never writes that"
            )
        return ref


def _declared(ref: _StorageRef | Unsupported) -> str:
    return ref.what if isinstance(ref, Unsupported) else f"{ref.numel} x {ref.dtype}"


# -- the zip ---------------------------------------------------------------------------------


@dataclass
class TorchArchive:
    """What a torch zip holds: the unpickled object and where each storage's bytes lie."""

    path: Path
    obj: Any
    storage_offsets: dict[str, tuple[int, int]]
    """Storage key -> (absolute byte offset in ``path``, record length)."""
    forbidden: list[str] = field(default_factory=list)
    """Globals off the allow-list that the pickle refers to (never imported)."""
    serial_id: bytes | None = None
    """The ``.data/serialization_id`` torch writes, derived from the records' CRC-32s and sizes
    (read for the files of a set only, ``read_torch_archive(serial=True)``): two files with one
    hold the same bytes (:func:`copied_files`)."""
    crc_table: dict[str, int] | tuple[dict[str, int], bytes] = field(default_factory=dict)
    """Storage key -> the CRC-32 its zip record declares (0: torch saved without them), as
    the directory says (checked against the bytes only where they are read); for a file
    recognised by its shape, the CRCs as read (4 bytes each) and each key's place among them,
    shared by the files of that shape: nothing is decoded until asked (:meth:`crc`)."""

    def crc(self, storage_key: str) -> int:
        """The CRC-32 of the record of storage ``storage_key`` (0: none)."""
        table = self.crc_table
        if isinstance(table, dict):
            return table.get(storage_key, 0)
        places, raw = table
        at = places.get(storage_key)
        return 0 if at is None else int.from_bytes(raw[4 * at : 4 * at + 4], "little")

    def has_crcs(self) -> bool:
        """Whether torch saved the file with CRC-32s (``compute_crc32``, on by default)."""
        table = self.crc_table
        return bool(table[1].strip(b"\0")) if isinstance(table, tuple) else any(table.values())

    def forbidden_message(self) -> str:
        names = ", ".join(f"'{n}'" for n in dict.fromkeys(self.forbidden))
        return (
            f"data.pkl refers to {names}, not on the allow-list of tensors, containers and "
            "dtypes; unpickling it could run code from the file. If you trust the file, load "
            "with restrict=False"
        )

    def state_dict(self, keep: Callable[[str], bool] | None = None) -> dict[str, StoredTensor]:
        """The flat state dict (see :func:`flatten_state_dict`); a forbidden global anywhere in
        the file is an error, named by key where it sits in the state dict."""
        flat = flatten_state_dict(self.obj, self.path, keep)
        if self.forbidden:
            raise CorruptModelCheckpointError(self.path, self.forbidden_message())
        return flat

    def left_out(self) -> str | None:
        """A note naming the entries beside the one the weights were taken from (see
        :func:`flatten_state_dict`: optimizer state, counters), which no load yields, for the
        caller to put after the file's name; None where the file holds the weights alone."""
        if not isinstance(self.obj, Mapping):
            return None
        _, wrapper = _unwrap(self.obj)
        if wrapper is None:
            return None
        others = [repr(k) for k in self.obj if k != wrapper]
        if not others:
            return None
        more = f" and {len(others) - 8} more" if len(others) > 8 else ""
        return (
            f"weights taken from its {wrapper!r} entry; left out beside it: "
            f"{', '.join(others[:8])}{more}"
        )

    def region(self, tensor: StoredTensor, key: str) -> FileRegion:
        """The file region of ``tensor`` (held by ``key``), after checking it lies inside its
        storage record."""
        ref = tensor.storage
        found = self.storage_offsets.get(ref.key)
        if found is None:
            raise self._bad(key, f"storage record data/{ref.key} is missing from the zip")
        offset, length = found
        itemsize = ref.dtype.itemsize
        # torch.save writes each storage whole, and torch.load refuses a record of any other
        # size: a longer one than the pickle declares means the pickle or the zip was edited.
        if ref.numel * itemsize != length:
            raise self._bad(
                key,
                f"storage record data/{ref.key} has {length} bytes but the pickle declares "
                f"{ref.numel} x {itemsize} bytes; the file is truncated or edited: copy it again",
            )
        end = tensor.end
        if end < 0:
            end = tensor.end = self._view_end(tensor, key)
        if end > ref.numel:
            raise self._bad(
                key,
                f"the view (offset {tensor.storage_offset}, size {tensor.sizes}, stride "
                f"{tensor.strides}) reaches past its storage of {ref.numel} elements",
            )
        strides = tensor.strides
        if 1 in tensor.sizes:
            # A dim of size 1 places no element, so the pickle's stride for it (whatever the
            # saved view had, up to 2**63 - 1 as torch.load takes it) bounds nothing; in bytes
            # it may pass int64 and overflow ``as_strided``. It makes no difference: made 1.
            strides = tuple([1 if n == 1 else st for n, st in zip(tensor.sizes, strides)])
        return FileRegion(self.path, offset + tensor.storage_offset * itemsize, strides)

    def _view_end(self, tensor: StoredTensor, key: str) -> int:
        """One past the last storage element of ``tensor``'s view, after checking its sizes
        and strides (0 for an empty view: it needs no storage, and a chunk of an empty tensor
        saved without ``clone()`` has an offset past its storage of 0 elements)."""
        sizes, strides = tensor.sizes, tensor.strides
        if len(sizes) != len(strides):
            raise self._bad(key, f"size {sizes} and stride {strides} differ in rank")
        if tensor.storage_offset < 0:
            raise self._bad(key, f"negative storage offset {tensor.storage_offset}")
        if tensor.storage_offset > MAX_INT64:  # torch.load cannot unpickle it (even empty)
            raise self._bad(key, f"storage offset {tensor.storage_offset} is past 2**63")
        last = 0  # the view's last element, relative to its first
        empty = False
        for n, st in zip(sizes, strides):
            if n < 0 or st < 0:
                raise self._bad(key, f"negative size or stride {sizes}/{strides}")
            if st > MAX_INT64:  # torch.load cannot make such a view either
                raise self._bad(key, f"stride {strides} has a value past 2**63")
            empty = empty or n == 0
            last += (n - 1) * st
        return 0 if empty else tensor.storage_offset + last + 1

    def _bad(self, key: str, message: str) -> CorruptModelCheckpointError:
        return CorruptModelCheckpointError(self.path, f"key {key!r}: {message}", key=key)


PickleMemo = dict[tuple[bytes, bool], tuple[Any, list[str], frozenset[str]]]
"""``data.pkl`` bytes (and ``restrict``) -> what unpickling them gave. The rank files of a
model-parallel checkpoint usually hold the same ``data.pkl`` byte for byte (same keys, shapes and
storage names), so a set is unpickled once."""


def read_torch_archive(
    path: Path,
    *,
    restrict: bool = True,
    window: tuple[int, int] | None = None,
    fd: int | None = None,
    size: int | None = None,
    memo: PickleMemo | None = None,
    shapes: ShapeMemo | None = None,
    serial: bool = False,
) -> TorchArchive:
    """Read the zip directory and ``data.pkl`` of a torch file (or of a zip at
    ``window=(start, length)`` inside ``path``); no storage byte is read. With ``memo``, a
    ``data.pkl`` already unpickled for another file is not unpickled again (the result is
    shared: treat it as read-only). With ``shapes``, an archive that repeats the checked bytes
    of one read before (see :class:`ShapeMemo`) is recognised from a read per record (records
    closer than 8 KiB read together) and a few comparisons instead of being parsed again.
    ``size``: the size of ``fd``, where the caller has it (a reader locating DCP chunks, one per
    key, stats nothing then). ``serial``: read its serialization id too."""
    own = fd is None
    if fd is None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if own:
            no_readahead(fd)  # exact reads of the directory, and no mark for the data reads
            st = os.fstat(fd)
            note_stamp(path, st)
            size = st.st_size
        elif size is None:
            size = os.fstat(fd).st_size
        start, length = window if window is not None else (0, size)
        if start < 0 or length < 0 or start + length > size:
            raise CorruptModelCheckpointError(
                path, f"bytes [{start}, {start + length}) lie past the end of the {size}-byte file"
            )
        if shapes is not None:
            known = _recognise(fd, start, shapes.get((length, restrict), ()))
            if known is not None:
                archive, crcs = known
                storages = {k: (start + at, n) for k, (at, n) in archive.storages.items()}
                sid = None
                if serial and archive.serial is not None:
                    at, n = archive.serial
                    sid = os.pread(fd, n, start + at)
                return TorchArchive(
                    path,
                    archive.obj,
                    storages,
                    archive.forbidden,
                    sid,
                    (archive.crc_places, crcs),
                )
        span = ZipSpan(fd, start, length)
        # The head block read_directory keeps: one read for the magic and the first records.
        _check_magic(path, span.keep(0, min(length, HEAD_BLOCK))[:4], window)
        try:
            return _read_archive(path, span, restrict, memo, shapes, serial)
        except ZipError as exc:
            raise CorruptModelCheckpointError(
                path, f"not a readable torch zip archive: {exc}"
            ) from None
    finally:
        if own:
            os.close(fd)


def read_torch_set(
    files: Sequence[Path],
    *,
    restrict: bool = True,
    keep: Callable[[str], bool] | None = None,
    serial: bool = False,
) -> list[tuple[TorchArchive, dict[str, StoredTensor]]]:
    """Every file's archive and flat state dict, for files saved alike (the rank files of a
    model-parallel set, the shards of a fairseq2 stage). They usually hold one ``data.pkl``
    and, but for their data and its CRCs, the same bytes: it is unpickled and flattened once
    (``PickleMemo``), and a file that repeats a checked one is recognised by comparing those
    bytes (``ShapeMemo``) instead of being parsed again (MP-8: ~0.1 ms a file against 1.4 for
    the first, parsed and its shape kept). ``keep``: see :func:`flatten_state_dict`.
    ``serial``: read each archive's ``serial_id`` too (see :func:`copied_files`)."""
    out = []
    memo: PickleMemo = {}
    shapes: ShapeMemo | None = {} if len(files) > 1 else None
    flats: dict[int, dict[str, StoredTensor]] = {}
    for f in files:
        archive = read_torch_archive(f, restrict=restrict, memo=memo, shapes=shapes, serial=serial)
        flat = flats.get(id(archive.obj))
        if flat is None:
            flat = flats[id(archive.obj)] = archive.state_dict(keep)
        out.append((archive, flat))
    return out


def copied_files(archives: Sequence[TorchArchive]) -> list[tuple[Path, Path]]:
    """``(first, copy)`` for each file of ``archives`` whose serialization id an earlier one has.
    torch derives the id from the CRC-32s and sizes of the records it writes, so two files with
    one hold the same values: a copy (``cp consolidated.07.pth consolidated.08.pth``), or ranks
    whose shards are equal (replicas only, empty or constant shards). Files without an id
    (torch before 2.1), or saved without CRC-32s (``compute_crc32=False``: the id then says
    only the records' sizes), are not compared."""
    seen: dict[bytes, Path] = {}
    pairs = []
    for a in archives:
        if a.serial_id and a.has_crcs():
            first = seen.setdefault(a.serial_id, a.path)
            if first != a.path:
                pairs.append((first, a.path))
    return pairs


CRC_PROOF = "their zip records' CRC-32s differ"
"""How :func:`differing_copy` knows, for the message that refuses such a replica."""


def differing_copy(copies: Sequence[tuple[TorchArchive, StoredTensor]]) -> int | None:
    """The index of the first of ``copies`` (one key's tensor as each file stores it) whose
    bytes differ from the first's, as the CRC-32s of their storage records prove without a
    byte read: where the copies are laid out alike and each fills its record, contiguous. None
    where none is proven to differ (equal CRCs, no CRCs, or copies not comparable so): a
    replica too large to be compared by reading (``verify_replicas_max_bytes``) is still
    checked this way."""
    first_archive, first = copies[0]
    crc = first_archive.crc(first.storage.key)
    if not crc or not _fills_record(first):
        return None
    for i, (archive, t) in enumerate(copies[1:], 1):
        # Files saved alike share one StoredTensor (see read_torch_set): checked once.
        if t is first or (t.sizes == first.sizes and t.dtype == first.dtype and _fills_record(t)):
            other = archive.crc(t.storage.key)
            if other and other != crc:
                return i
    return None


def _fills_record(t: StoredTensor) -> bool:
    """Whether ``t`` is its storage record's bytes in row-major order, so that equal tensors
    have equal records."""
    if t.storage_offset != 0:
        return False
    stride = 1
    for size, step in zip(reversed(t.sizes), reversed(t.strides)):
        if size != 1 and step != stride:
            return False
        stride *= size
    return stride == t.storage.numel


def _check_magic(path: Path, head: bytes, window: tuple[int, int] | None) -> None:
    if head == ZIP_MAGIC:
        return
    where = "" if window is None else f" at byte {window[0]}"
    # Pickle protocol 2 on (b"\x80"), or 0 and 1, which write torch's magic number as text.
    if head[:1] == b"\x80" or head == b"L119":
        raise CorruptModelCheckpointError(
            path,
            f"the data{where} is a bare pickle, the legacy torch.save format (torch < 1.6) that "
            "cannot be read lazily; load it once with torch.load and save it again",
        )
    raise CorruptModelCheckpointError(
        path, f"the data{where} is not a torch zip archive (starts with {head!r})"
    )


def _read_archive(
    path: Path,
    span: ZipSpan,
    restrict: bool,
    memo: PickleMemo | None,
    shapes: ShapeMemo | None = None,
    serial: bool = False,
) -> TorchArchive:
    records, directory = read_directory(span)
    pickles = [r for r in records if r.name.endswith("data.pkl") and r.name.count("/") <= 1]
    if len(pickles) != 1:
        raise CorruptModelCheckpointError(
            path, f"expected one data.pkl record in the zip, found {len(pickles)}"
        )
    prefix = pickles[0].name[: -len("data.pkl")]
    base = span.start
    storages: dict[str, tuple[int, int]] = {}
    crcs: dict[str, int] = {}
    order = pkl = sid_at = None
    n = len(prefix)
    # Local headers are checked for the records we read; the others (version, serialization
    # id) only bound their neighbours in the overlap check, from their header offset.
    spans: list[tuple[int, int] | None] = []
    payloads: list[int] = []
    for i, r in enumerate(records):
        rest = r.name[n:] if r.name.startswith(prefix) else ""
        found: tuple[int, int] | None = None
        if rest.startswith("data/"):
            found = record_data(span, r)
            storages[rest[5:]] = (base + found[0], r.size)
            crcs[rest[5:]] = r.crc
            payloads.append(i)
        elif rest == "data.pkl":
            found = record_data(span, r)
            pkl = (found[0], r.size)
        elif rest == "byteorder":
            found = record_data(span, r)
            order = (found[0], r.size)
        elif serial and rest == ".data/serialization_id" and 0 < r.size <= 64:
            # Located, but left out of the checked layout and of the shape other files are
            # recognised by: every save has its own id (recognising no file cost MP-8 ~9 ms).
            sid_at = (record_data(span, r)[0], r.size)
        spans.append(found)
    check_layout(span, records, [None if f is None else f[1] for f in spans], directory)
    if order is not None:
        byteorder = span.read(*order)
        if byteorder != b"little":
            raise CorruptModelCheckpointError(
                path,
                f"byte order {byteorder!r} is not supported; re-save the file on a little-endian "
                "machine",
            )
    assert pkl is not None
    if pkl[1] > _MAX_PICKLE_BYTES:
        raise CorruptModelCheckpointError(path, f"data.pkl is {pkl[1]} bytes, too large")
    data = span.read(*pkl)
    # A CRC of 0 is what torch writes when saving with compute_crc32=False
    # (torch.utils.serialization.config.save), and torch.load reads such files.
    if pickles[0].crc and zlib.crc32(data) != pickles[0].crc:
        raise CorruptModelCheckpointError(
            path, "data.pkl fails its zip CRC check: the file is damaged; copy it again"
        )
    known = None if memo is None else memo.get((data, restrict))
    if known is None:
        known = _unpickle(path, data, restrict)
        if memo is not None:
            memo[(data, restrict)] = known
    obj, forbidden, referenced = known
    stray = storages.keys() - referenced
    if stray:  # torch.save writes a record for each storage it pickles, and no other
        raise CorruptModelCheckpointError(
            path,
            f"holds storage record data/{min(stray)} that data.pkl never refers to: the pickle "
            "is damaged (its tensors would be lost without a word); copy the file again",
        )
    if shapes is not None and payloads:
        same = shapes.setdefault((span.length, restrict), [])
        full = len(same) >= _SHAPES_PER_LENGTH
        raw_prefix = pickles[0].raw_name[: -len(b"data.pkl")]
        shape = None if full else zip_shape(span, records, spans, directory, payloads, raw_prefix)
        if shape is not None:
            relative = {k: (at - base, size) for k, (at, size) in storages.items()}
            by_place = sorted(storages, key=lambda k: storages[k][0])  # as shape.crcs cuts them
            places = {k: i for i, k in enumerate(by_place)}
            same.append(_Known(shape, relative, obj, forbidden, places, sid_at))
    return TorchArchive(
        path, obj, storages, forbidden, None if sid_at is None else span.read(*sid_at), crcs
    )


@dataclass(frozen=True, slots=True)
class _Known:
    """An embedded archive that passed every check: its shape, and what it gave."""

    shape: ZipShape
    storages: dict[str, tuple[int, int]]
    """Storage key -> (byte offset from the archive's start, record length)."""
    obj: Any
    forbidden: list[str]
    crc_places: dict[str, int]
    """Storage key -> its place among the CRC-32s that :meth:`ZipShape.matches` gives (the
    order of their data in the archive)."""
    serial: tuple[int, int] | None = None
    """Where its serialization id lies (offset from the archive's start, length), if read."""


_SHAPES_PER_LENGTH = 8
"""Shapes kept per archive length: chunks of one length but different shapes are few."""

ShapeMemo = dict[tuple[int, bool], list[_Known]]
"""Archives already read, by length (and ``restrict``), to recognise others of the same shape
(:class:`zipdir.ZipShape`): as strict as parsing them again, and cheaper. DCP writes every
tensor chunk as a small ``torch.save`` zip, and the chunks of one shape and dtype hold the same
bytes but for their data and its CRC-32 (and torch's random ``serialization_id``): ~25 against
~100 us a chunk here. The rank files of a model-parallel set differ the same way (every rank's
shard of a key has one shape), and in the archive name that torch takes from the file name:
~0.1 ms a fairscale MP-8 file recognised. A few shapes are kept per length."""


def _recognise(fd: int, start: int, known: Sequence[_Known]) -> tuple[_Known, bytes] | None:
    """The first of ``known`` whose shape the archive at ``start`` of ``fd`` repeats, with
    the archive's payload CRC-32s."""
    for k in known:
        crcs = k.shape.matches(fd, start)
        if crcs is not None:
            return k, crcs
    return None


def _unpickle(path: Path, data: bytes, restrict: bool) -> tuple[Any, list[str], frozenset[str]]:
    unpickler = _IndexUnpickler(data, restrict=restrict)
    try:
        obj = unpickler.load()
    except _PickleError as exc:
        raise CorruptModelCheckpointError(path, f"data.pkl: {exc}") from None
    except CorruptModelCheckpointError:
        raise
    except Exception as exc:  # any malformed pickle: a file error, never a crash
        raise CorruptModelCheckpointError(
            path, f"data.pkl cannot be unpickled ({type(exc).__name__}: {exc})"
        ) from None
    return obj, unpickler.forbidden, frozenset(unpickler.storages)


# -- state dicts -----------------------------------------------------------------------------


_MAX_NESTING = 200
"""Dicts inside dicts a state dict may nest (a model's deepest module path is a few dozen)."""
_SHARING = 64
"""How many times over, at most, flattening may walk the entries the file's dicts hold
(:class:`_Walk`): a pickle may hold one dict in many places (``{"weights": sd, "ema": sd}``,
one config beside each of 15,000 experts, which key_map drops), but one that holds a dict
twice, that dict holding another twice, and so on, makes 2**depth keys of a 2 KB file, and
4,096 keys holding one dict of 100,000 keys make 400 million: walks that never end."""


class _Walk:
    """What a flattening has done: the distinct dicts it entered and their entries, and the
    entries it walked (each as often as its dict is reached)."""

    __slots__ = ("entries", "seen", "walked")

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.entries = 0
        self.walked = 0

    def enter(self, obj: Mapping[Any, Any]) -> bool:
        """Count a walk over ``obj``; False once the walks pass ``_SHARING`` times the
        entries (plus room for small files)."""
        if id(obj) not in self.seen:
            self.seen.add(id(obj))
            self.entries += len(obj)
        self.walked += len(obj)
        return self.walked <= _SHARING * self.entries + 100_000


def flatten_state_dict(
    obj: Any, path: Path, keep: Callable[[str], bool] | None = None
) -> dict[str, StoredTensor]:
    """The flat ``{key: tensor}`` of a loaded torch object.

    A dict whose ``"model"``, ``"state_dict"``, ``"model_state_dict"`` or ``"module"`` entry
    is a dict is unwrapped to it (training checkpoints keep optimizer state and counters beside
    the weights: see ``_WRAPPERS``). Nested dicts are joined with ``.``, integer keys
    (an optimizer's per-parameter state) written in decimal. Any other value is an error naming
    the key, unless ``keep(key)`` says the load does not want it (``options.key_map`` dropped
    it: a module's ``_extra_state``, say).
    """
    if isinstance(obj, Unsupported):
        raise CorruptModelCheckpointError(path, f"the file holds {obj.what}; {obj.hint}")
    if isinstance(obj, StoredTensor):
        raise CorruptModelCheckpointError(
            path,
            f"the file holds one tensor of shape {tuple(obj.sizes)}, not a state dict of "
            "named tensors; save a dict ({'name': tensor}) instead",
        )
    if not isinstance(obj, Mapping):
        raise CorruptModelCheckpointError(
            path,
            f"the file holds a {type(obj).__name__}, not a state dict; save "
            "model.state_dict() instead of the model",
        )
    obj, _ = _unwrap(obj)
    out: dict[str, StoredTensor] = {}
    _flatten(obj, "", out, path, keep, set(), _Walk())
    return out


_WRAPPERS = ("model", "state_dict", "model_state_dict", "module")
"""The entries training checkpoints keep their weights under, in the order they are looked for:
the common name, Lightning's, the PyTorch tutorial's, DeepSpeed's (``mp_rank_00_model_states.pt``,
beside its config, version and counters)."""


def _unwrap(obj: Mapping[Any, Any]) -> tuple[Mapping[Any, Any], str | None]:
    """The weights of a training checkpoint: the first of its ``_WRAPPERS`` entries that is a
    dict (and the entry's name), else ``obj`` itself (and None)."""
    for wrapper in _WRAPPERS:
        inner = obj.get(wrapper)
        if isinstance(inner, Mapping):
            return inner, wrapper
    return obj, None


def _flatten(
    obj: Mapping[Any, Any],
    prefix: str,
    out: dict[str, StoredTensor],
    path: Path,
    keep: Callable[[str], bool] | None,
    inside: set[int],
    walk: _Walk,
) -> None:
    """``inside``: the ids of the dicts ``obj`` lies in, itself included once entered (a
    pickle can make a dict hold itself, which torch.load takes; flattened, it never ends).
    ``walk``: what the flattening has done (see ``_SHARING``)."""
    if id(obj) in inside:
        key = prefix.removesuffix(".")
        raise CorruptModelCheckpointError(
            path, f"key {key!r} holds a dict that holds it: no state dict does", key=key
        )
    if not walk.enter(obj):
        key = prefix.removesuffix(".")
        raise CorruptModelCheckpointError(
            path,
            f"key {key!r}: the file's dicts hold one another so often that flattening them "
            f"walks {walk.walked:,} entries of {walk.entries:,} (dicts held in many places, "
            "each holding more: their keys multiply with each level): no state dict does",
            key=key,
        )
    if len(inside) >= _MAX_NESTING:
        raise CorruptModelCheckpointError(
            path, f"key {prefix[:200]!r}... nests dicts more than {_MAX_NESTING} deep"
        )
    inside.add(id(obj))
    for k, v in obj.items():
        if isinstance(k, int) and not isinstance(k, bool):
            k = str(k)  # optimizer state: {param index: {...}}; a clash is caught below
        elif not isinstance(k, str):
            raise CorruptModelCheckpointError(
                path,
                f"key {prefix}{k!r} is a {type(k).__name__}, not a string or int, so it has no "
                "name to load or to drop by key_map; save the weights under 'model' beside it, "
                "or save the file again without it",
                key=f"{prefix}{k!r}",
            )
        key = prefix + k
        if isinstance(v, StoredTensor):
            if key in out:
                raise CorruptModelCheckpointError(
                    path, f"key {key!r} appears twice after flattening", key=key
                )
            out[key] = v
        elif isinstance(v, Mapping):
            _flatten(v, key + ".", out, path, keep, inside, walk)  # under two keys: fine
        elif keep is not None and not keep(key):
            continue  # not a tensor, but dropped by the caller's key_map
        elif isinstance(v, Unsupported):
            raise CorruptModelCheckpointError(
                path, f"key {key!r} holds {v.what}, which lazyckpt cannot load; {v.hint}", key=key
            )
        else:
            raise CorruptModelCheckpointError(
                path,
                f"key {key!r} holds a {type(v).__name__}, not a tensor; a state dict may "
                "only hold tensors: drop the key with options.key_map (mapping it to None; "
                "--key-map on the command line), remove it from the file, or save the weights "
                "under 'model' beside it",
                key=key,
            )
    inside.discard(id(obj))
