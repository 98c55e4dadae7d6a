"""Stitched views: a box that several rank files fill with contiguous ranges is yielded as one
view whose pages are the files' own (``lazyckpt.stitch``), and is right in every case where it
cannot be (a copy then).

Whether a tensor is a stitched view is read off ``/proc/self/maps``: the memory in the middle of
its data belongs to a mapping of one of the rank files, not to anonymous memory.
"""

from __future__ import annotations

import gc
import hashlib
import sys
from pathlib import Path

import pytest
import torch
from helpers import expected, same_bits

import lazyckpt
import lazyckpt.stitch
import lazyckpt.unmap

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="stitched views use Linux's MAP_FIXED"
)

MP = 4
DIMS = {"wq": 0, "w1": 0, "odd": 0, "wo": 1}


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "wq": torch.randn(1024, 512, generator=g),  # 512 KiB per rank file: whole pages
        "w1": torch.randn(2048, 256, generator=g).to(torch.bfloat16),  # 256 KiB per rank
        "norm": torch.randn(512, generator=g),  # replicated
        "odd": torch.randn(1000, 300, generator=g),  # 300000 B per rank: not whole pages
        "wo": torch.randn(512, 1024, generator=g),  # split on dim 1: rows interleave
    }


def write_mp(root: Path, full: dict[str, torch.Tensor]) -> Path:
    """A Meta-style model-parallel set: ``consolidated.NN.pth`` per rank with ``torch.save``."""
    root.mkdir(parents=True, exist_ok=True)
    for r in range(MP):
        sd = {
            k: (t.chunk(MP, DIMS[k])[r].clone() if k in DIMS else t.clone())
            for k, t in full.items()
        }
        torch.save(sd, root / f"consolidated.{r:02d}.pth")
    return root


@pytest.fixture(scope="module")
def mp_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("stitch") / "mp4"
    full = full_tensors()
    write_mp(root, full)
    # The oracle: what torch.load reads back, concatenated along each key's dim.
    ranks = [torch.load(root / f"consolidated.{r:02d}.pth", weights_only=True) for r in range(MP)]
    oracle = {
        k: torch.cat([sd[k] for sd in ranks], DIMS[k]) if k in DIMS else ranks[0][k]
        for k in ranks[0]
    }
    assert all(same_bits(oracle[k], full[k]) for k in full)
    return root, oracle


def backing(t: torch.Tensor) -> str:
    """The file whose mapping holds ``t``'s data 3/8 of the way in ("" for anonymous memory).

    3/8 lies inside a piece when a box is stitched from 2 or 4 equal pieces; their seams, at
    1/4 and 1/2, are partial pages copied into anonymous memory."""
    address = t.data_ptr() + t.numel() * t.element_size() * 3 // 8
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                name = parts[5].strip() if len(parts) > 5 else ""
                return "" if name.startswith("[") else name  # [heap] and the like
    raise AssertionError(f"address {address:#x} is not mapped")


def mapped_paths(root: Path) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if str(root) in line]


def load(root: Path, layout: lazyckpt.Layout, **options: object) -> tuple[dict, lazyckpt.LoadStats]:
    stats = lazyckpt.LoadStats()
    opts = lazyckpt.ModelCheckpointLoadOptions(layout=layout, stats=stats, **options)  # type: ignore[arg-type]
    got = dict(lazyckpt.get_model_checkpoint_loader().lazy_load(root, DIMS, opts))
    return got, stats


@pytest.mark.parametrize(
    ("layout", "stitched"),
    [
        (lazyckpt.Layout(), {"wq", "w1"}),
        (lazyckpt.Layout(tp_size=2, tp_rank=1), {"wq"}),  # w1's half is 512 KiB: copied
        (lazyckpt.Layout(dp_size=2, dp_rank=1), {"wq"}),
        (lazyckpt.Layout(tp_size=4, tp_rank=3), set()),  # one rank file each: plain views
    ],
)
def test_boxes_spanning_rank_files_are_stitched_views(
    mp_set: tuple[Path, dict[str, torch.Tensor]], layout: lazyckpt.Layout, stitched: set[str]
) -> None:
    root, oracle = mp_set
    got, stats = load(root, layout)
    assert list(got) == list(oracle)
    for key, t in got.items():
        assert same_bits(t, expected(oracle[key], DIMS.get(key), layout)), key
        if key in stitched:
            assert Path(backing(t)).parent == root, key
            assert t.is_contiguous()
    for key in ("odd", "wo"):  # misaligned shards, interleaved rows: copies
        if got[key].numel() and layout.tp_size == 1:
            assert backing(got[key]) == "", key
    assert stats.bytes_delivered == sum(t.numel() * t.element_size() for t in got.values())


def test_a_stitched_view_outlives_the_load_and_writes_stay_private(
    mp_set: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    root, oracle = mp_set
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.iterdir()}
    got, _ = load(root, lazyckpt.Layout())
    gc.collect()  # the loader, its reader and its own references to the mappings are gone
    wq = got.pop("wq")
    assert Path(backing(wq)).parent == root
    assert same_bits(wq, oracle["wq"])
    wq.fill_(3.0)  # copy-on-write: the process's own pages, never the file
    assert bool((wq == 3.0).all())
    assert digest == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.iterdir()}
    again, _ = load(root, lazyckpt.Layout())
    assert same_bits(again["wq"], oracle["wq"])


def test_stitched_mappings_go_with_their_tensors(
    mp_set: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    root, _ = mp_set
    gc.collect()
    lazyckpt.unmap.wait()  # earlier tests' mappings may still be on their way out
    before = len(mapped_paths(root))
    got, stats = load(root, lazyckpt.Layout(), prefetch_bytes=0)
    assert stats.views >= 2 and len(mapped_paths(root)) > before
    del got
    gc.collect()
    lazyckpt.unmap.wait()  # mappings are dropped on a thread of their own
    assert len(mapped_paths(root)) == before


def test_shards_that_are_not_whole_pages_are_copied(tmp_path: Path) -> None:
    # 1000 x 300 float32 rows per rank: the ranks' offsets disagree modulo the page size.
    full = full_tensors()
    root = write_mp(tmp_path / "mp4", full)
    got, _ = load(root, lazyckpt.Layout())
    assert same_bits(got["odd"], full["odd"])
    assert backing(got["odd"]) == ""


def test_when_no_mapping_may_be_added_boxes_are_copied(
    mp_set: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, oracle = mp_set
    monkeypatch.setattr(lazyckpt.stitch._budget, "limit", 0)
    got, _ = load(root, lazyckpt.Layout())
    for key, t in got.items():
        assert same_bits(t, oracle[key]), key
    assert backing(got["wq"]) == ""


@pytest.mark.parametrize("options", [{"mmap": False}, {"dtype": torch.float64}])
def test_no_stitched_view_where_the_options_ask_for_copies(
    mp_set: tuple[Path, dict[str, torch.Tensor]], options: dict[str, object]
) -> None:
    root, oracle = mp_set
    got, stats = load(root, lazyckpt.Layout(), **options)
    for key, t in got.items():
        want = oracle[key]
        if "dtype" in options and want.is_floating_point():
            want = want.to(torch.float64)
        assert same_bits(t, want), key
    assert stats.views == 0
    assert backing(got["wq"]) == ""
