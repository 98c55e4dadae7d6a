"""Run one benchmark row in this process, for a profiler.

    python benchmarks/bench_load.py --dir /tmp/ck --keep --only nothing   # write and keep files
    py-spy record --native -o prof.svg -- \\
        python benchmarks/_profile.py --dir /tmp/ck --scenario tp2-r0 --fmt mp8 --loader lazyckpt
    python benchmarks/_profile.py ... --pyinstrument

The row is prepared once and run ``--runs`` times (first run included), printing each time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _ckpt
import _runner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, required=True, help="a --keep'd bench_load.py --dir")
    ap.add_argument("--scenario", default="unsharded")
    ap.add_argument("--fmt", default="mp8")
    ap.add_argument("--loader", default="lazyckpt")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pyinstrument", action="store_true")
    args = ap.parse_args()
    spec = _ckpt.kept_row_spec(args.dir, args.scenario, args.fmt, args.loader)
    ctx = _runner.Ctx(spec)
    run = _runner.PREPARERS[args.loader](ctx)
    profiler = None
    if args.pyinstrument:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
        profiler.start()
    for _ in range(args.runs):
        t0 = time.perf_counter()
        out = run()
        dt = time.perf_counter() - t0
        print(
            f"{args.scenario} {args.fmt} {args.loader}: {dt:.3f} s, "
            f"{ctx.delivered / dt / 1e9:.2f} GB/s, read {out['bytes_read'] / 1e9:.3f} GB"
        )
    if profiler is not None:
        profiler.stop()
        print(profiler.output_text(unicode=False, color=False, show_all=False))


if __name__ == "__main__":
    main()
