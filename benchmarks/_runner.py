"""One measurement, run in a fresh child process.

Each loader is a *preparer*: it does its setup (allocating and prefaulting the consumer's own
buffers, building a model, opening a fake process group) and returns the timed function. The
child tells the parent when setup is done, so the parent's memory baseline includes the
consumer's buffers, then runs the timed function once and sends back what it measured.

Every timed function feeds each delivered tensor to the same consumer, ``_ckpt.touch`` (a
checksum of one element per 2 KiB), and then drops it.
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import struct
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _ckpt
import safetensors.torch
import torch
import torch.distributed.checkpoint  # imported here so the fork server preloads it
from _ckpt import Scenario, box, box_numel, target_of, touch

import lazyckpt

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

Timed = Callable[[], dict[str, Any]]

_PIECE = 16 << 20
"""Largest single ``preadv`` of the limit."""


def rss_anon(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status", "rb") as f:
        data = f.read()
    i = data.find(b"RssAnon:")
    return int(data[i + 8 : data.find(b"kB", i)]) * 1024


class Ctx:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.cfg = _ckpt.LlamaConfig(**spec["cfg"])
        self.sc = Scenario(**spec["scenario"])
        self.paths: dict[str, str] = spec["paths"]
        self.shapes = _ckpt.shapes(self.cfg)
        self.dims = _ckpt.shard_dims(self.cfg)
        self.boxes = {k: box(s, self.dims.get(k), self.sc) for k, s in self.shapes.items()}
        self.delivered = sum(2 * box_numel(b) for b in self.boxes.values())

    @property
    def layout(self) -> lazyckpt.Layout:
        sc = self.sc
        return lazyckpt.Layout(
            tp_size=sc.tp_size, tp_rank=sc.tp_rank, dp_size=sc.dp_size, dp_rank=sc.dp_rank
        )

    def hf_files(self) -> list[Path]:
        root = Path(self.paths["hf"])
        index = json.loads((root / "model.safetensors.index.json").read_text())
        return sorted({root / name for name in index["weight_map"].values()})

    def mp_files(self) -> list[Path]:
        return sorted(Path(self.paths["mp8"]).glob("consolidated.*.pth"))


# -- the limit ----------------------------------------------------------------------------


def _limit_reads(ctx: Ctx) -> list[tuple[Path, int, int]]:
    """``(file, offset, length)`` per key: the key's target bytes in the HF safetensors files.

    Where the box is one contiguous range of the stored tensor (whole tensors, dim-0 boxes) these
    are exactly its bytes; where it is strided (TP boxes on dim 1) it is a contiguous range of
    the same length inside the same tensor, so the same number of distinct page-cache bytes are
    copied without the per-row overhead the box's layout would add.
    """
    reads = []
    for f in ctx.hf_files():
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        base = 8 + n
        for key, info in header.items():
            if key == "__metadata__":
                continue
            b = ctx.boxes[key]
            need = 2 * box_numel(b)
            if need == 0:
                continue
            begin, end = info["data_offsets"]
            strides = _strides(ctx.shapes[key])
            first = 2 * sum(lo * st for (lo, _), st in zip(b, strides))
            first = min(first, end - begin - need)
            reads.append((f, base + begin + first, need))
    return reads


def _strides(shape: tuple[int, ...]) -> list[int]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def prep_limit_preadv(ctx: Ctx) -> Timed:
    """The limit by system calls: ``os.preadv`` of each key's bytes (16 MiB calls) into one
    prefaulted buffer, the calls split between two threads (``preadv`` releases the GIL, so
    both cores copy)."""
    reads = _limit_reads(ctx)
    total = sum(n for _, _, n in reads)
    buf = torch.ones(total, dtype=torch.uint8)  # written: every page is faulted in
    view = memoryview(buf.numpy())
    calls: list[tuple[Path, int, int, int]] = []  # (file, offset, buffer position, length)
    pos = 0
    for path, offset, n in reads:
        for done in range(0, n, _PIECE):
            calls.append((path, offset + done, pos + done, min(_PIECE, n - done)))
        pos += n
    halves: list[list[tuple[Path, int, int, int]]] = [[], []]
    sizes = [0, 0]
    for call in sorted(calls, key=lambda c: -c[3]):  # balance the bytes of the two threads
        i = 0 if sizes[0] <= sizes[1] else 1
        halves[i].append(call)
        sizes[i] += call[3]

    def part(work: list[tuple[Path, int, int, int]], fds: dict[Path, int]) -> None:
        for path, offset, at, n in work:
            done = 0
            while done < n:
                got = os.preadv(fds[path], [view[at + done : at + n]], offset + done)
                if got <= 0:
                    raise OSError(f"short read from {path}")
                done += got

    def run() -> dict[str, Any]:
        fds = {path: os.open(path, os.O_RDONLY) for path in {c[0] for c in calls}}
        errors: list[BaseException] = []

        def second() -> None:
            try:
                part(halves[1], fds)
            except BaseException as exc:
                errors.append(exc)

        try:
            helper = threading.Thread(target=second)
            helper.start()
            part(halves[0], fds)
            helper.join()
            if errors:
                raise errors[0]
        finally:
            for fd in fds.values():
                os.close(fd)
        return {"bytes_read": total, "checksum": None}

    return run


def _limit_boxes(ctx: Ctx) -> list[tuple[Path, int, tuple[int, ...], list[tuple[int, int]]]]:
    """``(file, data offset, shape, box)`` per key of the HF safetensors files."""
    out = []
    for f in ctx.hf_files():
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for key, info in header.items():
            if key != "__metadata__" and box_numel(ctx.boxes[key]) > 0:
                begin = info["data_offsets"][0]
                out.append((f, 8 + n + begin, tuple(info["shape"]), ctx.boxes[key]))
    return out


def prep_limit_box(ctx: Ctx) -> Timed:
    """The limit, literally: copy the same bytes, each key's box as the file stores it
    (strided rows for TP boxes on dim 1), from fresh mappings into one prefaulted buffer."""
    boxes = _limit_boxes(ctx)
    total = sum(2 * box_numel(b) for _, _, _, b in boxes)
    buf = torch.ones(total // 2, dtype=torch.bfloat16)

    def run() -> dict[str, Any]:
        maps: dict[Path, tuple[int, mmap.mmap]] = {}
        pos = 0
        for path, offset, shape, b in boxes:
            if path not in maps:
                fd = os.open(path, os.O_RDONLY)
                maps[path] = (fd, mmap.mmap(fd, 0, access=mmap.ACCESS_COPY))
            numel = 1
            for s in shape:
                numel *= s
            full = torch.frombuffer(maps[path][1], dtype=torch.bfloat16, count=numel, offset=offset)
            src = full.view(shape)[tuple(slice(lo, hi) for lo, hi in b)]
            n = box_numel(b)
            buf[pos : pos + n].view(src.shape).copy_(src)
            del src, full
            pos += n
        _unmap_later(maps)
        return {"bytes_read": total, "checksum": None}

    return run


def prep_limit_mmap(ctx: Ctx) -> Timed:
    reads = _limit_reads(ctx)
    total = sum(n for _, _, n in reads)
    buf = torch.ones(total, dtype=torch.uint8)

    def run() -> dict[str, Any]:
        maps: dict[Path, tuple[int, mmap.mmap]] = {}
        pos = 0
        for path, offset, n in reads:
            if path not in maps:
                fd = os.open(path, os.O_RDONLY)
                maps[path] = (fd, mmap.mmap(fd, 0, access=mmap.ACCESS_COPY))
            src = torch.frombuffer(maps[path][1], dtype=torch.uint8, count=n, offset=offset)
            buf[pos : pos + n].copy_(src)
            del src
            pos += n
        _unmap_later(maps)
        return {"bytes_read": total, "checksum": None}

    return run


_LATER: list[object] = []


def _unmap_later(maps: dict[Path, tuple[int, mmap.mmap]]) -> None:
    """Close the files now and keep the mappings until the process ends: unmapping is not
    copying, so the limit rows leave it out of their time (lazyckpt unmaps on a thread of its
    own, off the caller's time, too)."""
    for fd, _ in maps.values():
        os.close(fd)
    _LATER.append(maps)


# -- lazyckpt -----------------------------------------------------------------------------


def _lazy(ctx: Ctx, *, use_mmap: bool, copy_into: bool) -> Timed:
    loader = lazyckpt.get_model_checkpoint_loader()
    path = ctx.paths[ctx.spec["fmt"]]
    bufs: dict[str, torch.Tensor] = {}
    if copy_into:
        for k, b in ctx.boxes.items():
            bufs[k] = torch.ones([hi - lo for lo, hi in b], dtype=torch.bfloat16)

    def run() -> dict[str, Any]:
        stats = lazyckpt.LoadStats()
        opts = lazyckpt.ModelCheckpointLoadOptions(layout=ctx.layout, mmap=use_mmap, stats=stats)
        s = 0.0
        for k, t in loader.lazy_load(path, ctx.dims, opts):
            if copy_into:
                bufs[k].copy_(t)
                s += touch(bufs[k])
            else:
                s += touch(t)
            del t
        return {
            "bytes_read": stats.total_bytes_read,  # replica checks included
            "bytes_verified": stats.bytes_verified,
            "views": stats.views,
            "tensors": stats.tensors,
            "stats_delivered": stats.bytes_delivered,
            "checksum": s,
        }

    return run


def prep_lazy(ctx: Ctx) -> Timed:
    return _lazy(ctx, use_mmap=True, copy_into=False)


def prep_lazy_pread(ctx: Ctx) -> Timed:
    return _lazy(ctx, use_mmap=False, copy_into=False)


def prep_lazy_copy(ctx: Ctx) -> Timed:
    return _lazy(ctx, use_mmap=True, copy_into=True)


def _dtensor_wrapper(ctx: Ctx) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """For a sharded scenario, a function that wraps a local tensor as the DTensor that holds
    this rank's box: a fake process group of the scenario's world size, a ("tp", "dp") mesh
    (TP applied first, as in DESIGN.md), ``Shard(dim)``/``Replicate`` on tp and ``Shard(0)``
    on dp. For the unsharded scenario, the identity."""
    sc = ctx.sc
    if sc.tp_size == 1 and sc.dp_size == 1:
        return lambda key, local: local
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = sc.tp_size * sc.dp_size
    rank = sc.tp_rank * sc.dp_size + sc.dp_rank
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    dims_shape = [(n, s) for n, s in (("tp", sc.tp_size), ("dp", sc.dp_size)) if s > 1]
    mesh = init_device_mesh(
        "cpu", tuple(s for _, s in dims_shape), mesh_dim_names=tuple(n for n, _ in dims_shape)
    )

    def wrap(key: str, local: torch.Tensor) -> torch.Tensor:
        d = ctx.dims.get(key)
        placements = [
            (Shard(d) if d is not None else Replicate()) if name == "tp" else Shard(0)
            for name, _ in dims_shape
        ]
        shape = torch.Size(ctx.shapes[key])
        return DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )

    return wrap


def prep_load_into(ctx: Ctx) -> Timed:
    """``load_into`` a model whose parameters are prefaulted: plain tensors for the unsharded
    scenario, DTensors holding this rank's box (see ``_dtensor_wrapper``) for the others."""
    wrap = _dtensor_wrapper(ctx)
    if ctx.sc.tp_size == 1 and ctx.sc.dp_size == 1:
        model = _ckpt.make_model(ctx.cfg)
    else:
        with torch.device("meta"):
            model = _ckpt.Llama(ctx.cfg)
        for name, module in model.named_modules():
            for attr, p in list(module._parameters.items()):
                if p is None:
                    continue
                key = f"{name}.{attr}" if name else attr
                b = ctx.boxes[key]
                local = torch.ones([hi - lo for lo, hi in b], dtype=torch.bfloat16)
                module._parameters[attr] = torch.nn.Parameter(wrap(key, local))
    path = ctx.paths[ctx.spec["fmt"]]

    def run() -> dict[str, Any]:
        stats = lazyckpt.LoadStats()
        opts = lazyckpt.ModelCheckpointLoadOptions(stats=stats)
        lazyckpt.load_into(model, path, shard_dims=ctx.dims, options=opts)  # type: ignore[attr-defined]
        return {
            "bytes_read": stats.total_bytes_read,  # replica checks included
            "bytes_verified": stats.bytes_verified,
            "views": stats.views,
            "tensors": stats.tensors,
        }

    def after() -> float:  # checksum of the filled model, outside the timed region
        sd = model.state_dict()
        return sum(touch(getattr(sd[k], "_local_tensor", sd[k])) for k in ctx.shapes)

    run.after = after  # type: ignore[attr-defined]
    return run


# -- baselines ----------------------------------------------------------------------------


def _torch_load_cat(ctx: Ctx, *, use_mmap: bool) -> Timed:
    files = ctx.mp_files()

    def run() -> dict[str, Any]:
        sds = [torch.load(f, mmap=use_mmap, weights_only=True) for f in files]
        s = 0.0
        for k in sds[0]:
            d = ctx.dims.get(k)
            full = torch.cat([sd[k] for sd in sds], d) if d is not None else sds[0][k]
            t = target_of(full, d, ctx.sc)
            s += touch(t)
            del full, t
        if use_mmap:  # pages touched: every sharded tensor whole (cat), replicas' boxes only
            read = sum(
                2 * (box_numel([(0, n) for n in shp]) if k in ctx.dims else box_numel(ctx.boxes[k]))
                for k, shp in ctx.shapes.items()
            )
        else:
            read = sum(f.stat().st_size for f in files)
        return {"bytes_read": read, "checksum": s}

    return run


def prep_torch_load(ctx: Ctx) -> Timed:
    return _torch_load_cat(ctx, use_mmap=False)


def prep_torch_load_mmap(ctx: Ctx) -> Timed:
    return _torch_load_cat(ctx, use_mmap=True)


def prep_torch_load_mmap_slice(ctx: Ctx) -> Timed:
    """A careful reshard script: map every shard, cut each key's box out of the shards that
    hold part of it, and ``cat`` only those pieces (a single dense piece is used as is)."""
    files = ctx.mp_files()

    def run() -> dict[str, Any]:
        sds = [torch.load(f, mmap=True, weights_only=True) for f in files]
        s = 0.0
        for k in sds[0]:
            d = ctx.dims.get(k)
            b = ctx.boxes[k]
            if d is None:
                t = sds[0][k][tuple(slice(lo, hi) for lo, hi in b)]
            else:
                pieces = []
                start = 0
                for sd in sds:
                    shard = sd[k]
                    n = shard.shape[d]
                    lo, hi = max(b[d][0], start), min(b[d][1], start + n)
                    if lo < hi:
                        idx = [slice(x, y) for x, y in b]
                        idx[d] = slice(lo - start, hi - start)
                        pieces.append(shard[tuple(idx)])
                    start += n
                if len(pieces) == 1 and pieces[0].is_contiguous():
                    t = pieces[0]
                elif pieces:
                    t = torch.cat(pieces, d)
                else:
                    t = torch.empty([hi - lo for lo, hi in b], dtype=torch.bfloat16)
            s += touch(t)
            del t
        return {"bytes_read": ctx.delivered, "checksum": s}

    return run


def prep_st_load_file(ctx: Ctx) -> Timed:
    files = ctx.hf_files()

    def run() -> dict[str, Any]:
        s = 0.0
        for f in files:
            sd = safetensors.torch.load_file(f)
            for k, full in sd.items():
                t = target_of(full, ctx.dims.get(k), ctx.sc)
                s += touch(t)
                del t, full
            del sd
        # safetensors maps the file and hands out zero-copy views of it (checked for 0.8):
        # only the pages the consumer touches, the target box's, are read.
        return {"bytes_read": ctx.delivered, "checksum": s}

    return run


def prep_st_get_slice(ctx: Ctx) -> Timed:
    files = ctx.hf_files()

    def run() -> dict[str, Any]:
        s = 0.0
        for f in files:
            with safetensors.safe_open(f, framework="pt") as h:
                for k in h.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    b = ctx.boxes[k]
                    if all(lo == 0 and hi == n for (lo, hi), n in zip(b, ctx.shapes[k])):
                        t = h.get_tensor(k)
                    else:
                        t = h.get_slice(k)[tuple(slice(lo, hi) for lo, hi in b)]
                    s += touch(t)
                    del t
        return {"bytes_read": ctx.delivered, "checksum": s}

    return run


def prep_dcp_load(ctx: Ctx) -> Timed:
    """``dcp.load`` into preallocated, prefaulted tensors: plain ones for whole tensors, DTensors
    on a fake process group of the scenario's world size for sharded ones."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    path = ctx.paths["dcp"]
    locals_: dict[str, torch.Tensor] = {}
    for k, b in ctx.boxes.items():
        locals_[k] = torch.ones([hi - lo for lo, hi in b], dtype=torch.bfloat16)
    wrap = _dtensor_wrapper(ctx)
    state: dict[str, Any] = {k: wrap(k, t) for k, t in locals_.items()}
    meta = FileSystemReader(path).read_metadata()
    read = 0
    for idx, info in meta.storage_data.items():
        md = meta.state_dict_metadata[idx.fqn]
        chunk = next(c for c in md.chunks if tuple(c.offsets) == tuple(idx.offset))
        b = ctx.boxes[idx.fqn]
        if all(
            max(lo, o) < min(hi, o + n) for (lo, hi), o, n in zip(b, chunk.offsets, chunk.sizes)
        ):
            read += info.length

    def run() -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=path, no_dist=True)
        s = sum(touch(locals_[k]) for k in ctx.shapes)
        return {"bytes_read": read, "checksum": s}

    return run


PREPARERS: dict[str, Callable[[Ctx], Timed]] = {
    "limit:preadv": prep_limit_preadv,
    "limit:mmap-copy": prep_limit_box,
    "ideal:contiguous": prep_limit_mmap,
    "lazyckpt": prep_lazy,
    "lazyckpt(pread)": prep_lazy_pread,
    "lazyckpt+copy": prep_lazy_copy,
    "load_into": prep_load_into,
    "torch.load+cat": prep_torch_load,
    "torch.load(mmap)+cat": prep_torch_load_mmap,
    "torch.load(mmap)+slice": prep_torch_load_mmap_slice,
    "st.load_file": prep_st_load_file,
    "st.get_slice": prep_st_get_slice,
    "dcp.load": prep_dcp_load,
}


def spin(conn: Any) -> None:
    """A fixed amount of pure-Python work; sends back how long it took (the CPU probe)."""
    x = 0
    for i in range(100_000):  # warm up (copy-on-write faults of a fresh fork)
        x += i
    t0 = time.perf_counter()
    for i in range(10_000_000):
        x += i
    conn.send(time.perf_counter() - t0)
    conn.close()


def disk_read() -> int | None:
    """Bytes this process has had read from storage (``read_bytes`` of ``/proc/self/io``: page
    cache misses, read-ahead included), or None where the kernel does not say."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_seconds() -> float | None:
    """CPU time this process has used, user and system, all its threads (None where the
    platform has no ``getrusage``). The limit copies with both cores for the whole run, so a
    loader's CPU time beyond the limit's is what it adds: Python, faults, extra copies."""
    if resource is None:
        return None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child_main(spec: dict[str, Any], conn: Any) -> None:
    """Entry point of a measurement process (started by the fork server)."""
    try:
        torch.ones(1 << 20).sum()  # start the intra-op thread pool outside the timed region
        ctx = Ctx(spec)
        run = PREPARERS[spec["loader"]](ctx)
        gc.collect()
        conn.send(("ready", rss_anon()))
        conn.recv()  # the parent's sampler is running
        disk = disk_read()
        cpu0 = cpu_seconds()
        t0 = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - t0
        cpu1 = cpu_seconds()
        out["cpu_seconds"] = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
        if disk is not None:
            after_disk = disk_read()
            out["disk_read"] = None if after_disk is None else after_disk - disk
        out["end_anon"] = rss_anon()
        after = getattr(run, "after", None)
        if after is not None:
            out["checksum"] = after()
        out["seconds"] = seconds
        out["delivered"] = ctx.delivered
        conn.send(("done", out))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
