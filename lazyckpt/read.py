"""Reading: copy the planned pieces of source chunks into one destination tensor.

Two ways to reach the bytes, picked by ``ModelCheckpointLoadOptions.mmap``:

* **mmap** (default): each file is mapped once, copy-on-write (``MAP_PRIVATE``), and a piece is
  one strided ``Tensor.copy_`` from a view of the mapping, which touches only the pages of the
  piece. When the target box lies in one chunk and no cast is asked, the view itself is yielded
  (strided where the file stores it so, like ``torch.chunk``): zero copies, and writing to it
  never reaches the file. A box that several chunks fill with ranges lying back to back is a
  stitched view (:mod:`lazyckpt.stitch`). Mappings go on the unmapping thread
  (:mod:`lazyckpt.unmap`) once nothing uses them.
* **direct reads** (``load_into``): pieces whose runs are long on both sides, or that are a
  few runs (a norm's shard), are read with ``preadv`` into the destination's memory, on two
  threads (:class:`ReadQueue`), whatever ``mmap`` says.
* **pread**: contiguous runs are read with ``os.preadv`` straight into the destination's memory;
  rows too short to be worth a system call each are read in slabs through a bounce buffer when
  that at most doubles the bytes read. Suits network filesystems, where mapping is slow.

Files are opened on first use, so a file that holds no byte of the target is never opened.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import ctypes
import functools
import math
import mmap
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from lazyckpt import alloc, cow, fdlimit, forks, readahead, stitch, unmap
from lazyckpt.claims import Claims, footprint
from lazyckpt.errors import CorruptModelCheckpointError
from lazyckpt.index import (
    Chunk,
    FileRegion,
    FileStamp,
    LazyRegion,
    contiguous_strides,
    file_stamp,
)
from lazyckpt.plan import (
    Piece,
    concat_order,
    contiguous_runs,
    element_offset,
    is_dense,
    middle_run,
    plan_stitch,
    repeats_elements,
    span,
)
from lazyckpt.stats import LoadStats

__all__ = ["DirectRead", "ReadQueue", "Reader", "ViewSpot"]

_MIN_RUN_BYTES = 64 << 10
"""Runs at least this long get a ``pread`` each (or an iovec of one); shorter ones are read in
slabs, or copied from the mapping."""
_FEW_RUNS = 4
"""Pieces of at most this many runs are read directly however short the runs: a ``pread``
each costs less than mapping the file and copying from it."""
_CALL_BYTES = 4 << 20
"""Largest single ``preadv`` of :meth:`Reader.direct_reads`: two threads share a box, and
finish within one call of each other (:class:`ReadQueue`)."""
_IOV_MAX = 1024
"""Iovecs per ``preadv`` (Linux's ``IOV_MAX``)."""
_SLAB_BYTES = 8 << 20
"""Largest bounce buffer for slab reads."""
_ALIGN = 64
"""Bounce buffers are a multiple of this many bytes: a whole number of any dtype's elements."""
_COPY_ANY = contextlib.nullcontext(True)
"""What :meth:`_OpenFile.copying` gives where no view goes to a consumer (reusable)."""
_RAW_BYTES = 1 << 20
"""Largest piece :meth:`Reader.raws` hands out as bytes (a copy; replica norms are a few KiB)."""


class _OpenFile:
    """A file opened for one load: its descriptor, size and (lazily) its mapping."""

    def __init__(
        self, path: Path, defer: int = 0, claims: bool = False, mapped: bool = True
    ) -> None:
        self.path = path
        self.name = str(path)
        """The path as :class:`LoadStats` counts it."""
        self._defer = defer
        # Opened as a FileIO, which owns the descriptor from the open on (made in one C call):
        # a Ctrl-C after an os.open returned, before anything held the number, lost it for
        # the life of the process. Until the closer below is set, the FileIO closes it when
        # dropped; then the closer does (no ``with``: the file outlives this call).
        self._file = fdlimit.opening(path, lambda: open(path, "rb", buffering=0), mapped)  # noqa: SIM115
        self.fd = self._file.fileno()
        # Closes the descriptor once: at close(), or when the object goes unclosed (a Ctrl-C
        # between here and the reader's listing of it, or inside the reader's close()).
        self._closer = weakref.finalize(self, self._file.close)
        self._closer.atexit = False
        try:
            st = os.fstat(self.fd)
            readahead.no_readahead(self.fd)
        except BaseException:  # an OSError, or a Ctrl-C: the descriptor is not left open
            self._close_fd()
            raise
        self.size = st.st_size
        self.stamp = file_stamp(st)
        self._map: ctypes.Array[ctypes.c_char] | None = None
        self._bytes: memoryview | None = None
        self.pages: cow.PrivatePages | None = None
        """The views of the mapping still alive (see :mod:`lazyckpt.cow`)."""
        self.flats: dict[torch.dtype, torch.Tensor] = {}
        """Flat tensors over the whole mapping, by dtype (see ``Reader._flat``)."""
        self.claims: Claims | None = Claims() if claims else None
        """The views made of the mapping and the copies from it under way, where views go to a
        consumer who may write into them (see :mod:`lazyckpt.claims`)."""

    def mapping(self) -> ctypes.Array[ctypes.c_char]:
        """The whole file mapped copy-on-write (``MAP_PRIVATE``: views are writable, writes
        never reach the file), as a lease that unmaps it off the caller's thread once the
        reader and every view are done with it (:mod:`lazyckpt.unmap`)."""
        if self._map is None:
            fd = self.fd
            self._map = unmap.lease(
                fdlimit.opening(self.path, lambda: mmap.mmap(fd, 0, access=mmap.ACCESS_COPY))
            )
        return self._map

    def watched(self) -> None:
        """Map the file, and watch its views (:attr:`pages`) from now on. Only a load that
        hands out views needs that: ``load_into`` copies from the mapping and watches nothing
        (closing eight files' watches took it 0.1-0.15 ms)."""
        if self.pages is None:
            self.pages = cow.PrivatePages(self.mapping(), self._defer, owner=self)

    def window(self, start: int, stop: int, probe: int) -> memoryview:
        """Bytes ``[start, stop)`` of the mapping, as a buffer of their own: tensors made from
        it keep it (and the mapping) alive, and its pages are given back when it goes (if the
        page at byte ``probe``, one the view holds, was written). :meth:`watched` first."""
        if self._bytes is None:
            self._bytes = memoryview(self.mapping())
        view = self._bytes[start:stop]
        assert self.pages is not None
        self.pages.watch(view, start, stop, probe)
        return view

    def copying(
        self, first: int, sizes: tuple[int, ...], strides: tuple[int, ...], itemsize: int
    ) -> contextlib.AbstractContextManager[bool]:
        """Whether the piece at byte ``first`` may be copied from the mapping; no view is made
        over it meanwhile (see :mod:`lazyckpt.claims`; always, where views go to no consumer)."""
        if self.claims is None:
            return _COPY_ANY
        return self.claims.copying([footprint(first, sizes, strides, itemsize)])

    def check_range(self, start: int, stop: int, key: str) -> None:
        # Checked before every access: touching a mapping past EOF is SIGBUS, not an error.
        if start < 0 or stop > self.size:
            raise CorruptModelCheckpointError(
                self.path,
                f"key {key!r} needs bytes [{start}, {stop}) but the file has {self.size} bytes; "
                "it is truncated or its metadata is wrong: copy it again",
                key=key,
            )

    def close(self) -> None:
        # The mapping is never closed by hand: closing it under a live view would unmap
        # memory the view still reads (a crash). Dropping our reference lets the last view
        # free it.
        self.flats.clear()
        self._map = self._bytes = self.pages = None
        # Once, and the number forgotten: by then it may be another file's, which a worker
        # still building for a stream closed under it would read (or close again).
        self.fd = -1
        self._close_fd()

    def _close_fd(self) -> None:
        # By hand, not through the finalizer, which does nothing once the interpreter is
        # shutting down: a stream closed then (kept to the end of a script) left its FileIOs
        # to be freed unclosed, each with a ResourceWarning. Closing twice does nothing.
        self._closer.detach()
        self._file.close()


def _changed(path: Path, key: str, how: str, then: str = "") -> CorruptModelCheckpointError:
    """A file that is no longer the one the checkpoint's index describes."""
    return CorruptModelCheckpointError(
        path,
        f"key {key!r}: the file changed since the checkpoint was indexed ({how}){then}; load "
        "it again",
        key=key,
    )


class ViewSpot(NamedTuple):
    """Where a zero-copy view lies (:meth:`Reader.find_view`)."""

    file: _OpenFile
    first: int
    """Byte offset of the first element."""
    elements: int
    """Elements from the first to the last, inclusive."""
    middle: tuple[int, int]
    """The bytes of the view's middle run (:func:`lazyckpt.plan.middle_run`): what is probed
    for the page cache, and, at :attr:`probe`, for writes when the view goes."""
    dtype: torch.dtype
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def probe(self) -> int:
        """A byte of the middle run, checked for writes when the view goes."""
        lo, hi = self.middle
        return (lo + hi) // 2

    @property
    def stop(self) -> int:
        """Byte offset just past the last element."""
        return self.first + self.elements * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the view's elements (what it counts as read)."""
        return math.prod(self.sizes) * self.dtype.itemsize


class Reader:
    """Copies pieces of chunks into destinations, keeping files open for one load.

    Safe to share between the prefetch thread and the caller, who builds zero-copy views
    itself: opening a file and mapping it happen under a lock, the rest is per call.
    """

    def __init__(
        self,
        *,
        use_mmap: bool = True,
        stats: LoadStats | None = None,
        defer: int = 0,
        consumer_views: bool = False,
        stamps: Mapping[Path, FileStamp] | None = None,
    ) -> None:
        self.use_mmap = use_mmap
        self.stamps = stamps or {}
        """Files as they were indexed (``CheckpointIndex.stamps``): one that changed since is
        refused when opened, as the index's offsets no longer describe its bytes."""
        self.stats = stats
        self.consumer_views = consumer_views
        """Views go to a consumer who may write into them (a stream): no two views cover one
        byte, and bytes a view covered are read with ``pread`` (see :mod:`lazyckpt.claims`).
        Else views are only read (replica checks) and nothing is kept."""
        self.defer = defer
        """Bytes of views that went to gather before they are checked for writes, while the
        reader is open (see :class:`lazyckpt.cow.PrivatePages`): a stream's views."""
        self._files: dict[Path, _OpenFile] = {}
        # Reentrant: the garbage collector may close a dropped stream's reader on a thread that
        # is inside one of its locked sections (the prefetch worker allocates the most).
        self._lock = threading.RLock()
        forks.renew_lock_in_child(self, threading.RLock)
        self._local = threading.local()
        self._closed = False
        cow.sweep()  # the mappings a Ctrl-C in an earlier load's close left watched

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:  # a thread still building (a stream closed by the GC) opens no more
            self._closed = True
            files, self._files = self._files, {}
        self._local = threading.local()  # the caller's bounce buffer (a worker's went with it)
        # Every file is closed though one close is interrupted (a Ctrl-C there left the other
        # files' descriptors open for the life of the process): the stack runs the rest, then
        # raises.
        with contextlib.ExitStack() as stack:
            for f in files.values():
                stack.callback(self._close_file, f)

    @staticmethod
    def _close_file(f: _OpenFile) -> None:
        try:
            if f.pages is not None:
                f.pages.flush()  # views that go from now on are checked at once
        finally:
            f.close()

    def _open(self, path: Path, key: str) -> _OpenFile:
        f = self._files.get(path)
        if f is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"{path}: read after the load was closed")
                f = self._files.get(path)
                if f is None:
                    try:
                        f = _OpenFile(path, self.defer, self.consumer_views, self.use_mmap)
                    except FileNotFoundError as exc:
                        raise CorruptModelCheckpointError(
                            path, "the file is gone: it was listed when the checkpoint was indexed"
                        ) from exc
                    except IsADirectoryError as exc:
                        raise _changed(path, key, "a folder now stands in its place") from exc
                    indexed = self.stamps.get(path)
                    if indexed is not None and f.stamp != indexed:
                        f.close()
                        raise _changed(
                            path,
                            key,
                            "replaced or rewritten while loading",
                            ", its offsets no longer hold",
                        )
                    self._files[path] = f
                    # The garbage collector may have closed the reader meanwhile, on this very
                    # thread (a stream dropped in a reference cycle): at an allocation, or from
                    # 3.12 at the next Python call, and hashing a path is one, even the hash
                    # that lists ``f`` (then into the listing close() had already taken). No
                    # other thread can close it while this one holds the lock, and closing
                    # twice does nothing.
                    if self._closed:
                        f.close()
                        raise RuntimeError(f"{path}: read after the load was closed")
        return f

    def _bounce(self, nbytes: int) -> torch.Tensor:
        """A byte buffer of at least ``nbytes`` for slab reads, one per thread, kept for the
        load: a fresh buffer per slab would be zeroed by the kernel each time, and glibc keeps
        freed blocks of this size around."""
        buf: torch.Tensor | None = getattr(self._local, "bounce", None)
        if buf is None or buf.numel() < nbytes:
            # A whole number of elements of any dtype, whichever piece reuses it next.
            size = -(-max(nbytes, _SLAB_BYTES) // _ALIGN) * _ALIGN
            buf = alloc.empty((size,), torch.uint8)
            self._local.bounce = buf
        return buf

    def _flat(self, f: _OpenFile, dtype: torch.dtype) -> torch.Tensor:
        """The whole mapped file as a flat ``dtype`` tensor: copies take pieces of it with one
        ``as_strided`` (never yielded, so no caller ever holds a storage spanning the whole
        file); only pieces at multiples of the itemsize are taken as ``dtype``."""
        flat = f.flats.get(dtype)
        if flat is None:
            with self._lock:
                flat = f.flats.get(dtype)  # another thread may have made it
                if flat is None:
                    count = f.size // dtype.itemsize
                    flat = f.flats[dtype] = torch.frombuffer(f.mapping(), dtype=dtype, count=count)
        return flat

    def _copy_unaligned(
        self,
        f: _OpenFile,
        first: int,
        dtype: torch.dtype,
        sizes: tuple[int, ...],
        strides: tuple[int, ...],
        dst: torch.Tensor,
    ) -> None:
        """Copy a piece whose elements do not lie at multiples of their size (a DCP chunk's zip
        starts anywhere in its file) byte by byte: torch's kernels may assume aligned elements
        (a complex128 copy from such an address crashes). Straight into ``dst`` where it holds
        the source dtype with unit stride on its last dim, else through an aligned copy."""
        itemsize = dtype.itemsize
        src = self._flat(f, torch.uint8).as_strided(
            (*sizes, itemsize), (*(s * itemsize for s in strides), 1), first
        )
        if dst.dtype == dtype and dst.dim() and dst.stride(-1) == 1:
            dst.view(torch.uint8).unflatten(-1, (sizes[-1], itemsize)).copy_(src)
            return
        out = alloc.empty(sizes, dtype)  # unmapped when freed: glibc would keep it
        out.reshape(-1).view(torch.uint8).view(*sizes, itemsize).copy_(src)
        dst.copy_(out)

    def _region(self, chunk: Chunk, key: str) -> FileRegion:
        data = chunk.data
        if isinstance(data, LazyRegion):
            # Located through the file this load opens anyway (see LazyRegion).
            f = self._open(data.path, key)
            return data.resolve(f.fd, f.size)
        assert isinstance(data, FileRegion)  # tensors are handled by the callers
        return data

    def _count(self, f: _OpenFile, nbytes: int) -> None:
        if self.stats is not None:
            self.stats.add_read(f.name, nbytes)

    # -- public ---------------------------------------------------------------------------

    def view(
        self, chunk: Chunk, dtype: torch.dtype, piece: Piece, key: str, *, strided: bool = True
    ) -> torch.Tensor | None:
        """A zero-copy view of ``piece`` in the mapped file, or None when there is no mapping.

        The view has the strides the file gives (a column slice of a row-major matrix is a
        strided view, as ``torch.chunk`` would give); ``strided=False`` asks for dense views only.
        """
        spot = self.find_view(chunk, dtype, piece, key, strided=strided)
        return None if spot is None else self.view_at(spot)

    def find_view(
        self,
        chunk: Chunk,
        dtype: torch.dtype,
        piece: Piece,
        key: str,
        *,
        strided: bool = True,
        ask: bool = True,
    ) -> ViewSpot | None:
        """Where :meth:`view` would find ``piece``, with its pages asked for if they are not
        cached (:func:`lazyckpt.readahead.read_ahead`), or None when it cannot be a view.
        ``ask=False`` leaves the asking to :meth:`ask_for`, which a stream calls once for the
        views it finds ahead of the one it hands out."""
        sizes = piece.sizes
        if not self.use_mmap or isinstance(chunk.data, torch.Tensor) or 0 in sizes:
            return None
        region = self._region(chunk, key)
        strides = region.strides
        if not strided and not is_dense(sizes, strides):
            return None
        f, first, count = self._locate(region, dtype, piece.src_offsets, sizes, key)
        itemsize = dtype.itemsize
        if first % itemsize:
            return None  # not at an address torch may read as dtype (see copy)
        # The piece's middle run: probed for the page cache here, and for writes when it goes.
        lo, hi = middle_run(first, sizes, strides, itemsize)
        if ask:
            readahead.read_ahead(f.fd, f.size, first, sizes, strides, itemsize, middle=(lo, hi))
        return ViewSpot(f, first, count, (lo, hi), dtype, sizes, strides)

    @staticmethod
    def ask_for(spots: Sequence[ViewSpot]) -> None:
        """Ask for the pages of views found with ``find_view(..., ask=False)`` that are not
        cached. The views of one file are first asked about together, with one ``cachestat``
        over the bytes from the first to the last (:func:`lazyckpt.readahead.all_cached`):
        warm, that is the only call (one per view cost a stream of small keys 3 us a key);
        where it finds pages missing, or cannot tell, each view is probed and advised as
        :meth:`find_view` does."""
        by_file: dict[int, list[ViewSpot]] = {}
        for spot in spots:
            by_file.setdefault(id(spot.file), []).append(spot)
        for group in by_file.values():
            f = group[0].file
            if len(group) > 1 and readahead.all_cached(
                f.fd, min(s.first for s in group), max(s.stop for s in group)
            ):
                continue
            for s in group:
                itemsize = s.dtype.itemsize
                readahead.read_ahead(
                    f.fd, f.size, s.first, s.sizes, s.strides, itemsize, middle=s.middle
                )

    def view_at(self, spot: ViewSpot, *, count: bool = True) -> torch.Tensor | None:
        """The view :meth:`find_view` found, or None where a view made since covers some of
        its bytes, or a copy under way reads them (the caller copies: see
        :mod:`lazyckpt.claims`). ``count=False``: its bytes are not counted as read here but by
        :meth:`hand_out`, when the view is handed out (a stream makes views ahead, and one it
        never hands out was never read)."""
        f, dtype = spot.file, spot.dtype
        if f.claims is not None and not f.claims.claim(
            spot.first, spot.stop, spot.sizes, spot.strides, dtype.itemsize
        ):
            return None
        if count:
            self._count(f, spot.nbytes)
        if f.pages is None:  # not watched yet: once, whichever thread asks first
            with self._lock:
                f.watched()
        window = f.window(spot.first, spot.stop, spot.probe)
        return torch.frombuffer(window, dtype=dtype).as_strided(spot.sizes, spot.strides)

    def hand_out(self, spot: ViewSpot) -> None:
        """A view made ahead with ``view_at(spot, count=False)`` is handed out: count its bytes
        as read."""
        self._count(spot.file, spot.nbytes)

    def settle_views(self) -> bool:
        """Check every view of the mapped files that went, and give back the pages of those
        written into (:meth:`lazyckpt.cow.PrivatePages.settle`): a stream does it before each
        batch of views it makes ahead. Returns whether any view was ever found written into."""
        written = False
        for f in list(self._files.values()):
            pages = f.pages
            if pages is not None:
                pages.settle()
                written = written or pages.written
        return written

    def stitch(
        self,
        chunks: Sequence[Chunk],
        dtype: torch.dtype,
        pieces: Sequence[Piece],
        sizes: tuple[int, ...],
        key: str,
    ) -> torch.Tensor | None:
        """A zero-copy view of a box that several chunks fill, each with one contiguous range
        of its file that is also one contiguous range of the box (see :mod:`lazyckpt.stitch`),
        or None when the pieces do not allow it (the caller copies)."""
        if not self.use_mmap or not stitch.available() or not 1 < len(pieces) <= stitch.MAX_RUNS:
            return None
        itemsize = dtype.itemsize
        box_strides = contiguous_strides(sizes)
        runs: list[tuple[int, int, int]] = []
        files: list[_OpenFile] = []
        for piece in pieces:
            chunk = chunks[piece.chunk]
            if isinstance(chunk.data, torch.Tensor) or not is_dense(piece.sizes, box_strides):
                return None
            region = self._region(chunk, key)
            if not is_dense(piece.sizes, region.strides):
                return None
            f, first, _ = self._locate(region, dtype, piece.src_offsets, piece.sizes, key)
            readahead.read_ahead(f.fd, f.size, first, piece.sizes, region.strides, itemsize)
            dst = element_offset(piece.dst_offsets, box_strides) * itemsize
            runs.append((dst, first, piece.numel * itemsize))
            files.append(f)
        order = sorted(range(len(runs)), key=lambda i: runs[i][0])
        plan = plan_stitch([runs[i] for i in order], stitch.PAGE)
        total = sum(r[2] for r in runs)
        # Worth it only when nearly all of the box is mapped, not copied at the seams.
        if plan is None or plan.shift % itemsize or 4 * plan.mapped_bytes < 3 * total:
            return None
        ordered = [files[i] for i in order]

        def read(run: int, offset: int, length: int) -> bytes:
            # From the file, not the mapping: a view handed out may have been written there.
            buf = bytearray(length)
            _pread_into(ordered[run], offset, memoryview(buf), key)
            return bytes(buf)

        built = stitch.build(plan, [f.fd for f in ordered], read)
        if built is None:
            return None
        buffer = unmap.lease(built)
        del built
        for i in order:
            self._count(files[i], runs[i][2])
        flat = torch.frombuffer(buffer, dtype=dtype, count=total // itemsize, offset=plan.shift)
        return flat.view(sizes)

    def raws(
        self, parts: Sequence[tuple[Chunk, Piece]], dtype: torch.dtype, key: str
    ) -> list[bytearray] | None:
        """The bytes of each ``(chunk, piece)``, read with ``pread``, when every one is one
        range of a file and at most ``_RAW_BYTES``; else None, having read nothing. Replica
        checks compare these, without mapping the files or building a tensor per copy: all of
        a key's copies located, then read, in two loops."""
        itemsize = dtype.itemsize
        spots = []
        for chunk, piece in parts:
            nbytes = piece.numel * itemsize
            if isinstance(chunk.data, torch.Tensor) or not 0 < nbytes <= _RAW_BYTES:
                return None
            region = self._region(chunk, key)
            if not is_dense(piece.sizes, region.strides):
                return None
            f, first, _ = self._locate(region, dtype, piece.src_offsets, piece.sizes, key)
            spots.append((f, first, nbytes))
        out = []
        for f, first, nbytes in spots:
            buf = bytearray(nbytes)
            if os.preadv(f.fd, [buf], first) != nbytes:  # a short read: finish it, or fail
                _pread_into(f, first, memoryview(buf), key)
            self._count(f, nbytes)
            out.append(buf)
        return out

    def copy(
        self, chunk: Chunk, dtype: torch.dtype, piece: Piece, dst: torch.Tensor, key: str
    ) -> None:
        """Copy ``piece`` of ``chunk`` (stored as ``dtype``) into its place in ``dst``, the whole
        target box (contiguous, on the CPU, any dtype)."""
        if piece.numel == 0:
            return
        itemsize = dtype.itemsize
        if piece.numel * itemsize > _SLAB_BYTES and (
            dst.dtype != dtype
            or (not self.use_mmap and piece.numel // piece.sizes[0] * itemsize > _SLAB_BYTES)
        ):
            # A cast goes through a temporary of the piece's size, and a pread of short rows
            # through a bounce buffer of at least one dim-0 slice: in slabs both stay within
            # _SLAB_BYTES (about: a slab's gaps count). Other pieces are read as they were.
            parts = _slabs(piece, itemsize)
            if parts is not None:
                for part in parts:
                    self.copy(chunk, dtype, part, dst, key)
                return
        dst_view = _sub(dst, piece.dst_offsets, piece.sizes)
        if isinstance(chunk.data, torch.Tensor):
            dst_view.copy_(_sub(chunk.data, piece.src_offsets, piece.sizes))
            return
        region = self._region(chunk, key)
        if self.use_mmap:
            f, first, _ = self._locate(region, dtype, piece.src_offsets, piece.sizes, key)
            with f.copying(first, piece.sizes, region.strides, itemsize) as clean:
                if not clean:  # a view covered some of its bytes: read from the file
                    self._pread(region, dtype, piece, dst_view, key)
                    return
                readahead.read_ahead(f.fd, f.size, first, piece.sizes, region.strides, itemsize)
                if first % itemsize:
                    self._copy_unaligned(f, first, dtype, piece.sizes, region.strides, dst_view)
                else:
                    flat = self._flat(f, dtype)
                    dst_view.copy_(flat.as_strided(piece.sizes, region.strides, first // itemsize))
                self._count(f, piece.numel * itemsize)
                return
        self._pread(region, dtype, piece, dst_view, key)

    def concat(
        self,
        chunks: Sequence[Chunk],
        dtype: torch.dtype,
        pieces: Sequence[Piece],
        dst: torch.Tensor,
        key: str,
    ) -> bool:
        """Copy ``pieces`` into ``dst`` (the whole box) with one ``torch.cat`` when they fill it
        side by side along one dim (:func:`lazyckpt.plan.concat_order`); False, having copied
        nothing (a DCP chunk may have been located), when they do not or cannot be taken as
        ``dtype`` from the mappings.

        Why: a key split on dim 1 over ranks' files arrives as column blocks, and copying them
        block by block writes each row of ``dst`` in short strided runs, one pass per block.
        ``torch.cat`` writes ``dst`` once, front to back, taking each row from every block in
        turn: 6.4-6.9 GB/s against 4.6-5.2 here, for runs of 512 B and 2 KiB from 8 files."""
        if not self.use_mmap or dst.dtype != dtype or dst.device.type != "cpu":
            return False
        if not dst.is_contiguous():
            return False
        found = concat_order(pieces, tuple(dst.shape))
        if found is None:
            return False
        dim, order = found
        itemsize = dtype.itemsize
        sources = []
        for i in order:
            piece = pieces[i]
            chunk = chunks[piece.chunk]
            if isinstance(chunk.data, torch.Tensor):
                return False
            region = self._region(chunk, key)
            f, first, _ = self._locate(region, dtype, piece.src_offsets, piece.sizes, key)
            if first % itemsize:
                return False  # not at an address torch may read as dtype (see copy)
            sources.append((f, first, piece, region))
        with contextlib.ExitStack() as copying:
            if self.consumer_views:  # no view is made over the pieces while they are copied
                for f, first, piece, region in sources:
                    if not copying.enter_context(
                        f.copying(first, piece.sizes, region.strides, itemsize)
                    ):
                        return False  # a view covered some of its bytes: copied piece by piece
            # One-byte dtypes as bytes: torch has no cat for the packed float4 (the copy is the
            # same either way).
            as_dtype = torch.uint8 if itemsize == 1 else dtype
            parts = []
            for f, first, piece, region in sources:
                readahead.read_ahead(f.fd, f.size, first, piece.sizes, region.strides, itemsize)
                flat = self._flat(f, as_dtype)
                parts.append(flat.as_strided(piece.sizes, region.strides, first // itemsize))
            torch.cat(parts, dim=dim, out=dst.view(as_dtype))
        for f, _, piece, _ in sources:
            self._count(f, piece.numel * itemsize)
        return True

    def direct_reads(
        self, chunk: Chunk, dtype: torch.dtype, piece: Piece, dst: torch.Tensor, key: str
    ) -> list[DirectRead] | None:
        """``preadv`` calls that put ``piece`` straight into its place in ``dst`` (the whole
        box, on the CPU, of the source dtype), or None when it has many runs too short for a
        system call each (a column slice of a matrix: copy it from the mapping instead).

        A kernel copy from the page cache maps nothing, so it has no page to fault in and none
        to unmap, and it releases the GIL: two threads copy at once (:class:`ReadQueue`)."""
        if isinstance(chunk.data, torch.Tensor) or dst.dtype != dtype or piece.numel == 0:
            return None
        if dst.device.type != "cpu":
            return None
        region = self._region(chunk, key)
        itemsize = dtype.itemsize
        strides = dst.stride()
        if repeats_elements(piece.sizes, strides):
            # load_into refuses such a target by key first (model_load).
            return None
        run_bytes, offsets = _run_offsets(piece.sizes, region.strides, strides, itemsize)
        if offsets is None:
            return None
        f, first, _ = self._locate(region, dtype, piece.src_offsets, piece.sizes, key)
        # The piece's place in dst, by pointer arithmetic (an as_strided view costs more).
        address = dst.data_ptr() + element_offset(piece.dst_offsets, strides) * itemsize
        memory = _memory(address, span(piece.sizes, strides) * itemsize)
        calls: list[DirectRead] = []
        for src, at in offsets:
            offset, at = first + src * itemsize, at * itemsize
            for done in range(0, run_bytes, _CALL_BYTES):
                n = min(_CALL_BYTES, run_bytes - done)
                last = calls[-1] if calls else None
                if (
                    last is not None
                    and last.offset + last.nbytes == offset + done
                    and last.nbytes + n <= _CALL_BYTES
                    and len(last.buffers) < _IOV_MAX
                ):
                    last.buffers.append(memory[at + done : at + done + n])
                    last.nbytes += n
                else:
                    calls.append(
                        DirectRead(f, offset + done, [memory[at + done : at + done + n]], n, key)
                    )
        return calls

    def read_queue(self) -> ReadQueue:
        """A queue of :class:`DirectRead` calls that a helper thread starts running as soon as
        the first is queued (see :class:`ReadQueue`)."""
        return ReadQueue(self)

    # -- internals ------------------------------------------------------------------------

    def _locate(
        self,
        region: FileRegion,
        dtype: torch.dtype,
        offsets: Sequence[int],
        sizes: Sequence[int],
        key: str,
    ) -> tuple[_OpenFile, int, int]:
        """The open file, the byte offset of the piece's first element, and its element span."""
        f = self._open(region.path, key)
        first = region.byte_offset + dtype.itemsize * element_offset(offsets, region.strides)
        count = span(sizes, region.strides)
        f.check_range(first, first + count * dtype.itemsize, key)
        return f, first, count

    def _pread(
        self,
        region: FileRegion,
        dtype: torch.dtype,
        piece: Piece,
        dst_view: torch.Tensor,
        key: str,
    ) -> None:
        f, first, count = self._locate(region, dtype, piece.src_offsets, piece.sizes, key)
        itemsize = dtype.itemsize
        # Straight into the destination when it holds the source dtype, else via a temporary.
        target = dst_view if dst_view.dtype == dtype else alloc.empty(piece.sizes, dtype)
        runs = contiguous_runs(piece.sizes, region.strides, tuple(target.stride()))
        run_bytes = runs.length * itemsize
        needed = piece.numel * itemsize
        if runs.count > 1 and run_bytes < _MIN_RUN_BYTES and count * itemsize <= 2 * needed:
            read = self._pread_slabs(f, region, dtype, piece, target, first, key)
        else:
            if runs.count > 1:  # cold, many short reads would each wait for the disk in turn
                readahead.read_ahead(f.fd, f.size, first, piece.sizes, region.strides, itemsize)
            # One memoryview over the destination's span; each run is a slice of it.
            dst_span = span(piece.sizes, tuple(target.stride())) * itemsize
            memory = _memory(target.data_ptr(), dst_span)
            for src, dst in runs.offsets():
                at = dst * itemsize
                _pread_into(f, first + src * itemsize, memory[at : at + run_bytes], key)
            read = needed
        self._count(f, read)
        if target is not dst_view:
            dst_view.copy_(target)

    def _pread_slabs(
        self,
        f: _OpenFile,
        region: FileRegion,
        dtype: torch.dtype,
        piece: Piece,
        target: torch.Tensor,
        first: int,
        key: str,
    ) -> int:
        """Read a piece of short rows in slabs along its first dim through a bounce buffer;
        returns the bytes read (gaps between rows included)."""
        itemsize = dtype.itemsize
        rows, inner = piece.sizes[0], piece.sizes[1:]
        row_step = region.strides[0]
        inner_span = span(inner, region.strides[1:])
        per_slab = max(1, _SLAB_BYTES // max(row_step * itemsize, 1))
        read = 0
        for r0 in range(0, rows, per_slab):
            r1 = min(rows, r0 + per_slab)
            count = (r1 - r0 - 1) * row_step + inner_span
            bounce = self._bounce(count * itemsize).view(dtype)[:count]
            memory = _memory(bounce.data_ptr(), count * itemsize)
            _pread_into(f, first + r0 * row_step * itemsize, memory, key)
            target[r0:r1].copy_(bounce.as_strided((r1 - r0, *inner), region.strides))
            read += count * itemsize
        return read


class DirectRead:
    """One ``preadv``: ``nbytes`` from ``offset`` of ``file`` into ``buffers`` in order."""

    __slots__ = ("buffers", "file", "key", "nbytes", "offset")

    def __init__(
        self, file: _OpenFile, offset: int, buffers: list[memoryview], nbytes: int, key: str
    ) -> None:
        self.file, self.offset, self.buffers, self.nbytes, self.key = (
            file,
            offset,
            buffers,
            nbytes,
            key,
        )


_HELPER_START_WAIT = 0.002
"""Seconds :meth:`ReadQueue.put` waits at most for its helper thread to start."""


class ReadQueue:
    """Direct reads run while the caller is still working out the next ones.

    A helper thread is started on the first :meth:`put` and runs calls in queue order while the
    caller goes on: locating the next chunks (a DCP chunk's zip is found on first use), checking
    replicas. Leaving the ``with`` block, the caller takes calls from the other end of the queue
    until none is left (or the helper has failed), so both cores copy, then waits for the helper.
    The first error either thread met is raised there; an error in the caller's block drops what
    is still queued, and is the one that propagates.

    ``preadv`` releases the GIL, so the helper copies while the caller runs Python. Calls are at
    most ``_CALL_BYTES``, so the two threads finish within one call of each other.
    """

    def __init__(self, reader: Reader) -> None:
        self._reader = reader
        self._calls: collections.deque[DirectRead] = collections.deque()
        self._queued = threading.Semaphore(0)
        """One token per queued call, taken before a call is popped (so a pop never finds the
        queue empty), plus one when the caller is done: the helper's signal to stop."""
        self._done: threading.Event | None = None
        self._errors: list[BaseException] = []

    def __enter__(self) -> ReadQueue:
        return self

    def put(self, calls: Sequence[DirectRead]) -> None:
        if not calls:
            return
        for c in calls:
            self._reader._count(c.file, c.nbytes)
        self._calls.extend(calls)
        self._queued.release(len(calls))
        if self._done is None:
            self._done = threading.Event()
            # Not threading.Thread, whose start() waits without a bound (see lazyckpt.unmap).
            started = _thread.allocate_lock()
            started.acquire()
            _thread.start_new_thread(self._helper, (started,))
            # The helper needs the GIL to reach its first preadv, and the caller holds it while
            # it lists the next reads: left to the interpreter's switching, the first read
            # started 1-2 ms after this call (medians of 12 fresh forks, HF and MP-8 0.25 GB
            # ranks), a core idle meanwhile; 0.4-0.5 ms with this wait. Blocking here hands
            # the GIL over until the helper releases it in its first preadv; bounded, for a
            # host whose other core is busy.
            started.acquire(timeout=_HELPER_START_WAIT)

    def reading(self) -> bool:
        """Whether calls are still queued for the helper (it has not run dry or failed)."""
        return self._done is not None and bool(self._calls) and not self._errors

    def _helper(self, started: _thread.LockType) -> None:
        assert self._done is not None
        started.release()  # the caller waits for the GIL until this thread's first preadv
        try:
            while True:
                self._queued.acquire()
                try:
                    call = self._calls.popleft()
                except IndexError:  # the caller's stop token: nothing is left
                    return
                _run_reads((call,))
        except BaseException as exc:  # re-raised by the caller in __exit__
            self._errors.append(exc)
        finally:
            self._done.set()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        failed = exc_type is not None
        try:
            while not failed and not self._errors and self._queued.acquire(blocking=False):
                _run_reads((self._calls.pop(),))
        except BaseException:
            failed = True
            raise
        finally:
            if failed:
                self._calls.clear()  # the helper stops at its next call
            if self._done is not None:
                self._queued.release()
                self._done.wait()
        if self._errors and exc_type is None:  # else the caller's own error goes on
            raise self._errors[0]


def _run_reads(calls: Sequence[DirectRead]) -> None:
    for c in calls:
        got = os.preadv(c.file.fd, c.buffers, c.offset)
        if got == c.nbytes:
            continue
        # A short read (the file shrank, or a signal): finish buffer by buffer, failing at EOF.
        at = c.offset
        for buf in c.buffers:
            take = min(got, len(buf))
            if take < len(buf):
                _pread_into(c.file, at + take, buf[take:], c.key)
            got -= take
            at += len(buf)


@functools.lru_cache(maxsize=1024)
def _run_offsets(
    sizes: tuple[int, ...],
    src_strides: tuple[int, ...],
    dst_strides: tuple[int, ...],
    itemsize: int,
) -> tuple[int, list[tuple[int, int]] | None]:
    """The run length in bytes and the ``(src, dst)`` element offsets of every run
    (:func:`contiguous_runs`), or no offsets when there are more than ``_FEW_RUNS`` runs
    shorter than ``_MIN_RUN_BYTES`` (a column block of a matrix has thousands, and is copied
    from the mapping instead). A few short runs (a norm's shard) are cheaper to read than to
    map the file for. Cached, as a model's layers repeat the same shapes."""
    runs = contiguous_runs(sizes, src_strides, dst_strides)
    run_bytes = runs.length * itemsize
    direct = run_bytes >= _MIN_RUN_BYTES or runs.count <= _FEW_RUNS
    return run_bytes, runs.offsets() if direct else None


def _slabs(piece: Piece, itemsize: int) -> list[Piece] | None:
    """``piece`` cut along its first dim longer than 1 into parts of at most ``_SLAB_BYTES``
    (one slice each where a slice is larger: :meth:`Reader.copy` cuts those again along the
    next dim), or None when no dim is longer than 1."""
    d = next((i for i, n in enumerate(piece.sizes) if n > 1), None)
    if d is None:
        return None
    n = piece.sizes[d]
    per = max(1, _SLAB_BYTES // (piece.numel // n * itemsize))
    parts = []
    for start in range(0, n, per):
        size = min(per, n - start)
        src, dst, sizes = list(piece.src_offsets), list(piece.dst_offsets), list(piece.sizes)
        src[d] += start
        dst[d] += start
        sizes[d] = size
        parts.append(Piece(piece.chunk, tuple(src), tuple(dst), tuple(sizes)))
    return parts


def _sub(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """``t[o0:o0+s0, o1:o1+s1, ...]``, as one ``as_strided`` (cheaper than indexing)."""
    if tuple(sizes) == tuple(t.shape):
        return t
    strides = t.stride()
    start = t.storage_offset()
    for o, st in zip(offsets, strides):
        start += o * st
    return t.as_strided(tuple(sizes), strides, start)


_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200


def _memory(address: int, nbytes: int) -> memoryview:
    """A writable byte view of tensor memory (the tensor must outlive it). One C call: a
    ``ctypes.c_char * nbytes`` array costs a new ctypes type per length, 30 us each here."""
    view: memoryview = _from_memory(address, nbytes, _PYBUF_WRITE)
    return view


def _pread_into(f: _OpenFile, offset: int, view: memoryview, key: str) -> None:
    """Fill ``view`` from ``offset`` of ``f``, failing on a short read."""
    nbytes = len(view)
    done = 0
    while done < nbytes:
        n = os.preadv(f.fd, [view[done:]], offset + done)
        if n == 0:
            size = os.fstat(f.fd).st_size  # where it ends now (it shrank while loading)
            raise CorruptModelCheckpointError(
                f.path,
                f"key {key!r}: the file ends at byte {size}, short of the {nbytes} bytes at "
                f"{offset} it needs; it is truncated: copy it again",
                key=key,
            )
        done += n
