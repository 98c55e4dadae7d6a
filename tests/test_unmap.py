"""File mappings are unmapped on the unmapping thread once nothing uses them, never while a
view still reads them."""

from __future__ import annotations

import gc
import mmap
import multiprocessing as mp
import os
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lazyckpt
from lazyckpt import unmap


def _mapped(path: Path) -> bool:
    with open("/proc/self/maps") as f:
        return any(str(path) in line for line in f)


def _lease_of(path: Path) -> tuple[object, list[str]]:
    """A lease over ``path`` and a list that gets the name of the thread that frees the map."""
    freed_on: list[str] = []
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    weakref.finalize(region, lambda: freed_on.append(threading.current_thread().name))
    buffer = unmap.lease(region)
    del region
    return buffer, freed_on


def test_a_mapping_is_unmapped_on_the_unmapping_thread(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 64)
    buffer, freed_on = _lease_of(path)
    view = torch.frombuffer(buffer, dtype=torch.uint8)
    del buffer
    gc.collect()
    unmap.wait()
    assert freed_on == []  # the view still reads it
    assert int(view[257]) == 1
    del view
    unmap.wait()
    assert freed_on == ["lazyckpt-unmap"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_view_keeps_its_file_mapped_after_the_load(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3)}, path)
    loader = lazyckpt.get_model_checkpoint_loader()
    got = dict(loader.lazy_load(path, {}))
    unmap.wait()
    assert _mapped(path)
    assert torch.equal(got["a"], torch.arange(4096, dtype=torch.float32))
    del got
    gc.collect()
    unmap.wait()
    assert not _mapped(path)


def _child(path: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    buffer, freed_on = _lease_of(Path(path))
    del buffer
    unmap.wait()
    out.put(freed_on)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_an_unmapping_thread_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 8192)
    buffer, _ = _lease_of(path)  # starts the thread in this process
    del buffer
    unmap.wait()
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    child = ctx.Process(target=_child, args=(str(path), out))
    child.start()
    assert out.get(timeout=60) == ["lazyckpt-unmap"]
    child.join(60)
    assert child.exitcode == 0
