"""The cyclic garbage collector is paused while a load indexes and plans (and for the whole of
``load_into``), and left as the caller had it afterwards: on after a load, an error or a
stream left early, and off where the caller had turned it off."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import same_bits, write_checkpoint
from torch import nn

import lazyckpt
from lazyckpt.gcpause import _PROMOTE_MIN, gc_paused
from lazyckpt.load_plan import TensorPlan


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def _folder(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = {f"layers.{i}.weight": torch.randn(4, 6) for i in range(5)}
    return write_checkpoint("safetensors-index", sd, tmp_path / "ck"), sd


def test_lazy_load_plans_with_the_collector_paused(tmp_path: Path, collector_on: None) -> None:
    path, sd = _folder(tmp_path)
    seen: list[bool] = []

    def key_map(key: str) -> str:
        seen.append(gc.isenabled())
        return key

    opts = lazyckpt.ModelCheckpointLoadOptions(key_map=key_map)
    stream = lazyckpt.get_model_checkpoint_loader().lazy_load(path, {}, opts)
    assert seen and not any(seen)  # every key was mapped while the index was built
    assert gc.isenabled()  # back on before the first tensor goes to the caller
    got = dict(stream)
    assert got.keys() == sd.keys()
    assert all(same_bits(got[k], sd[k]) for k in sd)
    assert gc.isenabled()


def test_load_into_runs_with_the_collector_paused(tmp_path: Path, collector_on: None) -> None:
    path, sd = _folder(tmp_path)
    model = nn.Module()
    layers = nn.ModuleList(nn.Linear(6, 4, bias=False) for _ in range(5))
    model.add_module("layers", layers)
    seen: list[bool] = []

    def key_map(key: str) -> str:
        seen.append(gc.isenabled())
        return key

    opts = lazyckpt.ModelCheckpointLoadOptions(key_map=key_map)
    report = lazyckpt.load_into(model, path, options=opts)
    assert seen and not any(seen)
    assert gc.isenabled()
    assert sorted(report.loaded) == sorted(sd)
    assert all(same_bits(layers[i].weight, sd[f"layers.{i}.weight"]) for i in range(5))


def test_the_collector_is_back_on_after_an_error(tmp_path: Path, collector_on: None) -> None:
    path, _ = _folder(tmp_path)

    def key_map(key: str) -> str:
        raise RuntimeError("the caller's key map failed")

    opts = lazyckpt.ModelCheckpointLoadOptions(key_map=key_map)
    with pytest.raises(RuntimeError, match="key map failed"):
        lazyckpt.get_model_checkpoint_loader().lazy_load(path, {}, opts)
    assert gc.isenabled()
    model = nn.Linear(6, 4)
    with pytest.raises(RuntimeError, match="key map failed"):
        lazyckpt.load_into(model, path, options=opts)
    assert gc.isenabled()
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"\xff" * 16)
    with pytest.raises(lazyckpt.CorruptModelCheckpointError):
        lazyckpt.get_model_checkpoint_loader().lazy_load(damaged, {})
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(tmp_path: Path, collector_on: None) -> None:
    path, sd = _folder(tmp_path)
    gc.disable()
    try:
        got = dict(lazyckpt.get_model_checkpoint_loader().lazy_load(path, {}))
        assert not gc.isenabled()
        model = nn.Module()
        model.add_module("layers", nn.ModuleList(nn.Linear(6, 4, bias=False) for _ in range(5)))
        lazyckpt.load_into(model, path)
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert got.keys() == sd.keys()


# -- what a pause that made many objects leaves the collector ----------------------------------
# Counts are read inside the block: after it, the first tracked allocation past the young
# threshold (700) runs a young collection, which moves what it finds to the middle generation.


def _in_oldest_generation(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects(generation=2))


def test_a_pause_that_made_many_objects_ends_with_them_in_the_oldest_generation(
    collector_on: None,
) -> None:
    """Left young, the next young and middle collections would walk them all again."""
    gc.collect()
    with gc_paused():
        made = [[i] for i in range(_PROMOTE_MIN + 2000)]
        assert gc.get_count()[0] >= _PROMOTE_MIN
    assert gc.isenabled()
    assert _in_oldest_generation(made[0]) and _in_oldest_generation(made[-1])


def test_a_small_pause_leaves_the_generations_as_they_were(collector_on: None) -> None:
    gc.collect()
    with gc_paused():
        made = [[i] for i in range(500)]
    assert gc.get_count()[0] >= 500  # below the young threshold: no collection since
    assert not _in_oldest_generation(made[0])


def test_nothing_the_caller_froze_is_thawed(collector_on: None) -> None:
    """A fork server freezes its objects so that collections never write to their pages;
    ``gc.unfreeze()`` at the end of a pause would give them back to the collector."""
    gc.collect()
    kept = [[i] for i in range(100)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            made = [[i] for i in range(_PROMOTE_MIN + 2000)]
        assert gc.get_freeze_count() >= frozen
        assert not _in_oldest_generation(kept[0])  # still frozen, not back in a generation
        assert not _in_oldest_generation(made[0])
    finally:
        gc.unfreeze()


def test_a_cycle_promoted_by_a_pause_is_still_collected(collector_on: None) -> None:
    gc.collect()
    freed: list[bool] = []

    class Node:
        other: Node

    with gc_paused():
        made = [[i] for i in range(_PROMOTE_MIN + 2000)]
        a, b = Node(), Node()
        a.other, b.other = b, a
        weakref.finalize(a, freed.append, True)
        del a, b
    assert not freed  # left young, the first young collection after the block would free it
    assert _in_oldest_generation(made[0])
    gc.collect()
    assert freed == [True]


def test_a_load_of_many_keys_leaves_its_plans_in_the_oldest_generation(
    tmp_path: Path, collector_on: None
) -> None:
    """The stream goes on with the collector on: its young collections walk what the stream
    makes, not the objects the index and the plans made for every key."""
    sd = {f"experts.{i}.w": torch.full((2,), float(i)) for i in range(3000)}
    path = write_checkpoint("safetensors-file", sd, tmp_path / "many")
    gc.collect()
    stream = lazyckpt.get_model_checkpoint_loader().lazy_load(path, {})
    plans = [o for o in gc.get_objects(generation=2) if type(o) is TensorPlan]
    assert len(plans) >= len(sd)
    del plans
    got = dict(stream)
    assert got.keys() == sd.keys()
    assert all(same_bits(got[k], sd[k]) for k in sd)


# -- other interpreters: CPython 3.12 files immortal objects under the permanent generation ----

_ON_ANOTHER_INTERPRETER = """
import gc, importlib.util, sys
spec = importlib.util.spec_from_file_location("gcpause", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
gc.collect()  # on 3.12 this files the immortal objects it meets under the permanent generation
with m.gc_paused():
    made = [[i] for i in range(m._PROMOTE_MIN + 2000)]
assert any(o is made[0] for o in gc.get_objects(2)), ("not promoted", gc.get_freeze_count())
gc.collect()
kept = [[i] for i in range(100)]
gc.freeze()
with m.gc_paused():
    more = [[i] for i in range(m._PROMOTE_MIN + 2000)]
assert not any(o is kept[0] for o in gc.get_objects(2)), "the caller's frozen objects thawed"
assert not any(o is more[0] for o in gc.get_objects(2)), "promoted past the caller's freeze"
print("ok", sys.version_info[:2], m._INTERPRETER_FROZEN)
"""


def _other_interpreters() -> list[str]:
    """CPython 3.12 and later found on this machine (on PATH, or pyenv's), that run."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = [shutil.which(f"python3.{minor}") for minor in range(12, 16)]
    found += [str(p) for p in sorted(root.glob("3.1[2-9]*/bin/python3"))]
    usable = {}
    for exe in filter(None, found):
        probe = subprocess.run(
            [exe, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, text=True
        )
        if probe.returncode == 0 and probe.stdout.split() != [str(v) for v in sys.version_info[:2]]:
            usable.setdefault(probe.stdout.strip(), exe)  # one interpreter per version
    return sorted(usable.values())


@pytest.mark.parametrize("python", _other_interpreters() or [None])
def test_a_pause_promotes_on_other_interpreters(python: str | None) -> None:
    """The module needs only the standard library, so it runs under any CPython found here: on
    3.12, whose freeze count is never 0, a check for 0 had turned the promotion off for good."""
    if python is None:
        pytest.skip("no other CPython (3.12 or later) on this machine")
    import lazyckpt.gcpause

    done = subprocess.run(
        [python, "-c", _ON_ANOTHER_INTERPRETER, lazyckpt.gcpause.__file__],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok"), done.stdout
