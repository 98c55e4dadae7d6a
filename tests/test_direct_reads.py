"""``load_into`` reads pieces with long runs straight into the parameters with ``preadv`` on two
threads (``Reader.direct_reads``) and copies the rest from the mapping; both give the oracle's
bits, whatever the destination's strides."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import needs_openmp, same_bits
from safetensors.torch import save_file
from torch import nn

import lazyckpt
from lazyckpt import read as read_module
from lazyckpt.index import Chunk, FileRegion
from lazyckpt.loaders import detect_loader
from lazyckpt.plan import Piece
from lazyckpt.read import DirectRead, Reader, _OpenFile, _run_reads


class Wide(nn.Module):
    """Rows of 128 KiB (direct reads), 2 KiB (copies) and a 0-d buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.zeros(64, 32768))  # 8 MiB, rows of 128 KiB
        self.w_out = nn.Parameter(torch.zeros(1024, 512))  # 2 MiB, rows of 2 KiB
        self.register_buffer("scale", torch.tensor(0.0))


def truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w_in": torch.randn(64, 32768, generator=g),
        "w_out": torch.randn(1024, 512, generator=g),
        "scale": torch.tensor(1.5),
    }


@contextlib.contextmanager
def _file_and_reader(path: Path, data: bytes) -> Iterator[tuple[_OpenFile, Reader]]:
    """``path`` written with ``data`` and open for direct reads, and a reader to queue them on;
    both closed on the way out."""
    path.write_bytes(data)
    f = _OpenFile(path)
    reader = Reader()
    try:
        yield f, reader
    finally:
        f.close()
        reader.close()


@pytest.fixture
def preadv_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes asked for by each ``os.preadv`` that reads data (the real one runs); the 1-byte
    probes of the page cache (``RWF_NOWAIT``, see lazyckpt.readahead) are not counted."""
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        if not flags:
            calls.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", counting)
    return calls


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_whole_tensors_are_read_into_place(
    tmp_path: Path, kind: str, preadv_calls: list[int]
) -> None:
    full = truth()
    path = tmp_path / ("m.safetensors" if kind == "safetensors" else "m.pt")
    if kind == "safetensors":
        save_file(full, path)
    else:
        torch.save(full, path)
    model = Wide()
    ptr = model.w_in.data_ptr()
    report = lazyckpt.load_into(model, path)
    assert report.loaded and model.w_in.data_ptr() == ptr
    for name, t in full.items():
        assert same_bits(model.state_dict()[name], t), name
    assert sum(preadv_calls) >= full["w_in"].nbytes + full["w_out"].nbytes


def test_strided_destinations(tmp_path: Path, preadv_calls: list[int]) -> None:
    # w_in lives in every other row of a larger tensor (runs of 128 KiB, strided: direct reads
    # with an iovec per row); w_out is a transposed view (runs of one element: copied).
    full = truth()
    save_file(full, tmp_path / "m.safetensors")
    model = Wide()
    backing = torch.zeros(128, 32768)
    model.w_in = nn.Parameter(backing[::2])
    model.w_out = nn.Parameter(torch.zeros(512, 1024).t())
    lazyckpt.load_into(model, tmp_path / "m.safetensors")
    assert same_bits(model.w_in.detach(), full["w_in"])
    assert bool((backing[1::2] == 0).all())  # rows between are untouched
    assert same_bits(model.w_out.detach(), full["w_out"])
    assert sum(preadv_calls) >= full["w_in"].nbytes


def test_model_parallel_pieces_mix_direct_reads_and_copies(tmp_path: Path) -> None:
    # MP-2: w_in split on dim 0 (each rank file holds whole rows: direct reads), w_out split on
    # dim 1 (each rank file holds 1 KiB of every row: copies).
    full = truth()
    dims = {"w_in": 0, "w_out": 1}
    for r in range(2):
        sd = {k: (v.chunk(2, dims[k])[r].clone() if k in dims else v) for k, v in full.items()}
        torch.save(sd, tmp_path / f"consolidated.{r:02d}.pth")
    model = Wide()
    report = lazyckpt.load_into(model, tmp_path)
    assert report.shard_dims == dims
    for name, t in full.items():
        assert same_bits(model.state_dict()[name], t), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_column_blocks_are_joined_by_one_cat_or_left_to_the_copies(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    # Three column blocks of one matrix, in three files (as model-parallel ranks save a key
    # split on dim 1), joined into the box; what concat cannot take it leaves untouched.
    g = torch.Generator().manual_seed(9)
    full = torch.randn(48, 96, generator=g).to(dtype)
    widths = [40, 16, 40]
    blocks = list(full.split(widths, dim=1))
    chunks, pieces, at = [], [], 0
    for i, block in enumerate(blocks):
        path = tmp_path / f"{i}.safetensors"
        save_file({"w": block.contiguous(), "z": torch.zeros(3, dtype=torch.int8)}, path)
        index = detect_loader(path).index(path)
        (chunk,) = index.entries["w"].chunks
        chunks.append(chunk)
        pieces.append(Piece(i, (0, 0), (0, at), tuple(block.shape)))
        at += block.shape[1]
    shuffled = [pieces[2], pieces[0], pieces[1]]
    stats = lazyckpt.LoadStats()
    with Reader(stats=stats) as reader:
        dst = torch.zeros(48, 96, dtype=dtype)
        assert reader.concat(chunks, dtype, shuffled, dst, "w")
        assert same_bits(dst, full)
        assert stats.total_bytes_read == full.nbytes
        # Rows 8-20 of the box: pieces of the blocks' rows, still side by side.
        rows = [Piece(p.chunk, (8, 0), p.dst_offsets, (12, p.sizes[1])) for p in pieces]
        part = torch.zeros(12, 96, dtype=dtype)
        assert reader.concat(chunks, dtype, rows, part, "w")
        assert same_bits(part, full[8:20])
        two = torch.zeros(48, 56, dtype=dtype)  # a box the first two blocks fill
        assert reader.concat(chunks, dtype, pieces[:2], two, "w")
        assert same_bits(two, full[:, :56])
        for bad_pieces, bad_dst in [
            (pieces, torch.zeros(96, 48, dtype=dtype).t()),  # not contiguous
            (pieces, torch.zeros(48, 96, dtype=torch.float64)),  # a cast
            ([pieces[0], pieces[2]], torch.zeros(48, 96, dtype=dtype)),  # a gap
        ]:
            assert not reader.concat(chunks, dtype, bad_pieces, bad_dst, "w")
            assert bool((bad_dst == 0).all())
        # A block one byte further on (as a DCP chunk may lie): not an address torch may read
        # as the dtype, so nothing is read.
        region = chunks[1].data
        assert isinstance(region, FileRegion)
        odd = Chunk(
            chunks[1].offsets,
            chunks[1].sizes,
            FileRegion(region.path, region.byte_offset + 1, region.strides),
        )
        untouched = torch.zeros(48, 96, dtype=dtype)
        assert not reader.concat([chunks[0], odd, chunks[2]], dtype, pieces, untouched, "w")
        assert bool((untouched == 0).all())
    with Reader(use_mmap=False) as reader:
        assert not reader.concat(chunks, dtype, pieces, torch.zeros(48, 96, dtype=dtype), "w")


def test_a_read_past_the_end_of_the_file_names_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(256)) * 256)  # 64 KiB
    f = _OpenFile(path)
    try:
        out = bytearray(80_000)
        with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"'some\.key'") as info:
            _run_reads([DirectRead(f, 1000, [memoryview(out)], len(out), "some.key")])
        assert info.value.path == path
        assert out[: 65536 - 1000] == (bytes(range(256)) * 256)[1000:]  # what was there
    finally:
        f.close()


def test_errors_from_the_helper_thread_reach_the_caller(tmp_path: Path) -> None:
    with _file_and_reader(tmp_path / "short.bin", b"x" * 65536) as (f, reader):
        bad = bytearray(40_000)
        error = pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"'bad\.key'")
        with error, reader.read_queue() as queue:
            queue.put([DirectRead(f, 60_000, [memoryview(bad)], len(bad), "bad.key")])
            while queue._calls:  # the helper takes it; the caller goes on meanwhile
                time.sleep(0.001)
        assert bad[:5536] == b"x" * 5536  # what the file had


def test_the_helper_reads_while_the_caller_works_and_both_drain_the_queue(tmp_path: Path) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    with _file_and_reader(tmp_path / "data.bin", data) as (f, reader):
        outs = [bytearray(4096) for _ in range(256)]
        with reader.read_queue() as queue:
            queue.put([DirectRead(f, 4096 * i, [memoryview(outs[i])], 4096, "k") for i in range(8)])
            while queue._calls:  # nothing else queued yet: the helper alone runs these
                time.sleep(0.001)
            assert b"".join(outs[:8]) == data[: 8 * 4096]
            rest = [
                DirectRead(f, 4096 * i, [memoryview(outs[i])], 4096, "k") for i in range(8, 256)
            ]
            queue.put(rest)
        assert b"".join(outs) == data  # left to both threads on leaving the block


@pytest.mark.parametrize("wait", [60.0, 0.0], ids=["waits-for-helper", "no-wait"])
def test_the_first_put_hands_the_gil_to_the_helper_within_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait: float
) -> None:
    # With room to wait, put() returns only once the helper runs (so its first read is not left
    # waiting for the GIL while the caller lists more); with none, it returns at once. Either
    # way every read is done on leaving the block.
    data = bytes(range(256)) * 1024
    monkeypatch.setattr(read_module, "_HELPER_START_WAIT", wait)
    ran: list[bool] = []
    helper = read_module.ReadQueue._helper

    def recorded(self: read_module.ReadQueue, started: object) -> None:
        ran.append(True)
        helper(self, started)  # type: ignore[arg-type]

    monkeypatch.setattr(read_module.ReadQueue, "_helper", recorded)
    with _file_and_reader(tmp_path / "data.bin", data) as (f, reader):
        outs = [bytearray(4096) for _ in range(64)]
        with reader.read_queue() as queue:
            queue.put([DirectRead(f, 4096 * i, [memoryview(outs[i])], 4096, "k") for i in range(64)])
            if wait:
                assert ran == [True]
        assert b"".join(outs) == data


@pytest.mark.parametrize("helper_fails", [False, True], ids=["helper-ok", "helper-fails-too"])
def test_an_error_in_the_callers_block_drops_the_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helper_fails: bool
) -> None:
    # The helper is held inside its first call until the caller has failed. Then it must stop
    # there (the rest was dropped, a bad call included); if that first call fails too, the
    # caller's own error is the one raised.
    entered, proceed = threading.Event(), threading.Event()
    offsets: list[int] = []
    real = os.preadv

    def gated(fd: int, buffers: list[memoryview], offset: int) -> int:
        offsets.append(offset)
        if len(offsets) == 1:  # the helper's first call waits until the caller has failed
            entered.set()
            proceed.wait()
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", gated)
    with _file_and_reader(tmp_path / "data.bin", b"y" * (1 << 20)) as (f, reader):
        try:
            outs = [bytearray(4096) for _ in range(8)]
            calls = [DirectRead(f, 4096 * i, [memoryview(outs[i])], 4096, "k") for i in range(8)]
            past_end = bytearray(4096)  # fails when read
            bad = DirectRead(f, 1 << 20, [memoryview(past_end)], 4096, "past.end")
            calls.insert(0 if helper_fails else 1, bad)
            with pytest.raises(KeyError, match="planning failed"), reader.read_queue() as queue:
                queue.put(calls)
                assert entered.wait(60)
                # Let the helper go on only once the queue has been dropped on the way out.
                threading.Timer(0.2, proceed.set).start()
                raise KeyError("planning failed")
            # The helper stopped after the call it was in (a failing one retries the same offset).
            assert set(offsets) == {calls[0].offset}
            assert not queue._calls
        finally:
            proceed.set()


class Deep(nn.Module):
    """Twelve 256 KiB matrices: one direct read each from a DCP folder."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ParameterList(nn.Parameter(torch.zeros(256, 256)) for _ in range(12))


def test_a_damaged_dcp_chunk_found_while_the_helper_reads_raises_and_stops_it(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(5)
    full = {f"layers.{i}": torch.randn(256, 256, generator=g) for i in range(12)}
    dcp.save(full, checkpoint_id=tmp_path / "ck", no_dist=True)
    meta = dcp.FileSystemReader(tmp_path / "ck").read_metadata()
    # The last chunk's zip is located only when its reads are worked out, after the helper
    # has started on the first ones: break its end-of-directory signature.
    last = max(meta.storage_data.values(), key=lambda info: info.offset)
    path = tmp_path / "ck" / last.relative_path
    raw = bytearray(path.read_bytes())
    eocd = raw.rfind(b"PK\x05\x06", last.offset, last.offset + last.length)
    assert eocd > 0
    raw[eocd : eocd + 4] = b"XXXX"
    path.write_bytes(bytes(raw))
    damaged = next(k.fqn for k, info in meta.storage_data.items() if info is last)

    model = Deep()
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=damaged.replace(".", r"\.")):
        lazyckpt.load_into(model, tmp_path / "ck")
    dcp.save(full, checkpoint_id=tmp_path / "good", no_dist=True)
    lazyckpt.load_into(model, tmp_path / "good")  # the next load is not stuck behind the first
    for name, t in full.items():
        assert same_bits(model.state_dict()[name], t), name


class Norms(nn.Module):
    """Small 1-D parameters and a 0-d buffer: a few short runs each."""

    def __init__(self) -> None:
        super().__init__()
        self.norm_a = nn.Parameter(torch.zeros(300))
        self.norm_b = nn.Parameter(torch.zeros(4096))
        self.register_buffer("scale", torch.tensor(0.0))


def test_pieces_of_a_few_short_runs_are_read_without_mapping_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preadv_calls: list[int]
) -> None:
    # A norm or a norm's FSDP shard is one short run: a pread costs less than mapping the file
    # and copying from it. A column slice (many short runs) is still copied from the mapping.
    g = torch.Generator().manual_seed(5)
    full = {
        "norm_a": torch.randn(300, generator=g),
        "norm_b": torch.randn(4096, generator=g),
        "scale": torch.tensor(2.5),
    }
    save_file(full, tmp_path / "m.safetensors")
    mapped: list[Path] = []
    real = _OpenFile.mapping

    def counting(self: _OpenFile) -> object:
        mapped.append(self.path)
        return real(self)

    monkeypatch.setattr(_OpenFile, "mapping", counting)
    model = Norms()
    lazyckpt.load_into(model, tmp_path / "m.safetensors")
    for name, t in full.items():
        assert same_bits(model.state_dict()[name], t), name
    assert mapped == []
    assert sorted(preadv_calls) == sorted(t.nbytes for t in full.values())

    wide = truth()
    save_file(wide, tmp_path / "w.safetensors")
    model_w = Wide()
    model_w.w_out = nn.Parameter(torch.zeros(512, 1024).t())  # runs of one element
    lazyckpt.load_into(model_w, tmp_path / "w.safetensors")
    assert same_bits(model_w.w_out.detach(), wide["w_out"])
    assert mapped == [tmp_path / "w.safetensors"]


@needs_openmp
def test_copies_run_on_the_caller_alone_while_the_helper_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MP-2: w_in's pieces are direct reads (the helper is held inside its first one), w_out's
    # column blocks are copied from the mappings (joined by one torch.cat), meanwhile, on one
    # intra-op thread.
    full = truth()
    dims = {"w_in": 0, "w_out": 1}
    for r in range(2):
        sd = {k: (v.chunk(2, dims[k])[r].clone() if k in dims else v) for k, v in full.items()}
        torch.save(sd, tmp_path / f"consolidated.{r:02d}.pth")
    proceed = threading.Event()
    real_preadv = os.preadv

    def gated(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        if threading.current_thread() is not threading.main_thread():
            assert proceed.wait(60)
        return real_preadv(fd, buffers, offset, *flags)

    threads_at_copy: list[int] = []
    real_concat = Reader.concat

    def concat(self: Reader, *args: object, **kwargs: object) -> bool:
        threads_at_copy.append(torch.get_num_threads())
        proceed.set()
        joined = real_concat(self, *args, **kwargs)  # type: ignore[arg-type]
        assert joined
        return joined

    monkeypatch.setattr(os, "preadv", gated)
    monkeypatch.setattr(Reader, "concat", concat)
    before = torch.get_num_threads()
    model = Wide()
    lazyckpt.load_into(model, tmp_path)
    for name, t in full.items():
        assert same_bits(model.state_dict()[name], t), name
    assert threads_at_copy[0] == 1  # the helper had not finished: the copy ran alone
    assert torch.get_num_threads() == before
