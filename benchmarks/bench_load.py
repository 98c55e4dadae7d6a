"""Benchmark lazyckpt against the usual ways of loading and resharding, and against the limit.

    python benchmarks/bench_load.py              # ~2 GB Llama-shaped bf16 checkpoint, 3 runs each
    python benchmarks/bench_load.py --quick      # ~200 MB, a smoke run
    python benchmarks/bench_load.py --gb 4 --json out.json --dir /data/tmp

Writes the same weights as Meta fairscale MP-8 ``consolidated.NN.pth``, a Hugging Face sharded
safetensors folder and a torch.distributed.checkpoint folder, warms the page cache, then measures
every (scenario, loader) in a fresh process, repeated, interleaved. See benchmarks/README.md for
what each column means and how memory is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _ckpt
import _runner
from _ckpt import GB, MB, SCENARIOS, box, box_numel

import lazyckpt

LIMITS = ("limit:preadv", "limit:mmap-copy")
"""Rows whose best is the scenario's limit: copying the same bytes (see benchmarks/README.md)."""
IDEAL = "ideal:contiguous"
"""The same number of bytes copied as contiguous ranges: a reference no strided box reaches."""


def rows_for(has_load_into: bool) -> list[dict[str, str]]:
    """Every (scenario, source, loader) measured, in table order."""
    rows = []
    for sc in SCENARIOS:

        def add(fmt: str, loader: str, sc: _ckpt.Scenario = sc) -> None:
            rows.append({"scenario": sc.name, "fmt": fmt, "loader": loader})

        for name in (*LIMITS, IDEAL):
            add("hf", name)
        if has_load_into:
            for fmt in ("mp8", "hf", "dcp"):
                add(fmt, "load_into")
        for fmt in ("mp8", "hf", "dcp"):
            add(fmt, "lazyckpt")
        for fmt in ("mp8", "hf"):
            add(fmt, "lazyckpt(pread)")
        for fmt in ("mp8", "hf"):
            add(fmt, "lazyckpt+copy")
        add("mp8", "torch.load+cat")
        add("mp8", "torch.load(mmap)+cat")
        add("mp8", "torch.load(mmap)+slice")
        add("hf", "st.load_file")
        add("hf", "st.get_slice")
        add("dcp", "dcp.load")
    return rows


def measure(ctx: Any, spec: dict[str, Any], sample_s: float, timeout: float) -> dict[str, Any]:
    """Run one measurement in a fresh process; sample its RssAnon from here while it loads."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_runner.child_main, args=(spec, child), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise TimeoutError("setup took too long")
        kind, payload = parent.recv()
        if kind == "error":
            return {"error": payload}
        base = _runner.rss_anon(proc.pid)
        peak = base
        parent.send("go")
        deadline = time.monotonic() + timeout
        while not parent.poll(sample_s):
            with contextlib.suppress(OSError, ValueError):
                peak = max(peak, _runner.rss_anon(proc.pid))
            if time.monotonic() > deadline:
                raise TimeoutError("the load took too long")
        kind, out = parent.recv()
        if kind == "error":
            return {"error": out}
        peak = max(peak, out.pop("end_anon"))
        out["anon_base"] = base
        out["anon_peak"] = peak - base
        return out
    except (EOFError, TimeoutError) as exc:
        return {"error": f"{type(exc).__name__}: {exc} (exit code {proc.exitcode})"}
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent.close()


def cpu_capacity(ctx: Any) -> float:
    """How many cores' worth of CPU two busy processes get together right now (2.0 on an idle
    2-core machine; about 1 where the two vCPUs share a core or the host is busy)."""

    def spin(n: int) -> float:
        pipes, procs = [], []
        for _ in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_runner.spin, args=(b,), daemon=True)
            p.start()
            b.close()
            pipes.append(a)
            procs.append(p)
        times = [a.recv() for a in pipes]
        for p in procs:
            p.join()
        return max(times)

    solo = min(spin(1) for _ in range(2))
    pair = min(spin(2) for _ in range(2))
    return round(2 * solo / pair, 2)


def _dense(shape: tuple[int, ...], b: list[tuple[int, int]]) -> bool:
    """Whether box ``b`` of a row-major tensor of ``shape`` is one contiguous range: past its
    first dim longer than 1, every dim is whole."""
    lengths = [hi - lo for lo, hi in b]
    first = next((d for d, n in enumerate(lengths) if n > 1), len(lengths))
    return all(b[d] == (0, shape[d]) for d in range(first + 1, len(shape)))


def summarize(rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Medians over runs, the limit of each scenario, fractions and target checks."""
    by_sc: dict[str, dict[str, Any]] = {}
    for sc in SCENARIOS:
        shapes = _ckpt.shapes(meta["cfg_obj"])
        dims = _ckpt.shard_dims(meta["cfg_obj"])
        boxes = {k: box(s, dims.get(k), sc) for k, s in shapes.items()}
        sizes = [2 * box_numel(b) for b in boxes.values()]
        by_sc[sc.name] = {
            "delivered": sum(sizes),
            "largest": max(sizes),
            "dense": all(_dense(shapes[k], b) for k, b in boxes.items()),
        }
    for r in rows:
        ok = [x for x in r["runs"] if "error" not in x]
        r["errors"] = [x["error"] for x in r["runs"] if "error" in x]
        if not ok:
            continue
        r["seconds"] = min(x["seconds"] for x in ok)
        r["seconds_median"] = statistics.median(x["seconds"] for x in ok)
        r["delivered"] = ok[0]["delivered"]
        r["gbps"] = r["delivered"] / r["seconds"] / GB
        r["gbps_median"] = r["delivered"] / r["seconds_median"] / GB
        r["anon_peak"] = max(x["anon_peak"] for x in ok)
        cpu = [x["cpu_seconds"] for x in ok if x.get("cpu_seconds") is not None]
        r["cpu_seconds_median"] = statistics.median(cpu) if cpu else None
        r["bytes_read"] = ok[0]["bytes_read"]
        r["read_ratio"] = r["bytes_read"] / r["delivered"] if r["delivered"] else 1.0
        r["views"] = ok[0].get("views")
        r["tensors"] = ok[0].get("tensors")
        want = meta["expected"][r["scenario"]]
        got = [x.get("checksum") for x in ok]
        r["check"] = (
            "n/a" if got[0] is None else ("ok" if all(_ckpt.close(g, want) for g in got) else "BAD")
        )
    for name, info in by_sc.items():
        # Where every box is one contiguous range, the ideal row copies the very same bytes
        # as limit:mmap-copy: it is one more measurement of the limit, and counts as one.
        kinds = (*LIMITS, IDEAL) if info["dense"] else LIMITS
        limits = [
            r["gbps"]
            for r in rows
            if r["scenario"] == name and r["loader"] in kinds and "gbps" in r
        ]
        info["limit_gbps"] = max(limits) if limits else None
        ideal = [
            r["gbps"]
            for r in rows
            if r["scenario"] == name and r["loader"] == IDEAL and "gbps" in r
        ]
        info["ideal_gbps"] = ideal[0] if ideal else None
        info["bound"] = info["largest"] + 64 * (1 << 20)
    for r in rows:
        lim = by_sc[r["scenario"]]["limit_gbps"]
        if "gbps" in r and lim:
            r["x_limit"] = r["gbps"] / lim
    meta["scenarios"] = by_sc


def targets(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    by_sc = meta["scenarios"]
    for r in rows:
        if "gbps" not in r:
            continue
        if r["loader"] == "load_into":
            ideal = by_sc[r["scenario"]].get("ideal_gbps")
            out.append(
                {
                    "target": "load_into >= 0.7x limit",
                    "scenario": r["scenario"],
                    "fmt": r["fmt"],
                    "value": round(r["x_limit"], 3),
                    "x_ideal": round(r["gbps"] / ideal, 3) if ideal else None,
                    "met": r["x_limit"] >= 0.7,
                }
            )
        if r["loader"] in ("lazyckpt", "lazyckpt(pread)"):
            bound = by_sc[r["scenario"]]["bound"]
            all_views = r["views"] is not None and r["views"] == r["tensors"]
            out.append(
                {
                    "target": "lazy_load anon overhead <= largest target + 64 MB"
                    + (" (all views: ~0)" if all_views else ""),
                    "scenario": r["scenario"],
                    "fmt": r["fmt"],
                    "loader": r["loader"],
                    "value": f"{r['anon_peak'] / MB:.0f} MB / bound {bound / MB:.0f} MB",
                    "met": r["anon_peak"] <= (16 * MB if all_views else bound),
                }
            )
            if r["scenario"] == "fsdp8-r0":
                frac = r["bytes_read"] / meta["checkpoint_bytes"]
                out.append(
                    {
                        "target": "FSDP dp-8 reads <= 1.05 x 1/8 of the checkpoint",
                        "scenario": r["scenario"],
                        "fmt": r["fmt"],
                        "loader": r["loader"],
                        "value": f"{frac * 8:.3f} x 1/8",
                        "met": frac <= 1.05 / 8,
                    }
                )
    return out


BASELINES = {
    "mp8": ("torch.load+cat", "torch.load(mmap)+cat", "torch.load(mmap)+slice"),
    "hf": ("st.load_file", "st.get_slice"),
    "dcp": ("dcp.load",),
}


def versus(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """lazyckpt's throughput over the fastest baseline on the same source, per scenario: best
    run against best run (``ratio``), and median against median (``ratio_median``, the
    baseline with the fastest median), since one lucky run of a 15 ms row moves the first by
    a fifth."""
    best: dict[tuple[str, str], tuple[float, str]] = {}
    best_median: dict[tuple[str, str], tuple[float, str]] = {}
    mine: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        if "gbps" not in r:
            continue
        key = (r["scenario"], r["fmt"])
        if r["loader"] == "lazyckpt":
            mine[key] = r
        elif r["loader"] in BASELINES.get(r["fmt"], ()):
            if key not in best or r["gbps"] > best[key][0]:
                best[key] = (r["gbps"], r["loader"])
            if key not in best_median or r["gbps_median"] > best_median[key][0]:
                best_median[key] = (r["gbps_median"], r["loader"])
    return [
        {
            "scenario": k[0],
            "fmt": k[1],
            "lazyckpt": mine[k]["gbps"],
            "baseline": best[k][1],
            "baseline_gbps": best[k][0],
            "ratio": mine[k]["gbps"] / best[k][0],
            "baseline_median": best_median[k][1],
            "ratio_median": mine[k]["gbps_median"] / best_median[k][0],
        }
        for k in mine
        if k in best
    ]


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    head = (
        f"{'scenario':<12} {'source':<4} {'loader':<23} {'GB/s':>6} {'median':>6} "
        f"{'x limit':>7} {'CPU ms':>6} {'anon MB':>8} {'read/deliv':>10} {'views':>7} {'check':>5}"
    )
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        if r["scenario"] != last:
            info = meta["scenarios"][r["scenario"]]
            if last is not None:
                lines.append("")
            lim = info["limit_gbps"]
            lines.append(
                f"# {r['scenario']}: {info['delivered'] / GB:.3f} GB delivered, largest tensor "
                f"{info['largest'] / MB:.0f} MB, limit {lim:.2f} GB/s"
                if lim
                else f"# {r['scenario']}"
            )
            last = r["scenario"]
        if "gbps" not in r:
            lines.append(
                f"{r['scenario']:<12} {r['fmt']:<4} {r['loader']:<23} "
                f"ERROR {r['errors'][0].strip().splitlines()[-1][:60]}"
            )
            continue
        views = f"{r['views']}/{r['tensors']}" if r.get("views") is not None else ""
        cpu = r.get("cpu_seconds_median")
        lines.append(
            f"{r['scenario']:<12} {r['fmt']:<4} {r['loader']:<23} {r['gbps']:6.2f} "
            f"{r['gbps_median']:6.2f} {r.get('x_limit', 0):7.2f} "
            f"{'' if cpu is None else f'{cpu * 1e3:.0f}':>6} {r['anon_peak'] / MB:8.0f} "
            f"{r['read_ratio']:10.3f} {views:>7} {r['check']:>5}"
        )
    return "\n".join(lines)


_SOURCES = ("fairscale-mp8", "hf-safetensors", "dcp")


def checkpoints(root: Path, cfg: Any, keep: bool) -> tuple[dict[str, str], Any, int]:
    """``(paths, expected checksums, bytes)`` of the three checkpoints under ``root``: written
    now, or reused when ``keep`` and an earlier run left them (the stamp says which config)."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = root / f"ckpt-{cfg.dim}-{cfg.n_layers}.json"
    if keep and stamp.exists():
        saved = json.loads(stamp.read_text())
        print(f"reusing the checkpoints in {root}", flush=True)
        return saved["paths"], saved["expected"], saved["nbytes"]
    for sub in _SOURCES:
        _ckpt.remove(root / sub)
    print(f"writing a {cfg} checkpoint to {root} ...", flush=True)
    paths, expected, nbytes = _ckpt.write_all(cfg, root)
    stamp.write_text(json.dumps({"paths": paths, "expected": expected, "nbytes": nbytes}))
    return paths, expected, nbytes


def remove_checkpoints(root: Path, cfg: Any, own_root: bool) -> None:
    """Remove what :func:`checkpoints` wrote (and ``root`` itself when the run made it)."""
    for sub in _SOURCES:
        _ckpt.remove(root / sub)
    (root / f"ckpt-{cfg.dim}-{cfg.n_layers}.json").unlink(missing_ok=True)
    if own_root:
        _ckpt.remove(root)


def process_context(spawn: bool) -> Any:
    """Where each measurement's fresh process comes from.

    By default a fork server that has imported torch, safetensors and lazyckpt (and started no
    thread) forks one child per measurement: no import paid per run. With ``spawn`` every run
    is a new interpreter that imports them itself (2-3 s a run here), as a script run once
    would: its first load finds its own modules' memory already written by the import, where a
    fork's first writes to the server's memory are copy-on-write faults, and it finds native
    code (safetensors' Rust) not yet used (see benchmarks/README.md, "Method")."""
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH", "")) if p
    )
    if spawn:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["_runner"])
    return ctx


def _percent(fraction: float) -> str:
    """A fraction as a percentage, or "unknown" for the -1 of what could not be measured."""
    return "unknown" if fraction < 0 else f"{fraction * 100:.0f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (default 2)")
    ap.add_argument("--quick", action="store_true", help="~0.2 GB, one run each: a smoke run")
    ap.add_argument("--repeats", type=int, default=None, help="runs per row (default 3; quick 1)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (with --dir: reuse)")
    ap.add_argument("--json", type=Path, default=None, help="write all figures here")
    ap.add_argument("--only", default="", help="comma-separated substrings: run matching rows")
    ap.add_argument("--sample-ms", type=float, default=1.0, help="RssAnon sampling period")
    ap.add_argument(
        "--spawn",
        action="store_true",
        help="run each measurement in a new interpreter instead of a fork of a server that\n"
        "imported everything (2-3 s more per run)",
    )
    args = ap.parse_args(argv)
    gb = 0.2 if args.quick else args.gb
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)

    cfg = _ckpt.config_for(gb)
    has_load_into = hasattr(lazyckpt, "load_into")
    if not has_load_into:
        print("note: lazyckpt.load_into does not exist yet; its rows are skipped", flush=True)
    rows = rows_for(has_load_into)
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        rows = [
            r
            for r in rows
            if r["loader"].startswith(("limit", "ideal"))
            or any(w in f"{r['scenario']} {r['fmt']} {r['loader']}" for w in wanted)
        ]

    root = args.dir if args.dir is not None else Path(tempfile.mkdtemp(prefix="lazyckpt-bench-"))
    t0 = time.perf_counter()
    paths, expected, nbytes = checkpoints(root, cfg, args.keep)
    sources = [Path(p) for p in paths.values()]
    pmd = {"found": _ckpt.pmd_mapped_fraction(sources)}
    _ckpt.settle(sources)  # the same page-cache state whatever ran before (see _ckpt.settle)
    pmd["settled"] = _ckpt.pmd_mapped_fraction(sources)
    cached = _ckpt.cached_fraction(sources)
    print(
        f"checkpoint: {nbytes / GB:.3f} GB of tensors, {len(rows)} rows x {repeats} runs; "
        f"written/read in {time.perf_counter() - t0:.0f} s, page cache holds "
        f"{cached * 100:.0f}% of the files, {_percent(pmd['settled'])} of it mappable by PMD "
        f"(was {_percent(pmd['found'])})",
        flush=True,
    )

    ctx = process_context(args.spawn)
    # The CPU probe always forks: two new interpreters would each spend seconds importing
    # while the other spins, and measure that instead of the host.
    probe = process_context(spawn=False)
    specs = []
    for r in rows:
        sc = next(s for s in SCENARIOS if s.name == r["scenario"])
        specs.append(
            {
                **r,
                "cfg": _ckpt.config_dict(cfg),
                "scenario": sc.__dict__,
                "paths": paths,
            }
        )
        r["runs"] = []
    capacity = [cpu_capacity(probe)]
    print(f"CPU capacity of two busy processes: {capacity[0]} cores", flush=True)
    t1 = time.perf_counter()
    try:
        for rep in range(repeats):
            for r, spec in zip(rows, specs):
                # Re-read the row's files right before it runs: this host's DAMON pages out
                # page cache untouched for about a minute, so a warm-once cache goes cold
                # during the run (benchmarks/README.md, "Method").
                source = [Path(paths[r["fmt"]])]
                cached = _ckpt.cached_fraction(source)
                _ckpt.warm(source)
                res = measure(ctx, spec, args.sample_ms / 1000, timeout=900)
                res["cached_before_warm"] = cached
                r["runs"].append(res)
                if "error" in res:
                    print(
                        f"  {r['scenario']} {r['fmt']} {r['loader']}: ERROR\n{res['error']}",
                        file=sys.stderr,
                        flush=True,
                    )
            print(f"run {rep + 1}/{repeats} done ({time.perf_counter() - t1:.0f} s)", flush=True)
        capacity.append(cpu_capacity(probe))
        pmd["end"] = _ckpt.pmd_mapped_fraction(sources)
    finally:
        if not args.keep:
            remove_checkpoints(root, cfg, own_root=args.dir is None)

    meta: dict[str, Any] = {"cfg_obj": cfg, "expected": expected, "checkpoint_bytes": nbytes}
    summarize(rows, meta)
    checks = targets(rows, meta)
    machine = _ckpt.machine()
    print()
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['mem_gib']} GiB, "
        f"Linux {machine['kernel']}, torch {machine['torch']}, THP {machine['thp']}"
    )
    print(
        f"checkpoint: Llama-shaped bf16, {cfg}, {nbytes / GB:.3f} GB; best and median of "
        f"{repeats} run(s), each in a fresh process ({'new interpreter' if args.spawn else 'fork'}), "
        f"warm page cache; CPU capacity "
        f"{capacity[0]} -> {capacity[-1]} cores"
    )
    before = [
        x["cached_before_warm"]
        for r in rows
        for x in r["runs"]
        if x.get("cached_before_warm", -1) >= 0
    ]
    print(
        f"page cache mappable by PMD: {_percent(pmd['settled'])} at the start, "
        f"{_percent(pmd.get('end', -1.0))} at the end (see benchmarks/README.md, Method)"
    )
    if before:
        print(
            f"page cache held {min(before) * 100:.0f}%-{max(before) * 100:.0f}% "
            f"(median {statistics.median(before) * 100:.0f}%) of a row's files before they were "
            "re-read for it"
        )
    print(table(rows, meta))
    comparison = versus(rows)
    print()
    print("lazyckpt (lazy_load) over the fastest baseline on the same source:")
    for fmt in ("mp8", "hf", "dcp"):
        sel = [c for c in comparison if c["fmt"] == fmt]
        if not sel:
            continue
        for label, ratio, baseline in (
            (f"{fmt:<4}", "ratio", "baseline"),
            (f"{'':<4} medians:", "ratio_median", "baseline_median"),
        ):
            cells = ", ".join(f"{c['scenario']} {c[ratio]:.2f}x ({c[baseline]})" for c in sel)
            geo = statistics.geometric_mean(c[ratio] for c in sel)
            print(f"  {label} {cells}; geomean {geo:.2f}x")
    print()
    for c in checks:
        tag = "MET " if c["met"] else "MISS"
        where = f"{c['scenario']} {c['fmt']} {c.get('loader', '')}".strip()
        extra = f" (x ideal:contiguous {c['x_ideal']})" if c.get("x_ideal") else ""
        print(f"[{tag}] {c['target']}: {where}: {c['value']}{extra}")
    if args.json is not None:
        doc = {
            "machine": machine,
            "config": _ckpt.config_dict(cfg),
            "checkpoint_bytes": nbytes,
            "repeats": repeats,
            "processes": "spawn" if args.spawn else "forkserver",
            "page_cache_fraction": cached,
            "pmd_mapped_fraction": pmd,
            "cpu_capacity": capacity,
            "scenarios": meta["scenarios"],
            "rows": rows,
            "targets": checks,
            "versus_baselines": comparison,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=str))
        print(f"\nwrote {args.json}")
    # A row fails if any run of it failed or gave a wrong checksum, not only if all did.
    return 1 if any(r["errors"] or r.get("check") == "BAD" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
