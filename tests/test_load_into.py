"""``load_into`` for plain, meta-device and DTensor models (FSDP2, TP, FSDP2 + TP), built with
torch's own APIs in real gloo process groups and filled from sources of other layouts."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from dist_workers import (
    OddModel,
    check_load_into,
    check_load_into_a_mesh_without_this_rank,
    check_load_into_empty_tp_shard,
    check_load_into_matches_torch_sharding,
    check_load_into_unsharded,
    odd_model_truth,
    save_odd_dcp,
    spawn,
)
from helpers import same_bits
from safetensors.torch import save_file
from torch import nn

import lazyckpt


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    truth = odd_model_truth()
    torch.save(truth, root / "full.pt")
    save_file({k: v.contiguous() for k, v in truth.items()}, root / "full.safetensors")
    spawn(save_odd_dcp, 2, "fsdp2", str(root / "dcp-fsdp2"))
    spawn(save_odd_dcp, 4, "2d", str(root / "dcp-2d"))
    return {
        "pt": root / "full.pt",
        "safetensors": root / "full.safetensors",
        "dcp-fsdp2": root / "dcp-fsdp2",
        "dcp-2d": root / "dcp-2d",
    }


@pytest.mark.parametrize(
    ("kind", "world", "source", "meta"),
    [
        ("fsdp2", 2, "pt", False),
        ("fsdp2", 3, "dcp-2d", True),
        ("tp", 2, "dcp-fsdp2", False),
        ("tp", 3, "safetensors", False),
        ("2d", 4, "pt", False),
        ("2d", 4, "dcp-fsdp2", True),
        ("2d", 6, "pt", False),  # dp 3 x tp 2: uneven _StridedShard, full_tensor() agrees
    ],
)
def test_dtensor_models_match_the_truth(sources: dict[str, Path], kind: str, world: int,
                                        source: str, meta: bool) -> None:
    spawn(check_load_into, world, kind, str(sources[source]), meta)


@pytest.mark.parametrize(("kind", "world"), [("2d", 6), ("2d", 4), ("fsdp2", 3), ("tp", 3)])
def test_local_shards_are_what_torch_shards_the_truth_into(
    sources: dict[str, Path], kind: str, world: int
) -> None:
    # dp 3 x tp 2: FSDP2 over TP on dim 0 is _StridedShard(0, split_factor=2); with 53 and 7
    # rows torch's compute_local_shape_and_global_offset places rows elsewhere than FSDP2 does.
    spawn(check_load_into_matches_torch_sharding, world, kind, str(sources["safetensors"]))


@pytest.mark.parametrize(("kind", "world"), [("fsdp2", 2), ("2d", 4)])
def test_a_model_holding_unsharded_parameters_is_filled_in_its_sharded_ones(
    sources: dict[str, Path], kind: str, world: int
) -> None:
    spawn(check_load_into_unsharded, world, kind, str(sources["pt"]))


def test_plain_model_is_filled_in_place(sources: dict[str, Path]) -> None:
    truth = odd_model_truth()
    model = OddModel().to(torch.float64)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    report = lazyckpt.load_into(model, sources["pt"])
    assert report.loaded == list(truth) and not report.missing and not report.unexpected
    for name, p in model.named_parameters():
        assert p.data_ptr() == before[name]  # same storage: no new full-size buffer
        assert same_bits(p.detach(), truth[name].to(torch.float64))
    assert model.steps.dtype == torch.int64 and int(model.steps) == 3


def test_meta_model_materializes_on_the_target_device(sources: dict[str, Path]) -> None:
    truth = odd_model_truth()
    with torch.device("meta"):
        model = OddModel()
    lazyckpt.load_into(model, sources["dcp-2d"])
    for name, t in model.state_dict().items():
        assert t.device.type == "cpu" and same_bits(t, truth[name]), name
    assert isinstance(model.up.weight, nn.Parameter) and model.up.weight.requires_grad


@pytest.mark.parametrize("mmap", [True, False])
def test_an_ambient_default_device_does_not_decide_where_lazyckpt_reads(
    tmp_path: Path, mmap: bool
) -> None:
    # Inside the `with torch.device("meta")` that built the model (or after
    # torch.set_default_device), options.device=None still means the CPU: buffers made without
    # a device went to meta (parameters left there, reported loaded; preadv into no memory).
    truth = {"weight": torch.randn(64, 32), "bias": torch.randn(64)}
    save_file(truth, tmp_path / "m.safetensors")
    options = lazyckpt.ModelCheckpointLoadOptions(mmap=mmap)
    with torch.device("meta"):
        model = nn.Linear(32, 64)
        report = lazyckpt.load_into(model, tmp_path / "m.safetensors", options=options)
        cast = lazyckpt.ModelCheckpointLoadOptions(mmap=mmap, dtype=torch.bfloat16)
        got = dict(lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", {}, cast))
    assert report.loaded == ["bias", "weight"]
    for name, t in model.state_dict().items():
        assert t.device.type == "cpu" and same_bits(t, truth[name]), name
    for name, t in got.items():
        assert t.device.type == "cpu" and same_bits(t, truth[name].to(torch.bfloat16)), name


def test_a_meta_parameters_attributes_come_along(sources: dict[str, Path]) -> None:
    # Megatron-style tags on a parameter (its TP layout) were lost with the meta tensor.
    with torch.device("meta"):
        model = OddModel()
    model.up.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
    model.up.weight.partition_dim = 0  # type: ignore[attr-defined]
    model.down.bias.requires_grad_(False)
    lazyckpt.load_into(model, sources["pt"])
    assert not model.up.weight.is_meta
    assert model.up.weight.tensor_model_parallel is True  # type: ignore[attr-defined]
    assert model.up.weight.partition_dim == 0  # type: ignore[attr-defined]
    assert not hasattr(model.up.bias, "partition_dim")
    assert not model.down.bias.requires_grad and model.up.bias.requires_grad


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_a_cuda_device_without_cuda_is_a_value_error(sources: dict[str, Path]) -> None:
    # Only where it would be used: a meta model is materialized there.
    with torch.device("meta"):
        model = OddModel()
    options = lazyckpt.ModelCheckpointLoadOptions(device="cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        lazyckpt.load_into(model, sources["pt"], options=options)
    lazyckpt.load_into(OddModel(), sources["pt"], options=options)  # filled in place


def test_strict_reports_missing_and_unexpected_before_reading(tmp_path: Path) -> None:
    truth = odd_model_truth()
    partial = {k: v for k, v in truth.items() if k != "down.bias"}
    partial["extra.weight"] = torch.ones(2)
    torch.save(partial, tmp_path / "partial.pt")
    model = OddModel()
    original = model.up.weight.detach().clone()
    with pytest.raises(lazyckpt.KeyMismatchError, match=r"missing \['down.bias'\].*unexpected \['extra.weight'\]"):
        lazyckpt.load_into(model, tmp_path / "partial.pt")
    assert torch.equal(model.up.weight, original)  # nothing was written
    stats = lazyckpt.LoadStats()
    report = lazyckpt.load_into(model, tmp_path / "partial.pt", strict=False,
                                options=lazyckpt.ModelCheckpointLoadOptions(stats=stats))
    assert report.missing == ["down.bias"] and report.unexpected == ["extra.weight"]
    assert torch.equal(model.up.weight, truth["up.weight"])
    # The unexpected tensor was never read.
    assert stats.total_bytes_read == sum(v.nbytes for k, v in partial.items() if k != "extra.weight")


def _suggested_key_map(message: str):
    """The ``key_map`` a KeyMismatchError suggests, evaluated as written in the message."""
    import re

    found = re.search(r"key_map=(lambda k: .+?) loads them", message)
    assert found, message
    return eval(found.group(1))  # the message's own code, checked by loading with it


def test_a_prefixed_dcp_save_gets_the_key_map_that_loads_it(tmp_path: Path) -> None:
    """DCP saved as ``{"model": ..., "optim": ...}`` names every weight ``model.*``: the error
    says which key_map loads it, and that key_map does."""
    import torch.distributed.checkpoint as dcp

    truth = odd_model_truth()
    optim = {"state": {"0": {"exp_avg": torch.ones(3)}}}
    dcp.save({"model": truth, "optim": optim}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    with pytest.raises(lazyckpt.KeyMismatchError, match=r"under the prefix 'model\.'") as info:
        lazyckpt.load_into(OddModel(), tmp_path / "dcp")
    key_map = _suggested_key_map(str(info.value))
    model = OddModel()
    report = lazyckpt.load_into(
        model, tmp_path / "dcp", options=lazyckpt.ModelCheckpointLoadOptions(key_map=key_map)
    )
    assert not report.missing and not report.unexpected
    for key, value in model.state_dict().items():
        assert torch.equal(value, truth[key]), key


class _Wrapped(nn.Module):
    """A model held as ``module``, as DistributedDataParallel holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.module = OddModel()


def test_a_wrapped_model_gets_the_key_map_that_loads_into_it(tmp_path: Path) -> None:
    truth = odd_model_truth()
    torch.save(truth, tmp_path / "full.pt")
    with pytest.raises(lazyckpt.KeyMismatchError, match=r"under the prefix 'module\.'") as info:
        lazyckpt.load_into(_Wrapped(), tmp_path / "full.pt")
    key_map = _suggested_key_map(str(info.value))
    model = _Wrapped()
    lazyckpt.load_into(
        model, tmp_path / "full.pt", options=lazyckpt.ModelCheckpointLoadOptions(key_map=key_map)
    )
    for key, value in model.module.state_dict().items():
        assert torch.equal(value, truth[key]), key


def test_no_prefix_hint_where_the_keys_simply_differ(tmp_path: Path) -> None:
    truth = odd_model_truth()
    partial = {k: v for k, v in truth.items() if k != "down.bias"}
    partial["extra.weight"] = torch.ones(2)
    torch.save(partial, tmp_path / "partial.pt")
    with pytest.raises(lazyckpt.KeyMismatchError) as info:
        lazyckpt.load_into(OddModel(), tmp_path / "partial.pt")
    assert "under the prefix" not in str(info.value)


class _Base(nn.Module):
    """A Hugging Face base model: what ``model.*`` holds in a ``*ForCausalLM``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.layer = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


class _CausalLM(nn.Module):
    """``model.*`` keys beside an unprefixed ``lm_head.weight``, as Hugging Face saves them."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Base()
        self.lm_head = nn.Linear(4, 5, bias=False)


class _Flat(_Base):
    """The same tensors, in the same order, with no ``model.`` prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(4, 5, bias=False)


class _DDP(nn.Module):
    """``_Flat`` held as ``module``, as DistributedDataParallel holds it: every key prefixed."""

    def __init__(self) -> None:
        super().__init__()
        self.module = _Flat()


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
@pytest.mark.parametrize(
    ("source", "target", "extra", "prefix", "keeps"),
    [
        (_CausalLM, _Flat, False, "model.", True),  # strip 'model.', keep lm_head.weight
        (_CausalLM, _Flat, True, "model.", True),  # ... and drop a key matching nothing
        (_Flat, _CausalLM, False, "model.", True),  # add 'model.', but not to lm_head.weight
        (_Flat, _CausalLM, True, "model.", True),
        (_DDP, _Flat, False, "module.", False),  # every key prefixed, as before
        (_DDP, _Flat, True, "module.", False),
        (_Flat, _DDP, False, "module.", False),
    ],
)
def test_the_suggested_key_map_loads_the_model_as_written(
    tmp_path: Path,
    fmt: str,
    source: type[nn.Module],
    target: type[nn.Module],
    extra: bool,
    prefix: str,
    keeps: bool,
) -> None:
    """A checkpoint of ``model.*`` keys and an unprefixed ``lm_head.weight``, into a model
    without the prefix (or the reverse): the hint's key_map, followed as written, dropped
    ``lm_head.weight`` (or renamed it away) and the load failed again. The hint is followed
    literally here, from the message's own text."""
    torch.manual_seed(0)
    truth = dict(source().state_dict())
    if extra:
        truth["optim.step"] = torch.ones(3)  # matches nothing on either side
    path = tmp_path / f"ckpt.{fmt}"
    if fmt == "pt":
        torch.save(truth, path)
    else:
        save_file({k: v.contiguous() for k, v in truth.items()}, path)
    with pytest.raises(lazyckpt.KeyMismatchError, match=f"under the prefix '{prefix}'") as info:
        lazyckpt.load_into(target(), path)
    message = str(info.value)
    key_map = _suggested_key_map(message)
    model = target()
    options = lazyckpt.ModelCheckpointLoadOptions(key_map=key_map)
    if extra and key_map("optim.step") is not None:  # renamed, not dropped: as the hint said
        assert "drops" not in message
        report = lazyckpt.load_into(model, path, options=options, strict=False)
        assert report.unexpected == [key_map("optim.step")]
    else:
        report = lazyckpt.load_into(model, path, options=options)
        assert not report.unexpected
    assert not report.missing and len(report.loaded) == 6
    got = list(model.state_dict().values())  # the same tensors in the same order
    assert all(torch.equal(a, b) for a, b in zip(got, list(truth.values())[:6], strict=True))
    assert ("keeps the keys that already match" in message) == keeps, message


def test_shape_mismatch_always_raises(tmp_path: Path) -> None:
    truth = odd_model_truth()
    truth["up.weight"] = torch.zeros(8, 6)
    torch.save(truth, tmp_path / "bad.pt")
    with pytest.raises(lazyckpt.KeyMismatchError, match=r"up.weight: checkpoint \(8, 6\), model \(7, 6\)"):
        lazyckpt.load_into(OddModel(), tmp_path / "bad.pt", strict=False)


def test_options_load_into_does_not_honour_are_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """``options.layout`` and ``options.dtype`` were ignored without a word: a rank-local model
    given its ``Layout`` failed on shapes naming no fix, and a meta model asked for bfloat16
    came out in float32. Refused up front, saying what to do instead."""
    torch.manual_seed(0)
    full = nn.Linear(8, 8)
    torch.save(full.state_dict(), tmp_path / "full.pt")
    options = lazyckpt.ModelCheckpointLoadOptions
    tp2 = lazyckpt.Layout(tp_size=2, tp_rank=1)
    local = nn.Linear(8, 4)  # what a ColumnParallelLinear holds on TP rank 1 of 2
    before = {k: v.clone() for k, v in local.state_dict().items()}
    dims = {"weight": 0, "bias": 0}
    with pytest.raises(ValueError, match=r"options\.layout \(tp 1/2.*own mesh and placements.*lazy_load") as info:
        lazyckpt.load_into(local, tmp_path / "full.pt", shard_dims=dims, options=options(layout=tp2))
    assert "dtype" not in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in local.state_dict().items())
    with torch.device("meta"):
        meta = nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"options\.dtype \(torch\.bfloat16\).*model\.to\(torch\.bfloat16\)"):
        lazyckpt.load_into(meta, tmp_path / "full.pt", options=options(dtype=torch.bfloat16))
    assert meta.weight.is_meta
    with pytest.raises(ValueError, match=r"options\.layout.*leave options\.layout None"):
        lazyckpt.load_into(meta, tmp_path / "full.pt", options=options(dtype=torch.float16, layout=tp2))
    # What the message says loads the rank-local model.
    loader = lazyckpt.get_model_checkpoint_loader()
    local.load_state_dict(dict(loader.lazy_load(tmp_path / "full.pt", dims, options(layout=tp2))))
    assert torch.equal(local.weight, full.weight[4:]) and torch.equal(local.bias, full.bias[4:])
    # The dtype the message says to give first is the one loaded.
    lazyckpt.load_into(meta.to(torch.bfloat16), tmp_path / "full.pt")
    assert meta.weight.dtype == torch.bfloat16
    assert torch.equal(meta.weight, full.weight.to(torch.bfloat16))
    # Options that change nothing here are taken: a whole-tensor layout, contiguous, prefetch.
    plain = nn.Linear(8, 8)
    taken = options(layout=lazyckpt.Layout(), contiguous=True, prefetch_bytes=0, mmap=False)
    lazyckpt.load_into(plain, tmp_path / "full.pt", options=taken)
    assert torch.equal(plain.weight, full.weight)


def test_options_dtype_the_model_already_has_is_taken(tmp_path: Path) -> None:
    """One options object serves ``lazy_load`` and ``load_into``: its ``dtype`` is taken where
    every floating-point tensor of the model has it (the one cast is the same), and refused,
    naming a tensor of another dtype, where one has not (a float32 buffer of a bfloat16 model
    would get the values ``lazy_load`` rounds to bfloat16)."""
    torch.manual_seed(0)
    full = nn.Linear(8, 8)
    torch.save(full.state_dict(), tmp_path / "full.pt")
    bf16 = lazyckpt.ModelCheckpointLoadOptions(dtype=torch.bfloat16)
    loader = lazyckpt.get_model_checkpoint_loader()
    with torch.device("meta"):
        model = nn.Linear(8, 8).to(torch.bfloat16)
    model.register_buffer("steps", torch.zeros(2, dtype=torch.int64))  # not floating: no matter
    torch.save({**full.state_dict(), "steps": torch.tensor([3, 4])}, tmp_path / "full.pt")
    lazyckpt.load_into(model, tmp_path / "full.pt", options=bf16)
    expected = dict(loader.lazy_load(tmp_path / "full.pt", {}, bf16))
    assert model.weight.dtype == torch.bfloat16
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())

    mixed = nn.Linear(8, 8).to(torch.bfloat16)
    mixed.register_buffer("scale", torch.ones(8))  # float32
    torch.save({**full.state_dict(), "scale": torch.full((8,), 1 / 3)}, tmp_path / "mixed.pt")
    before = mixed.weight.clone()
    with pytest.raises(ValueError, match=r"options\.dtype \(torch\.bfloat16\).*'scale' \(torch\.float32 in the checkpoint\) fills a torch\.float32 one"):
        lazyckpt.load_into(mixed, tmp_path / "mixed.pt", options=bf16)
    assert torch.equal(mixed.weight, before)
    # A float the checkpoint holds for an integer buffer: lazy_load rounds 257.0 to bfloat16's
    # 256 first, load_into would not.
    counted = nn.Linear(8, 8).to(torch.bfloat16)
    counted.register_buffer("steps", torch.zeros((), dtype=torch.int64))
    torch.save({**full.state_dict(), "steps": torch.tensor(257.0)}, tmp_path / "steps.pt")
    with pytest.raises(ValueError, match=r"'steps' \(torch\.float32 in the checkpoint\) fills a torch\.int64 one; leave options\.dtype None"):
        lazyckpt.load_into(counted, tmp_path / "steps.pt", options=bf16)
    lazyckpt.load_into(counted, tmp_path / "steps.pt")
    assert counted.steps.item() == 257
    # A dtype that casts nothing (the checkpoint's own) changes no value: taken.
    counted.steps.zero_()
    lazyckpt.load_into(counted, tmp_path / "steps.pt", options=lazyckpt.ModelCheckpointLoadOptions(dtype=torch.float32))
    assert counted.steps.item() == 257
    # A checkpoint already in the dtype asked for does not make a float32 meta model take it:
    # lazy_load gives bfloat16, so would load_into have, without a word, float32.
    torch.save(full.to(torch.bfloat16).state_dict(), tmp_path / "bf16.pt")
    with torch.device("meta"):
        wide = nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"'weight' \(torch\.bfloat16 in the checkpoint\) is made as a torch\.float32 one; give the model that dtype first"):
        lazyckpt.load_into(wide, tmp_path / "bf16.pt", options=bf16)
    assert wide.weight.is_meta
    # A module's extra state is cast as lazy_load casts it, so it does not stand in the way.

    class Scaled(nn.Linear):
        def get_extra_state(self) -> torch.Tensor:
            return self.scale

        def set_extra_state(self, state: torch.Tensor) -> None:
            self.scale = state

    scaled = Scaled(8, 8).to(torch.bfloat16)
    scaled.scale = torch.full((2,), 1 / 3)
    torch.save(scaled.state_dict(), tmp_path / "scaled.pt")
    scaled.scale = torch.zeros(2)
    lazyckpt.load_into(scaled, tmp_path / "scaled.pt", options=bf16)
    want = dict(loader.lazy_load(tmp_path / "scaled.pt", {}, bf16))["_extra_state"]
    assert scaled.scale.dtype == torch.bfloat16 and torch.equal(scaled.scale, want)


_MESH_CHILD = """
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
import lazyckpt
torch.save(torch.nn.Linear(3, 2).state_dict(), sys.argv[2])
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
try:
    lazyckpt.load_into(torch.nn.Linear(3, 2), sys.argv[2],
                       options=lazyckpt.ModelCheckpointLoadOptions(mesh=mesh))
except ValueError as exc:
    print(exc)
dist.destroy_process_group()
"""


def test_a_mesh_in_the_options_is_refused(tmp_path: Path) -> None:
    """A DTensor's own mesh and placements give its shard: ``options.mesh`` was ignored."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-c", _MESH_CHILD, str(port), str(tmp_path / "m.pt")],
        capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("load_into takes no options.mesh: each tensor's own box"), done.stdout
    assert "leave options.mesh None" in done.stdout


def test_a_rank_local_model_gets_a_shape_error_that_names_lazy_load(tmp_path: Path) -> None:
    """A model of plain tensors of one TP rank's shapes (fairscale's parallel layers), without a
    layout: the shape error says how such a model is loaded. A shape that no TP chunk gives (a
    resized vocabulary) gets no such hint."""
    torch.save(nn.Linear(8, 8).state_dict(), tmp_path / "full.pt")
    with pytest.raises(lazyckpt.KeyMismatchError, match=r"weight: checkpoint \(8, 8\), model \(4, 8\)") as info:
        lazyckpt.load_into(nn.Linear(8, 4), tmp_path / "full.pt")
    message = str(info.value)
    assert "cut on one dim ({'weight': 0, 'bias': 0})" in message
    assert "lazy_load(path, shard_dims, ModelCheckpointLoadOptions(layout=Layout(tp_size=2, tp_rank=...)))" in message
    with pytest.raises(lazyckpt.KeyMismatchError, match=r"\{'weight': 1\}.*tp_size=2"):
        lazyckpt.load_into(nn.Linear(4, 8), tmp_path / "full.pt")  # a RowParallelLinear's
    torch.save({"weight": torch.zeros(32001, 4)}, tmp_path / "vocab.pt")
    with pytest.raises(lazyckpt.KeyMismatchError) as info:
        lazyckpt.load_into(nn.Embedding(32000, 4), tmp_path / "vocab.pt")
    assert "lazy_load" not in str(info.value)
    with pytest.raises(lazyckpt.KeyMismatchError) as info:  # two dims differ
        lazyckpt.load_into(nn.Linear(4, 4), tmp_path / "full.pt")
    assert "lazy_load" not in str(info.value)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.uint8])
def test_a_dtype_torch_cannot_convert_raises_before_anything_is_written(
    tmp_path: Path, model_dtype: torch.dtype
) -> None:
    # copy_ has no kernel to or from the packed float4: it stopped the load halfway, naming no
    # key, with the keys before it written.
    w = torch.randint(0, 256, (4, 3), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    save_file({"a": torch.full((5,), 2.0), "w": w}, tmp_path / "m.safetensors")
    model = nn.Module()
    model.a = nn.Parameter(torch.zeros(5))
    model.w = nn.Parameter(torch.zeros(4, 3, dtype=model_dtype), requires_grad=False)
    with pytest.raises(lazyckpt.KeyMismatchError, match=rf"w: checkpoint torch.float4_e2m1fn_x2, model {model_dtype}"):
        lazyckpt.load_into(model, tmp_path / "m.safetensors")
    assert torch.equal(model.a.detach(), torch.zeros(5))
    model.register_buffer("q", torch.zeros(3, dtype=torch.uint4))  # sub-byte integers too
    save_file({"a": torch.full((5,), 2.0), "q": torch.ones(3, dtype=torch.uint8)}, tmp_path / "q.safetensors")
    with pytest.raises(lazyckpt.KeyMismatchError, match=r"q: checkpoint torch.uint8, model torch.uint4"):
        lazyckpt.load_into(model, tmp_path / "q.safetensors", strict=False)
    assert torch.equal(model.a.detach(), torch.zeros(5))
    del model.q
    # Its own dtype loads.
    model.w = nn.Parameter(torch.zeros(4, 3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2), requires_grad=False)
    lazyckpt.load_into(model, tmp_path / "m.safetensors")
    assert same_bits(model.w.detach(), w) and torch.equal(model.a.detach(), torch.full((5,), 2.0))


class _WithExtraState(nn.Module):
    """Keeps a tensor out of its parameters and buffers, in its extra state (as
    TransformerEngine's modules keep their FP8 scaling state)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = torch.zeros(4)

    def get_extra_state(self) -> torch.Tensor:
        return self.scale.clone()

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.scale = state.clone()


@pytest.mark.parametrize("meta", [False, True])
def test_extra_state_and_checkpoint_wrapped_layers_load_under_their_state_dict_names(
    tmp_path: Path, meta: bool
) -> None:
    # A checkpoint of the model's own state dict loads into it, as with load_state_dict: the
    # extra state is handed to set_extra_state (it was refused as unexpected, or with
    # strict=False silently left unset), and checkpoint_wrapper's inner layer is filled under
    # the name its state dict gives (it was refused as missing).
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def build() -> nn.Module:
        return nn.Sequential(_WithExtraState(), checkpoint_wrapper(nn.Linear(3, 2)))

    torch.manual_seed(0)
    src = build()
    src[0].scale = torch.arange(4.0)
    torch.save(src.state_dict(), tmp_path / "m.pt")
    assert "1.weight" in src.state_dict() and "0._extra_state" in src.state_dict()
    if meta:
        with torch.device("meta"):
            model = build()
    else:
        model = build()
    report = lazyckpt.load_into(model, tmp_path / "m.pt")
    assert sorted(report.loaded) == sorted(src.state_dict()) and not report.missing
    assert torch.equal(model[0].scale, torch.arange(4.0))
    for key, value in src.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    # Left out of the checkpoint, the extra state is missing, as load_state_dict says.
    torch.save({k: v for k, v in src.state_dict().items() if "extra" not in k}, tmp_path / "n.pt")
    with pytest.raises(lazyckpt.KeyMismatchError, match=r"missing \['0._extra_state'\]"):
        lazyckpt.load_into(build(), tmp_path / "n.pt")


def test_shard_dims_name_every_path_of_shared_and_subclassed_fairscale_layers() -> None:
    # A module under two paths (or a tied weight) is in the state dict, and so in checkpoints,
    # under each: the second was left out, its key then read as a replica (a load failed with
    # a shape mismatch). A subclass of a fairscale layer (a fused QKV) splits as its base.
    class ColumnParallelLinear(nn.Linear):  # fairscale's layers are told by class name
        pass

    class RowParallelLinear(nn.Linear):
        pass

    class FusedQKV(ColumnParallelLinear):
        pass

    shared = ColumnParallelLinear(3, 4)
    model = nn.ModuleDict(
        {"a": shared, "b": shared, "qkv": FusedQKV(3, 6), "o": RowParallelLinear(6, 3)}
    )
    assert set(model.state_dict()) == {
        "a.weight", "a.bias", "b.weight", "b.bias", "qkv.weight", "qkv.bias", "o.weight", "o.bias"
    }
    assert lazyckpt.get_shard_dims(model) == {
        "a.weight": 0, "a.bias": 0, "b.weight": 0, "b.bias": 0,
        "qkv.weight": 0, "qkv.bias": 0, "o.weight": 1,
    }


_MESH_DIMS_CHILD = """
import os, sys, torch, torch.distributed as dist
from torch import nn
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
import lazyckpt

# A tied TP weight: the state dict holds it under both names.
tp = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
model = nn.Module()
model.embed = nn.Embedding(6, 4)
model.lm_head = nn.Linear(4, 6, bias=False)
model.embed.weight = nn.Parameter(distribute_tensor(torch.ones(6, 4), tp, [Shard(0)]))
model.lm_head.weight = model.embed.weight
print(sorted(lazyckpt.get_shard_dims(model).items()))

# torch's own HSDP mesh names: replicas, then FSDP's shards; no TP.
hsdp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
plain = fully_shard(nn.Sequential(nn.Linear(4, 4)), mesh=hsdp)
print(lazyckpt.get_shard_dims(plain), lazyckpt.Layout.from_mesh(hsdp))
dist.destroy_process_group()
"""


def test_shard_dims_of_a_tied_dtensor_and_of_torchs_hsdp_mesh() -> None:
    # A tied DTensor weight's second name was left out; fully_shard on torch's HSDP mesh
    # ("replicate", "shard") raised "a 2-D mesh whose dims are not named".
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-c", _MESH_DIMS_CHILD, str(port)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[('embed.weight', 0), ('lm_head.weight', 0)]",
        "{} tp 0/1, dp 0/1",
    ], done.stdout


def test_shard_dims_use_the_state_dict_names_of_checkpoint_wrapped_layers() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class ColumnParallelLinear(nn.Linear):  # fairscale's layers are told by class name
        pass

    model = nn.Sequential(checkpoint_wrapper(ColumnParallelLinear(3, 4)))
    assert lazyckpt.get_shard_dims(model) == {"0.weight": 0, "0.bias": 0}


def test_state_dicts_that_hooks_change_or_thin_leave_every_tensor_under_its_path(
    tmp_path: Path,
) -> None:
    # Names come from the state dict only where it holds the path's own tensor: a hook that
    # casts, an override that saves only adapters, a state_dict() without keep_vars, or one
    # module's extra state left out must not drop paths load_state_dict expects (they were
    # left unloaded, or the load refused), nor hand one module's extra state to another.
    source = nn.Linear(2, 2)
    torch.save(source.state_dict(), tmp_path / "m.pt")

    def halve(module: nn.Module, sd: dict[str, torch.Tensor], prefix: str, local: object) -> None:
        sd[prefix + "weight"] = sd[prefix + "weight"] / 2

    casting = nn.Linear(2, 2)
    casting._register_state_dict_hook(halve)
    lazyckpt.load_into(casting, tmp_path / "m.pt")
    assert torch.equal(casting.weight.detach(), source.weight.detach())

    class Adapter(nn.Linear):  # saves only what training changed, as LoRA wrappers do
        def state_dict(self, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:
            return {}

    with torch.device("meta"):
        adapted = nn.Sequential(Adapter(2, 2))
    torch.save({f"0.{k}": v for k, v in source.state_dict().items()}, tmp_path / "base.pt")
    lazyckpt.load_into(adapted, tmp_path / "base.pt")
    assert torch.equal(adapted[0].weight.detach(), source.weight.detach())

    class Legacy(nn.Linear):
        def state_dict(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
            return {"weight": self.weight.detach(), "bias": self.bias.detach()}

    legacy = Legacy(2, 2)
    lazyckpt.load_into(legacy, tmp_path / "m.pt")
    assert torch.equal(legacy.bias.detach(), source.bias.detach())

    class Tagged(nn.Module):
        def __init__(self, tag: float) -> None:
            super().__init__()
            self.tag, self.got = tag, None

        def get_extra_state(self) -> torch.Tensor:
            return torch.tensor([self.tag])

        def set_extra_state(self, state: torch.Tensor) -> None:
            self.got = state

    def drop_a(module: nn.Module, sd: dict[str, torch.Tensor], prefix: str, local: object) -> None:
        sd.pop(prefix + "a._extra_state")

    def two() -> nn.Module:
        model = nn.Module()
        model.a, model.b = Tagged(1.0), Tagged(2.0)
        model._register_state_dict_hook(drop_a)
        return model

    torch.save(two().state_dict(), tmp_path / "extra.pt")
    model = two()
    report = lazyckpt.load_into(model, tmp_path / "extra.pt", strict=False)
    assert model.a.got is None and torch.equal(model.b.got, torch.tensor([2.0]))
    assert report.missing == ["a._extra_state"]


def test_an_extra_state_inside_a_wrapper_goes_where_its_module_went(tmp_path: Path) -> None:
    # Matched by order alone, a module elsewhere taking an extra state the checkpoint lacks
    # left the wrapped module's unmatched (missing, and its saved state unexpected).
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class SetOnly(nn.Module):
        def set_extra_state(self, state: object) -> None:
            self.got = state

    def build() -> nn.Module:
        model = nn.Module()
        model.a = checkpoint_wrapper(_WithExtraState())
        model.s = SetOnly()
        return model

    source = build()
    source.a._checkpoint_wrapped_module.scale = torch.arange(4.0)
    torch.save(source.state_dict(), tmp_path / "m.pt")
    model = build()
    report = lazyckpt.load_into(model, tmp_path / "m.pt", strict=False)
    assert torch.equal(model.a._checkpoint_wrapped_module.scale, torch.arange(4.0))
    assert report.missing == ["s._extra_state"] and report.unexpected == []


def test_a_complex_checkpoint_into_a_real_model_still_warns_of_the_imaginary_parts(
    tmp_path: Path,
) -> None:
    # torch says it once a process; the dtype check's probe used to swallow it under a filter.
    torch.save({"weight": torch.ones(2, 2, dtype=torch.complex64), "bias": torch.ones(2)}, tmp_path / "c.pt")
    code = (
        "import warnings, torch, lazyckpt\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        f"    lazyckpt.load_into(torch.nn.Linear(2, 2), {str(tmp_path / 'c.pt')!r})\n"
        "assert any('imaginary part' in str(w.message) for w in seen), [str(w.message) for w in seen]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_graph_that_saved_a_parameter_refuses_backward_after_load_into(tmp_path: Path) -> None:
    # Reads write the parameter's memory behind autograd's back: its version is bumped, as
    # copy_ in load_state_dict bumps it, so the old graph cannot run backward on new values.
    torch.save(nn.Linear(8, 8).state_dict(), tmp_path / "m.pt")
    model = nn.Linear(8, 8)
    loss = (model(torch.randn(2, 8, requires_grad=True)) ** 2).sum()  # saves the weight
    before = model.weight._version
    lazyckpt.load_into(model, tmp_path / "m.pt")
    assert model.weight._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


class _Tied(nn.Module):
    """Two names of one weight, the embedding first in module order but last by name."""

    def __init__(self, n: int = 4096) -> None:
        super().__init__()
        self.z_embed = nn.Embedding(n, 64)
        self.a_head = nn.Linear(64, n, bias=False)
        self.a_head.weight = self.z_embed.weight


@pytest.mark.parametrize("meta", [False, True])
@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_a_checkpoint_holding_both_names_of_a_tied_weight(tmp_path: Path, meta: bool, fmt: str) -> None:
    # Both keys fill one tensor: the one later in the model's state dict wins, as
    # load_state_dict leaves it (safetensors stores keys sorted by name, so file order is not
    # it). The other is read apart and compared (two reads into one tensor would race between
    # threads): saved untied, with other values, the checkpoint's is lost, and a warning says
    # so (it was lost without a word, where Hugging Face's from_pretrained warns).
    sd = {"z_embed.weight": torch.full((4096, 64), 1.0), "a_head.weight": torch.full((4096, 64), 2.0)}
    path = tmp_path / f"both.{fmt}"
    save_file(sd, path) if fmt == "safetensors" else torch.save(sd, path)
    same = tmp_path / f"same.{fmt}"
    equal = {k: torch.full((4096, 64), 2.0) for k in sd}
    save_file(equal, same) if fmt == "safetensors" else torch.save(equal, same)
    want = _Tied()
    want.load_state_dict(sd)
    for source, differ in ((path, True), (same, False)):
        if meta:
            with torch.device("meta"):
                model = _Tied()
        else:
            model = _Tied()
        stats = lazyckpt.LoadStats()
        options = lazyckpt.ModelCheckpointLoadOptions(stats=stats)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            report = lazyckpt.load_into(model, source, options=options)
        said = [w for w in seen if "ties 'z_embed.weight'" in str(w.message)]
        assert len(said) == differ and all(w.filename == __file__ for w in said), said
        assert report.loaded == ["a_head.weight"] and report.tied == ["z_embed.weight"], report
        assert model.a_head.weight is model.z_embed.weight
        assert torch.equal(model.z_embed.weight, want.z_embed.weight)
        assert stats.total_bytes_read == 2 * sd["a_head.weight"].nbytes  # both names read
        assert stats.bytes_verified == sd["z_embed.weight"].nbytes  # one only to compare


def test_a_tie_warning_made_an_error_leaves_a_meta_model_whole(tmp_path: Path) -> None:
    # The warning was given before the meta tensors were put in place: made an error, it left
    # the model on meta with its in-place targets already written.
    sd = {"z_embed.weight": torch.full((64, 64), 1.0), "a_head.weight": torch.full((64, 64), 2.0)}
    save_file(sd, tmp_path / "untied.safetensors")
    with torch.device("meta"):
        model = _Tied(64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=r"ties 'z_embed\.weight'"):
            lazyckpt.load_into(model, tmp_path / "untied.safetensors")
    assert not model.z_embed.weight.is_meta and torch.equal(model.a_head.weight, sd["a_head.weight"])


def test_tied_names_are_compared_where_they_are_other_bytes_within_the_replica_bound(
    tmp_path: Path,
) -> None:
    # torch.save of a tied model stores one storage under both names: nothing to compare. A
    # key beyond verify_replicas_max_bytes (an embedding, often) is compared on its first rows
    # within that many bytes (here 1000: 3 rows of 256), as much as a replica check reads.
    tied = _Tied()
    torch.save(tied.state_dict(), tmp_path / "tied.pt")
    sd = {"z_embed.weight": torch.full((4096, 64), 1.0), "a_head.weight": torch.full((4096, 64), 2.0)}
    save_file(sd, tmp_path / "untied.safetensors")
    save_file({k: sd["a_head.weight"].clone() for k in sd}, tmp_path / "equal.safetensors")
    nbytes, row = sd["a_head.weight"].nbytes, sd["a_head.weight"][0].nbytes
    for source, read, differ in (
        ("tied.pt", nbytes, False),
        ("untied.safetensors", nbytes + 3 * row, True),
        ("equal.safetensors", nbytes + 3 * row, False),
    ):
        stats = lazyckpt.LoadStats()
        options = lazyckpt.ModelCheckpointLoadOptions(stats=stats, verify_replicas_max_bytes=1000)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            lazyckpt.load_into(_Tied(), tmp_path / source, options=options)
        assert len([w for w in seen if "ties 'z_embed.weight'" in str(w.message)]) == differ, source
        assert stats.total_bytes_read == read, source


def test_two_parameters_over_one_tensor_are_tied(tmp_path: Path) -> None:
    # nn.Parameter(t) twice: two objects, one storage. With both names in the checkpoint and
    # different values, load_into wrote both at once (the two threads): a torn mix, or either
    # value, run to run. As load_state_dict: the later key's values, the other tied, read apart
    # to be compared, and its loss told.
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            t = torch.zeros(4, 1 << 16)
            self.a = nn.Parameter(t)
            self.b = nn.Parameter(t)

    sd = {"a": torch.full((4, 1 << 16), 1.0), "b": torch.full((4, 1 << 16), 2.0)}
    torch.save(sd, tmp_path / "m.pt")
    want = Shared()
    want.load_state_dict(torch.load(tmp_path / "m.pt"))
    for _ in range(3):
        model = Shared()
        with pytest.warns(UserWarning, match="ties 'a' to 'b'"):
            report = lazyckpt.load_into(model, tmp_path / "m.pt")
        assert report.loaded == ["b"] and report.tied == ["a"]
        assert torch.equal(model.a, want.a) and torch.equal(model.b, want.b)
        assert report.stats.total_bytes_read == 2 * sd["b"].nbytes


def test_overlapping_views_of_one_buffer_are_refused_and_interleaved_ones_load(
    tmp_path: Path,
) -> None:
    # x = flat[0:2N], y = flat[N:3N]: both written at once, the shared half came out torn.
    # Every other row of one buffer each share no element: loaded.
    n = 1 << 14

    class Overlap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            flat = torch.zeros(3 * n)
            self.x = nn.Parameter(flat[: 2 * n])
            self.y = nn.Parameter(flat[n:])

    class Interleaved(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            rows = torch.zeros(8, n)
            self.x = nn.Parameter(rows[::2])
            self.y = nn.Parameter(rows[1::2])

    torch.save({"x": torch.full((2 * n,), 1.0), "y": torch.full((2 * n,), 2.0)}, tmp_path / "o.pt")
    with pytest.raises(ValueError, match="'x' and 'y' share memory"):
        lazyckpt.load_into(Overlap(), tmp_path / "o.pt")
    sd = {"x": torch.randn(4, n), "y": torch.randn(4, n)}
    torch.save(sd, tmp_path / "i.pt")
    model = Interleaved()
    lazyckpt.load_into(model, tmp_path / "i.pt")
    assert torch.equal(model.x, sd["x"]) and torch.equal(model.y, sd["y"])


def _strided_pair(kind: str) -> nn.Module:
    m = nn.Module()
    if kind == "transpose":  # a parameter and a buffer that is its transpose
        m.x = nn.Parameter(torch.zeros(64, 64))
        m.register_buffer("y", m.x.data.t())
    else:  # column slices of one buffer: overlapping, or side by side
        flat = torch.zeros(16, 64)
        m.register_buffer("x", flat[:, :48] if kind == "overlap" else flat[:, :16])
        m.register_buffer("y", flat[:, 16:])
    return m


@pytest.mark.parametrize("kind", ["transpose", "overlap", "side by side"])
def test_strided_views_that_share_elements_are_refused_and_others_load(
    tmp_path: Path, kind: str
) -> None:
    # Strided targets were left out of the check: a parameter and its transpose, or two
    # overlapping column slices, were written at once by the two threads, a mix of both that
    # changed run to run (found with 2048 x 2048 float32, rows read by preadv).
    want = _strided_pair(kind)
    sd = {k: torch.randn(v.shape) for k, v in want.state_dict().items()}
    save_file(sd, tmp_path / "m.safetensors")
    if kind == "side by side":
        want.load_state_dict(sd)
        model = _strided_pair(kind)
        lazyckpt.load_into(model, tmp_path / "m.safetensors")
        assert torch.equal(model.x, want.x) and torch.equal(model.y, want.y)
        return
    with pytest.raises(ValueError, match="'x' and 'y' share memory"):
        lazyckpt.load_into(_strided_pair(kind), tmp_path / "m.safetensors")


def test_a_lazy_module_is_refused_by_name(tmp_path: Path) -> None:
    # nn.LazyLinear's parameters have no shape before a forward pass: torch's own error came
    # out of the planning ("Can't access the shape of an uninitialized parameter").
    torch.save({"0.weight": torch.randn(5, 3), "0.bias": torch.randn(5)}, tmp_path / "m.pt")
    with pytest.raises(ValueError, match=r"'0\.weight' is an uninitialized parameter"):
        lazyckpt.load_into(nn.Sequential(nn.LazyLinear(5)), tmp_path / "m.pt")


def test_an_expanded_target_is_refused_by_name_before_anything_is_written(tmp_path: Path) -> None:
    # copy_ refuses to write a tensor whose elements share memory; its message named no key,
    # and came after the keys before it had been written.
    model = nn.Module()
    model.register_buffer("a", torch.zeros(3))
    model.register_buffer("x", torch.zeros(1, 4).expand(3, 4))
    torch.save({"a": torch.ones(3), "x": torch.randn(3, 4)}, tmp_path / "e.pt")
    with pytest.raises(ValueError, match=r"'x' is an expanded tensor"):
        lazyckpt.load_into(model, tmp_path / "e.pt")
    assert torch.equal(model.a, torch.zeros(3))  # nothing written
    # Dropped by key_map, the rest loads.
    opts = lazyckpt.ModelCheckpointLoadOptions(key_map=lambda k: None if k == "x" else k)
    report = lazyckpt.load_into(model, tmp_path / "e.pt", options=opts, strict=False)
    assert report.loaded == ["a"] and torch.equal(model.a, torch.ones(3))


def test_tied_weights_and_key_map(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    w = torch.randn(10, 4)
    save_file({"model.embed.weight": w}, tmp_path / "tied.safetensors")
    for meta in (False, True):
        if meta:
            with torch.device("meta"):
                model = Tied()
        else:
            model = Tied()
        report = lazyckpt.load_into(
            model, tmp_path / "tied.safetensors",
            options=lazyckpt.ModelCheckpointLoadOptions(key_map=lambda k: k.removeprefix("model.")),
        )
        assert report.loaded == ["embed.weight"] and report.tied == ["head.weight"]
        assert model.head.weight is model.embed.weight and torch.equal(model.head.weight, w)


def test_shard_dims_that_cannot_be_inferred_are_refused(tmp_path: Path) -> None:
    for r in range(2):
        torch.save({"w": torch.zeros(3, 4)}, tmp_path / f"consolidated.{r:02d}.pth")

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(5, 4))

    with pytest.raises(ValueError, match="cannot infer the shard dim of 'w'"):
        lazyckpt.load_into(M(), tmp_path)


def test_a_plain_model_does_not_import_dtensor(tmp_path: Path) -> None:
    """Asking "is this parameter a DTensor?" of a plain model imports nothing: importing
    torch.distributed.tensor takes about half a second, more than a small model's load."""
    save_file({k: v.contiguous() for k, v in OddModel().state_dict().items()}, tmp_path / "m.safetensors")
    code = (
        "import sys; from dist_workers import OddModel; import lazyckpt\n"
        f"m = OddModel(); lazyckpt.load_into(m, {str(tmp_path / 'm.safetensors')!r})\n"
        "lazyckpt.get_shard_dims(m)\n"
        "print(sorted(n for n in ('torch.distributed.tensor', 'torch.distributed.fsdp') if n in sys.modules))"
    )
    tests = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", code], cwd=tests, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_mesh_and_placements_without_a_spec() -> None:
    """A DTensor's mesh and placements are read from its private ``_spec`` where it has one
    (the DTensor tests above take that path); without one, from the public properties."""
    from lazyckpt.model_load import _mesh_and_placements

    class Public:  # what DTensor's public API gives, and no _spec
        def __init__(self) -> None:
            self.device_mesh = "the mesh"
            self.placements = ["Shard(0)", "Replicate()"]

    assert _mesh_and_placements(Public()) == ("the mesh", ("Shard(0)", "Replicate()"))


def test_an_empty_tp_shard_under_fsdp2_is_left_empty(tmp_path: Path) -> None:
    torch.save({"0.weight": torch.arange(4.0).reshape(4, 1)}, tmp_path / "full.pt")
    spawn(check_load_into_empty_tp_shard, 4, str(tmp_path / "full.pt"))


def test_a_rank_outside_a_parameters_mesh_holds_nothing_and_reads_nothing(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(15.0).reshape(5, 3)}, tmp_path / "full.pt")
    spawn(check_load_into_a_mesh_without_this_rank, 3, str(tmp_path / "full.pt"))


_OLD_DTENSOR_CHILD = """
import os, sys, tempfile, torch, torch.distributed as dist
from pathlib import Path
from safetensors.torch import save_file
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed._tensor import DeviceMesh, Shard, distribute_tensor
import lazyckpt
folder = Path(tempfile.mkdtemp())
save_file({"w": torch.arange(12.0).reshape(4, 3)}, folder / "m.safetensors")
model = torch.nn.Module()
model.w = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), DeviceMesh("cpu", [0]), [Shard(0)]))
try:
    lazyckpt.load_into(model, folder / "m.safetensors")
except RuntimeError as exc:
    print(exc)
"""


@pytest.mark.skipif(
    isinstance(getattr(__import__("torch.distributed.tensor").distributed.tensor, "DTensor", None), type),
    reason="torch 2.5 and later have torch.distributed.tensor",
)
def test_a_dtensor_model_on_torch_2_4_is_told_to_upgrade() -> None:
    """torch 2.4 keeps DTensor in torch.distributed._tensor: a DTensor model failed deep in a copy
    ("invalid python storage"); the error now says what is missing."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-c", _OLD_DTENSOR_CHILD, str(port)], capture_output=True, text=True
    )
    assert "need torch 2.5 or later" in done.stdout, (done.stdout, done.stderr)


class _Rotary(nn.Module):
    """A module that derives a buffer from its loaded weight in a load post-hook, as caches
    of rotary tables or fused weights do."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4))
        self.register_buffer("doubled", torch.zeros(4, 4), persistent=False)
        self.register_load_state_dict_post_hook(self._refresh)

    @staticmethod
    def _refresh(module: nn.Module, keys: object) -> None:
        assert hasattr(keys, "missing_keys") and hasattr(keys, "unexpected_keys")
        module.doubled.copy_(module.weight.detach() * 2)


class _Legacy(nn.Linear):
    """A module whose _load_from_state_dict converts what it is given."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def test_load_state_dict_hooks_are_run_or_named(tmp_path: Path) -> None:
    # load_into writes in place and never calls load_state_dict: its post-hooks are run as it
    # runs them; what only load_state_dict can do (pre-hooks, _load_from_state_dict) is named
    # before anything is written, not skipped without a word.
    w = torch.arange(16.0).reshape(4, 4)
    torch.save({"weight": w}, tmp_path / "r.pt")
    model = _Rotary()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own and plain modules: no warning
        lazyckpt.load_into(model, tmp_path / "r.pt")
        norm = nn.Sequential(nn.BatchNorm1d(4))
        lazyckpt.load_into(norm, _saved(tmp_path, norm))
        # torch's compatibility hooks for old versions' keys (wav2vec2's, HiFi-GAN's convs)
        normed = nn.Sequential(
            nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 2, 3)),
            nn.utils.spectral_norm(nn.Linear(2, 2)),
        )
        lazyckpt.load_into(normed, _saved(tmp_path, normed))
    assert torch.equal(model.doubled, w * 2)

    def rename(module, state_dict, prefix, *args):  # type: ignore[no-untyped-def]
        if prefix + "old_weight" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "old_weight")

    def _pre_load_state_dict_hook(module, state_dict, prefix, *args):  # type: ignore[no-untyped-def]
        rename(module, state_dict, prefix)  # named as checkpoint_wrapper's: still the user's

    inner = nn.Linear(4, 4, bias=False)
    inner._register_load_state_dict_pre_hook(_pre_load_state_dict_hook)
    model2 = nn.Sequential(inner, _Legacy(4, 4, bias=False))
    path = _saved(tmp_path, model2)
    with pytest.warns(UserWarning, match="does not run load_state_dict") as caught:
        lazyckpt.load_into(model2, path)
    message = str(caught[0].message)
    assert "0: load_state_dict pre-hook" in message and "_pre_load_state_dict_hook" in message, message
    assert "1: _Legacy._load_from_state_dict" in message, message


def _saved(tmp_path: Path, model: nn.Module) -> Path:
    path = tmp_path / f"{type(model).__name__}-{len(list(tmp_path.iterdir()))}.pt"
    torch.save(model.state_dict(), path)
    return path


@pytest.mark.parametrize(
    ("ckpt_keys", "model_keys"),
    [
        # An old Llama checkpoint's rotary buffer under the prefix, no key of the model.
        (["model.a.weight", "model.b.weight", "model.layers.0.rotary_emb.inv_freq", "lm_head.weight"],
         ["a.weight", "b.weight", "lm_head.weight"]),
        # A DDP checkpoint with a buffer the model no longer has.
        (["module.a.weight", "module.b.weight", "module.layers.0.old_buf"], ["a.weight", "b.weight"]),
        # Adding the prefix: an extra key (an EMA counter) must not become 'module.n_averaged'.
        (["a.weight", "b.weight", "n_averaged"], ["module.a.weight", "module.b.weight"]),
        # The same name with and without the prefix: the prefixed one is no rename target.
        (["module.a.weight", "module.b.weight", "a.weight"], ["a.weight", "b.weight"]),
    ],
)
def test_the_suggested_key_map_renames_only_what_the_prefix_makes_model_keys(
    tmp_path: Path, ckpt_keys: list[str], model_keys: list[str]
) -> None:
    # A real model whose state-dict keys are model_keys: nested modules built from the names.
    root = nn.Module()
    for key in model_keys:
        *path, leaf = key.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_buffer(leaf, torch.zeros(2))
    assert list(root.state_dict()) == model_keys
    torch.save({k: torch.full((2,), float(i + 1)) for i, k in enumerate(ckpt_keys)}, tmp_path / "c.pt")
    with pytest.raises(lazyckpt.KeyMismatchError) as info:
        lazyckpt.load_into(root, tmp_path / "c.pt")
    key_map = _suggested_key_map(str(info.value))
    report = lazyckpt.load_into(
        root, tmp_path / "c.pt", options=lazyckpt.ModelCheckpointLoadOptions(key_map=key_map)
    )
    assert sorted(report.loaded) == sorted(model_keys) and not report.unexpected, info.value


def test_load_hooks_of_any_kind_are_named(tmp_path: Path) -> None:
    # A partial is named by its function, and a hook without a module (made by exec) is no crash.
    import functools

    def user_hook(module, state_dict, prefix, *args, extra=None):  # type: ignore[no-untyped-def]
        pass

    scope: dict[str, object] = {}
    exec("def made(module, state_dict, prefix, *args):\n    pass", scope)
    for hook, name in ((functools.partial(user_hook, extra=1), "user_hook"), (scope["made"], "made")):
        model = nn.Linear(2, 2)
        model._register_load_state_dict_pre_hook(hook)
        path = _saved(tmp_path, model)
        with pytest.warns(UserWarning, match=rf"the model: load_state_dict pre-hook \S*{name}\. "):
            lazyckpt.load_into(model, path)
