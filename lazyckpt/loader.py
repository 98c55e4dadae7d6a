"""The loader interface and the one pipeline every format shares.

A format loader only builds a :class:`CheckpointIndex` from metadata.
:class:`IndexedCheckpointLoader` then validates and plans the whole load eagerly, and streams:
for each key, in checkpoint order, read the planned pieces into one buffer (or yield a view),
cast, move, yield.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import final

import torch

from lazyckpt import alloc, cow
from lazyckpt.build import PinnedPool, build_tensor, output_dtype
from lazyckpt.deliver import Deliverer
from lazyckpt.errors import CorruptModelCheckpointError, ShardDimsWarning, warn
from lazyckpt.gcpause import gc_paused
from lazyckpt.index import CheckpointIndex, FileStamp, stamped
from lazyckpt.load_plan import TensorPlan, check_shard_dims, plan_load
from lazyckpt.options import (
    KeyMap,
    ModelCheckpointLoadOptions,
    apply_key_map,
    options_or_default,
)
from lazyckpt.prefetch import prefetched
from lazyckpt.read import Reader, ViewSpot
from lazyckpt.stats import LoadStats, byte_bar

__all__ = ["IndexedCheckpointLoader", "KeyRules", "ModelCheckpointLoader", "check_path"]


class ModelCheckpointLoader(ABC):
    """Loads a checkpoint lazily: one ``(key, tensor)`` at a time, resharded for a target rank."""

    @abstractmethod
    def lazy_load(
        self,
        path: str | os.PathLike[str],
        shard_dims: Mapping[str, int],
        options: ModelCheckpointLoadOptions | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every key of the checkpoint, once, in checkpoint order, as the target rank's
        part of the tensor (DESIGN.md, "What a target rank receives").

        ``shard_dims`` maps a key to its tensor-parallel dim; other keys are replicated across
        TP ranks. Bad input raises when this is called, not at the first ``next()``:
        ``FileNotFoundError`` for a missing path, ``ValueError`` for a bad layout or shard dim,
        :class:`CorruptModelCheckpointError` for bad checkpoint data.
        """

    @abstractmethod
    def supports_path(self, path: str | os.PathLike[str]) -> bool:
        """True when this loader recognises ``path`` (reads file names and magic bytes only)."""


ShardDimInference = Callable[[str, Sequence[tuple[int, ...]]], "int | None"]
"""``(key, each TP rank's shard shape) -> dim``: how ``load_into`` reads a model-parallel
source's shard dims off its model while the index is built."""


class KeyRules:
    """Key renaming and shard-dim lookup as a format loader sees them: by checkpoint key."""

    def __init__(
        self,
        shard_dims: Mapping[str, int],
        key_map: KeyMap | None,
        infer: ShardDimInference | None = None,
    ) -> None:
        self.shard_dims = shard_dims
        self.key_map = key_map
        self.infer = infer

    def target(self, source_key: str) -> str | None:
        """The key's name after ``key_map`` (``None``: dropped)."""
        return apply_key_map(self.key_map, source_key)

    def wants(self, source_key: str) -> bool:
        """Whether ``key_map`` keeps the key."""
        return self.target(source_key) is not None

    def shard_dim(
        self, source_key: str, shard_shapes: Sequence[tuple[int, ...]] | None = None
    ) -> int | None:
        """The key's TP dim: from ``shard_dims``, else inferred from ``shard_shapes`` (the shape
        of the key in each TP rank's shard) when the rules carry an inference."""
        target = self.target(source_key)
        if target is None:
            return None
        dim = self.shard_dims.get(target)
        if dim is None and self.infer is not None and shard_shapes is not None:
            dim = self.infer(target, shard_shapes)
        return dim

    def refuse_misnamed(self, path: Path, source_key: str, source_keys: Iterable[str]) -> None:
        """Refuse (``ValueError`` naming ``path``) ``shard_dims`` that misses ``source_key``
        because it names the key as the checkpoint does while ``key_map`` renames it
        (``shard_dims`` takes the names after ``key_map``), where no other of ``source_keys``
        (the checkpoint's keys) takes that name. Asked on error paths only, where the key's
        shards did not join as a replica's would."""
        message = misnamed_message(self.shard_dims, source_key, self.target(source_key))
        if message is None or any(self.target(k) == source_key for k in source_keys):
            return  # named right, or the name is another key's after key_map
        raise ValueError(f"{path}: {message}") from None


def misnamed_message(
    shard_dims: Mapping[str, int], source_key: str, target: str | None
) -> str | None:
    """See :meth:`KeyRules.misnamed`."""
    if target is None or target == source_key or target in shard_dims:
        return None
    if source_key not in shard_dims:
        return None
    return (
        f"shard_dims names {source_key!r}, which options.key_map renames to {target!r}; "
        f"shard_dims takes the names after key_map: give shard_dims[{target!r}] "
        f"= {shard_dims[source_key]}"
    )


def check_shard_dims_names(index: CheckpointIndex, shard_dims: Mapping[str, int]) -> None:
    """Refuse ``shard_dims`` naming a key by its checkpoint name where ``key_map`` renames it
    (and no other key takes that name): left alone, the key would be read whole, as a replica,
    where the user meant it split."""
    if not shard_dims:
        return
    for entry in index:
        source = entry.checkpoint_key
        if source not in index.entries:
            message = misnamed_message(shard_dims, source, entry.key)
            if message is not None:
                raise ValueError(f"{index.path}: {message}")


def check_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a ``Path``, or ``FileNotFoundError`` naming it."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    p = Path(path)
    try:
        p.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: no such checkpoint file or folder") from None
    except OSError as exc:
        raise CorruptModelCheckpointError(p, f"cannot be opened: {exc.strerror or exc}") from None
    return p


class IndexedCheckpointLoader(ModelCheckpointLoader):
    """A loader defined by the index it builds; the pipeline is shared and final."""

    name: str = ""

    @abstractmethod
    def build_index(
        self, path: Path, rules: KeyRules, options: ModelCheckpointLoadOptions
    ) -> CheckpointIndex:
        """Read metadata only and index every kept key under its target name."""

    @final
    @gc_paused()
    def index(
        self,
        path: str | os.PathLike[str],
        shard_dims: Mapping[str, int] | None = None,
        options: ModelCheckpointLoadOptions | None = None,
        *,
        infer_shard_dim: ShardDimInference | None = None,
    ) -> CheckpointIndex:
        """The checkpoint's index (metadata only): what ``inspect`` shows.

        ``infer_shard_dim`` decides the dim of a model-parallel key missing from ``shard_dims``
        from its shard shapes (formats that store global shapes never ask)."""
        options = options_or_default(options)
        shard_dims = {} if shard_dims is None else shard_dims
        check_shard_dims(shard_dims)
        p = check_path(path)
        if not self.supports_path(p):
            raise CorruptModelCheckpointError(p, f"is not a {self.name} checkpoint")
        rules = KeyRules(shard_dims, options.key_map, infer_shard_dim)
        index = stamped(lambda: self.build_index(p, rules, options))
        if options.key_map is not None:
            check_shard_dims_names(index, shard_dims)
        return index

    @final
    @gc_paused()
    def plan(
        self,
        path: str | os.PathLike[str],
        shard_dims: Mapping[str, int] | None = None,
        options: ModelCheckpointLoadOptions | None = None,
    ) -> tuple[CheckpointIndex, list[TensorPlan]]:
        """Index and plan a load without reading tensor data (a dry run)."""
        options = options_or_default(options)
        shard_dims = {} if shard_dims is None else shard_dims
        layout = options.target_layout()
        index = self.index(path, shard_dims, options)
        plans = plan_load(
            index,
            shard_dims,
            layout,
            verify_replicas=options.verify_replicas,
            verify_max_bytes=options.verify_replicas_max_bytes,
        )
        return index, plans

    @final
    def lazy_load(
        self,
        path: str | os.PathLike[str],
        shard_dims: Mapping[str, int],
        options: ModelCheckpointLoadOptions | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        options = options_or_default(options)
        stats = options.stats
        # The metadata work done here counts in the load's time, as a span of its own: the
        # stream's runs from its first tensor asked for, and the time between is the caller's.
        with contextlib.nullcontext() if stats is None else stats.timing(whole=True):
            index, plans = self.plan(path, shard_dims, options)
        _warn_if_nothing_split(index, shard_dims, options.target_layout().tp_size)
        deliverer = Deliverer(options)
        return _stream(plans, options, deliverer, index.stamps)


SPLITS_UNRECORDED = ("fairscale", "fairseq2")
"""Model-parallel formats whose files do not record how a key is split across them."""


def read_as_replicas(index: CheckpointIndex) -> bool:
    """Whether ``index`` is of a model-parallel set whose files do not record how keys are
    split, and holds keys of which several TP files have a copy: read as replicas, they are
    split keys if ``shard_dims`` left them out (a set of TP 1 has none, but a 0-d key, which
    every file holds whole)."""
    return index.format in SPLITS_UNRECORDED and any(len(e.copies) > 1 and e.shape for e in index)


def _warn_if_nothing_split(index: CheckpointIndex, shard_dims: Mapping[str, int], tp: int) -> None:
    """Warn where ``shard_dims`` names none of the checkpoint's keys but splitting matters: a
    TP target, or a model-parallel set (whose files do not record how keys are split). Rarely
    meant: a preset's Meta names given a Hugging Face checkpoint give ``{}``, and then every
    TP rank gets every tensor whole, or each key of the set is read as a replica from one rank
    file (compared with its other copies only up to ``verify_replicas_max_bytes``)."""
    if shard_dims and any(k in shard_dims for k in index.entries):
        return
    several = read_as_replicas(index)
    if not (tp > 1 or several):
        return
    if several:
        what = (
            f"each key of this {index.source_layout} set is read as a replica from one rank "
            "file, and split keys come out as one rank's shard"
        )
    else:
        what = f"each of the {tp} TP ranks gets every tensor whole"
    warn(
        f"{index.path}: shard_dims names none of its {len(index.entries)} keys, so {what}. "
        "Name keys as the checkpoint does (after key_map); the presets use Meta's names "
        "('layers.0.attention.wq.weight')",
        ShardDimsWarning,
    )


_WORKER_MIN_BYTES = 256 << 10
"""Keys that read fewer bytes are built by the caller at their turn, not ahead on the prefetch
thread (see ``_stream``)."""
_AHEAD_KEYS = 32
_AHEAD_BYTES = 64 << 20
"""How far ahead ``lazy_load`` finds and makes the views it will hand out: a cold load asks the
kernel for up to this many bytes of pages at once."""


def _stream(
    plans: list[TensorPlan],
    options: ModelCheckpointLoadOptions,
    deliverer: Deliverer,
    stamps: Mapping[Path, FileStamp],
) -> Iterator[tuple[str, torch.Tensor]]:
    stats = options.stats if options.stats is not None else LoadStats()
    device = options.target_device
    pool = None
    if device.type == "cuda":
        # The prefetch thread has CUDA's current device and stream of a new thread (device 0,
        # its default stream): it builds on the caller's, resolved here (see ``build``).
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        caller_stream = torch.cuda.current_stream(device)
        pool = PinnedPool()
    source_bytes = [p.nbytes for p in plans]
    bar = byte_bar(sum(source_bytes), "loading", enabled=options.progress)
    dtypes = [output_dtype(p.entry.dtype, options.dtype) for p in plans]
    # Memory each delivered tensor takes (a cast to a wider dtype takes more).
    sizes = [p.box.numel * dtype.itemsize for p, dtype in zip(plans, dtypes)]
    # Views of the mapped files are built by the caller (no memory); a stitched view the files'
    # offsets do not allow is copied there instead. A view of one piece is asked of the reader
    # straight away, ahead of its turn: a stream of views spends its time per key.
    same = [
        options.mmap and device.type == "cpu" and dtype == p.entry.dtype
        for p, dtype in zip(plans, dtypes)
    ]
    views = [ok and p.may_be_view and not options.contiguous for p, ok in zip(plans, same)]
    # So is a key of few bytes: building it is Python more than copying, and on the worker that
    # Python takes the GIL from the consumer each time one of the consumer's torch calls lets it
    # go (15,400 keys of 4 KiB from MP-8 files: the consumer's work took 3.4 s instead of 0.5).
    inline = [
        view or (ok and p.may_stitch) or n < _WORKER_MIN_BYTES
        for p, ok, view, n in zip(plans, same, views, source_bytes)
    ]

    # Freed tensors' buffers are reused (the kernel need not zero new ones), within the same
    # bound as the prefetcher's memory: the largest tensor plus the budget.
    largest = max(sizes, default=0)
    with (
        stats.timing() as span,
        Reader(
            use_mmap=options.mmap,
            stats=stats,
            defer=cow.STREAM_DEFER,
            consumer_views=True,
            stamps=stamps,
        ) as reader,
        bar,
        contextlib.closing(alloc.BufferPool(largest + options.prefetch_bytes)) as buffers,
    ):
        found: dict[int, tuple[ViewSpot, torch.Tensor] | Exception | None] = {}
        first_batch = True

        def find_ahead(i: int) -> None:
            """Find the views of keys ``i`` on (see ``Reader.find_view``), within
            ``_AHEAD_KEYS`` keys and ``_AHEAD_BYTES``, and make them.

            In the first batch, and in all once the consumer is seen writing into views, the
            bytes a view spans count, not its box: a strided view written in place makes
            private copies of all its span's pages (counting spans in every batch made more,
            smaller batches: 0.2 ms of a 14 ms HF load that writes nothing). A loop of views,
            with the check of the views that went for writes before it
            (``Reader.settle_views``), costs a fresh process 2-3% less of an HF load than
            making and checking each view between two of the consumer's tensors, whose code
            and data it pushes out of the CPU's caches (see benchmarks/HISTORY.md); written
            pages then outlive their view by at most one batch. A key over bytes that a view
            covered (tied keys) is no view: it is copied at its turn, with ``pread`` (see
            ``lazyckpt.claims``). The pages of the batch's views are asked for once the views
            are made (``Reader.ask_for``: one ``cachestat`` for small keys close together). An
            error is raised at its key's turn."""
            nonlocal first_batch
            spans = reader.settle_views() or first_batch
            first_batch = False
            nbytes = 0
            made: list[ViewSpot] = []
            try:
                for j in range(i, min(len(plans), i + _AHEAD_KEYS)):
                    if not views[j]:
                        continue
                    plan = plans[j]
                    piece, entry = plan.pieces[0], plan.entry
                    chunk = entry.copies[plan.copy][piece.chunk]
                    try:
                        spot = reader.find_view(
                            chunk, entry.dtype, piece, entry.checkpoint_key, ask=False
                        )
                        view = None if spot is None else reader.view_at(spot, count=False)
                    except Exception as exc:
                        found[j] = exc
                        return
                    if spot is None or view is None:
                        found[j] = None
                        nbytes += sizes[j]
                    else:
                        found[j] = spot, view
                        made.append(spot)
                        nbytes += max(sizes[j], spot.stop - spot.first) if spans else sizes[j]
                    if nbytes >= _AHEAD_BYTES:
                        return
            finally:
                reader.ask_for(made)

        def build(i: int) -> tuple[int, torch.Tensor, bool]:
            if views[i]:
                if i not in found:
                    find_ahead(i)
                got = found.pop(i)
                if isinstance(got, Exception):
                    raise got
                if got is not None:
                    spot, view = got
                    reader.hand_out(spot)  # counted as read when handed out
                    return i, view, True
            # Views that went are checked for writes at the next batch of views ahead or the
            # next view made: a stream whose later keys are all copies (contiguous=True, a cast
            # of all but integer keys) would keep a written view's pages to its end. (A reader
            # that made no view has nothing to check: a loop over its files.)
            reader.settle_views()
            tensor, is_view = build_tensor(
                plans[i],
                reader,
                dtypes[i],
                device=device,
                pool=pool,
                contiguous=options.contiguous,
                buffers=buffers,
                try_view=not views[i],  # else the reader found that it cannot be one
            )
            return i, tensor, is_view

        if pool is not None:
            build_here = build

            def build(i: int) -> tuple[int, torch.Tensor, bool]:
                with torch.cuda.device(device), torch.cuda.stream(caller_stream):
                    return build_here(i)

        items = prefetched(
            range(len(plans)),
            build,
            nbytes=sizes.__getitem__,
            inline=inline.__getitem__,
            budget=options.prefetch_bytes,
            watch=lambda built: alloc.owner(built[1]),
        )
        # Closed before the reader: a stream left early (break, close(), an error) stops and
        # joins the prefetch worker while the files it reads are still open (else it reopens
        # them into a closed reader, and they stay open).
        # Looked up once: a stream of views spends its time per key.
        update = bar.update if options.progress else None
        deliver = deliverer.deliver if deliverer.mesh is not None else None
        with contextlib.closing(items):
            for i, tensor, viewed in items:
                plan = plans[i]
                stats.add_delivered(source_bytes[i], view=viewed, span=span)
                if update is not None:
                    update(source_bytes[i])
                out = tensor if deliver is None else deliver(plan, tensor)
                del tensor
                yield plan.key, out
                del out
        if pool is not None:
            pool.synchronize()
