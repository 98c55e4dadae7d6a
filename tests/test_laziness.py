"""Validate eagerly, stream lazily: errors come from ``lazy_load()`` itself, tensor bytes are
read only by ``next()``, and a file with no byte of the target is never opened."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import expected, opened_files, same_bits, write_checkpoint
from safetensors.torch import save_file

import lazyckpt


def _overwrite_in_place(src: Path, dst: Path) -> None:
    """Copy ``src``'s bytes over ``dst`` keeping its inode (what a mapping would see) and its
    modification time: the load refuses a file that changed since it was indexed, and this
    change is one it must not see, to show what it read after the call."""
    data = src.read_bytes()
    st = dst.stat()
    assert len(data) == st.st_size
    with open(dst, "r+b") as f:
        f.write(data)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("kind", ["safetensors-index", "torch-folder", "torch-file"])
def test_no_tensor_data_is_read_before_the_first_yield(tmp_path: Path, kind: str) -> None:
    shapes = {"a": (64, 8), "b": (33,), "c": (5, 7)}
    old = {k: torch.zeros(s) for k, s in shapes.items()}
    new = {k: torch.randn(s) for k, s in shapes.items()}
    path = write_checkpoint(kind, old, tmp_path / "ckpt")
    write_checkpoint(kind, new, tmp_path / "other")
    stats = lazyckpt.LoadStats()
    opts = lazyckpt.ModelCheckpointLoadOptions(
        stats=stats, layout=lazyckpt.Layout(tp_size=2, tp_rank=1)
    )
    stream = lazyckpt.get_model_checkpoint_loader().lazy_load(path, {"a": 0}, opts)
    assert stats.total_bytes_read == 0
    # Same names, shapes and dtypes: only tensor bytes differ, so metadata offsets still hold.
    root = path if path.is_dir() else path.parent
    for f in sorted(p for p in root.iterdir() if p.is_file()):
        twin = tmp_path / "other" / f.name
        if twin.exists() and not f.name.endswith(".json"):
            _overwrite_in_place(twin, f)
    got = {k: v.clone() for k, v in stream}
    for k in shapes:
        assert same_bits(got[k], expected(new[k], {"a": 0}.get(k), opts.layout)), k


def test_a_file_without_target_bytes_is_never_opened_while_streaming(tmp_path: Path) -> None:
    # Key "tail" has 5 rows: TP-8 ranks 5..7 receive none of it, so its file is not opened.
    parts = [{"big": torch.randn(64, 4)}, {"tail": torch.randn(5, 4)}]
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for part, name in zip(parts, names):
        save_file(part, tmp_path / name)
    weight_map = {"big": names[0], "tail": names[1]}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    dims = {"big": 0, "tail": 0}
    for rank, touched in ((6, {names[0]}), (1, set(names))):
        opts = lazyckpt.ModelCheckpointLoadOptions(layout=lazyckpt.Layout(tp_size=8, tp_rank=rank))
        stream = lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, dims, opts)
        with opened_files() as seen:
            got = {k: v.clone() for k, v in stream}
        assert {Path(p).name for p in seen} == touched
        assert got["tail"].shape[0] == (1 if rank == 1 else 0)


def test_a_file_gone_while_streaming_fails_at_its_first_key(tmp_path: Path) -> None:
    # The stream finds views ahead of the one it yields: an error found early (a file deleted
    # after lazy_load() indexed it) is still raised at its own key, after the keys before it.
    parts = [{"a": torch.randn(64, 4), "b": torch.randn(8)}, {"c": torch.randn(16, 4)}]
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for part, name in zip(parts, names):
        save_file(part, tmp_path / name)
    weight_map = {k: name for part, name in zip(parts, names) for k in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    stream = lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, {})
    (tmp_path / names[1]).unlink()
    got = {}
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="the file is gone") as err:
        for k, v in stream:
            got[k] = v.clone()
    assert names[1] in str(err.value)
    assert sorted(got) == ["a", "b"]
    assert all(torch.equal(got[k], parts[0][k]) for k in got)


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("how", ["replaced", "rewritten"])
def test_a_file_changed_after_indexing_is_refused_not_misread(
    tmp_path: Path, mmap: bool, how: str
) -> None:
    # The reader opens each file by path when it first reads from it: one replaced meanwhile
    # (a sync tool's write-then-rename) was read at the old header's offsets, wrong tensors
    # and no error.
    import time

    first = {f"a{i:02d}": torch.randn(64, 4) for i in range(40)}  # past the views made ahead
    parts = [first, {"c": torch.randn(16, 4), "d": torch.randn(16, 4)}]
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for part, name in zip(parts, names):
        save_file(part, tmp_path / name)
    weight_map = {k: name for part, name in zip(parts, names) for k in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    options = lazyckpt.ModelCheckpointLoadOptions(mmap=mmap, prefetch_bytes=0)
    stream = lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, {}, options)
    key, _ = next(stream)
    new = {"zz": torch.zeros(3), "c": torch.randn(16, 4), "d": torch.randn(16, 4)}  # other offsets
    if how == "replaced":
        save_file(new, tmp_path / "new.safetensors")
        os.replace(tmp_path / "new.safetensors", tmp_path / names[1])
    else:
        time.sleep(0.01)  # a modification time of its own, on coarse clocks too
        save_file(new, tmp_path / names[1])
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="the file changed since") as err:
        for _k, _v in stream:
            pass
    assert key == "a00" and names[1] in str(err.value)


def test_a_file_replaced_while_it_is_indexed_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The files were stamped after the index was built: one replaced while its header was
    # parsed (seconds, for a large one) was stamped as the new file, and read at the old
    # offsets.
    from lazyckpt.loaders.safetensors import SafetensorsCheckpointLoader

    save_file({"a": torch.randn(64, 4)}, tmp_path / "m.safetensors")
    save_file({"zz": torch.zeros(3), "a": torch.randn(64, 4)}, tmp_path / "new.safetensors")
    build = SafetensorsCheckpointLoader.build_index

    def build_then_replace(self: Any, *args: Any) -> Any:
        index = build(self, *args)
        os.replace(tmp_path / "new.safetensors", tmp_path / "m.safetensors")
        return index

    monkeypatch.setattr(SafetensorsCheckpointLoader, "build_index", build_then_replace)
    stream = lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", {})
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="the file changed since"):
        next(stream)


def test_bad_calls_fail_before_the_first_next(tmp_path: Path) -> None:
    loader = lazyckpt.get_model_checkpoint_loader()
    with pytest.raises(FileNotFoundError, match="no-such"):
        loader.lazy_load(tmp_path / "no-such.safetensors", {})
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"notes\.txt"):
        loader.lazy_load(tmp_path / "notes.txt", {})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="empty"):
        loader.lazy_load(empty, {})
    save_file({"w": torch.zeros(4, 4)}, tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match=r"shard_dims\['w'\] = 2 is out of range"):
        loader.lazy_load(tmp_path / "m.safetensors", {"w": 2})
    with pytest.raises(ValueError, match="must be an int"):
        loader.lazy_load(tmp_path / "m.safetensors", {"w": "0"})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp_size": 0}, "tp_size must be >= 1"),
        ({"tp_size": 4, "tp_rank": 4}, "tp_rank must be in"),
        ({"dp_size": 2, "dp_rank": -1}, "dp_rank must be in"),
        ({"tp_size": 2.0}, "must be an int"),
        ({"dp_size": True}, "must be an int"),
    ],
)
def test_impossible_layouts_are_value_errors(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lazyckpt.Layout(**fields)  # type: ignore[arg-type]


def test_bad_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match=r"options\.dtype"):
        lazyckpt.ModelCheckpointLoadOptions(dtype="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"options\.prefetch_bytes"):
        lazyckpt.ModelCheckpointLoadOptions(prefetch_bytes=-1)
    with pytest.raises(ValueError, match=r"options\.layout"):
        lazyckpt.ModelCheckpointLoadOptions(layout=(2, 0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"options\.device"):
        lazyckpt.ModelCheckpointLoadOptions(device="warp-drive")


def test_options_that_are_not_options_are_refused_by_name(tmp_path: Path) -> None:
    # A dict of fields failed deep inside: "'dict' object has no attribute 'target_layout'".
    save_file({"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}, tmp_path / "m.safetensors")
    loader = lazyckpt.get_model_checkpoint_loader()
    fix = r"ModelCheckpointLoadOptions\(\*\*options\)"
    with pytest.raises(TypeError, match=f"got a dict; write {fix}"):
        loader.lazy_load(tmp_path / "m.safetensors", {}, {"mmap": False})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=f"got a dict; write {fix}"):
        lazyckpt.load_into(
            torch.nn.Linear(3, 2), tmp_path / "m.safetensors", options={"mmap": False}  # type: ignore[arg-type]
        )
    with pytest.raises(TypeError, match=r"got a Layout$"):
        loader.lazy_load(tmp_path / "m.safetensors", {}, lazyckpt.Layout())  # type: ignore[arg-type]


def test_closing_the_stream_early_stops_the_prefetcher(tmp_path: Path) -> None:
    save_file({f"k{i}": torch.randn(256, 64) for i in range(20)}, tmp_path / "m.safetensors")
    opts = lazyckpt.ModelCheckpointLoadOptions(prefetch_bytes=1 << 20, dtype=torch.float16)
    stream = lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", {}, opts)
    first = next(stream)
    stream.close()  # type: ignore[attr-defined]
    import threading

    assert not any(t.name == "lazyckpt-prefetch" for t in threading.enumerate())
    assert first[0] == "k0"
    shutil.rmtree(tmp_path)  # nothing holds the files open


def _open_under(folder: Path) -> int:
    """This process's file descriptors open on files under ``folder``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder))
    return count


@pytest.mark.parametrize("how", ["close", "break", "consumer-error"])
@pytest.mark.parametrize("mmap", [True, False])
def test_a_stream_left_early_leaves_no_file_open_and_no_tensor_alive(
    tmp_path: Path, how: str, mmap: bool
) -> None:
    # The prefetch worker is mid-build when the stream is left: it must be joined before the
    # reader closes its files (else it reopens them into a closed reader), and what it built
    # must not be kept (a slot stored after the queue was cleared was held for good).
    from lazyckpt import prefetch

    save_file({f"k{i}": torch.randn(512, 256) for i in range(24)}, tmp_path / "m.safetensors")
    opts = lazyckpt.ModelCheckpointLoadOptions(
        mmap=mmap, dtype=torch.float16, prefetch_bytes=4 << 20
    )
    for _ in range(8):
        stream = lazyckpt.get_model_checkpoint_loader().lazy_load(
            tmp_path / "m.safetensors", {}, opts
        )
        if how == "close":
            next(stream)
            stream.close()  # type: ignore[attr-defined]
        elif how == "break":
            for _key, _tensor in stream:
                break
            del stream
        else:
            with pytest.raises(RuntimeError, match="consumer"):
                for _key, _tensor in stream:
                    raise RuntimeError("consumer")
            del stream
    gc.collect()
    assert _open_under(tmp_path) == 0
    states = [o for o in gc.get_objects() if type(o) is prefetch._State]
    assert not [st for st in states if st.ready], "prefetched tensors kept after the stream ended"


def test_a_ctrl_c_while_closing_one_file_still_closes_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reader closed its files one after the other: a KeyboardInterrupt in one close left
    # the descriptors of every file after it open for the life of the process.
    from lazyckpt import read

    for r in range(4):
        save_file({f"k{r}": torch.randn(64, 64)}, tmp_path / f"m-{r}.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"k{r}": f"m-{r}.safetensors" for r in range(4)}})
    )
    close = read._OpenFile.close
    interrupted = []

    def close_then_interrupt(self: read._OpenFile) -> None:
        close(self)
        if not interrupted:
            interrupted.append(self)
            raise KeyboardInterrupt

    monkeypatch.setattr(read._OpenFile, "close", close_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        for _key, _tensor in lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, {}):
            pass
    del _tensor
    gc.collect()
    assert interrupted and _open_under(tmp_path) == 0


def _mapped(path: Path) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(str(path)) for line in f)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps: Linux")
def test_views_made_ahead_are_counted_when_handed_out_and_dropped_with_the_stream(
    tmp_path: Path,
) -> None:
    # The stream makes the views of a batch of keys before it hands out the first: bytes read
    # count the views handed out, not the ones made ahead, and closing the stream early drops
    # the rest (the mapping goes with the last of them).
    from lazyckpt import unmap

    full = {f"k{i}": torch.randn(64, 32) for i in range(10)}
    save_file(full, tmp_path / "m.safetensors")
    stats = lazyckpt.LoadStats()
    opts = lazyckpt.ModelCheckpointLoadOptions(stats=stats)
    stream = lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", {}, opts)
    key, t = next(stream)
    assert key == "k0" and torch.equal(t, full["k0"])
    assert (stats.views, stats.total_bytes_read) == (1, t.nbytes)
    stream.close()  # type: ignore[attr-defined]
    assert stats.total_bytes_read == t.nbytes
    assert _mapped(tmp_path / "m.safetensors")  # the view in hand keeps the mapping
    del t
    gc.collect()
    unmap.wait()
    assert not _mapped(tmp_path / "m.safetensors")


def test_a_stats_object_reused_sums_the_loads_times_not_the_time_between(
    tmp_path: Path,
) -> None:
    # seconds ran from the first load's start: a LoadStats reused after a pause counted the
    # pause, and summary() showed a rate hundreds of times too low.
    import time

    save_file({"w": torch.randn(64, 64)}, tmp_path / "m.safetensors")
    stats = lazyckpt.LoadStats()
    opts = lazyckpt.ModelCheckpointLoadOptions(stats=stats)
    loader = lazyckpt.get_model_checkpoint_loader()
    list(loader.lazy_load(tmp_path / "m.safetensors", {}, opts))
    first = stats.seconds
    time.sleep(0.5)
    began = time.perf_counter()
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.empty(64, 64))
    report = lazyckpt.load_into(model, tmp_path / "m.safetensors", options=opts)
    second = time.perf_counter() - began
    assert report.stats is stats and stats.tensors == 2
    assert first < stats.seconds <= first + second


def test_a_loads_time_counts_its_metadata_work_not_the_wait_for_its_first_tensor(
    tmp_path: Path,
) -> None:
    # The clock started at the stream's first tensor asked for (load_into's at its first
    # read): indexing and planning, a good part of a many-key load, were left out of seconds
    # and summary()'s GB/s. A key_map that takes 0.3 s stands in for a slow index.
    import time

    save_file({"w": torch.randn(64, 64)}, tmp_path / "m.safetensors")
    slow = []

    def key_map(key: str) -> str:
        if not slow:
            slow.append(key)
            time.sleep(0.3)
        return key

    loader = lazyckpt.get_model_checkpoint_loader()
    stats = lazyckpt.LoadStats()
    began = time.perf_counter()
    stream = loader.lazy_load(
        tmp_path / "m.safetensors", {}, lazyckpt.ModelCheckpointLoadOptions(stats=stats, key_map=key_map)
    )
    time.sleep(0.5)  # the caller's time, between the call and the first tensor
    assert len(list(stream)) == 1
    assert 0.3 <= stats.seconds <= time.perf_counter() - began - 0.5
    slow.clear()
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.empty(64, 64))
    stats = lazyckpt.LoadStats()
    began = time.perf_counter()
    lazyckpt.load_into(
        model, tmp_path / "m.safetensors", options=lazyckpt.ModelCheckpointLoadOptions(stats=stats, key_map=key_map)
    )
    assert 0.3 <= stats.seconds <= time.perf_counter() - began
    # A load_into that fills nothing (no key in common) still took its time.
    slow.clear()
    stats = lazyckpt.LoadStats()
    other = torch.nn.Module()
    other.v = torch.nn.Parameter(torch.empty(2))
    options = lazyckpt.ModelCheckpointLoadOptions(stats=stats, key_map=key_map)
    lazyckpt.load_into(other, tmp_path / "m.safetensors", options=options, strict=False)
    assert stats.tensors == 0 and stats.seconds >= 0.3


def test_a_stats_object_given_to_loads_that_overlap_counts_their_common_time_once(
    tmp_path: Path,
) -> None:
    # Each load's start reset the one clock: a load that began first, overlapped by a second
    # that came and went, lost its time before the second's start.
    import time

    save_file({"a": torch.randn(64, 64), "b": torch.randn(64, 64)}, tmp_path / "m.safetensors")
    stats = lazyckpt.LoadStats()
    opts = lazyckpt.ModelCheckpointLoadOptions(stats=stats)
    loader = lazyckpt.get_model_checkpoint_loader()
    began = time.perf_counter()
    outer = loader.lazy_load(tmp_path / "m.safetensors", {}, opts)
    next(outer)
    time.sleep(0.3)
    assert len(list(loader.lazy_load(tmp_path / "m.safetensors", {}, opts))) == 2
    assert len(list(outer)) == 1
    assert 0.3 <= stats.seconds <= time.perf_counter() - began
    assert stats.tensors == 4
    # A stream left suspended after its last tensor (kept in a notebook) adds nothing: a load
    # a second later counts its own time, not the second.
    idle = lazyckpt.LoadStats()
    opts = lazyckpt.ModelCheckpointLoadOptions(stats=idle)
    kept = loader.lazy_load(tmp_path / "m.safetensors", {}, opts)
    next(kept)
    first = idle.seconds
    time.sleep(1.0)
    began = time.perf_counter()
    assert len(list(loader.lazy_load(tmp_path / "m.safetensors", {}, opts))) == 2
    assert idle.seconds <= first + (time.perf_counter() - began)
    kept.close()
    # A copy is a snapshot: loading into it leaves the original's time as it was.
    import copy
    import dataclasses

    for snapshot in (copy.copy(stats), dataclasses.replace(stats)):
        before = stats.seconds
        assert snapshot.seconds == before
        opts = lazyckpt.ModelCheckpointLoadOptions(stats=snapshot)
        time.sleep(0.05)
        assert len(list(loader.lazy_load(tmp_path / "m.safetensors", {}, opts))) == 2
        assert stats.seconds == before and snapshot.seconds > before


_CAST_PEAK = """
import gc, sys, threading, time
import torch, lazyckpt

def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10

path, mmap = sys.argv[1], sys.argv[2] == "1"
opts = lazyckpt.ModelCheckpointLoadOptions(mmap=mmap, dtype=torch.bfloat16, prefetch_bytes=0)
stream = lazyckpt.get_model_checkpoint_loader().lazy_load(path, {}, opts)
gc.collect()
base = peak = rss_anon()
done = threading.Event()

def sample():
    global peak
    while not done.is_set():
        peak = max(peak, rss_anon())
        time.sleep(0.0005)

sampler = threading.Thread(target=sample)
sampler.start()
largest = 0
for _key, tensor in stream:
    largest = max(largest, tensor.nbytes)
    del tensor
done.set()
sampler.join()
print(largest, peak - base)
"""


@pytest.mark.parametrize("source", ["safetensors", "dcp"])
@pytest.mark.parametrize("mmap", [True, False])
def test_a_cast_holds_no_full_size_temporary(tmp_path: Path, source: str, mmap: bool) -> None:
    # fp32 -> bf16 with no read-ahead: a read with pread, or a copy from a DCP chunk whose
    # elements are not aligned, goes through a temporary of the source dtype: in slabs, it
    # stays small (a whole one would be 2x the target, 3x in all).
    sd = {f"w{i}": torch.randn(4096, 2048) for i in range(2)}  # 32 MiB fp32, 16 MiB targets
    if source == "safetensors":
        path = tmp_path / "m.safetensors"
        save_file(sd, path)
    else:
        import torch.distributed.checkpoint as dcp

        path = tmp_path / "dcp"
        dcp.save({"pad": torch.ones(3, dtype=torch.uint8), **sd}, checkpoint_id=path, no_dist=True)
    out = subprocess.run(
        [sys.executable, "-c", _CAST_PEAK, str(path), "1" if mmap else "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    largest, growth = int(out[0]), int(out[1])
    assert largest == 16 << 20
    assert growth <= largest + (20 << 20), (growth >> 20, "MiB")


def test_copied_tensors_pickle_and_deep_copy_like_any_tensor(tmp_path: Path) -> None:
    # Buffers of 2 MiB and more are mappings of their own; what keeps them alive must not ride
    # in the tensor's __dict__, which torch.save, pickle and deepcopy take along.
    import copy
    import io
    import pickle

    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(16, generator=g)}
    save_file(full, tmp_path / "m.safetensors")
    opts = lazyckpt.ModelCheckpointLoadOptions(dtype=torch.bfloat16)  # every tensor a copy
    sd = dict(
        lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", {}, opts)
    )
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    for again in (
        torch.load(buf, weights_only=True),
        pickle.loads(pickle.dumps(sd)),
        copy.deepcopy(sd),
    ):
        assert all(same_bits(again[k], sd[k]) for k in full)

    class WithBuffer(torch.nn.Module):  # load_into installs a meta buffer's new tensor as is
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", torch.empty(1024, 1024))

    with torch.device("meta"):
        model = WithBuffer()
    save_file({"w": full["w"]}, tmp_path / "w.safetensors")
    lazyckpt.load_into(model, tmp_path / "w.safetensors")
    assert torch.equal(copy.deepcopy(model).w, full["w"])


def _open_with_a_close_at(path: Path, at: int) -> int:
    """Open ``path`` in a new reader whose ``at``-th hash of the path closes the reader (as the
    collector would, on this thread); close it, and return how many hashes there were."""
    from lazyckpt.read import Reader

    reader = Reader(stamps={})
    calls = 0

    class ClosingPath(type(path)):  # type: ignore[misc]
        def __hash__(self) -> int:
            nonlocal calls
            calls += 1
            if calls == at:
                reader.close()
            return super().__hash__()

    with contextlib.suppress(RuntimeError):  # closed before the file was listed
        reader._open(ClosingPath(path), "w")
    reader.close()
    return calls


def test_a_reader_closed_on_its_own_thread_while_it_opens_a_file_leaks_nothing(
    tmp_path: Path,
) -> None:
    """The collector closes a stream dropped in a reference cycle on whatever thread allocates,
    and from Python 3.12 it runs at the next Python call: hashing a path, while the reader
    opens a file, is one. A file opened across that close was listed in the closed reader and
    its descriptor never closed (seen on 3.13). Here the path's ``at``-th hash closes the
    reader, for every hash that opening the file makes."""
    save_file({"w": torch.zeros(4)}, tmp_path / "m.safetensors")
    at = 0
    while True:
        at += 1
        calls = _open_with_a_close_at(tmp_path / "m.safetensors", at)
        assert _open_under(tmp_path) == 0, f"closed at hash {at} of {calls}"
        if calls < at:  # opened without a close: every point was tried
            break
    assert at > 3


def test_a_closed_file_reads_nothing_of_the_file_that_took_its_descriptor(tmp_path: Path) -> None:
    """A worker still building for a stream closed under it reads through the file it holds; the
    closed file's descriptor number, reused by the next file opened, read that file's bytes."""
    from lazyckpt.read import Reader, _pread_into

    save_file({"w": torch.zeros(256)}, tmp_path / "m.safetensors")
    (tmp_path / "other").write_bytes(b"\xff" * 4096)
    reader = Reader(stamps={})
    f = reader._open(tmp_path / "m.safetensors", "w")
    number = f.fd
    reader.close()
    other = os.open(tmp_path / "other", os.O_RDONLY)
    try:
        if other != number:
            pytest.skip("the other file did not get the closed file's descriptor number")
        buf = bytearray(8)
        with pytest.raises(OSError):
            _pread_into(f, 0, memoryview(buf), "w")
        assert buf == bytearray(8)
        f.close()  # a second close leaves the other file's descriptor open
        assert os.pread(other, 1, 0) == b"\xff"
    finally:
        os.close(other)


def _prefetch_workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lazyckpt-prefetch"]


def test_a_stream_dropped_in_a_reference_cycle_closes_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cyclic collector then closes the stream on whatever thread allocates, often the
    # prefetch worker itself: it may not join itself, and it may not reopen files into the
    # reader that closing shut.
    for f in range(8):
        save_file(
            {f"f{f}.w{i}": torch.randn(256, 256) for i in range(2)}, tmp_path / f"m{f}.safetensors"
        )
    opts = lazyckpt.ModelCheckpointLoadOptions(dtype=torch.float64)  # built on the worker
    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    before = gc.get_threshold()
    workers_before = set(_prefetch_workers())
    gc.set_threshold(50)

    class Holder:
        def __init__(self) -> None:
            self.me = self
            self.stream = lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, {}, opts)

    try:
        for _ in range(60):
            holder = Holder()
            next(holder.stream)
            del holder
    finally:
        gc.set_threshold(*before)
    # gc.collect() returns at once while a collection runs on another thread (a prefetch
    # worker's, waiting to join the worker of a stream it closes): collect until none runs.
    from lazyckpt import unmap

    for _ in range(200):
        gc.collect()
        unmap.wait()
        if not set(_prefetch_workers()) - workers_before:
            break
        time.sleep(0.05)
    gc.collect()
    unmap.wait()
    assert not set(_prefetch_workers()) - workers_before, "a closed stream's worker is left"
    assert unraisable == [], unraisable
    assert _open_under(tmp_path) == 0


def test_a_ctrl_c_opening_a_file_or_closing_its_watch_leaks_nothing_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Opened but not yet listed by the reader, a file's descriptor stayed open for good; a
    # watch of views whose flush was cut kept its mapping (and descriptor) for good. Now the
    # descriptor goes with its object, and the next load flushes the watch its owner left.
    from lazyckpt import cow, read, unmap

    save_file({"k": torch.randn(64, 64)}, tmp_path / "m.safetensors")
    loader = lazyckpt.get_model_checkpoint_loader()

    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(read, "file_stamp", interrupt)
        with pytest.raises(KeyboardInterrupt):
            list(loader.lazy_load(tmp_path / "m.safetensors", {}))
    gc.collect()
    assert _open_under(tmp_path) == 0

    with monkeypatch.context() as patch:
        patch.setattr(cow.PrivatePages, "flush", interrupt)
        with pytest.raises(KeyboardInterrupt):
            for _key, _tensor in loader.lazy_load(tmp_path / "m.safetensors", {}):
                pass
    del _tensor
    gc.collect()
    got = dict(loader.lazy_load(tmp_path / "m.safetensors", {}, lazyckpt.ModelCheckpointLoadOptions(mmap=False)))
    assert set(got) == {"k"}
    gc.collect()
    unmap.wait()
    assert _open_under(tmp_path) == 0 and not _mapped(tmp_path / "m.safetensors")


def _descriptors_of(path: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target == str(path):
                out.append(target)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_ctrl_c_as_the_prefetch_thread_starts_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Thread.start() waits for the thread to run; a Ctrl-C there (seen with real SIGINTs) came
    # before the stream's try: the worker polled for good, holding what it built and the file.
    # Here the interrupt is raised as the signal handler would, once the worker runs.
    from lazyckpt import prefetch, unmap

    torch.save({f"k{i}": torch.full((256, 256), float(i)) for i in range(8)}, tmp_path / "m.pt")
    start = threading.Thread.start

    def interrupted(self: threading.Thread) -> None:
        start(self)
        if self.name == "lazyckpt-prefetch":
            time.sleep(0.05)  # the worker builds meanwhile
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    options = lazyckpt.ModelCheckpointLoadOptions(contiguous=True, prefetch_bytes=1 << 20)
    with pytest.raises(KeyboardInterrupt):
        for _ in lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.pt", {}, options):
            pass
    monkeypatch.undo()
    gc.collect()
    unmap.wait()
    assert not [t for t in threading.enumerate() if t.name == "lazyckpt-prefetch" and t.is_alive()]
    assert not prefetch._RUNNING
    assert _descriptors_of(tmp_path / "m.pt") == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_ctrl_c_right_after_a_file_is_opened_leaks_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Between os.open's return and the finalizer that closes it, a Ctrl-C (seen with real
    # SIGINTs) lost the descriptor for the life of the process. The interrupt is raised here
    # where the signal handler would run, once the open has returned.
    from lazyckpt import fdlimit, read

    save_file({"w": torch.ones(64, 64)}, tmp_path / "m.safetensors")
    opening = fdlimit.opening
    armed = [True]

    def interrupted(path: Path, call: Any, mapped: bool = True) -> Any:
        opened = opening(path, call, mapped)
        if armed and Path(path) == tmp_path / "m.safetensors":
            armed.clear()
            raise KeyboardInterrupt
        return opened

    monkeypatch.setattr(read.fdlimit, "opening", interrupted)
    options = lazyckpt.ModelCheckpointLoadOptions(mmap=False)
    with pytest.raises(KeyboardInterrupt):
        list(lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", {}, options))
    monkeypatch.undo()
    gc.collect()
    assert not armed and _descriptors_of(tmp_path / "m.safetensors") == []


def test_a_stream_kept_to_the_end_of_a_script_exits_without_a_warning(tmp_path: Path) -> None:
    # Closed at interpreter shutdown, when weakref finalizers do nothing, the stream's files
    # were freed unclosed: one ResourceWarning each ("Exception ignored ... unclosed file").
    save_file({f"w{i}": torch.ones(8) for i in range(4)}, tmp_path / "m.safetensors")
    script = (
        "import lazyckpt\n"
        f"stream = lazyckpt.get_model_checkpoint_loader().lazy_load({str(tmp_path / 'm.safetensors')!r}, {{}})\n"
        "print(next(stream)[0])\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::ResourceWarning", "-c", script],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "w0", done.stderr
    assert "ResourceWarning" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


def test_a_file_replaced_by_a_folder_while_streaming_is_named(tmp_path: Path) -> None:
    # open() refuses a folder where os.open took it (and the stamp check named the change):
    # the load ended in a bare IsADirectoryError.
    folder = tmp_path / "hf"
    folder.mkdir()
    index = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    for key, name in index.items():
        save_file({key: torch.ones(4)}, folder / name)
    text = json.dumps({"metadata": {}, "weight_map": index})
    (folder / "model.safetensors.index.json").write_text(text)
    options = lazyckpt.ModelCheckpointLoadOptions(mmap=False, prefetch_bytes=0)
    stream = lazyckpt.get_model_checkpoint_loader().lazy_load(folder, {}, options)
    first, _ = next(stream)
    other = next(k for k in index if index[k] != index[first])
    (folder / index[other]).unlink()
    (folder / index[other]).mkdir()
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="a folder now stands in its place") as info:
        list(stream)
    assert info.value.key == other
