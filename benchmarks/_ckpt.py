"""The benchmark's checkpoint: a Llama-shaped bf16 model, its scenarios, and the three writers.

Everything here is independent of lazyckpt except the shard-dim preset: the boxes a rank
receives are computed with ``torch.chunk`` semantics (the DESIGN.md oracle), so the checksums the
benchmark compares are not derived from the code under test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

GB = 1e9
MB = 1e6


# -- model shape --------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab: int

    @property
    def kv_dim(self) -> int:
        return self.dim // self.n_heads * self.n_kv_heads


# Llama 3.2 1B widths (vocab 128256, 8 KV heads); the layer count sets the size.
_LARGE = dict(dim=2048, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab=128256)
# A narrower model for small sizes (--quick): same structure, 1/2 the widths, 1/4 the vocab.
_SMALL = dict(dim=1024, n_heads=16, n_kv_heads=4, ffn_dim=4096, vocab=32768)


def config_for(gb: float) -> LlamaConfig:
    """The Llama-shaped config closest to ``gb`` gigabytes of bf16 weights."""
    for widths in (_LARGE, _SMALL):
        probe = LlamaConfig(n_layers=1, **widths)
        fixed = sum(n for k, n in param_numels(probe).items() if not k.startswith("layers."))
        per_layer = sum(n for k, n in param_numels(probe).items() if k.startswith("layers."))
        if gb * GB >= 2 * (fixed + 2 * per_layer) or widths is _SMALL:
            layers = max(1, round((gb * GB / 2 - fixed) / per_layer))
            return LlamaConfig(n_layers=layers, **widths)
    raise AssertionError("unreachable")


def shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Meta Llama 3 (fairscale) key names and shapes, in checkpoint order."""
    d, kv, f = cfg.dim, cfg.kv_dim, cfg.ffn_dim
    out: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab, d)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out[p + "attention.wq.weight"] = (d, d)
        out[p + "attention.wk.weight"] = (kv, d)
        out[p + "attention.wv.weight"] = (kv, d)
        out[p + "attention.wo.weight"] = (d, d)
        out[p + "feed_forward.w1.weight"] = (f, d)
        out[p + "feed_forward.w2.weight"] = (d, f)
        out[p + "feed_forward.w3.weight"] = (f, d)
        out[p + "attention_norm.weight"] = (d,)
        out[p + "ffn_norm.weight"] = (d,)
    out["norm.weight"] = (d,)
    out["output.weight"] = (cfg.vocab, d)
    return out


def param_numels(cfg: LlamaConfig) -> dict[str, int]:
    out = {}
    for k, s in shapes(cfg).items():
        n = 1
        for x in s:
            n *= x
        out[k] = n
    return out


def shard_dims(cfg: LlamaConfig) -> dict[str, int]:
    from lazyckpt import preset_shard_dims

    return preset_shard_dims("llama3-fairscale", shapes(cfg))


class _Norm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d))


class _Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)


class _FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)


class _Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention = _Attention(cfg)
        self.feed_forward = _FeedForward(cfg)
        self.attention_norm = _Norm(cfg.dim)
        self.ffn_norm = _Norm(cfg.dim)


class Llama(nn.Module):
    """A plain (unsharded) module whose state_dict keys and shapes match the checkpoint."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.norm = _Norm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)


def make_model(cfg: LlamaConfig) -> Llama:
    """The model in bf16 with every page of its parameters written (prefaulted), built without
    running the (slow) default initialisers."""
    with torch.device("meta"):
        model = Llama(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


# -- what a rank receives -----------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0


SCENARIOS = (
    Scenario("unsharded"),
    Scenario("tp2-r0", tp_size=2, tp_rank=0),
    Scenario("fsdp8-r0", dp_size=8, dp_rank=0),
    Scenario("tp4r1-dp2r1", tp_size=4, tp_rank=1, dp_size=2, dp_rank=1),
)


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of ``torch.chunk(range(n), parts)[index]`` (empty past the end)."""
    step = -(-n // parts)
    start = min(index * step, n)
    return start, min(start + step, n)


def box(shape: tuple[int, ...], dim: int | None, sc: Scenario) -> list[tuple[int, int]]:
    """Per-dim ``[start, stop)`` of the rank's part of a tensor: TP chunk, then FSDP chunk."""
    b = [(0, s) for s in shape]
    if dim is not None and sc.tp_size > 1:
        b[dim] = chunk_bounds(shape[dim], sc.tp_size, sc.tp_rank)
    if sc.dp_size > 1 and shape:
        lo, hi = b[0]
        s0, s1 = chunk_bounds(hi - lo, sc.dp_size, sc.dp_rank)
        b[0] = (lo + s0, lo + s1)
    return b


def box_numel(b: list[tuple[int, int]]) -> int:
    n = 1
    for lo, hi in b:
        n *= hi - lo
    return n


def target_of(full: torch.Tensor, dim: int | None, sc: Scenario) -> torch.Tensor:
    """The oracle: ``torch.chunk`` on the full tensor (DESIGN.md)."""
    t = full
    if dim is not None and sc.tp_size > 1:
        parts = torch.chunk(t, sc.tp_size, dim)
        t = parts[sc.tp_rank] if sc.tp_rank < len(parts) else t.narrow(dim, t.shape[dim], 0)
    if sc.dp_size > 1 and t.dim() > 0:
        parts = torch.chunk(t, sc.dp_size, 0)
        t = parts[sc.dp_rank] if sc.dp_rank < len(parts) else t.narrow(0, t.shape[0], 0)
    return t


# -- the consumer -------------------------------------------------------------------------


def touch(t: torch.Tensor) -> float:
    """The one consumer every loader feeds: a checksum of one element per 2 KiB along each row.

    For a contiguous tensor consecutive samples are at most 2 KiB apart, so every 4 KiB page is
    read: a zero-copy view of a mapped file pays its page faults here and is not free. The
    sample is taken by logical index, so the sum is the same whatever the tensor's strides,
    which lets the benchmark check that every loader delivered the right bytes.
    """
    if t.dim() == 0:
        return float(t.to(torch.float64))
    if t.numel() == 0:
        return 0.0
    step = max(1, 2048 // t.element_size())
    return float(t[..., ::step].to(torch.float64).sum())


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


# -- writers ------------------------------------------------------------------------------


def random_state_dict(cfg: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: (torch.randn(s, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        for k, s in shapes(cfg).items()
    }


def write_fairscale(
    sd: dict[str, torch.Tensor], dims: dict[str, int], cfg: LlamaConfig, root: Path, mp: int = 8
) -> Path:
    """Meta's layout: ``consolidated.NN.pth`` per model-parallel rank (torch.save), keys in
    ``dims`` split with ``torch.chunk`` along their dim, the others replicated in every file."""
    root.mkdir(parents=True)
    for r in range(mp):
        part = {
            k: (torch.chunk(t, mp, dims[k])[r].clone() if k in dims else t) for k, t in sd.items()
        }
        torch.save(part, root / f"consolidated.{r:02d}.pth")
        del part
    params = {
        "dim": cfg.dim,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "vocab_size": cfg.vocab,
        "norm_eps": 1e-5,
    }
    (root / "params.json").write_text(json.dumps(params))
    return root


def write_hf(sd: dict[str, torch.Tensor], root: Path, shards: int = 4) -> Path:
    """A Hugging Face sharded safetensors folder with its index, written by huggingface_hub."""
    from huggingface_hub import save_torch_state_dict

    total = sum(t.numel() * t.element_size() for t in sd.values())
    root.mkdir(parents=True)
    save_torch_state_dict(sd, root, max_shard_size=max(1, total // shards))
    return root


def write_dcp(sd: dict[str, torch.Tensor], root: Path) -> Path:
    """A torch.distributed.checkpoint folder, saved from one process."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(root), no_dist=True)
    return root


def file_sizes(path: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in sorted(Path(path).iterdir()) if p.is_file()}


def warm(paths: list[Path]) -> None:
    """Read every file once so the page cache holds it."""
    buf = bytearray(16 << 20)
    for root in paths:
        for p in sorted(Path(root).iterdir()):
            if p.is_file():
                with open(p, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass


def settle(paths: list[Path]) -> None:
    """Put every file in the page cache as a sequential read leaves it: dropped, then read
    from start to end with the kernel's default read-ahead.

    How the cache holds a file changes how fast it can be mapped. Linux 6.x caches a file that
    was written or read sequentially in large folios (up to 2 MiB), and a mapping of those is
    filled one PMD per fault; pages read one by one (``POSIX_FADV_RANDOM``, as lazyckpt's and
    ``bench_cold.py``'s cold loads do) are cached as 4 KiB folios, filled 16 PTEs per fault.
    On this VM touching 241 MB of a mapping took 1.3 ms in the first state and 9.3 ms in the
    second; copying from the page cache (``preadv``) is the same in both. Without this step the
    state was whatever earlier runs left (0-26% of the files mappable by PMD after a cold
    benchmark), and mapped rows moved with it."""
    drop(paths)
    warm(paths)


def pmd_mapped_fraction(paths: list[Path]) -> float:
    """Fraction of the files' cached bytes that a fresh mapping maps by PMD (2 MiB at a time):
    each file is mapped, one byte per page read, and ``/proc/self/smaps`` read back for the
    mapping (``FilePmdMapped`` over ``Rss``); -1 where that cannot be told."""
    import ctypes
    import mmap

    pmd = rss = 0
    for root in paths:
        for p in sorted(Path(root).iterdir()):
            size = p.stat().st_size if p.is_file() else 0
            if size < mmap.PAGESIZE:
                continue
            with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
                sum(m[i] for i in range(0, size, mmap.PAGESIZE))
                first = ctypes.c_char.from_buffer(m)
                address = ctypes.addressof(first)
                del first
                fields = _smaps_fields(address)
            if not fields:
                return -1.0
            pmd += fields.get("FilePmdMapped", 0)
            rss += fields.get("Rss", 0)
    return pmd / rss if rss else -1.0


def _smaps_fields(address: int) -> dict[str, int]:
    """The ``/proc/self/smaps`` fields (kB) of the mapping that starts at ``address``."""
    fields: dict[str, int] = {}
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                    if inside:
                        break
                    inside = int(head.split("-")[0], 16) == address
                elif inside:
                    parts = line.split()
                    if len(parts) >= 2 and parts[1].isdigit():
                        fields[head[:-1]] = int(parts[1])
    except OSError:
        return {}
    return fields


def drop(paths: list[Path]) -> None:
    """Take every file out of the page cache: written back first (dirty pages stay), then
    ``POSIX_FADV_DONTNEED`` (pages some process still maps stay too)."""
    for root in paths:
        for p in sorted(Path(root).iterdir()):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def cached_fraction(paths: list[Path]) -> float:
    """Fraction of the files' pages resident in the page cache (mincore), or -1 if unknown."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return -1.0
    page = mmap.PAGESIZE
    resident = total = 0
    for root in paths:
        for p in sorted(Path(root).iterdir()):
            size = p.stat().st_size if p.is_file() else 0
            if size == 0:
                continue
            with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
                n = (size + page - 1) // page
                vec = (ctypes.c_ubyte * n)()
                first = ctypes.c_char.from_buffer(m)  # the mapping's address; nothing is read
                rc = libc.mincore(
                    ctypes.c_void_p(ctypes.addressof(first)), ctypes.c_size_t(size), vec
                )
                del first
                if rc != 0:
                    return -1.0
                resident += sum(v & 1 for v in vec)
                total += n
    return resident / total if total else 1.0


def write_all(cfg: LlamaConfig, root: Path) -> tuple[dict[str, str], dict[str, float], int]:
    """Write the three formats under ``root``; returns their paths, the expected checksum of each
    scenario (from the in-memory tensors) and the checkpoint's tensor bytes."""
    dims = shard_dims(cfg)
    sd = random_state_dict(cfg)
    expected = {
        sc.name: sum(touch(target_of(t, dims.get(k), sc)) for k, t in sd.items())
        for sc in SCENARIOS
    }
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    paths = {
        "mp8": write_fairscale(sd, dims, cfg, root / "fairscale-mp8"),
        "hf": write_hf(sd, root / "hf-safetensors"),
        "dcp": write_dcp(sd, root / "dcp"),
    }
    del sd
    return {k: str(v) for k, v in paths.items()}, expected, nbytes


def remove(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


def iter_files(root: str) -> Iterator[Path]:
    yield from sorted(p for p in Path(root).iterdir() if p.is_file())


def machine() -> dict[str, object]:
    """What the figures came from."""
    import platform

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    thp = "?"
    with contextlib.suppress(OSError):
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "thp": thp,
    }


def config_dict(cfg: LlamaConfig) -> dict[str, int]:
    return asdict(cfg)


def kept_row_spec(folder: Path, scenario: str, fmt: str, loader: str) -> dict[str, Any]:
    """The spec of one row, as ``bench_load.py`` gives it to its children, for the checkpoint
    a ``bench_load.py --dir folder --keep`` run left there (the newest, if several); exits
    with a message naming what is missing or unknown."""
    stamps = sorted(folder.glob("ckpt-*.json"))
    if not stamps:
        sys.exit(f"{folder} holds no kept checkpoint: run bench_load.py --dir {folder} --keep")
    saved = json.loads(stamps[-1].read_text())
    dim, layers = (int(x) for x in stamps[-1].stem.split("-")[1:3])
    cfg = next(LlamaConfig(n_layers=layers, **w) for w in (_LARGE, _SMALL) if w["dim"] == dim)
    sc = next((s for s in SCENARIOS if s.name == scenario), None)
    if sc is None:
        sys.exit(f"no scenario {scenario!r}: one of {[s.name for s in SCENARIOS]}")
    if fmt not in saved["paths"]:
        sys.exit(f"no source {fmt!r}: one of {sorted(saved['paths'])}")
    return {
        "scenario": sc.__dict__,
        "fmt": fmt,
        "loader": loader,
        "cfg": config_dict(cfg),
        "paths": saved["paths"],
    }
