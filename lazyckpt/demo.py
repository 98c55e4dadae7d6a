"""``lazyckpt demo``: the main job, end to end, on a checkpoint small enough to build in a second.

It writes a Llama-shaped Meta fairscale MP-8 checkpoint (``consolidated.00.pth`` ...
``consolidated.07.pth`` with ``torch.save``, split by the ``llama3-fairscale`` rules, plus
``params.json``), then streams it into every rank of TP-2 and of FSDP-4, checking each tensor
bit for bit against ``torch.chunk`` of the full tensors it built, and shows what each rank read
and how much memory it took. A mismatch is an error (exit 1): the demo is also a self-test.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lazyckpt.build import same_bits
from lazyckpt.cli import human, summarize_plans
from lazyckpt.layout import Layout
from lazyckpt.loaders import detect_loader, get_model_checkpoint_loader
from lazyckpt.options import ModelCheckpointLoadOptions
from lazyckpt.presets import preset_shard_dims
from lazyckpt.stats import LoadStats

__all__ = ["LLAMA_PARAMS", "build_llama_mp", "expected_part", "run_demo"]

LLAMA_PARAMS: dict[str, Any] = {
    "dim": 256,
    "n_layers": 4,
    "n_heads": 8,
    "n_kv_heads": 2,
    "vocab_size": 4096,
    "ffn_dim_multiplier": 1.0,
    "multiple_of": 256,
    "norm_eps": 1e-5,
    "rope_theta": 500000.0,
}
"""A Llama 3 ``params.json`` in miniature (grouped-query attention: 2 KV heads of 8)."""

PRESET = "llama3-fairscale"
PREFETCH_BYTES = 1 << 20
"""Read-ahead budget of the demo's loads (the default, 32 MiB, would hold this whole model)."""


def llama_state_dict(params: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (unsharded) bf16 weights with Meta's Llama key names and shapes."""
    g = torch.Generator().manual_seed(seed)
    dim, vocab = params["dim"], params["vocab_size"]
    head_dim = dim // params["n_heads"]
    kv_dim = params["n_kv_heads"] * head_dim
    hidden = int(2 * 4 * dim / 3 * params["ffn_dim_multiplier"])
    hidden = params["multiple_of"] * ((hidden + params["multiple_of"] - 1) // params["multiple_of"])

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd = {"tok_embeddings.weight": w(vocab, dim)}
    for i in range(params["n_layers"]):
        p = f"layers.{i}."
        sd[p + "attention.wq.weight"] = w(dim, dim)
        sd[p + "attention.wk.weight"] = w(kv_dim, dim)
        sd[p + "attention.wv.weight"] = w(kv_dim, dim)
        sd[p + "attention.wo.weight"] = w(dim, dim)
        sd[p + "feed_forward.w1.weight"] = w(hidden, dim)
        sd[p + "feed_forward.w2.weight"] = w(dim, hidden)
        sd[p + "feed_forward.w3.weight"] = w(hidden, dim)
        sd[p + "attention_norm.weight"] = torch.ones(dim, dtype=torch.bfloat16) + w(dim)
        sd[p + "ffn_norm.weight"] = torch.ones(dim, dtype=torch.bfloat16) + w(dim)
    sd["norm.weight"] = torch.ones(dim, dtype=torch.bfloat16) + w(dim)
    sd["output.weight"] = w(vocab, dim)
    return sd


def build_llama_mp(
    folder: Path, *, mp: int = 8, params: dict[str, Any] | None = None, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Write an MP-``mp`` fairscale checkpoint into ``folder``; the full tensors and shard dims."""
    params = dict(LLAMA_PARAMS if params is None else params)
    full = llama_state_dict(params, seed)
    dims = preset_shard_dims(PRESET, full)
    folder.mkdir(parents=True, exist_ok=True)
    for r in range(mp):
        # clone(): torch.save writes a view's whole storage, which would not be a shard.
        shard = {
            k: torch.chunk(v, mp, dims[k])[r].clone() if k in dims else v for k, v in full.items()
        }
        torch.save(shard, folder / f"consolidated.{r:02d}.pth")
    (folder / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    return full, dims


def expected_part(full: torch.Tensor, dim: int | None, layout: Layout) -> torch.Tensor:
    """What DESIGN.md says ``layout`` receives, with ``torch.chunk`` alone."""

    def chunk(t: torch.Tensor, parts: int, d: int, i: int) -> torch.Tensor:
        pieces = torch.chunk(t, parts, d)
        return pieces[i] if i < len(pieces) else t.narrow(d, t.shape[d], 0)

    t = full
    if dim is not None and layout.tp_size > 1:
        t = chunk(t, layout.tp_size, dim, layout.tp_rank)
    if layout.dp_size > 1 and t.dim() > 0:
        t = chunk(t, layout.dp_size, 0, layout.dp_rank)
    return t


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@contextmanager
def peak_rss_growth() -> Iterator[list[int | None]]:
    """Measure how far the process's resident memory rose above where it started, on Linux
    (``VmHWM`` after resetting it through ``/proc/self/clear_refs``); ``[None]`` elsewhere."""
    result: list[int | None] = [None]
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
    except OSError:
        before = None
    yield result
    after = _status_kib("VmHWM")
    if before is not None and after is not None:
        result[0] = max(0, after - before)


def run_demo(*, keep: Path | None = None, as_json: bool = False, progress: bool = False) -> int:
    """Build, stream, check, report; 0 when every tensor matched, 1 otherwise."""
    if keep is not None and keep.exists() and not keep.is_dir():
        raise ValueError(f"--keep {keep}: not a folder; give a new or empty folder")
    if keep is not None and keep.exists() and any(keep.iterdir()):
        raise ValueError(f"--keep {keep}: the folder is not empty; give a new or empty folder")
    with tempfile.TemporaryDirectory(prefix="lazyckpt-demo-") as tmp:
        folder = keep if keep is not None else Path(tmp) / "llama-mp8"
        return _run(folder, as_json=as_json, progress=progress)


def _run(folder: Path, *, as_json: bool, progress: bool) -> int:
    out = sys.stdout
    full, dims = build_llama_mp(folder)
    files = sorted(folder.glob("consolidated.*.pth"))
    on_disk = sum(f.stat().st_size for f in files)
    total = sum(t.nbytes for t in full.values())
    loader = get_model_checkpoint_loader()
    targets = {
        "TP-2": [Layout(tp_size=2, tp_rank=r) for r in range(2)],
        "FSDP-4": [Layout(dp_size=4, dp_rank=r) for r in range(4)],
    }
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    ranks: list[dict[str, Any]] = []
    mismatches: list[str] = []
    for name, layouts in targets.items():
        for layout in layouts:
            stats = LoadStats()
            # pread, so that resident memory is the tensors' own (pages of a mapping would count
            # too), and a read-ahead budget scaled down to this small checkpoint.
            options = ModelCheckpointLoadOptions(
                layout=layout,
                stats=stats,
                progress=progress,
                mmap=False,
                prefetch_bytes=PREFETCH_BYTES,
            )
            _, plans = detect_loader(folder).plan(folder, dims, options)
            planned = summarize_plans(plans, mmap=False, prefetch_bytes=PREFETCH_BYTES)
            largest = 0
            with peak_rss_growth() as peak:
                for key, tensor in loader.lazy_load(folder, dims, options):
                    want = expected_part(full[key], dims.get(key), layout)
                    if not same_bits(tensor, want):
                        mismatches.append(f"{name} {layout}: key {key!r} differs from torch.chunk")
                    if layout.tp_rank == 0 and layout.dp_rank == 0:
                        shapes.setdefault(key, {})[name] = tuple(tensor.shape)
                    largest = max(largest, tensor.nbytes)
                    del tensor
            ranks.append(
                {
                    "target": name,
                    "tp_rank": layout.tp_rank,
                    "dp_rank": layout.dp_rank,
                    "tensors": stats.tensors,
                    "bytes_delivered": stats.bytes_delivered,
                    "bytes_read": stats.total_bytes_read,
                    "files_read": stats.files_read,
                    "largest_tensor_bytes": largest,
                    "peak_memory_planned_bytes": planned.peak,
                    "peak_rss_growth_bytes": peak[0],
                }
            )
    if as_json:
        doc = {
            "checkpoint": {
                "path": str(folder),
                "format": "fairscale",
                "source_layout": f"MP-{len(files)}",
                "keys": len(full),
                "bytes": total,
                "file_bytes": on_disk,
                "preset": PRESET,
            },
            "keys": [
                {"key": k, "shape": list(full[k].shape), **{n: list(s) for n, s in v.items()}}
                for k, v in shapes.items()
            ],
            "ranks": ranks,
            "ok": not mismatches,
            "mismatches": mismatches,
        }
        print(json.dumps(doc, indent=2), file=out)
        return 0 if not mismatches else 1

    print(
        f"built a Llama-shaped fairscale MP-{len(files)} checkpoint in {folder}:\n"
        f"  {len(full)} keys, {human(total)} of bf16 weights in {len(files)} files "
        f"(consolidated.00.pth .. consolidated.{len(files) - 1:02d}.pth, {human(on_disk)}), "
        f"split by the {PRESET} rules",
        file=out,
    )
    print(file=out)
    rows = [["key", "full shape", "TP-2 rank 0", "FSDP-4 rank 0"]]
    for key, by_target in shapes.items():
        rows.append(
            [key, _shape(full[key].shape), _shape(by_target["TP-2"]), _shape(by_target["FSDP-4"])]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=out)
    print(file=out)
    for r in ranks:
        who = f"{r['target']} rank {r['tp_rank'] if r['target'] == 'TP-2' else r['dp_rank']}"
        measured = r["peak_rss_growth_bytes"]
        print(
            f"{who:<14} read {human(r['bytes_read']):>9} from {r['files_read']} of {len(files)} "
            f"files; largest tensor {human(r['largest_tensor_bytes']):>9}, peak memory "
            f"~{human(r['peak_memory_planned_bytes'])} planned"
            + (f", RSS +{human(measured)} measured" if measured is not None else ""),
            file=out,
        )
    print(
        f"(pread and a {human(PREFETCH_BYTES)} read-ahead budget; the planned peak is the tensor "
        "in hand plus what may be read ahead, the measured one how far resident memory rose)",
        file=out,
    )
    print(file=out)
    if mismatches:
        for m in mismatches:
            print(f"MISMATCH {m}", file=out)
        print(
            f"FAILED: {len(mismatches)} tensor(s) differ from torch.chunk of the originals",
            file=out,
        )
        return 1
    print(
        f"OK: every tensor of every rank equals torch.chunk of the full tensor, bit for bit "
        f"(the checkpoint holds {human(total)}; each rank read only its own bytes)",
        file=out,
    )
    return 0


def _shape(shape: Any) -> str:
    return "x".join(str(s) for s in shape) if len(shape) else "()"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_demo(progress=os.isatty(2)))
