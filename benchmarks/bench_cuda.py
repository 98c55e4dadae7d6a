"""Loading onto a GPU: lazyckpt against the usual recipes, side by side, in one run.

    python benchmarks/bench_cuda.py [--gb 2] [--dir DIR] [--repeats 3]

Writes the same Llama-shaped bf16 weights as fairscale MP-8 ``.pth`` and Hugging Face
safetensors (the writers of ``bench_load.py``), warms the page cache, then times each way of
getting one rank's part of every tensor into GPU memory (``torch.cuda.synchronize`` included):

- lazyckpt ``lazy_load(device="cuda")``, keeping every yielded tensor;
- lazyckpt ``load_into`` a model whose parameters are on the GPU;
- ``safetensors.torch.load_file(device="cuda")`` of every shard, then ``chunk`` on the GPU;
- ``torch.load(mmap=True)`` of every ``.pth`` shard, ``cat`` + ``chunk``, then ``.cuda()``;
- two limits for the same number of bytes: copied from one pinned host buffer to the GPU in
  64 MB copies (the bus), and copied from the page cache (mapped safetensors files) into two
  pinned 32 MB buffers in turn, each sent to the GPU while the other fills (lazyckpt's own
  route, with no parsing, planning or per-tensor work).

Scenarios: the whole model on one GPU, and TP-2 rank 0. Without a GPU it says so and exits 0.
Each row runs in this process, best of ``--repeats``; figures are GB/s of delivered bytes and
the ratio to the baseline on the same source (machines are shared: compare ratios, not times).
"""

from __future__ import annotations

import argparse
import gc
import mmap
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ckpt import (
    GB,
    SCENARIOS,
    Llama,
    LlamaConfig,
    Scenario,
    config_for,
    random_state_dict,
    remove,
    shard_dims,
    target_of,
    warm,
    write_fairscale,
    write_hf,
)

import lazyckpt

_SCENARIOS = [sc for sc in SCENARIOS if sc.name in ("unsharded", "tp2-r0")]


def _best(
    fn: Callable[[], dict[str, torch.Tensor]], repeats: int, want: dict[str, torch.Tensor] | None
) -> tuple[float, int]:
    """Best wall time of ``fn`` (which returns what it put on the GPU) and the bytes it
    delivered; the last result is compared bit for bit with ``want`` after the clock stops."""
    times, nbytes = [], 0
    got: dict[str, torch.Tensor] = {}
    for _ in range(repeats):
        got = {}  # the last run's tensors are freed before this one starts
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        nbytes = _nbytes(got)
    if want is not None:
        _check(got, want)
    return min(times), nbytes


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (default 2)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row (default 3)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda: needs a CUDA GPU; none here, nothing measured")
        return 0

    cfg = config_for(args.gb)
    dims = shard_dims(cfg)
    root = Path(tempfile.mkdtemp(prefix="lazyckpt-cuda-", dir=args.dir))
    try:
        sd = random_state_dict(cfg)
        want = {
            sc.name: {k: target_of(t, dims.get(k), sc).clone() for k, t in sd.items()}
            for sc in _SCENARIOS
        }
        mp8 = write_fairscale(sd, dims, cfg, root / "fairscale-mp8")
        hf = write_hf(sd, root / "hf-safetensors")
        del sd
        warm([mp8, hf])
        print(
            f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"checkpoint {_nbytes(want['unsharded']) / GB:.2f} GB bf16, {cfg.n_layers} layers, "
            f"best of {args.repeats}"
        )

        rows: list[tuple[str, str, str, str]] = []
        for sc in _SCENARIOS:
            measured = _measure(sc, cfg, dims, mp8, hf, want[sc.name], args.repeats)
            base = {
                "mp8": measured["torch.load mmap + cat + chunk mp8"][0],
                "hf": measured["safetensors.load_file + chunk hf"][0],
            }
            for name, (secs, nbytes) in measured.items():
                src = name.rsplit(" ", 1)[-1]
                ours = name.startswith(("lazy_load", "load_into"))
                vs = f"{base[src] / secs:5.2f}x" if ours else ""
                rows.append((sc.name, name, f"{nbytes / secs / GB:6.2f}", vs))
        print(f"{'scenario':<10} {'row':<38} {'GB/s':>6}  vs baseline (same source)")
        for sc_name, name, gbs, vs in rows:
            print(f"{sc_name:<10} {name:<38} {gbs:>6}  {vs}")
    finally:
        remove(root)
    return 0


def _measure(
    sc: Scenario,
    cfg: LlamaConfig,
    dims: dict[str, int],
    mp8: Path,
    hf: Path,
    want: dict[str, torch.Tensor],
    repeats: int,
) -> dict[str, tuple[float, int]]:
    """Seconds and delivered bytes of each row for one scenario."""
    layout = lazyckpt.Layout(tp_size=sc.tp_size, tp_rank=sc.tp_rank)
    opts = lazyckpt.ModelCheckpointLoadOptions(layout=layout, device="cuda")
    loader = lazyckpt.get_model_checkpoint_loader()
    delivered = _nbytes(want)

    def lazy(src: Path) -> dict[str, torch.Tensor]:
        return dict(loader.lazy_load(src, dims, opts))

    def safetensors_then_chunk() -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        got = {}
        for f in sorted(hf.glob("*.safetensors")):
            for k, t in load_file(f, device="cuda").items():
                got[k] = target_of(t, dims.get(k), sc)
        return got

    def torch_load_cat_chunk() -> dict[str, torch.Tensor]:
        files = sorted(mp8.glob("consolidated.*.pth"))
        shards = [torch.load(f, mmap=True, weights_only=True) for f in files]
        got = {}
        for k in shards[0]:
            full = torch.cat([s[k] for s in shards], dims[k]) if k in dims else shards[0][k]
            got[k] = target_of(full, dims.get(k), sc).cuda()
        return got

    def limit() -> dict[str, torch.Tensor]:
        step = 64 << 20
        host = torch.empty(step, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(delivered, dtype=torch.uint8, device="cuda")
        for lo in range(0, delivered, step):
            n = min(step, delivered - lo)
            dev[lo : lo + n].copy_(host[:n], non_blocking=True)
        return {"bytes": dev}

    def staged() -> dict[str, torch.Tensor]:
        """The delivered number of bytes of the safetensors files, copied from the page cache
        into two pinned 32 MB buffers in turn, each sent on to the GPU while the other fills."""
        step = 32 << 20
        host = [torch.empty(step, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        done: list[torch.cuda.Event | None] = [None, None]
        dev = torch.empty(delivered, dtype=torch.uint8, device="cuda")
        lo, turn = 0, 0
        for f in sorted(hf.glob("*.safetensors")):
            with open(f, "rb") as fh:
                src = torch.frombuffer(
                    mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8
                )  # unmapped when src goes
            for at in range(0, src.numel(), step):
                n = min(step, src.numel() - at, delivered - lo)
                if n <= 0:
                    break
                event = done[turn]
                if event is not None:
                    event.synchronize()
                host[turn][:n].copy_(src[at : at + n])
                dev[lo : lo + n].copy_(host[turn][:n], non_blocking=True)
                event = done[turn] = torch.cuda.Event()
                event.record()
                lo, turn = lo + n, 1 - turn
            torch.cuda.synchronize()
            del src
        return {"bytes": dev[:lo]}

    measured = {
        "limit: pinned host to GPU": _best(limit, repeats, None),
        "limit: page cache, pinned, GPU": _best(staged, repeats, None),
    }
    for name, fn in (
        ("lazy_load mp8", lambda: lazy(mp8)),
        ("lazy_load hf", lambda: lazy(hf)),
        ("safetensors.load_file + chunk (hf)", safetensors_then_chunk),
        ("torch.load mmap + cat + chunk (mp8)", torch_load_cat_chunk),
    ):
        measured[name] = _best(fn, repeats, want)
    if sc.tp_size == 1:
        measured["load_into mp8"] = _best(lambda: _load_into(cfg, mp8), repeats, want)
        measured["load_into hf"] = _best(lambda: _load_into(cfg, hf), repeats, want)
    return {k.replace("(", "").replace(")", ""): v for k, v in measured.items()}


def _load_into(cfg: LlamaConfig, src: Path) -> dict[str, torch.Tensor]:
    """A bf16 model allocated on the GPU (not initialised: load_into writes every element)."""
    with torch.device("meta"):
        model = Llama(cfg)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    lazyckpt.load_into(model, src)
    return model.state_dict()


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor arrived, on the GPU, bit for bit."""
    assert got.keys() == want.keys(), "keys differ"
    for k, t in want.items():
        g = got[k]
        assert g.device.type == "cuda" and g.dtype == t.dtype and g.shape == t.shape, k
        assert torch.equal(g.cpu().view(torch.int16), t.view(torch.int16)), k


if __name__ == "__main__":
    raise SystemExit(main())
