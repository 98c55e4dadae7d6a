"""A child forked while another thread of the parent holds one of lazyckpt's locks (the prefetch
worker inside the reader, the buffer pool, the stats) gets a new lock, instead of waiting for
good on a copy that nobody will release."""

from __future__ import annotations

import mmap
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fork_mid_stream
from safetensors.torch import save_file

import lazyckpt
from lazyckpt import alloc, claims, cow, prefetch, read, stitch, unmap

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")


def _fork_while_held(holder: Any, use: Callable[[], object], attr: str = "_lock") -> int:
    """Fork while a thread holds ``holder``'s lock (``attr``); the child runs ``use()`` (exit
    0), or is killed by an alarm if it waits on the lock. The child's exit code (negative: a
    signal)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with getattr(holder, attr):
            held.set()
            release.wait()

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            signal.alarm(30)
            code = 1
            try:
                use()
                code = 0
            finally:
                os._exit(code)
    finally:
        release.set()
        thread.join()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_stats(tmp_path: Path) -> None:
    stats = lazyckpt.LoadStats()
    assert _fork_while_held(stats, lambda: stats.add_read("f", 1)) == 0


def test_reader(tmp_path: Path) -> None:
    save_file({"w": torch.randn(4, 4)}, tmp_path / "m.safetensors")
    reader = read.Reader()
    reader._open(tmp_path / "m.safetensors", "w")
    assert _fork_while_held(reader, reader.close) == 0
    reader.close()


def test_buffer_pool() -> None:
    pool = alloc.BufferPool(64 << 20)
    assert _fork_while_held(pool, lambda: pool.empty((1 << 20,), torch.float32)) == 0
    pool.close()


def test_claims() -> None:
    c = claims.Claims()
    assert _fork_while_held(c, lambda: c.claim(0, 8, (2,), (1,), 4)) == 0


def test_private_pages_of_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 8192)
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    pages = cow.PrivatePages(unmap.lease(region))
    del region
    assert _fork_while_held(pages, pages.flush) == 0


def test_the_unmapping_thread() -> None:
    reaper = unmap._reaper
    assert _fork_while_held(reaper, unmap.wait) == 0


def test_prefetch_state() -> None:
    # A child that frees a tensor the parent's prefetch worker built gives its bytes back here.
    state = prefetch._State()
    assert _fork_while_held(state, lambda: state.release(1), "cond") == 0


def test_stitched_view_budget() -> None:
    budget = stitch._budget

    def use() -> None:
        if budget.take(1):
            budget.give(1)

    assert _fork_while_held(budget, use) == 0


def test_a_stream_forked_mid_load_can_be_closed_in_the_child(tmp_path: Path) -> None:
    # The whole path: the child closes the stream it inherited (its reader, buffer pool and
    # prefetch state), while the parent finishes it.
    def close(stream: Iterator[tuple[str, torch.Tensor]]) -> int:
        stream.close()  # type: ignore[attr-defined]
        return 0

    assert fork_mid_stream(tmp_path, close) == 0
