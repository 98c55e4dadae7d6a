"""Cold page cache: how many bytes each loader has the disk read, and how long it takes.

    python benchmarks/bench_cold.py --dir /tmp/ck --keep        # reuse bench_load's checkpoints
    python benchmarks/bench_cold.py --quick                      # ~200 MB, one run each

Same checkpoints, scenarios and loaders as ``bench_load.py``, but before every run the row's
files are written back and dropped from the page cache (``POSIX_FADV_DONTNEED``), and the
measuring process reports ``read_bytes`` from ``/proc/self/io``: what the storage was asked to
read for it, read-ahead included. A loader that reads only a rank's bytes shows ``disk/deliv``
near 1 (more where a rank's box is a column slice: whole pages of each row). Needs Linux and a
filesystem on a block device (tmpfs reads nothing from disk: every row would show 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _ckpt
import bench_load
from _ckpt import GB, MB, SCENARIOS

LOADERS = (
    ("hf", "limit:preadv"),
    ("mp8", "load_into"),
    ("hf", "load_into"),
    ("dcp", "load_into"),
    ("mp8", "lazyckpt"),
    ("hf", "lazyckpt"),
    ("dcp", "lazyckpt"),
    ("mp8", "lazyckpt(pread)"),
    ("hf", "lazyckpt(pread)"),
    ("mp8", "torch.load(mmap)+slice"),
    ("hf", "st.load_file"),
    ("hf", "st.get_slice"),
    ("dcp", "dcp.load"),
)
"""The warm benchmark's rows, less those that read every file whatever the rank (``cat``)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (default 2)")
    ap.add_argument("--quick", action="store_true", help="~0.2 GB, one run each: a smoke run")
    ap.add_argument("--repeats", type=int, default=None, help="runs per row (default 3; quick 1)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (with --dir: reuse)")
    ap.add_argument("--json", type=Path, default=None, help="write all figures here")
    ap.add_argument("--only", default="", help="comma-separated substrings: run matching rows")
    args = ap.parse_args(argv)
    if not hasattr(os, "posix_fadvise") or not Path("/proc/self/io").exists():
        print("needs Linux (posix_fadvise and /proc/self/io)", file=sys.stderr)
        return 2
    gb = 0.2 if args.quick else args.gb
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    cfg = _ckpt.config_for(gb)
    rows = [
        {"scenario": sc.name, "fmt": fmt, "loader": loader}
        for sc in SCENARIOS
        for fmt, loader in LOADERS
    ]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        rows = [
            r for r in rows if any(w in f"{r['scenario']} {r['fmt']} {r['loader']}" for w in wanted)
        ]

    root = args.dir if args.dir is not None else Path(tempfile.mkdtemp(prefix="lazyckpt-cold-"))
    paths, expected, nbytes = bench_load.checkpoints(root, cfg, args.keep)
    ctx = bench_load.process_context(spawn=False)
    t0 = time.perf_counter()
    try:
        for rep in range(repeats):
            for r in rows:
                sc = next(s for s in SCENARIOS if s.name == r["scenario"])
                spec = {**r, "cfg": _ckpt.config_dict(cfg), "scenario": sc.__dict__, "paths": paths}
                source = [Path(paths[r["fmt"]])]
                _ckpt.drop(source)
                cached = _ckpt.cached_fraction(source)
                res = bench_load.measure(ctx, spec, 0.001, timeout=900)
                res["cached_before"] = cached
                r.setdefault("runs", []).append(res)
                if "error" in res:
                    print(f"  {r['scenario']} {r['fmt']} {r['loader']}: ERROR\n{res['error']}")
            print(f"run {rep + 1}/{repeats} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        if not args.keep:
            bench_load.remove_checkpoints(root, cfg, own_root=args.dir is None)

    failed = False
    lines = [
        f"{'scenario':<12} {'source':<4} {'loader':<24} {'s best':>7} {'s med':>7} "
        f"{'GB/s':>6} {'disk MB':>8} {'disk/deliv':>10} {'check':>6}",
        "-" * 92,
    ]
    for r in rows:
        ok = [x for x in r["runs"] if "error" not in x]
        failed |= len(ok) < len(r["runs"])
        if not ok:
            lines.append(f"{r['scenario']:<12} {r['fmt']:<4} {r['loader']:<24} ERROR")
            continue
        best = min(x["seconds"] for x in ok)
        r["seconds"], r["seconds_median"] = best, statistics.median(x["seconds"] for x in ok)
        r["delivered"] = ok[0]["delivered"]
        disks = [x["disk_read"] for x in ok if x.get("disk_read") is not None]
        r["disk_read"] = statistics.median(disks) if disks else None
        want = expected[r["scenario"]]
        sums = [x.get("checksum") for x in ok]
        r["check"] = (
            "n/a"
            if sums[0] is None
            else ("ok" if all(_ckpt.close(s, want) for s in sums) else "BAD")
        )
        failed |= r["check"] == "BAD"
        disk = "?" if r["disk_read"] is None else f"{r['disk_read'] / MB:.0f}"
        ratio = "?" if r["disk_read"] is None else f"{r['disk_read'] / r['delivered']:.2f}"
        # Cold, the "limit" row is plain preadv with the kernel's read-ahead: a reference only.
        name = "preadv (kernel's way)" if r["loader"] == "limit:preadv" else r["loader"]
        lines.append(
            f"{r['scenario']:<12} {r['fmt']:<4} {name:<24} {best:7.3f} "
            f"{r['seconds_median']:7.3f} {r['delivered'] / best / GB:6.2f} {disk:>8} {ratio:>10} "
            f"{r['check']:>6}"
        )
    left = [x["cached_before"] for r in rows for x in r["runs"] if x.get("cached_before", -1) >= 0]
    machine = _ckpt.machine()
    print()
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, Linux {machine['kernel']}, "
        f"torch {machine['torch']}; {cfg}, {nbytes / GB:.3f} GB; best and median of {repeats} "
        "run(s), each in a fresh process, cold page cache"
        + (
            f"; before a run the cache held at most {max(left) * 100:.1f}% of the row's files"
            if left
            else ""
        )
    )
    print("\n".join(lines))
    if args.json is not None:
        doc = {"machine": machine, "config": _ckpt.config_dict(cfg), "rows": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=str))
        print(f"\nwrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
