"""The cyclic garbage collector is paused while a load indexes and plans (and for the whole of
``load_into``), and left as the caller had it afterwards: on after a load, an error or a
stream left early, and off where the caller had turned it off."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import same_bits, write_checkpoint
from torch import nn

import lazyckpt


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
