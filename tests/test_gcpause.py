"""The cyclic garbage collector is paused while a load indexes and plans (and for the whole of
``load_into``), and left as the caller had it afterwards: on after a load, an error or a
stream left early, and off where the caller had turned it off."""

from __future__ import annotations

import gc
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
