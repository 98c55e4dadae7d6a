"""What each key costs: a many-key checkpoint (an MoE model's experts), lazyckpt against the usual
loaders, side by side in one run.

    python benchmarks/bench_keys.py                  # 40 layers x 128 experts: 15,400 keys, 63 MB
    python benchmarks/bench_keys.py --experts 16 --repeats 5 --dir /tmp/keys --keep

``bench_load.py`` measures bytes (75 keys of up to 525 MB); here the tensors are small (32 x 64
bf16, 4 KiB), so the time is what a loader spends per key: metadata, planning, bookkeeping, and
the consumer (``_ckpt.touch``). The same weights are written as Hugging Face safetensors (4
files), Meta's fairscale MP-8 (expert matrices split on dim 0 or 1, norms replicated) and a DCP
folder; each row loads the ``unsharded`` or ``tp2-r0`` target (DESIGN.md's ``torch.chunk``) in a
fresh process forked from a server that has imported torch, safetensors and lazyckpt, with the
page cache warm (``dcp.load``'s row imports ``torch.distributed.checkpoint`` before its clock
starts; lazyckpt does not import it).
Printed: milliseconds (best and median), microseconds per key, and lazyckpt over the fastest
baseline of the same source. Every row's checksum is compared with ``torch.chunk`` of the
weights in memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ckpt
from _ckpt import Scenario, close, target_of, touch

SCENARIOS = (Scenario("unsharded"), Scenario("tp2-r0", tp_size=2, tp_rank=0))
ROWS = (
    ("hf", "lazyckpt"),
    ("hf", "st.load_file"),
    ("mp8", "lazyckpt"),
    ("mp8", "torch.load(mmap)+slice"),
    ("dcp", "lazyckpt"),
    ("dcp", "dcp.load"),
)


def weights(layers: int, experts: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Qwen/Mixtral-style expert keys: ``gate``/``up`` split on dim 0, ``down`` on dim 1."""
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    dims: dict[str, int] = {}
    for layer in range(layers):
        for e in range(experts):
            for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
                key = f"model.layers.{layer}.mlp.experts.{e}.{name}.weight"
                sd[key] = torch.randn(32, 64, generator=g).to(torch.bfloat16)
                dims[key] = dim
        sd[f"model.layers.{layer}.input_layernorm.weight"] = torch.randn(64, generator=g).to(
            torch.bfloat16
        )
    return sd, dims


def write(root: Path, sd: dict[str, torch.Tensor], dims: dict[str, int]) -> dict[str, Path]:
    paths = {"hf": root / "hf", "mp8": root / "mp8", "dcp": root / "dcp"}
    if all(p.exists() for p in paths.values()):
        return paths
    for p in paths.values():
        shutil.rmtree(p, ignore_errors=True)
    _ckpt.write_hf(sd, paths["hf"])
    paths["mp8"].mkdir(parents=True)
    for r in range(8):
        part = {k: (t.chunk(8, dims[k])[r].clone() if k in dims else t) for k, t in sd.items()}
        torch.save(part, paths["mp8"] / f"consolidated.{r:02d}.pth")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _ckpt.write_dcp(sd, paths["dcp"])
    return paths


def loader(
    fmt: str, name: str, path: Path, dims: dict[str, int], sc: Scenario
) -> Callable[[], float]:
    """The row's load, with the consumer: returns the checksum."""
    if name == "lazyckpt":
        import lazyckpt

        layout = lazyckpt.Layout(tp_size=sc.tp_size, tp_rank=sc.tp_rank)
        opts = lazyckpt.ModelCheckpointLoadOptions(layout=layout)

        def run() -> float:
            s = 0.0
            for _, t in lazyckpt.get_model_checkpoint_loader().lazy_load(path, dims, opts):
                s += touch(t)
                del t
            return s

        return run
    if name == "st.load_file":
        import safetensors.torch

        files = sorted(path.glob("*.safetensors"))

        def run() -> float:
            s = 0.0
            for f in files:
                for k, full in safetensors.torch.load_file(f).items():
                    s += touch(target_of(full, dims.get(k), sc))
            return s

        return run
    if name == "torch.load(mmap)+slice":
        files = sorted(path.glob("consolidated.*.pth"))

        def run() -> float:
            sds = [torch.load(f, mmap=True, weights_only=True) for f in files]
            s = 0.0
            for k, first in sds[0].items():
                d = dims.get(k)
                if d is None:
                    s += touch(first)
                    continue
                n = first.shape[d] * len(sds)
                lo, hi = _ckpt.chunk_bounds(n, sc.tp_size, sc.tp_rank)
                step = first.shape[d]
                pieces = [sd[k].narrow(d, 0, step) for sd in sds[lo // step : -(-hi // step)]]
                t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
                s += touch(t.narrow(d, lo - lo // step * step, hi - lo))
            return s

        return run
    if name == "dcp.load":
        import torch.distributed.checkpoint as dcp

        def run() -> float:
            # Whole tensors (DCP reads whole chunks), then the rank's part.
            meta = dcp.FileSystemReader(str(path)).read_metadata()
            sd = {
                k: torch.empty(m.size, dtype=m.properties.dtype)
                for k, m in meta.state_dict_metadata.items()
            }
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(sd, checkpoint_id=str(path), no_dist=True)
            return sum(touch(target_of(t, dims.get(k), sc)) for k, t in sd.items())

        return run
    raise ValueError(name)


def _child(spec: dict[str, Any], conn: Any) -> None:
    sc = next(s for s in SCENARIOS if s.name == spec["scenario"])
    dims = json.loads(Path(spec["dims"]).read_text())
    run = loader(spec["fmt"], spec["loader"], Path(spec["path"]), dims, sc)
    gc.collect()
    t0 = time.perf_counter()
    checksum = run()
    conn.send((time.perf_counter() - t0, checksum))
    conn.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="runs per row (default 3)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (with --dir: reuse)")
    ap.add_argument("--json", type=Path, default=None, help="write all figures here")
    args = ap.parse_args(argv)
    root = args.dir if args.dir is not None else Path(tempfile.mkdtemp(prefix="lazyckpt-keys-"))
    root = root / f"keys-{args.layers}x{args.experts}"
    sd, dims = weights(args.layers, args.experts)
    nkeys = len(sd)
    paths = write(root, sd, dims)
    (root / "dims.json").write_text(json.dumps(dims))
    expected = {
        sc.name: sum(touch(target_of(t, dims.get(k), sc)) for k, t in sd.items())
        for sc in SCENARIOS
    }
    del sd
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH", "")) if p
    )
    import bench_keys  # the children's target, by a name the fork server can import

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["safetensors.torch", "lazyckpt", "bench_keys"])
    rows = [(sc, fmt, name) for sc in SCENARIOS for fmt, name in ROWS]
    times: dict[tuple[str, str, str], list[float]] = {}
    bad = []
    print(
        f"{nkeys} keys, {sum(p.stat().st_size for p in root.rglob('*') if p.is_file()) / 1e6:.0f} MB on disk; {args.repeats} runs per row, fresh processes"
    )
    for _ in range(args.repeats):
        for sc, fmt, name in rows:  # interleaved: the host's slow phases spread over all rows
            _ckpt.warm([paths[fmt]])
            here, there = ctx.Pipe()
            spec = {
                "scenario": sc.name,
                "fmt": fmt,
                "loader": name,
                "path": str(paths[fmt]),
                "dims": str(root / "dims.json"),
            }
            p = ctx.Process(target=bench_keys._child, args=(spec, there))
            p.start()
            seconds, checksum = here.recv()
            p.join()
            times.setdefault((sc.name, fmt, name), []).append(seconds)
            if not close(checksum, expected[sc.name]):
                bad.append((sc.name, fmt, name))
    print(
        f"{'scenario':<10} {'source':<5} {'loader':<24} {'best ms':>8} {'median':>8} {'us/key':>7}"
    )
    report: dict[str, Any] = {"keys": nkeys, "rows": [], "ratios": []}
    for sc in SCENARIOS:
        for fmt in ("hf", "mp8", "dcp"):
            got = {n: times[(sc.name, f, n)] for f, n in ROWS if f == fmt}
            for n, v in got.items():
                best, med = min(v) * 1e3, statistics.median(v) * 1e3
                flag = "" if (sc.name, fmt, n) not in bad else "  WRONG CHECKSUM"
                print(
                    f"{sc.name:<10} {fmt:<5} {n:<24} {best:8.1f} {med:8.1f} {best * 1e3 / nkeys:7.1f}{flag}"
                )
                report["rows"].append({"scenario": sc.name, "fmt": fmt, "loader": n, "seconds": v})
            base = min((n for n in got if n != "lazyckpt"), key=lambda n: min(got[n]))
            ratio = min(got[base]) / min(got["lazyckpt"])
            ratio_med = statistics.median(got[base]) / statistics.median(got["lazyckpt"])
            report["ratios"].append(
                {
                    "scenario": sc.name,
                    "fmt": fmt,
                    "baseline": base,
                    "best": ratio,
                    "median": ratio_med,
                }
            )
    print("lazyckpt (lazy_load) over the fastest baseline on the same source (best; median):")
    for r in report["ratios"]:
        print(
            f"  {r['scenario']:<10} {r['fmt']:<4} {r['best']:5.2f}x  {r['median']:5.2f}x  ({r['baseline']})"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
