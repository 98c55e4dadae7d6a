"""Write a checkpoint in a new layout, one tensor at a time, into a folder that appears whole.

Every output file's layout is known before any tensor byte is read: the plan gives each key's
target shape and the options its dtype. So a safetensors header is written first and each
tensor lands at its offset as the stream delivers it, and a ``torch.save`` file is written with
torch's own zip writer, pickle first and then one storage record per tensor, exactly as
``torch.save`` lays it out. Tensors are read with ``pread`` and no read-ahead, so memory
stays at about one tensor, never a rank's shard.

Output goes to a temporary folder beside the destination; files and folder are fsync'd and the
folder renamed into place only when complete. On any error, or Ctrl-C, the temporary folder is
removed, so the destination either holds the whole new checkpoint or is left as it was.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Literal

import torch
from tqdm.auto import tqdm

from lazyckpt.build import fill, output_dtype
from lazyckpt.index import CheckpointIndex, contiguous_strides
from lazyckpt.layout import Layout
from lazyckpt.load_plan import TensorPlan, plan_entry, plan_load
from lazyckpt.loader import IndexedCheckpointLoader
from lazyckpt.loaders import detect_loader
from lazyckpt.options import ModelCheckpointLoadOptions, castable
from lazyckpt.read import Reader
from lazyckpt.stats import LoadStats, byte_bar
from lazyckpt.zipdir import ends_with_end_record

__all__ = [
    "DestinationError",
    "OutputFormat",
    "ReshardResult",
    "SafetensorsWriter",
    "TensorSpec",
    "TorchSaveWriter",
    "atomic_folder",
    "parse_size",
    "reshard",
]

OutputFormat = Literal["consolidated", "safetensors"]
FORMATS: tuple[str, ...] = ("consolidated", "safetensors")

DEFAULT_MAX_SHARD_SIZE = 5_000_000_000
"""Hugging Face's default ``max_shard_size`` ("5GB")."""

SIDECARS = ("params.json", "config.json", "generation_config.json")
"""Small files that describe the model; carried over from a source folder as they are."""
RESHARD_OPTIONS = ModelCheckpointLoadOptions(mmap=False, prefetch_bytes=0)
""":func:`reshard`'s reading options by default: pread (pages of a mapping would stay resident
as the files are walked) and no read-ahead, so that exactly one tensor is alive while it is
written."""

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


class DestinationError(ValueError):
    """The destination cannot be written as asked (not empty without ``force``, same as the
    source ...): a usage problem, nothing is touched."""


def parse_size(text: str) -> int:
    """``"5GB"`` (10**9, as Hugging Face counts), ``"500MiB"`` (2**20), or plain bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"size {text!r} is not a size: write bytes, or a number with KB/MB/GB/TB (powers "
            "of 1000) or KiB/MiB/GiB/TiB (powers of 1024), e.g. 5GB"
        )
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return value


# -- output files ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """What an output file will hold under ``key``, known before the data is read."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def _check_tensor(path: Path, spec: TensorSpec, key: str, tensor: torch.Tensor) -> None:
    if key != spec.key or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
        raise RuntimeError(
            f"{path}: expected key {spec.key!r} ({spec.dtype}, {spec.shape}) but the stream "
            f"gave {key!r} ({tensor.dtype}, {tuple(tensor.shape)}); this is a lazyckpt bug"
        )


def _dense_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat CPU uint8 tensor (a view when it is already dense)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _attr, _name in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _attr):
        _ST_DTYPES[getattr(torch, _attr)] = _name
_PACKED = getattr(torch, "float4_e2m1fn_x2", None)
"""Written as ``F4``, whose shape counts 4-bit values: the last dim doubled."""
if _PACKED is not None:
    _ST_DTYPES[_PACKED] = "F4"


def _check_storable(spec: TensorSpec) -> None:
    """Refuse a tensor safetensors has no dtype for (or an ``F4`` one without a dim to hold
    its pairs, or one named as the header's metadata), naming the key: before anything is
    written, and again by the writer."""
    if spec.dtype not in _ST_DTYPES or (spec.dtype == _PACKED and not spec.shape):
        dims = " and no dims" if spec.dtype == _PACKED and not spec.shape else ""
        fix = (
            "pass --dtype or use --format consolidated"
            if castable(spec.dtype)
            else "use --format consolidated (--dtype casts floating-point tensors only)"
        )
        raise ValueError(
            f"key {spec.key!r} has dtype {spec.dtype}{dims}, which safetensors cannot store; {fix}"
        )
    try:
        spec.key.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, which torch.save's pickle allows
        raise ValueError(
            f"key {spec.key!r} is not valid Unicode (character {exc.start}), and a safetensors "
            "header is UTF-8; rename it with a key_map or use --format consolidated"
        ) from None
    if spec.key == "__metadata__":  # the header's own entry: a tensor there makes it unreadable
        raise ValueError(
            "key '__metadata__' is the name safetensors gives its header's metadata, so no "
            "tensor can have it; use --format consolidated"
        )


class SafetensorsWriter:
    """A safetensors file written header first, then each tensor at its offset as it comes.

    Tensors are laid out by descending item size (then name), as the safetensors writer does,
    so every tensor starts aligned to its item size; they may arrive in any order.
    """

    def __init__(
        self, path: Path, specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
    ) -> None:
        self.path = path
        self.specs = {s.key: s for s in specs}
        for s in specs:
            _check_storable(s)
        order = sorted(specs, key=lambda s: (-s.dtype.itemsize, s.key))
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        self.offsets: dict[str, int] = {}
        cursor = 0
        for s in order:
            header[s.key] = {
                "dtype": _ST_DTYPES[s.dtype],
                "shape": [*s.shape[:-1], s.shape[-1] * 2] if s.dtype == _PACKED else list(s.shape),
                "data_offsets": [cursor, cursor + s.nbytes],
            }
            self.offsets[s.key] = cursor
            cursor += s.nbytes
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.data_start = 8 + len(raw)
        self.size = self.data_start + cursor
        self._pending = set(self.specs)
        self._fd: int | None = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666
        )
        try:
            os.ftruncate(self._fd, self.size)
            _pwrite_all(self._fd, len(raw).to_bytes(8, "little") + raw, 0)
        except BaseException:
            self.abort()
            raise

    def write(self, key: str, tensor: torch.Tensor) -> None:
        spec = self.specs.get(key)
        if spec is None or key not in self._pending or self._fd is None:
            raise RuntimeError(f"{self.path}: key {key!r} is not due here; this is a lazyckpt bug")
        _check_tensor(self.path, spec, key, tensor)
        data = _dense_bytes(tensor)
        if data.numel():
            _pwrite_all(self._fd, data.numpy().data, self.data_start + self.offsets[key])
        self._pending.discard(key)

    @property
    def complete(self) -> bool:
        return not self._pending

    def close(self) -> None:
        """Check every tensor was written, then fsync and close."""
        if self._fd is None:
            return
        if self._pending:
            missing = sorted(self._pending)
            self.abort()
            raise RuntimeError(
                f"{self.path}: {len(missing)} tensor(s) never arrived, e.g. {missing[0]!r}; "
                "this is a lazyckpt bug"
            )
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def abort(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class _StorageStub:
    """Stands for a tensor's storage in the pickle; torch.save's persistent id names it."""

    def __init__(self, record: str, dtype: torch.dtype, numel: int) -> None:
        self.record = record
        self.dtype = dtype
        self.numel = numel


class _TensorStub:
    """Pickles exactly as a dense CPU tensor does (``Tensor._reduce_ex_internal``)."""

    def __init__(self, storage: _StorageStub, shape: tuple[int, ...]) -> None:
        self.storage = storage
        # A tuple of its own: pickle writes a tuple it has seen as a reference to it, and the
        # planner hands out one shape object to every key of that shape (its boxes are cached),
        # where torch.save's tensors each have their own.
        self.shape = (*shape,)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        args: tuple[Any, ...] = (
            self.storage,
            0,
            self.shape,
            (*contiguous_strides(self.shape),),  # its own tuple too: the strides are cached
            False,
            collections.OrderedDict(),
        )
        if _typed_storage_name(self.storage.dtype) is None:
            # Dtypes newer than typed storages (float8, uint16 ...): an untyped byte storage
            # and the dtype spelled out, as torch.save does.
            return (torch._utils._rebuild_tensor_v3, (*args, self.storage.dtype))
        return (torch._utils._rebuild_tensor_v2, args)


def _typed_storage_name(dtype: torch.dtype) -> str | None:
    return torch.storage._dtype_to_storage_type_map().get(dtype)


class _StubPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, _StorageStub):
            return None
        name = _typed_storage_name(obj.dtype)
        if name is None:
            nbytes = obj.numel * obj.dtype.itemsize
            return ("storage", torch.storage.UntypedStorage, obj.record, "cpu", nbytes)
        return ("storage", getattr(torch, name), obj.record, "cpu", obj.numel)


class TorchSaveWriter:
    """A ``torch.save`` file of a flat ``{key: tensor}`` dict, written one tensor at a time.

    The pickle only needs shapes and dtypes, so it is written first; then each tensor is one
    storage record, appended as it arrives (in ``specs`` order), with torch's own zip writer.
    The records are those ``torch.save`` writes for the same dict, byte for byte.
    """

    def __init__(self, path: Path, specs: Sequence[TensorSpec]) -> None:
        self.path = path
        self.specs = list(specs)
        self._next = 0
        stubs = {}
        for i, s in enumerate(self.specs):
            numel = s.nbytes // s.dtype.itemsize
            stubs[s.key] = _TensorStub(_StorageStub(str(i), s.dtype, numel), s.shape)
        buf = io.BytesIO()
        _StubPickler(buf, protocol=2).dump(stubs)
        pkl = buf.getvalue()
        self._stream: Any = None
        name = str(path)
        align = _storage_alignment()
        if name.isascii():
            self._writer: Any = _file_writer(name, align)
        else:  # the C++ writer only takes ASCII names; torch.save falls back the same way
            self._stream = open(path, "xb")  # noqa: SIM115 - closed in close()/abort()
            self._writer = _file_writer(self._stream, align)
        with self._failing():
            self._writer.write_record("data.pkl", pkl, len(pkl))
            if _ALIGNED_RECORDS:
                self._writer.write_record(".format_version", "1", 1)
                self._writer.write_record(".storage_alignment", str(align), len(str(align)))
            self._writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))

    @contextmanager
    def _failing(self) -> Iterator[None]:
        """Aborts on any error, and turns torch's writer's (a ``RuntimeError`` saying ``basic_ios``
        or ``unexpected pos``, never the errno) into an ``OSError`` naming the file."""
        try:
            yield
        except BaseException as exc:
            self.abort()
            if isinstance(exc, RuntimeError):
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no detail"
                raise OSError(
                    f"torch's zip writer failed ({detail}); is the disk full, or a file size "
                    "limit (ulimit -f) reached?"
                ) from exc
            raise

    @property
    def complete(self) -> bool:
        return self._next == len(self.specs)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if self._writer is None or self._next >= len(self.specs):
            raise RuntimeError(f"{self.path}: key {key!r} is not due here; this is a lazyckpt bug")
        spec = self.specs[self._next]
        _check_tensor(self.path, spec, key, tensor)
        data = _dense_bytes(tensor)
        if data.untyped_storage().nbytes() != data.numel() or data.storage_offset() != 0:
            data = data.clone()  # a record is a whole storage: copy out a view into a larger one
        with self._failing():
            self._writer.write_record(f"data/{self._next}", data.untyped_storage(), data.numel())
        self._next += 1

    def close(self) -> None:
        if self._writer is None:
            return
        if not self.complete:
            missing = self.specs[self._next].key
            self.abort()
            raise RuntimeError(
                f"{self.path}: tensors from {missing!r} on never arrived; this is a lazyckpt bug"
            )
        with self._failing():
            self._writer.write_end_of_file()
            self._writer = None  # the C++ writer closes its file when released
            if self._stream is not None:
                self._stream.close()
            with open(self.path, "rb+") as f:
                os.fsync(f.fileno())
                # torch 2.4's writer ignores a failed write of the directory at the end (rc 0,
                # a file torch.load cannot open): the file must end with the zip end record.
                if not ends_with_end_record(f):
                    raise RuntimeError("the file ends without its zip end record")

    def abort(self) -> None:
        """Drop the writer with its file unfinished (the caller removes the file).

        Released unfinished, torch's writer finishes the file in its destructor, where a write
        that fails (the disk full) terminates the process. Finishing it here first marks it
        finished even when that fails, so the release only closes the file."""
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(RuntimeError):
                writer.write_end_of_file()
            del writer
        if self._stream is not None:
            self._stream.close()


_ALIGNED_RECORDS = hasattr(torch.serialization, "_get_storage_alignment")
"""Whether this torch's ``torch.save`` writes the ``.format_version`` and ``.storage_alignment``
records (torch 2.4 writes neither)."""


def _storage_alignment() -> int:
    get = getattr(torch.serialization, "_get_storage_alignment", None)
    return int(get()) if get is not None else 64


def _file_writer(target: str | IO[bytes], align: int) -> Any:
    """torch's zip writer, made as this torch's ``torch.save`` makes it: with the CRC32 and
    alignment options it has, else from the file alone (torch 2.4 has neither option, and its
    writer takes no more: CRC32 always, 64-byte alignment)."""
    crc = getattr(torch.serialization, "get_crc32_options", None)
    if crc is None or not _ALIGNED_RECORDS:
        return torch._C.PyTorchFileWriter(target)
    return torch._C.PyTorchFileWriter(target, crc(), align)


# -- the destination ---------------------------------------------------------------------------


def _is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or inner.is_relative_to(outer)


@contextmanager
def atomic_folder(dst: str | os.PathLike[str], *, force: bool = False) -> Iterator[Path]:
    """A temporary folder beside ``dst`` that becomes ``dst`` when the block succeeds.

    ``dst`` may be missing or an empty folder; with ``force`` anything there is replaced (moved
    aside, then deleted once the new folder is in place). Without ``force``, a ``dst`` that was
    filled meanwhile is not replaced (:class:`DestinationError`). Files written in the block
    must be fsync'd by their writers; the folder and its parent are fsync'd here. On any
    exception, KeyboardInterrupt included, the temporary folder and any parent folders created
    for it are removed and ``dst`` is left as it was. Interrupts wait while the new folder is
    put in place and the old one deleted: one that comes then is raised after, saying that
    ``dst`` was written, with nothing left beside it.
    """
    dst = Path(os.path.abspath(dst))
    empty_dir = check_destination(dst, force=force)
    created: list[Path] = []
    parent = dst.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    for p in reversed(created):
        p.mkdir()
    tmp: Path | None = None
    try:
        try:
            tmp = Path(
                tempfile.mkdtemp(
                    prefix=f"{_hidden(dst)}{os.getpid()}@{_host()}-",
                    suffix=_WORK_SUFFIX,
                    dir=dst.parent,
                )
            )
        except OSError as exc:  # it names the hidden folder, which the user never asked for
            raise type(exc)(
                exc.errno, f"{exc.strerror}: cannot make a folder in {dst.parent} to write {dst}"
            ) from None
        # The folder prepared for it keeps its group and mode (setgid included); else a plain
        # folder (mkdtemp makes it private).
        mode = _take_place_of(tmp, dst) if empty_dir else 0o777 & ~_umask()
        os.chmod(tmp, mode | stat.S_IRWXU)  # writable by its writer until it is in place
        yield tmp
        _fsync_dir(tmp)
        with _interrupts_deferred(f"{dst} was written"):
            _publish(tmp, dst, force)
            tmp = None
            if mode & stat.S_IRWXU != stat.S_IRWXU:  # the mode of the folder it replaced
                os.chmod(dst, mode)
    finally:
        if tmp is not None:
            _remove_all(tmp, created)


def check_destination(dst: Path, *, force: bool) -> bool:
    """Refuse a ``dst`` that :func:`atomic_folder` may not replace (see there); returns whether
    it is an empty folder. Run by it, and by :func:`reshard` before anything long."""
    _check_replaceable(dst)
    empty_dir = dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir())
    if (dst.exists() or dst.is_symlink()) and not force and not empty_dir:
        what = (
            "a link"  # even to an empty folder: the rename would replace the link, not fill it
            if dst.is_symlink()
            else "a folder that is not empty"
            if dst.is_dir()
            else "a file"
        )
        raise DestinationError(
            f"{dst} is {what}; choose a new destination or pass --force to replace it"
        )
    return empty_dir


def _take_place_of(tmp: Path, dst: Path) -> int:
    """Give ``tmp`` the group of the empty folder ``dst`` it will replace (a shared folder
    made group-writable and setgid for a team), before anything is written in it, so that the
    files take its group too (kept where this user may set it); returns ``dst``'s mode, which
    ``tmp`` takes once written (a folder without the owner's write bit is written first)."""
    st = dst.stat()
    with contextlib.suppress(OSError):
        os.chown(tmp, -1, st.st_gid)
    return stat.S_IMODE(st.st_mode)


def stale_work_folders(dst: str | os.PathLike[str]) -> list[Path]:
    """The work folders beside ``dst`` that earlier runs on this machine left when they were
    killed outright (SIGKILL, the OOM killer, a power cut: every other ending removes them),
    whose process is gone, and those of versions that did not name the run in them: hidden,
    they would hold a partial checkpoint's disk space unseen."""
    dst = Path(os.path.abspath(dst))
    prefix = _hidden(dst)
    try:
        names = os.listdir(dst.parent)
    except OSError:
        return []
    found = []
    for name in names:
        m = _WORK_NAME.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
        if m is None:
            continue  # not one of dst's
        pid, host = m.group(1), m.group(2)
        if pid is not None and (host != _host() or _alive(int(pid))):
            continue  # a run writing now, or another machine's (a shared file system)
        found.append(dst.parent / name)
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: it exists
        return True
    return True


def _check_replaceable(dst: Path) -> None:
    """Refuse, before anything is written, a ``dst`` that a renamed folder cannot take the
    place of: a mount point (a fresh volume's root: the output was written on the parent's
    disk, then the rename failed with EBUSY), or a device, pipe or socket (``--force`` replaced
    ``/dev/full`` with a folder)."""
    if os.path.ismount(dst):  # (Path.is_mount is POSIX-only before Python 3.12)
        raise DestinationError(
            f"{dst} is a mount point, which a new folder cannot replace; write into a folder "
            f"inside it, such as {dst / 'checkpoint'}"
        )
    try:
        mode = dst.lstat().st_mode
    except OSError:  # missing: made
        return
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise DestinationError(
            f"{dst} is a device, pipe or socket, not a folder to write a checkpoint in; "
            "choose a folder (--force replaces only files, folders and links)"
        )


def _remove_all(tmp: Path, created: Sequence[Path]) -> None:
    """Delete the temporary folder, then the parent folders made for it, to the end: a second
    Ctrl-C while deleting (the first one's cleanup) restarts it, and is raised once all is
    gone, instead of leaving a partial output behind."""
    interrupt: KeyboardInterrupt | None = None
    while True:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            for p in created:
                try:
                    p.rmdir()
                except OSError:
                    break
            break
        except KeyboardInterrupt as exc:
            interrupt = exc
    if interrupt is not None:
        raise interrupt


_WORK_SUFFIX = ".lazyckpt-tmp"
"""The end of a work folder's name: ``.{dst name}.{pid}@{host}-{random}.lazyckpt-tmp``."""
_WORK_NAME = re.compile(r"(?:(\d{1,9})@([A-Za-z0-9_]{1,32})-)?[a-z0-9_]{8}\.lazyckpt-tmp")
"""What follows ``.{dst name}.`` in a work folder's name: the pid and host of the run writing
it (none before 2026-11-28), then mkdtemp's random part."""


def _host() -> str:
    """This machine's name as a work folder's name holds it (letters, digits, ``_``)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname().split(".")[0])[:32] or "host"


def _hidden(dst: Path) -> str:
    """The prefix of a hidden folder beside ``dst``: its name cut so that the prefix, the run's
    pid and host (up to 43 bytes), 8 random characters and the suffix fit a file name (255
    bytes) however long ``dst``'s name is."""
    name = os.fsdecode(os.fsencode(dst.name)[:180])  # a name need not be UTF-8
    return f".{name}."


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


TERMINATING = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))
"""Signals that end a command the way Ctrl-C does (Windows has no SIGHUP): the CLI turns them
into ``KeyboardInterrupt``, and publishing defers them with SIGINT."""
_DEFERRED = (signal.SIGINT, *TERMINATING)


@contextmanager
def _interrupts_deferred(done: str) -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP wait until the block is done, then act as they would have: a
    ``KeyboardInterrupt`` from Python's handler or the CLI's (saying ``done`` when the block
    succeeded), the default action otherwise, also when the block raised. (A signal mask would
    not do: another thread of the process may take the signal, and CPython still raises in the
    main thread.) Outside the main thread nothing waits: Python delivers no signal there."""
    got: list[int] = []

    def record(signum: int, frame: Any) -> None:
        got.append(signum)

    before: dict[signal.Signals, Any] = {}
    succeeded = False
    try:
        with contextlib.suppress(ValueError):  # not the main thread
            for s in _DEFERRED:
                before[s] = signal.signal(s, record)
        yield
        succeeded = True
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if got:
            _deliver(before[signal.Signals(got[0])], got[0], f"after {done}" if succeeded else "")


def _deliver(handler: Any, signum: int, note: str) -> None:
    """What ``signum`` would have done under ``handler``, a little late."""
    if callable(handler):
        try:
            handler(signum, None)
        except KeyboardInterrupt as exc:
            if not note:
                raise
            raise KeyboardInterrupt(note) from exc
    elif handler in (signal.SIG_DFL, None):
        signal.raise_signal(signum)


def _publish(tmp: Path, dst: Path, force: bool) -> None:
    """Rename ``tmp`` to ``dst``, then fsync the parent. Without ``force`` a missing or empty
    ``dst`` is replaced and anything else refused, in the rename itself (Linux replaces an empty
    folder and refuses a non-empty one); with ``force`` whatever is there is moved aside first
    and deleted once ``tmp`` took its place."""
    if not force:
        try:
            os.rename(tmp, dst)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            raise DestinationError(
                f"{dst} was filled while resharding, so it is left as it is; choose a new "
                "destination or pass --force to replace it"
            ) from None
        _fsync_dir(dst.parent)
        return
    old: Path | None = None
    if dst.exists() or dst.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=_hidden(dst), suffix=".lazyckpt-old", dir=dst.parent))
        try:
            os.rename(dst, old / "old")
        except OSError as exc:  # a folder without write permission cannot move
            old.rmdir()
            raise DestinationError(
                f"{dst} cannot be moved aside to be replaced ({exc.strerror}), so it is left as "
                "it is; remove it yourself or choose a new destination"
            ) from None
    try:
        os.rename(tmp, dst)
    except OSError:
        if old is not None:
            os.rename(old / "old", dst)
            old.rmdir()
        raise
    _fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- resharding --------------------------------------------------------------------------------


@dataclass
class OutputFile:
    """One file of the output: its name, the rank whose tensors it holds, and those tensors."""

    name: str
    layout: Layout
    specs: list[TensorSpec]
    kind: Literal["torch", "safetensors"]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


@dataclass
class ReshardResult:
    """What a reshard wrote and read."""

    dst: Path
    format: str
    layout: str
    files: list[tuple[str, int]]
    """``(file name, tensor bytes)`` of each output file."""
    sidecars: list[str]
    tensors: int
    bytes_written: int
    stats: LoadStats = field(default_factory=LoadStats)
    index_file: str | None = None
    """The Hugging Face index written beside the files (``--tp 1 --dp 1`` safetensors)."""


def _specs(plans: Sequence[TensorPlan], dtype: torch.dtype | None) -> list[TensorSpec]:
    return [
        TensorSpec(p.key, output_dtype(p.entry.dtype, dtype), tuple(p.box.sizes)) for p in plans
    ]


def hf_shards(specs: Sequence[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Hugging Face's greedy split in key order: a new shard when the next tensor would pass
    ``max_shard_size``; a tensor larger than that gets a shard of its own."""
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for s in specs:
        if s.nbytes > max_shard_size:
            shards.append([s])
            continue
        if current and size + s.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(s)
        size += s.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def plan_outputs(
    plans_for: Callable[[Layout], list[TensorPlan]],
    *,
    tp: int,
    dp: int,
    fmt: str,
    dtype: torch.dtype | None,
    max_shard_size: int,
) -> list[OutputFile]:
    """The output files and what each holds, from the plans alone (no tensor data)."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "consolidated" and dp > 1:
        raise ValueError(
            "--format consolidated writes one file per TP rank (fairscale MP-N) and has no "
            "place for FSDP shards; use --dp 1, or --format safetensors for one file per rank"
        )
    outputs: list[OutputFile] = []
    if fmt == "consolidated":
        width = max(2, len(str(tp - 1)))
        for r in range(tp):
            layout = Layout(tp_size=tp, tp_rank=r)
            name = f"consolidated.{r:0{width}d}.pth"
            outputs.append(OutputFile(name, layout, _specs(plans_for(layout), dtype), "torch"))
        return outputs
    if tp == 1 and dp == 1:
        layout = Layout()
        shards = hf_shards(_specs(plans_for(layout), dtype), max_shard_size)
        n = len(shards)
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            outputs.append(OutputFile(name, layout, shard, "safetensors"))
        return outputs
    for r in range(tp):
        for d in range(dp):
            layout = Layout(tp_size=tp, tp_rank=r, dp_size=dp, dp_rank=d)
            parts = ([f"tp{r:02d}"] if tp > 1 else []) + ([f"dp{d:02d}"] if dp > 1 else [])
            name = f"model-{'-'.join(parts)}.safetensors"
            outputs.append(
                OutputFile(name, layout, _specs(plans_for(layout), dtype), "safetensors")
            )
    return outputs


def reshard(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    shard_dims: Mapping[str, int],
    *,
    tp: int = 1,
    dp: int = 1,
    fmt: str = "consolidated",
    dtype: torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
    progress: bool = False,
    options: ModelCheckpointLoadOptions | None = None,
    loader: IndexedCheckpointLoader | None = None,
    before_writing: Callable[[CheckpointIndex], None] | None = None,
) -> ReshardResult:
    """Write ``src`` to ``dst`` for ``tp`` x ``dp`` ranks, streaming one tensor at a time.

    Everything that can fail before writing (format, shard dims, layout, destination) fails
    before the temporary folder is made. Each rank's tensors are streamed with ``lazy_load`` for
    that rank, so only its bytes are read.
    """
    src_path = Path(src)
    dst_path = Path(os.path.abspath(dst))
    loader = loader or detect_loader(src_path)
    src_abs = Path(os.path.abspath(src_path))
    src_root = src_abs if src_path.is_dir() else src_abs.parent
    src_real, dst_real = src_abs.resolve(), dst_path.resolve()
    if _is_within(src_real, dst_real) or (src_path.is_dir() and _is_within(dst_real, src_real)):
        raise DestinationError(
            f"{dst_path} overlaps the source {src_abs}; write the new checkpoint elsewhere"
        )
    Layout(tp_size=tp, dp_size=dp)  # rejects sizes < 1 with a ValueError naming the field
    base = options or RESHARD_OPTIONS
    stats = base.stats if base.stats is not None else LoadStats()
    base = replace(base, dtype=dtype, stats=stats, progress=False, layout=None)
    index = loader.index(src_path, shard_dims, base)
    if not index.entries:  # an output of no files (or an index listing none) reads as broken
        kept = " that the key_map keeps" if base.key_map is not None else ""
        raise ValueError(f"{src_abs} holds no tensors{kept}, so there is nothing to write")
    for f in index.files:  # an index file names data files elsewhere, maybe inside dst
        if _is_within(f.resolve(), dst_real):
            raise DestinationError(
                f"{dst_path} holds {f}, a file of the source; write the new checkpoint elsewhere"
            )
    cache: dict[Layout, list[TensorPlan]] = {}

    def plans_for(layout: Layout) -> list[TensorPlan]:
        if layout not in cache:
            cache[layout] = plan_load(
                index,
                shard_dims,
                layout,
                verify_replicas=base.verify_replicas,
                verify_max_bytes=base.verify_replicas_max_bytes,
            )
        return cache[layout]

    outputs = plan_outputs(
        plans_for, tp=tp, dp=dp, fmt=fmt, dtype=dtype, max_shard_size=max_shard_size
    )
    for out in outputs:
        if out.kind == "safetensors":
            for s in out.specs:
                _check_storable(s)
    # A Hugging Face index file stands for its folder; a lone weights file has no sidecars.
    in_folder = src_path.is_dir() or src_path.name.endswith(".index.json")
    sidecars = [n for n in SIDECARS if in_folder and (src_root / n).is_file()]
    sidecar_bytes = {n: _read_sidecar(src_root / n, dtype) for n in sidecars}  # fail before
    if base.verify_replicas:
        _check_replicas(index, shard_dims, base)
    check_destination(dst_path, force=force)  # all of dst's checks before a long one
    if before_writing is not None:
        before_writing(index)  # the caller's (the CLI's check of the source's CRC-32s)
    total = sum(o.nbytes for o in outputs)
    index_file = (
        "model.safetensors.index.json" if fmt == "safetensors" and tp == 1 and dp == 1 else None
    )
    bar = byte_bar(total, "writing", enabled=progress)
    with bar, atomic_folder(dst_path, force=force) as tmp:
        by_layout: dict[Layout, list[OutputFile]] = {}
        for out in outputs:
            by_layout.setdefault(out.layout, []).append(out)
        for layout, files in by_layout.items():
            options = replace(base, layout=layout)
            _write_rank(loader, src_path, shard_dims, options, files, tmp, dst_path, bar)
        if index_file is not None:
            weight_map = {s.key: o.name for o in outputs for s in o.specs}
            doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with _writing(dst_path / index_file):
                _write_small(tmp / index_file, json.dumps(doc, indent=2, sort_keys=True) + "\n")
        for name, data in sidecar_bytes.items():
            with _writing(dst_path / name):
                _write_small(tmp / name, data)
    return ReshardResult(
        dst=dst_path,
        format=fmt,
        layout=f"TP-{tp}" + (f" x FSDP-{dp}" if dp > 1 else ""),
        files=[(o.name, o.nbytes) for o in outputs],
        sidecars=sidecars,
        tensors=sum(len(o.specs) for o in outputs),
        bytes_written=total,
        stats=stats,
        index_file=index_file,
    )


def _check_replicas(
    index: CheckpointIndex, shard_dims: Mapping[str, int], options: ModelCheckpointLoadOptions
) -> None:
    """Compare every copy of each replicated key (up to ``verify_replicas_max_bytes``) before
    anything is written.

    ``lazy_load`` compares only the copies in files its rank reads anyway, so an MP-N set
    written as TP-N (each rank reads its one file) compared none, and a damaged copy was
    written out as it was. ``reshard`` reads every file, so it checks them all."""
    entries = [
        e for e in index if len(e.copies) > 1 and e.nbytes <= options.verify_replicas_max_bytes
    ]
    if not entries:
        return
    with (
        torch.no_grad(),
        Reader(use_mmap=options.mmap, stats=options.stats, stamps=index.stamps) as reader,
    ):
        for entry in entries:
            dim, box, pieces = plan_entry(entry, shard_dims, Layout(), index.path)
            others = tuple((i, p) for i, p in enumerate(pieces) if i)
            plan = TensorPlan(entry, dim, box, 0, pieces[0], others)
            fill(plan, reader, torch.empty(box.sizes, dtype=entry.dtype, device="cpu"))


_HF_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _read_sidecar(path: Path, dtype: torch.dtype | None) -> bytes:
    """:func:`_sidecar`, read before anything is written: an unreadable one fails at once,
    named as the source it is, not after every tensor as a file that could not be written."""
    try:
        return _sidecar(path, dtype)
    except OSError as exc:
        raise type(exc)(
            exc.errno, f"{exc.strerror}: cannot read {path} to copy it beside the weights"
        ) from None


def _sidecar(path: Path, dtype: torch.dtype | None) -> bytes:
    """A sidecar's bytes, as they are but for a Hugging Face ``config.json``'s ``torch_dtype``
    (or ``dtype``) after a cast (``transformers`` loads the weights in that dtype)."""
    raw = path.read_bytes()
    if path.name != "config.json" or dtype not in _HF_DTYPES:
        return raw
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw
    keys = [k for k in ("torch_dtype", "dtype") if k in doc] if isinstance(doc, dict) else []
    if not keys:  # newer transformers write "dtype", older "torch_dtype"
        return raw
    for k in keys:
        doc[k] = _HF_DTYPES[dtype]
    return (json.dumps(doc, indent=2) + "\n").encode()


def _write_small(path: Path, data: str | bytes) -> None:
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with open(path, "xb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def _write_rank(
    loader: IndexedCheckpointLoader,
    src: Path,
    shard_dims: Mapping[str, int],
    options: ModelCheckpointLoadOptions,
    files: list[OutputFile],
    folder: Path,
    shown: Path,
    bar: tqdm,
) -> None:
    """Stream one rank's tensors into its output files in ``folder``, opening each file when
    its first tensor comes and closing it when its last one is written. A file that cannot be
    written is named as it would be in ``shown``, the destination (not the hidden folder)."""
    target: dict[str, OutputFile] = {s.key: f for f in files for s in f.specs}
    open_writers: dict[str, SafetensorsWriter | TorchSaveWriter] = {}
    stream = loader.lazy_load(src, shard_dims, options)
    try:
        for f in files:
            if not f.specs:  # an empty shard: no tensor will ever open it
                with _writing(shown / f.name):
                    open_writers[f.name] = _open_writer(folder, f)
        for key, tensor in stream:
            out = target[key]
            with _writing(shown / out.name):
                writer = open_writers.get(out.name)
                if writer is None:
                    writer = open_writers[out.name] = _open_writer(folder, out)
                bar.set_description(f"writing {out.name}", refresh=False)
                writer.write(key, tensor)
                nbytes = tensor.numel() * tensor.element_size()
                del tensor
                bar.update(nbytes)
                if writer.complete:
                    writer.close()
        for f in files:
            w = open_writers.get(f.name)
            if w is None:
                raise RuntimeError(f"{folder / f.name}: no tensor arrived; this is a lazyckpt bug")
            with _writing(shown / f.name):
                w.close()
    except BaseException:
        for w in open_writers.values():
            w.abort()
        raise
    finally:
        stream.close()  # type: ignore[attr-defined]  # stops the prefetch thread at once


@contextmanager
def _writing(shown: Path) -> Iterator[None]:
    """An ``OSError`` raised in the block (a full disk) said of the file ``shown``; the writers'
    own errors name no file (``os.pwrite`` gives none), or the hidden folder's."""
    try:
        yield
    except OSError as exc:
        error = OSError(f"cannot write {shown}: {exc.strerror or exc}")
        error.errno = exc.errno  # kept for callers, out of the message's way
        raise error from exc


def _open_writer(folder: Path, out: OutputFile) -> SafetensorsWriter | TorchSaveWriter:
    if out.kind == "torch":
        return TorchSaveWriter(folder / out.name, out.specs)
    return SafetensorsWriter(folder / out.name, out.specs, {"format": "pt"})
