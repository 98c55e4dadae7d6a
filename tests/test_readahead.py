"""Cold page cache: a load reads from disk the pages it needs, not the device's read-ahead window
around them (lazyckpt.readahead).

The disk tests drop the files from the page cache (``fsync`` + ``POSIX_FADV_DONTNEED``) and read
this process's ``read_bytes`` from ``/proc/self/io``; they skip where the filesystem does not
show reads there (tmpfs) or the pages cannot be dropped. They fail without the advice on a
device whose read-ahead window is larger than the pieces (8 MiB on the VM they were written on;
128 KiB is common, and there the kernel's read-ahead was close to exact already).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import assert_layout_matches
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

import lazyckpt
from lazyckpt.plan import page_ranges
from lazyckpt.readahead import PAGE

# -- which pages: pure integers -------------------------------------------------------------


def _element_bytes(first: int, sizes: list[int], strides: list[int], itemsize: int) -> set[int]:
    """Every byte of every element, by brute force over the index space."""
    out: set[int] = set()
    numel = 1
    for s in sizes:
        numel *= s
    for flat in range(numel):
        rest, at = flat, first
        for size, stride in zip(reversed(sizes), reversed(strides)):
            at += (rest % size) * stride * itemsize
            rest //= size
        out.update(range(at, at + itemsize))
    return out


@st.composite
def strided_pieces(draw: st.DrawFn) -> tuple[int, list[int], list[int], int, int]:
    """A box of a row-major (or permuted) tensor in a file: first byte, sizes, strides."""
    ndim = draw(st.integers(1, 3))
    full = [draw(st.integers(1, 12)) for _ in range(ndim)]
    order = draw(st.permutations(range(ndim)))
    strides = [0] * ndim
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= full[d]
    sizes = [draw(st.integers(1, n)) for n in full]
    starts = [draw(st.integers(0, n - s)) for n, s in zip(full, sizes)]
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    base = draw(st.integers(0, 200))
    first = base + sum(o * s for o, s in zip(starts, strides)) * itemsize
    page = draw(st.sampled_from([8, 16, 64]))
    return first, sizes, strides, itemsize, page


@given(strided_pieces())
def test_page_ranges_cover_the_piece_and_stay_close_to_it(
    case: tuple[int, list[int], list[int], int, int],
) -> None:
    first, sizes, strides, itemsize, page = case
    ranges = list(page_ranges(first, sizes, strides, itemsize, page))
    wanted = _element_bytes(first, sizes, strides, itemsize)
    covered: set[int] = set()
    for start, stop in ranges:
        assert start % page == 0 and stop % page == 0 and start < stop
        covered.update(range(start, stop))
    assert wanted <= covered
    pages = {b // page for b in covered}
    needed = {b // page for b in wanted}
    lo, hi = min(wanted), max(wanted) + 1
    if len(ranges) > 1:  # run by run: only pages that hold an element
        assert pages == needed
    else:  # the span: the piece fills at least half of it
        assert pages == set(range(lo // page, -(-hi // page)))
        assert len(wanted) * 2 >= hi - lo or pages == needed


def test_page_ranges_of_a_column_slice_skip_the_other_columns() -> None:
    # TP-4 rank 1 of a matrix of 16 KiB rows (bf16, 8192 columns), in pages of 4 KiB: the slice
    # is 4 KiB of each row at byte 4096 + 100 of it, so it lies in 2 of each row's 4 pages.
    first = 100 + 2 * 2048
    ranges = list(page_ranges(first, [3, 2048], [8192, 1], 2, 4096))
    assert ranges == [(4096, 12288), (20480, 28672), (36864, 45056)]


# -- what a cold load reads from disk ------------------------------------------------------


def _disk_reads() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


def _drop(paths: list[Path]) -> None:
    """Take the files out of the page cache (dirty pages are written first: they would stay)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.fixture
def cold(tmp_path: Path) -> Iterator[None]:
    """Skip unless reads of dropped pages of ``tmp_path`` show in ``read_bytes``."""
    if not hasattr(os, "posix_fadvise") or not os.path.exists("/proc/self/io"):
        pytest.skip("needs posix_fadvise and /proc/self/io (Linux)")
    probe = tmp_path / "probe.bin"
    probe.write_bytes(os.urandom(1 << 20))
    _drop([probe])
    before = _disk_reads()
    probe.read_bytes()
    if _disk_reads() - before < 1 << 20:
        pytest.skip(f"{tmp_path} does not show reads of dropped pages in /proc/self/io")
    probe.unlink()
    yield


def _within(
    bound: int, measure: Callable[[], tuple[dict[str, torch.Tensor], int]]
) -> tuple[dict[str, torch.Tensor], int]:
    """``measure()`` (the tensors of a load and the bytes it had read from disk), made again
    once if it read more than ``bound``.

    The second go is for pages that lazyckpt asked for and the kernel reclaimed before they
    were touched (memory pressure, or proactive reclaim: this VM runs DAMON's ``pageout``).
    The fault on such a page reads the device's read-ahead window around it, as without any
    advice: 4 loads of about 2,800 in a loop of the TP-4 slice below (benchmarks/HISTORY.md,
    thirteenth session). A load that reads too much every time (a regression) still fails; one
    that does so once in hundreds, whatever the cause, passes: on a kernel without
    ``cachestat``, the ``RWF_NOWAIT`` probe's own misreadings (see lazyckpt.readahead) among
    them. The probe's wiring has its own test (``test_advice_goes_to_uncached_pieces_only``).
    """
    got, read = measure()
    if read > bound:
        got, read = measure()
    return got, read


def _cold_load(
    paths: list[Path],
    source: Path,
    shard_dims: dict[str, int],
    layout: lazyckpt.Layout,
    bound: int,
    mmap: bool = True,
) -> tuple[dict[str, torch.Tensor], int]:
    """Every tensor of a cold ``lazy_load`` (touched, then copied), and the bytes read from
    disk meanwhile (see :func:`_within` for ``bound``)."""

    def measure() -> tuple[dict[str, torch.Tensor], int]:
        _drop(paths)
        return _measured_load(source, shard_dims, layout, mmap)

    return _within(bound, measure)


def _measured_load(
    source: Path, shard_dims: dict[str, int], layout: lazyckpt.Layout, mmap: bool = True
) -> tuple[dict[str, torch.Tensor], int]:
    """Every tensor of a ``lazy_load`` as the page cache is now, and the bytes read from disk."""
    options = lazyckpt.ModelCheckpointLoadOptions(layout=layout, mmap=mmap)
    loader = lazyckpt.get_model_checkpoint_loader()
    before = _disk_reads()
    got = {k: t.clone() for k, t in loader.lazy_load(source, shard_dims, options)}
    return got, _disk_reads() - before


_SLACK = 64 << 10
"""Index reads (a header, a zip directory) and a page more at the ends of each piece."""


@pytest.mark.parametrize("mmap", [True, False])
def test_fsdp_rank_reads_its_eighth_from_a_cold_safetensors_file(
    tmp_path: Path, cold: None, mmap: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    full = {f"layers.{i}.w": torch.randn(1024, 1024, generator=g) for i in range(8)}  # 32 MiB
    path = tmp_path / "model.safetensors"
    save_file(full, path)
    layout = lazyckpt.Layout(dp_size=8, dp_rank=3)
    needed = sum(t.numel() * 4 for t in full.values()) // 8
    bound = needed + len(full) * 2 * PAGE + _SLACK
    got, read = _cold_load([path], path, {}, layout, bound, mmap=mmap)
    assert_layout_matches(got, full, {}, layout)
    assert read <= bound, (read, needed)


def test_column_blocks_of_a_cold_model_parallel_set_read_their_own_rows(
    tmp_path: Path, cold: None
) -> None:
    # MP-4, split on dim 1: FSDP rank 0 takes the first rows of each rank file's block, one
    # contiguous range per file, copied from the mapping into its columns.
    g = torch.Generator().manual_seed(1)
    full = {"w": torch.randn(4096, 2048, generator=g)}  # 32 MiB, 8 MiB per rank file
    paths = []
    for r in range(4):
        paths.append(tmp_path / f"consolidated.{r:02d}.pth")
        torch.save({"w": full["w"].chunk(4, 1)[r].clone()}, paths[-1])
    layout = lazyckpt.Layout(dp_size=8, dp_rank=0)
    needed = full["w"].numel() * 4 // 8
    bound = needed + 4 * (2 * PAGE + _SLACK)
    got, read = _cold_load(paths, tmp_path, {"w": 1}, layout, bound)
    assert_layout_matches(got, full, {"w": 1}, layout)
    assert read <= bound, (read, needed)


def test_a_cold_column_slice_reads_only_the_pages_of_its_columns(
    tmp_path: Path, cold: None
) -> None:
    # TP-4 rank 1 of a matrix of 16 KiB rows: 4 KiB of each row, which lie in 2 of its 4 pages.
    g = torch.Generator().manual_seed(2)
    full = {"w": torch.randn(1024, 4096, generator=g)}  # 16 MiB
    path = tmp_path / "model.safetensors"
    save_file(full, path)
    layout = lazyckpt.Layout(tp_size=4, tp_rank=1)
    rows, row_bytes = full["w"].shape[0], full["w"].shape[1] * 4
    bound = rows * (-(-(row_bytes // 4) // PAGE) + 1) * PAGE + _SLACK
    got, read = _cold_load([path], path, {"w": 1}, layout, bound)
    assert_layout_matches(got, full, {"w": 1}, layout)
    assert read <= bound, read


@given(strided_pieces())
def test_the_probed_run_is_bytes_the_piece_holds(
    case: tuple[int, list[int], list[int], int, int],
) -> None:
    from lazyckpt.plan import middle_run

    first, sizes, strides, itemsize, _page = case
    start, stop = middle_run(first, sizes, strides, itemsize)
    assert start < stop
    assert set(range(start, stop)) <= _element_bytes(first, sizes, strides, itemsize)


def test_page_ranges_walk_a_transposed_piece_in_file_order() -> None:
    # M.t() saved: its dim-0 TP slice is a column block of M in the file, 1024 elements of each
    # of 4096 rows; walked in the tensor's own order it was 4M one-element runs and 4M ranges.
    ranges = list(page_ranges(0, [1024, 4096], [1, 4096], 2, 4096))
    assert len(ranges) <= 4096
    # Past _MAX_RANGES runs, the span: a bounded loop, whatever the piece.
    last = ((1 << 20) - 1) * 128 + 2  # past the last element's bytes
    assert list(page_ranges(0, [1 << 20], [64], 2, 4096)) == [(0, -(-last // 4096) * 4096)]


def test_a_column_slice_next_to_a_cached_one_reads_its_own_pages(
    tmp_path: Path, cold: None
) -> None:
    # TP-8 ranks of a matrix of 32 KiB rows, one after the other: rank 0's load caches pages in
    # the middle of rank 1's span (its own columns), and a probe there took rank 1's pages for
    # cached: read-around then read every uncached page of the matrix.
    g = torch.Generator().manual_seed(4)
    full = {"w": torch.randn(2048, 8192, generator=g)}  # 64 MiB
    path = tmp_path / "model.safetensors"
    save_file(full, path)
    layout = lazyckpt.Layout(tp_size=8, tp_rank=1)
    rows, slice_bytes = full["w"].shape[0], full["w"].shape[1] * 4 // 8
    bound = rows * (slice_bytes // PAGE + 1) * PAGE + _SLACK

    def after_rank_0() -> tuple[dict[str, torch.Tensor], int]:
        _drop([path])
        _measured_load(path, {"w": 1}, lazyckpt.Layout(tp_size=8, tp_rank=0))
        return _measured_load(path, {"w": 1}, layout)  # not dropped again

    got, read = _within(bound, after_rank_0)
    assert_layout_matches(got, full, {"w": 1}, layout)
    assert read <= bound, read


# -- is it cached: the two ways of asking ----------------------------------------------------


def _needs_cachestat() -> None:
    from lazyckpt import readahead

    if readahead._syscall is None:
        pytest.skip("cachestat cannot be asked here (Linux 6.5+)")


@contextlib.contextmanager
def _dropped_file(path: Path, nbytes: int) -> Iterator[int]:
    """``path`` written with ``nbytes`` random bytes, dropped from the page cache, and open as
    lazyckpt opens files (``POSIX_FADV_RANDOM``: a read reads its own pages, nothing ahead)."""
    from lazyckpt import readahead

    path.write_bytes(os.urandom(nbytes))
    _drop([path])
    fd = os.open(path, os.O_RDONLY)
    readahead.no_readahead(fd)
    try:
        yield fd
    finally:
        os.close(fd)


def test_cachestat_counts_the_cached_pages_without_reading_them(tmp_path: Path, cold: None) -> None:
    from lazyckpt import readahead

    _needs_cachestat()
    with _dropped_file(tmp_path / "f.bin", 64 * PAGE) as fd:
        before = _disk_reads()
        assert readahead._all_cached(fd, 0, 64 * PAGE) is False
        assert readahead._all_cached(fd, 5 * PAGE + 1, 5 * PAGE + 2) is False
        assert _disk_reads() == before  # asking read nothing
        os.pread(fd, 8 * PAGE, 8 * PAGE)  # pages 8-15
        assert readahead._all_cached(fd, 8 * PAGE + 100, 16 * PAGE) is True
        assert readahead._all_cached(fd, 8 * PAGE, 16 * PAGE + 1) is False  # one page more
        assert readahead._all_cached(fd, 0, 64 * PAGE) is False


def test_the_nowait_probe_tells_a_cached_page_from_a_dropped_one(
    tmp_path: Path, cold: None
) -> None:
    # Where cachestat cannot be asked. A probe starts reading the page it misses, and on a fast
    # device that read can end before the probe returns ("cached"): 1 in ~2,000 here, so of
    # three files dropped and probed, one at least must come back "not cached".
    from lazyckpt import readahead

    if not readahead._NOWAIT:
        pytest.skip("no RWF_NOWAIT here")
    answers = []
    for i in range(3):
        with _dropped_file(tmp_path / f"f{i}.bin", 16 * PAGE) as fd:
            answers.append(readahead._probe(fd, 3 * PAGE + 7, 9 * PAGE))
            os.pread(fd, 16 * PAGE, 0)
            assert readahead._probe(fd, 3 * PAGE + 7, 9 * PAGE) is True
    assert False in answers, answers


def test_a_refused_cachestat_call_leaves_it_on_for_other_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A closed descriptor (EBADF) here; in the field, a file the caller may neither write nor
    # own (EPERM on recent kernels). Either way the probe answers for that call only.
    from lazyckpt import readahead

    _needs_cachestat()
    monkeypatch.setattr(readahead, "_syscall", readahead._syscall)  # put back if it fails
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 * PAGE))
    fd = os.open(path, os.O_RDONLY)
    os.close(fd)
    assert readahead._all_cached(fd, 0, PAGE) is None
    assert readahead._syscall is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        assert readahead._all_cached(fd, 0, 4 * PAGE) is True  # just written: cached
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
def test_cachestat_refused_for_a_file_the_caller_may_not_write(tmp_path: Path) -> None:
    # In a child that became another user: a root-owned file it may only read, where a kernel
    # that refuses cachestat (EPERM) must not turn it off for the files the user owns.
    from lazyckpt import readahead

    _needs_cachestat()
    nobody = 65534
    theirs, mine = tmp_path / "root_owned.bin", tmp_path / "mine.bin"
    for path in (theirs, mine):
        path.write_bytes(os.urandom(2 * PAGE))
    theirs.chmod(0o644)
    os.chown(mine, nobody, nobody)
    fds = [os.open(theirs, os.O_RDONLY), os.open(mine, os.O_RDONLY)]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no torch, only the calls
        try:
            try:
                os.setgid(nobody)
                os.setuid(nobody)
            except OSError:  # a container without the capability
                os.write(w, b"cannot switch user")
                raise
            answer = readahead._all_cached(fds[0], 0, PAGE)
            refused = ctypes.get_errno()
            still_on = readahead._syscall is not None
            own = readahead._all_cached(fds[1], 0, 2 * PAGE)
            os.write(w, f"{answer} {refused} {still_on} {own}".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        words = f.read().split()
    os.waitpid(pid, 0)
    for fd in fds:
        os.close(fd)
    if words[:1] == ["cannot"]:
        pytest.skip("cannot switch to another user here")
    assert len(words) == 4, words
    answer, refused, still_on, own = words
    if answer != "None":
        pytest.skip(f"this kernel answers cachestat for a file the caller may not write ({answer})")
    assert int(refused) == errno.EPERM, words
    assert still_on == "True" and own == "True", words


def test_every_page_of_a_short_run_is_asked_about(tmp_path: Path, cold: None) -> None:
    # A run of 5 pages whose first, middle and last pages are cached and the two between are
    # not: three single probes would call it cached; cachestat counts the whole run.
    from lazyckpt import readahead

    _needs_cachestat()
    with _dropped_file(tmp_path / "f.bin", 8 * PAGE) as fd:
        for page in (1, 3, 5):
            os.pread(fd, PAGE, page * PAGE)
        assert readahead._all_cached(fd, 2 * PAGE, 3 * PAGE) is False
        readahead.read_ahead(fd, 8 * PAGE, PAGE, [5 * PAGE // 4], [1], 4)  # pages 1-5
        assert readahead._all_cached(fd, PAGE, 6 * PAGE) is True  # advised: all asked for


def _recording_willneed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every ``POSIX_FADV_WILLNEED`` given from now on, as ``(start, stop)`` byte ranges; the
    advice still goes to the kernel."""
    advised: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append((offset, offset + length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    return advised


@pytest.mark.parametrize("how", ["cachestat", "probe"])
def test_advice_goes_to_uncached_pieces_only(
    tmp_path: Path, cold: None, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # A column slice (4 KiB of each 16 KiB row, at byte 4096 of it) asked for in three files
    # just dropped, then again once they are cached: advice (the real one, recorded) for the
    # pages of its rows the first time, none the second.
    from lazyckpt import readahead

    if how == "cachestat":
        _needs_cachestat()
    else:
        if not readahead._NOWAIT:
            pytest.skip("no RWF_NOWAIT here")
        monkeypatch.setattr(readahead, "_syscall", None)
    advised = _recording_willneed(monkeypatch)
    rows = 64
    wanted = [(r * 4 * PAGE + PAGE, r * 4 * PAGE + 2 * PAGE) for r in range(rows)]
    cold_answers = []
    for i in range(3):
        with _dropped_file(tmp_path / f"f{i}.bin", rows * 4 * PAGE) as fd:
            args = (fd, rows * 4 * PAGE, PAGE, [rows, PAGE // 4], [PAGE, 1], 4)
            advised.clear()
            readahead.read_ahead(*args)
            cold_answers.append(list(advised))
            os.pread(fd, rows * 4 * PAGE, 0)
            advised.clear()
            readahead.read_ahead(*args)
            assert advised == []
    # The probe's own read can end before it returns (see lazyckpt.readahead): one file of
    # three is enough there; cachestat must see all three.
    assert all(a == wanted for a in cold_answers if a), cold_answers
    assert sum(1 for a in cold_answers if a) >= (3 if how == "cachestat" else 1), cold_answers


def test_all_cached_answers_for_the_whole_range_within_its_bound(
    tmp_path: Path, cold: None
) -> None:
    from lazyckpt import readahead

    _needs_cachestat()
    with _dropped_file(tmp_path / "f.bin", 64 * PAGE) as fd:
        os.pread(fd, 16 * PAGE, 8 * PAGE)  # pages 8-23
        assert readahead.all_cached(fd, 8 * PAGE, 24 * PAGE)
        assert not readahead.all_cached(fd, 8 * PAGE, 25 * PAGE)
        assert not readahead.all_cached(fd, 0, 9 * PAGE)
        os.pread(fd, 64 * PAGE, 0)
        assert readahead.all_cached(fd, 0, 64 * PAGE)
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(readahead._BATCH_BYTES + PAGE)
    fd = os.open(big, os.O_RDONLY)
    try:
        os.pread(fd, readahead._BATCH_BYTES + PAGE, 0)  # a hole reads as zero pages, cached
        assert readahead._all_cached(fd, 0, readahead._BATCH_BYTES + PAGE) is True
        assert not readahead.all_cached(fd, 0, readahead._BATCH_BYTES + PAGE)  # too long
    finally:
        os.close(fd)


def _small_keys(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    full = {f"k{i:03d}": torch.randn(16, 64, generator=g) for i in range(256)}  # 4 KiB each
    save_file(full, path)
    return full


def test_a_warm_stream_of_small_views_asks_the_page_cache_once_a_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 256 views of 4 KiB, all cached (just written): one cachestat over each batch of views
    # ahead, not one a view (3 us a key).
    from lazyckpt import readahead
    from lazyckpt.loader import _AHEAD_KEYS

    _needs_cachestat()
    path = tmp_path / "m.safetensors"
    full = _small_keys(path)
    calls: list[tuple[int, int]] = []
    real = readahead._all_cached

    def counting(fd: int, start: int, stop: int) -> bool | None:
        calls.append((start, stop))
        return real(fd, start, stop)

    monkeypatch.setattr(readahead, "_all_cached", counting)
    got = dict(lazyckpt.get_model_checkpoint_loader().lazy_load(path, {}))
    assert all(torch.equal(got[k], v) for k, v in full.items())
    assert len(calls) <= -(-len(full) // _AHEAD_KEYS) + 1, len(calls)


def test_a_cold_stream_of_small_views_asks_for_each_views_pages(
    tmp_path: Path, cold: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same keys dropped from the page cache, FSDP rank 1 of 4 (rows 4-7 of each, one page):
    # the batch's one question finds pages missing, and each view's pages are asked for, as
    # the views of large keys are. Recorded, then given to the kernel.
    _needs_cachestat()
    path = tmp_path / "m.safetensors"
    full = _small_keys(path)
    layout = lazyckpt.Layout(dp_size=4, dp_rank=1)
    advised = _recording_willneed(monkeypatch)
    _drop([path])
    options = lazyckpt.ModelCheckpointLoadOptions(layout=layout)
    got = {k: t.clone() for k, t in lazyckpt.get_model_checkpoint_loader().lazy_load(path, {}, options)}
    assert_layout_matches(got, full, {}, layout)
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    pages = set()
    for i in range(len(full)):  # each key's rows 4-7: bytes [1024, 2048) of its 4 KiB
        start = header + i * 4096 + 1024
        pages.update(range(start // PAGE, (start + 1023) // PAGE + 1))
    pages -= set(range(header // PAGE + 1))  # the header's pages: read by the index, cached
    asked = {p for a, b in advised for p in range(a // PAGE, -(-b // PAGE))}
    assert pages <= asked, sorted(pages - asked)[:5]
    assert len(asked) <= 2 * len(pages), (len(asked), len(pages))
