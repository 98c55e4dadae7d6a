"""Writing into yielded views: private pages are given back when a view goes, never while a live
tensor can see them (lazyckpt.cow). Oracle: the tensors as written, and what was written into
the views that are kept."""

from __future__ import annotations

import ctypes
import gc
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

import lazyckpt
from lazyckpt.cow import private_pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTNEED: Linux")


@given(
    start=st.integers(0, 200),
    length=st.integers(0, 200),
    others=st.lists(st.tuples(st.integers(0, 250), st.integers(0, 60)), max_size=4),
    page=st.sampled_from([4, 8, 16]),
)
def test_private_pages_are_whole_pages_no_live_view_touches(
    start: int, length: int, others: list[tuple[int, int]], page: int
) -> None:
    stop = start + length
    ranges = [(s, s + n) for s, n in others]
    got = private_pages(start, stop, ranges, page)
    dropped = {p for lo, hi in got for p in range(lo // page, hi // page)}
    for lo, hi in got:
        assert lo % page == 0 and hi % page == 0 and lo < hi
    assert all(b[0] > a[1] for a, b in itertools.pairwise(got))  # apart, in order
    # Brute force: a page may go when it holds a byte of [start, stop) and no live byte.
    live = {b // page for s, e in ranges for b in range(s, e)}
    want = {b // page for b in range(start, stop)} - live
    assert dropped == want


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no RssAnon")


@linux
def test_in_place_writes_into_views_do_not_pile_up(tmp_path: Path) -> None:
    # Each view is rescaled in place and dropped: the private pages go with it, not at the
    # end of the load (before: the whole checkpoint's size). The stream makes views in batches
    # of _AHEAD_BYTES and checks those that went before each batch: at most one batch's
    # written pages, and the tensor in hand, are alive at once.
    from lazyckpt.loader import _AHEAD_BYTES

    g = torch.Generator().manual_seed(0)
    full = {f"w{i:02d}": torch.randn(1024, 2048, generator=g) for i in range(24)}  # 8 MiB each
    assert sum(t.nbytes for t in full.values()) >= 2 * _AHEAD_BYTES + (32 << 20)
    save_file(full, tmp_path / "m.safetensors")
    halves = {k: v * 0.5 for k, v in full.items()}  # made before the baseline is taken
    loader = lazyckpt.get_model_checkpoint_loader()
    gc.collect()
    base = peak = _rss_anon()
    for key, t in loader.lazy_load(tmp_path / "m.safetensors", {}):
        t.mul_(0.5)
        assert torch.equal(t, halves[key])
        del t
        peak = max(peak, _rss_anon())
    assert peak - base < _AHEAD_BYTES + 2 * (8 << 20), (peak - base) >> 20


@linux
def test_written_views_that_went_are_given_back_when_the_stream_ends(tmp_path: Path) -> None:
    # A stream checks the views that went in batches (lazyckpt.cow.STREAM_DEFER bytes of them):
    # those still unchecked when it ends are checked then, though a kept view holds the mapping.
    from lazyckpt.cow import STREAM_DEFER

    # TP-2 rank 0: the first half of each tensor, 1 MiB views 1 MiB apart (a view next to one
    # that went, sharing a page with it, has it checked first: see
    # test_a_later_view_of_the_same_bytes_sees_the_file).
    full = {f"w{i:02d}": torch.full((512, 1024), float(i)) for i in range(12)}
    assert STREAM_DEFER > 11 * (1 << 20)  # all of them wait for the end of the stream
    save_file(full, tmp_path / "m.safetensors")
    want = {k: v[:256] + 1.0 for k, v in full.items()}  # made before the baseline is taken
    loader = lazyckpt.get_model_checkpoint_loader()
    options = lazyckpt.ModelCheckpointLoadOptions(layout=lazyckpt.Layout(tp_size=2, tp_rank=0))
    gc.collect()
    base = _rss_anon()
    kept = None
    stream = loader.lazy_load(tmp_path / "m.safetensors", dict.fromkeys(full, 0), options)
    for key, t in stream:
        if kept is None:
            kept = t  # never written: keeps the mapping
            continue
        t.add_(1.0)
        assert torch.equal(t, want[key])
        del t
    gc.collect()
    assert _rss_anon() - base < 4 << 20, (_rss_anon() - base) >> 20
    assert kept is not None and torch.equal(kept, want["w00"] - 1.0)


@linux
@pytest.mark.parametrize("kw", [{"contiguous": True}, {"dtype": torch.bfloat16}])
def test_a_written_view_followed_only_by_copies_is_given_back_midway(
    tmp_path: Path, kw: dict
) -> None:
    # The views that went are checked for writes before the next batch of views, or when the
    # next view is made: a stream whose later keys are all copies (strided keys with
    # contiguous=True; a cast, which leaves only the integer key a view) kept the written
    # pages to its end.
    sd: dict[str, torch.Tensor] = {"buf": torch.arange(8 << 20)}  # 64 MiB of int64: a view
    for i in range(8):
        sd[f"w{i}"] = torch.randn(256, 256).t()  # saved transposed
    torch.save(sd, tmp_path / "m.pt")
    want = sd["buf"] + 1  # made before the baseline is taken
    options = lazyckpt.ModelCheckpointLoadOptions(prefetch_bytes=0, **kw)
    gc.collect()
    base = _rss_anon()
    after = []
    for key, t in lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.pt", {}, options):
        if key == "buf":
            t.add_(1)
            assert torch.equal(t, want)
        del t
        after.append(_rss_anon() - base)
    assert after[0] > 48 << 20  # the view's written pages, private until checked
    assert max(after[1:]) < 16 << 20, [a >> 20 for a in after]


@linux
def test_writes_a_live_view_can_see_are_kept(tmp_path: Path) -> None:
    # Neighbours that share pages at their seams, and a key saved as part of another (a copy,
    # not a second view of the same bytes: see test_tied_keys_hold_the_file_whatever_was_written):
    # dropping one never undoes what was written into another that is still alive.
    w = torch.randn(4096, 33)
    sd = {"all": w, "tail": w[1000:], "a": torch.randn(777), "b": torch.randn(1234)}
    sd.update({f"s{i}": torch.randn(300 + i) for i in range(20)})
    torch.save(sd, tmp_path / "m.pt")
    kept: dict[str, torch.Tensor] = {}
    stream = lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.pt", {})
    for i, (key, t) in enumerate(stream):
        t.add_(100.0)  # written into: private pages made
        if key == "all" or (key != "tail" and i % 2):
            kept[key] = t
        del t
        gc.collect()
    want = {k: v + 100.0 for k, v in sd.items() if k in kept}
    assert "tail" not in kept and len(kept) > 10
    for key, t in kept.items():
        assert torch.equal(t, want[key]), key


@linux
def test_a_later_view_of_the_same_bytes_sees_the_file(tmp_path: Path) -> None:
    # "tail" is saved as a slice of "all": written into and dropped, "all" must leave nothing
    # behind for "tail" to show, not even at the pages of its ends (a torn tensor).
    w = torch.arange(4096 * 33, dtype=torch.float32).view(4096, 33)
    torch.save({"all": w, "tail": w[1000:]}, tmp_path / "m.pt")
    seen = {}
    for key, t in lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.pt", {}):
        if key == "all":
            t.add_(100.0)
        else:
            seen[key] = t.clone()
        del t
        gc.collect()
    assert torch.equal(seen["tail"], w[1000:])


def _tied_state_dict() -> dict[str, torch.Tensor]:
    """Keys over one storage, as ``torch.save(model.state_dict())`` writes tied weights, with
    neighbours sharing pages with them."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 1024, generator=g)
    return {
        "a": big,
        "n1": torch.randn(300, generator=g),
        "a_tied": big,
        "a_row0": big[0],
        "a_cols": big[:, 3:17],
        "a_t": big.t(),
        "n2": torch.randn(5000, generator=g),
    }


@linux
@pytest.mark.parametrize(
    ("how", "contiguous", "prefetch"),
    [
        ("scale, drop", False, None),
        ("zero, drop", False, None),
        ("first row, drop", False, None),
        ("scale, keep the loop variable", False, None),
        ("zero, drop", True, None),
        ("zero, drop", True, 0),
        ("scale, keep all", False, 0),
    ],
)
def test_tied_keys_hold_the_file_whatever_was_written(
    tmp_path: Path, how: str, contiguous: bool, prefetch: int | None
) -> None:
    # A consumer that writes into each tensor (in place, in whole or in part) and drops it, or
    # keeps it: every key over the same bytes still comes out as the file holds it, as with
    # mmap=False, never with some of another key's writes (a torn tensor) nor all of them (an
    # in-place transform applied twice).
    sd = _tied_state_dict()
    torch.save(sd, tmp_path / "m.pt")
    want = torch.load(tmp_path / "m.pt", weights_only=True)
    want = {k: v.clone() for k, v in want.items()}
    options = lazyckpt.ModelCheckpointLoadOptions(contiguous=contiguous)
    if prefetch is not None:
        options = lazyckpt.ModelCheckpointLoadOptions(contiguous=contiguous, prefetch_bytes=prefetch)
    kept = []
    got = {}
    for key, t in lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.pt", {}, options):
        got[key] = torch.equal(t, want[key])
        if how.startswith("scale"):
            t.mul_(0.5)
        elif how.startswith("zero"):
            t.zero_()
        else:
            t[0] = 0
        if how.endswith("keep all"):
            kept.append(t)
        elif how.endswith("drop"):
            del t
            gc.collect()
    assert got == dict.fromkeys(sd, True)


@linux
def test_a_view_is_not_made_over_bytes_the_worker_is_copying(tmp_path: Path) -> None:
    # An MP-2 set whose files tie "a" (split on dim 0) to "b" (split on dim 1); FSDP rank 0 of
    # 2 gets file 0's "a" whole, a view the caller makes, and rows of "b" from both files, a
    # copy from the mappings the prefetch worker makes meanwhile. The consumer zeroes "a" at
    # once: "b" must still be the file's (it was zeroed in part in about half the loads while
    # the view could be made over bytes being copied). The claims themselves are checked
    # deterministically in test_claims.py.
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(512, 512, generator=g) for _ in range(2)]
    for r, part in enumerate(shards):
        torch.save({"a": part, "b": part}, tmp_path / f"consolidated.{r:02d}.pth")
    want_a = torch.chunk(torch.cat(shards, 0), 2, 0)[0]
    want_b = torch.chunk(torch.cat(shards, 1), 2, 0)[0]
    options = lazyckpt.ModelCheckpointLoadOptions(layout=lazyckpt.Layout(dp_size=2, dp_rank=0))
    loader = lazyckpt.get_model_checkpoint_loader()
    wrong = 0
    for _ in range(12):
        for key, t in loader.lazy_load(tmp_path, {"a": 0, "b": 1}, options):
            if key == "a":
                assert torch.equal(t, want_a)
                t.zero_()
            else:
                wrong += not torch.equal(t, want_b)
            del t
    assert wrong == 0


@linux
def test_keys_side_by_side_in_one_storage_are_views(tmp_path: Path) -> None:
    # q, k, v saved as qkv.split(n, dim=1) without a clone share a storage but no byte: three
    # strided views, each written into without touching the others.
    qkv = torch.randn(256, 3 * 64)
    q, k, v = qkv.split(64, dim=1)
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "m.pt")
    want = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    stats = lazyckpt.LoadStats()
    options = lazyckpt.ModelCheckpointLoadOptions(stats=stats)
    kept = {}
    for key, t in lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.pt", {}, options):
        assert torch.equal(t, want[key]), key
        t.add_(1.0)
        kept[key] = t
    assert stats.views == 3
    for key, t in kept.items():
        assert torch.equal(t, want[key] + 1.0), key


@linux
@pytest.mark.filterwarnings("ignore::lazyckpt.ShardDimsWarning")
def test_replica_checks_claim_no_bytes(tmp_path: Path) -> None:
    # A replicated key compared across rank files is read for the comparison only: a later key
    # over the same bytes (here the whole matrix it was saved from) is still a view.
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(64, 128, generator=g)
    for r in range(2):
        torch.save({"small": whole[:, :8], "big": whole}, tmp_path / f"consolidated.{r:02d}.pth")
    stats = lazyckpt.LoadStats()
    options = lazyckpt.ModelCheckpointLoadOptions(stats=stats, verify_replicas_max_bytes=16 << 10)
    got = dict(lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, {}, options))
    assert torch.equal(got["small"], whole[:, :8]) and torch.equal(got["big"], whole)
    assert stats.bytes_verified > 0  # "small" was compared
    assert stats.views == 1  # "big" (32 KiB, past the verify bound) is a view


@linux
@pytest.mark.parametrize("tp_size", [1, 8])
def test_strided_views_written_in_place_hold_one_batch_of_pages(
    tmp_path: Path, tp_size: int
) -> None:
    # A TP dim-1 view is strided: written in place, every page of its span is copied, not only
    # its box's. The stream's batches of views count the bytes the views span, so the pages
    # written stay within one batch whatever the layout (before: 32 views of 4 MiB spans, for
    # 512 KiB boxes, were held at once).
    from lazyckpt.loader import _AHEAD_BYTES

    g = torch.Generator().manual_seed(0)
    keys = [f"w{i:02d}" for i in range(40)]
    save_file({k: torch.randn(1024, 1024, generator=g) for k in keys}, tmp_path / "m.safetensors")
    options = lazyckpt.ModelCheckpointLoadOptions(layout=lazyckpt.Layout(tp_size=tp_size, tp_rank=0))
    loader = lazyckpt.get_model_checkpoint_loader()
    gc.collect()
    base = peak = _rss_anon()
    for _, t in loader.lazy_load(tmp_path / "m.safetensors", dict.fromkeys(keys, 1), options):
        t.mul_(0.5)
        del t
        peak = max(peak, _rss_anon())
    assert peak - base < _AHEAD_BYTES + 2 * (4 << 20), (peak - base) >> 20


_FORKED = """
import os, sys, torch, lazyckpt
path = sys.argv[1]
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
def stream():
    base = peak = anon()
    for _, t in lazyckpt.get_model_checkpoint_loader().lazy_load(path, {}):
        t.mul_(0.5)
        del t
        peak = max(peak, anon())
    return peak - base
stream()  # the parent reads its page map first
pid = os.fork()
if pid == 0:
    torch.set_num_threads(1)
    print(stream(), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


@linux
def test_a_forked_child_reads_its_own_page_map(tmp_path: Path) -> None:
    # The page map's descriptor, inherited, still reads the parent's map: the child's written
    # pages would pass for clean ones and stay.
    from lazyckpt.loader import _AHEAD_BYTES

    save_file(  # 8 MiB each, 192 MiB in all: three batches of views
        {f"w{i:02d}": torch.full((1024, 2048), float(i)) for i in range(24)},
        tmp_path / "m.safetensors",
    )
    done = subprocess.run(
        [sys.executable, "-c", _FORKED, str(tmp_path / "m.safetensors")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(done.stdout.split()[-1]) < _AHEAD_BYTES + 2 * (8 << 20), done.stdout


@linux
@pytest.mark.parametrize("tp_rank", [None, 1])
def test_views_taken_whole_then_written_after_a_collection_give_pages_back(
    tmp_path: Path, tp_rank: int | None
) -> None:
    # The stream is taken first (the reader closes), a collection runs, then each view is
    # rescaled and dropped: the bookkeeping must outlive the reader. A TP column view holds one
    # column block of each row: its written pages are found by a byte it holds, not the
    # middle of its span (another rank's columns).
    full = {f"w{i:02d}": torch.full((1024, 4096), float(i)) for i in range(12)}  # 16 MiB
    save_file(full, tmp_path / "m.safetensors")
    layout = lazyckpt.Layout() if tp_rank is None else lazyckpt.Layout(tp_size=4, tp_rank=tp_rank)
    dims = {} if tp_rank is None else {k: 1 for k in full}
    options = lazyckpt.ModelCheckpointLoadOptions(layout=layout)
    views = dict(
        lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", dims, options)
    )
    gc.collect()
    one = views["w00"].numel() * 4
    base = peak = _rss_anon()
    for key in sorted(views):
        t = views.pop(key)
        t.mul_(0.5)
        assert t[0, 0].item() == int(key[1:]) * 0.5
        del t
        peak = max(peak, _rss_anon())
    assert peak - base < 3 * one + (4 << 20), (peak - base) >> 20


def test_copies_from_the_mapping_watch_nothing_views_do(tmp_path: Path) -> None:
    # load_into copies column blocks from the mapping and hands out no view: nothing of its
    # views is watched (and nothing to close). A view made later watches the mapping.
    from lazyckpt.loaders import detect_loader
    from lazyckpt.plan import Piece
    from lazyckpt.read import Reader

    full = torch.arange(64 * 96, dtype=torch.float32).view(64, 96)
    path = tmp_path / "m.safetensors"
    save_file({"w": full}, path)
    (chunk,) = detect_loader(path).index(path).entries["w"].chunks
    with Reader() as reader:
        columns = Piece(0, (0, 32), (0, 0), (64, 32))  # rows of 128 B: copied from the mapping
        dst = torch.zeros(64, 32)
        reader.copy(chunk, torch.float32, columns, dst, "w")
        assert torch.equal(dst, full[:, 32:64])
        (opened,) = reader._files.values()
        assert opened.flats and opened.pages is None
        view = reader.view(chunk, torch.float32, Piece(0, (8, 0), (0, 0), (8, 96)), "w")
        assert view is not None and torch.equal(view, full[8:16])
        assert opened.pages is not None


@linux
def test_one_page_map_read_tells_written_pages_as_reads_of_each(tmp_path: Path) -> None:
    # _written_many reads the page map once for addresses close together: its answers must be
    # those of a read per address, for pages written, read only, and never touched.
    import mmap

    from lazyckpt.cow import _ONE_READ_PAGES, _written, _written_many

    page = mmap.PAGESIZE
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * (3 * _ONE_READ_PAGES * page // 256))
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    buf = (ctypes.c_char * len(m)).from_buffer(m)
    try:
        base = ctypes.addressof(buf)
        for p in (0, 3, 5, 40):
            m[p * page + 7] = 1  # a private copy
        for p in (1, 4, 6):
            assert m[p * page + 9] == 9  # read: still the file's page
        near = [base + p * page + 11 for p in (0, 1, 2, 3, 4, 5, 6, 40)]
        far = [*near, base + 2 * _ONE_READ_PAGES * page + 5]  # past one read: a read each
        for addresses in (near, far, near[:1], []):
            got = _written_many(addresses)
            assert got == [_written(at) for at in addresses]
        assert _written_many(near) == [True, False, False, True, False, True, False, True]
    finally:
        del buf
        m.close()


@linux
def test_small_views_written_in_place_are_given_back_in_batches(tmp_path: Path) -> None:
    # 4,096 keys of 16 KiB (64 MiB), each rescaled in place and dropped: the stream checks the
    # views that went, a batch at a time, with one read of the page map (_written_many), and
    # gives their pages back. Nothing given back would be the whole 64 MiB.
    g = torch.Generator().manual_seed(0)
    full = {f"w{i:04d}": torch.randn(64, 64, generator=g) for i in range(4096)}
    save_file(full, tmp_path / "m.safetensors")
    total = sum(t.nbytes for t in full.values())
    loader = lazyckpt.get_model_checkpoint_loader()
    gc.collect()
    base = peak = _rss_anon()
    for n, (key, t) in enumerate(loader.lazy_load(tmp_path / "m.safetensors", {})):
        t.mul_(0.5)
        assert torch.equal(t, full[key] * 0.5)
        del t
        if n % 64 == 0:
            peak = max(peak, _rss_anon())
    assert peak - base < total // 4, (peak - base) >> 20
