"""Compare two versions of lazyckpt on one benchmark row, in alternating fresh processes.

    git worktree add /tmp/old <commit>                                   # the version to beat
    python benchmarks/bench_load.py --dir /tmp/ck --keep --only nothing  # write and keep files
    python benchmarks/ab.py --dir /tmp/ck --old /tmp/old --row "fsdp8-r0 mp8 load_into"

This host's noise (other tenants, the page cache's state) moves one row's time by more than most
changes do, so two versions timed in separate runs of ``bench_load.py``, minutes apart, tell
little. Here every round re-reads the row's files into the page cache, then runs ``--runs``
fresh forks of an interpreter that imports the old tree and as many of one that imports this
checkout, the order swapped every round; the quantiles of both and their differences are
printed. Each fork prepares the row and times one load as ``bench_load.py`` does (the same
preparers), so the figures compare with its table's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))


def child(spec: dict[str, object], runs: int) -> None:
    """Time ``runs`` loads, each in a fork of this interpreter (which has imported, and started
    no thread), and print them as JSON: ``[[seconds, cpu seconds], ...]`` and the lazyckpt used."""
    import _runner
    import torch

    import lazyckpt

    out = []
    for _ in range(runs):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            torch.ones(1 << 20).sum()  # torch's intra-op threads start outside the timed region
            ctx = _runner.Ctx(spec)
            run = _runner.PREPARERS[str(spec["loader"])](ctx)
            gc.collect()
            cpu0 = _runner.cpu_seconds()
            t0 = time.perf_counter()
            run()
            seconds = time.perf_counter() - t0
            cpu1 = _runner.cpu_seconds()
            cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
            os.write(w, json.dumps([seconds, cpu]).encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        if status != 0 or not data:
            sys.exit(f"a timed load failed (wait status {status})")
        out.append(json.loads(data))
    print(json.dumps({"runs": out, "lazyckpt": lazyckpt.__file__}))


def _quantiles(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {
        "best": v[0],
        "p10": v[len(v) // 10],
        "p25": v[len(v) // 4],
        "median": statistics.median(v),
        "p75": v[(3 * len(v)) // 4],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="a --keep'd bench_load.py --dir")
    ap.add_argument("--old", type=Path, required=True, help="the other tree (a git worktree)")
    ap.add_argument(
        "--row", required=True, help='"scenario source loader", e.g. "fsdp8-r0 mp8 load_into"'
    )
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5, help="forks per version and round")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(json.loads(args.child), args.runs)
        return
    import _ckpt

    scenario, fmt, loader = args.row.split()
    spec = _ckpt.kept_row_spec(args.dir, scenario, fmt, loader)
    source = [Path(str(spec["paths"][fmt]))]  # type: ignore[index]
    if not (args.old / "lazyckpt" / "__init__.py").is_file():
        sys.exit(f"{args.old} holds no lazyckpt package")
    trees = {"old": args.old.resolve(), "new": REPO}
    times: dict[str, list[float]] = {"old": [], "new": []}
    cpus: dict[str, list[float]] = {"old": [], "new": []}
    for rnd in range(args.rounds):
        _ckpt.warm(source)
        for name in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
            env = dict(os.environ, PYTHONPATH=str(trees[name]))
            cmd = [sys.executable, __file__, "--dir", str(args.dir), "--old", str(args.old)]
            cmd += ["--row", args.row, "--runs", str(args.runs), "--child", json.dumps(spec)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"{name} ({trees[name]}) failed:\n{done.stderr}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            if not Path(got["lazyckpt"]).is_relative_to(trees[name]):
                sys.exit(f"{name} imported {got['lazyckpt']}, not the tree {trees[name]}")
            times[name] += [s * 1e3 for s, _ in got["runs"]]
            cpus[name] += [c * 1e3 for _, c in got["runs"] if c is not None]
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    q = {name: _quantiles(v) for name, v in times.items()}
    print(f"{args.row}: {len(times['new'])} fresh processes per version, ms")
    print(f"{'':8s}" + "".join(f"{k:>9s}" for k in q["old"]) + f"{'CPU med':>10s}")
    for name in ("old", "new"):
        cpu = f"{statistics.median(cpus[name]):10.1f}" if cpus[name] else f"{'n/a':>10s}"
        print(f"{name:8s}" + "".join(f"{x:9.2f}" for x in q[name].values()) + cpu)
    print(f"{'new-old':8s}" + "".join(f"{q['new'][k] - q['old'][k]:+9.2f}" for k in q["old"]))


if __name__ == "__main__":
    main()
