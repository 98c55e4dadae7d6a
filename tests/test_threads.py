"""``threads.one_intraop_thread``: torch kernels on the calling thread run on it alone, and no
other thread's setting changes (``torch.set_num_threads`` would change the whole process)."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import needs_openmp

from lazyckpt.threads import one_intraop_thread


@needs_openmp
def test_only_the_calling_thread_runs_on_one_intraop_thread() -> None:
    before = torch.get_num_threads()
    inside: list[int] = []
    other: list[int] = []
    entered, checked = threading.Event(), threading.Event()

    def elsewhere() -> None:
        entered.wait(60)
        other.append(torch.get_num_threads())
        checked.set()

    t = threading.Thread(target=elsewhere)
    t.start()
    with one_intraop_thread() as alone:
        inside.append(torch.get_num_threads())
        entered.set()
        assert checked.wait(60)
        inside.append(torch.get_num_threads())
    t.join()
    assert alone
    assert inside == [1, 1]
    assert other == [before]  # a thread that asks meanwhile keeps the process's count
    assert torch.get_num_threads() == before


@needs_openmp
def test_the_setting_is_restored_when_the_block_raises() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="inside"), one_intraop_thread():
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before


@needs_openmp
def test_the_runtime_is_found_by_name_and_by_the_process_maps() -> None:
    # The name lookup is the fast path; the maps scan is the fallback for runtimes shipped
    # under another name. Each must reach the runtime torch reads its thread count from.
    from lazyckpt import threads

    def reaches_torch(lib: object) -> bool:
        own = lib.omp_get_max_threads()  # type: ignore[attr-defined]
        lib.omp_set_num_threads(1)  # type: ignore[attr-defined]
        try:
            return torch.get_num_threads() == 1
        finally:
            lib.omp_set_num_threads(own)  # type: ignore[attr-defined]

    mapped = threads._mapped_runtimes()
    assert any(reaches_torch(lib) for lib in mapped)
    by_name = threads._by_name()
    if by_name is not None:  # torch's runtime is libgomp.so.1 on this build
        assert reaches_torch(by_name)
