"""CUDA targets: ``lazy_load(device="cuda")`` and ``load_into`` a model on the GPU, filled through
pinned host buffers. Skipped without a GPU; the oracle is always computed on the CPU from
``torch.load`` / ``safetensors`` and ``torch.chunk``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_workers import TOKENS, TinyLlama, logits_path, save_fairscale, spawn
from helpers import LAYOUTS, expected, load_all, needs_gpu, same_bits
from safetensors.torch import save_file

import lazyckpt

pytestmark = needs_gpu
pytest.importorskip("fairscale")

MP = 4


@pytest.fixture(scope="module")
def mp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cuda-mp4")
    spawn(save_fairscale, MP, str(root), True, True, "bfloat16")
    return root


def _full(folder: Path, dims: dict[str, int]) -> dict[str, torch.Tensor]:
    ranks = [torch.load(folder / f"consolidated.{r:02d}.pth", weights_only=True) for r in range(MP)]
    return {
        k: torch.cat([sd[k] for sd in ranks], dims[k]) if k in dims else ranks[0][k]
        for k in ranks[0]
    }


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_lazy_load_fairscale_onto_the_gpu(mp4: Path, layout: lazyckpt.Layout,
                                          dtype: torch.dtype | None) -> None:
    keys = torch.load(mp4 / "consolidated.00.pth", weights_only=True).keys()
    dims = lazyckpt.preset_shard_dims("llama2-fairscale", keys)
    full = _full(mp4, dims)
    got = load_all(mp4, dims, layout=layout, device="cuda", dtype=dtype)
    assert list(got) == list(full)
    for key, t in full.items():
        want = expected(t, dims.get(key), layout)
        if dtype is not None and want.is_floating_point():
            want = want.to(dtype)
        assert got[key].device.type == "cuda", key
        assert same_bits(got[key].cpu(), want), (key, layout)


def test_load_into_a_gpu_model_from_fairscale_files(mp4: Path) -> None:
    """A bf16 MP-4 checkpoint into a float32 model on the GPU: replicas verified on the way,
    column and row shards stitched, and the model's forward matches fairscale's logits."""
    keys = torch.load(mp4 / "consolidated.00.pth", weights_only=True).keys()
    full = _full(mp4, lazyckpt.preset_shard_dims("llama2-fairscale", keys))
    model = TinyLlama(llama2=True, rope=True).cuda()
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    report = lazyckpt.load_into(model, mp4)
    assert not report.missing and not report.unexpected
    for name, t in model.state_dict().items():
        assert t.device.type == "cuda" and t.dtype == torch.float32, name
        assert same_bits(t.cpu(), full[name].float()), name
    assert all(p.data_ptr() == before[n] for n, p in model.named_parameters())
    with torch.no_grad():
        got = model.bfloat16()(TOKENS.cuda()).float().cpu()
    want = torch.load(logits_path(mp4), weights_only=True).float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_load_into_a_meta_model_materializes_on_the_gpu(tmp_path: Path) -> None:
    truth = {k: v.clone() for k, v in TinyLlama().state_dict().items()}
    save_file(truth, tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = TinyLlama()
    opts = lazyckpt.ModelCheckpointLoadOptions(device="cuda")
    lazyckpt.load_into(model, tmp_path / "model.safetensors", options=opts)
    for name, t in model.state_dict().items():
        assert t.device.type == "cuda" and same_bits(t.cpu(), truth[name]), name


def test_tensors_larger_than_a_pinned_buffer(tmp_path: Path) -> None:
    """Rows that fill several pinned buffers, and one row larger than a whole buffer, through
    column and row shards (the pool's buffers are 32 MB)."""
    g = torch.Generator().manual_seed(5)
    sd = {
        "tall": torch.randn(12_000, 1_000, generator=g),  # 48 MB: slabs of rows
        "wide": torch.randn(2, 9_000_000, generator=g),  # 36 MB per row: a one-off buffer
    }
    save_file(sd, tmp_path / "big.safetensors")
    dims = {"tall": 1, "wide": 0}
    for layout in (lazyckpt.Layout(), lazyckpt.Layout(tp_size=2, tp_rank=1),
                   lazyckpt.Layout(dp_size=3, dp_rank=2)):
        got = load_all(tmp_path / "big.safetensors", dims, layout=layout, device="cuda")
        for key, t in sd.items():
            assert same_bits(got[key].cpu(), expected(t, dims[key], layout)), (key, layout)


def test_small_keys_between_large_ones_onto_the_gpu(tmp_path: Path) -> None:
    """Keys under 256 KiB are built by the consumer's thread, larger ones ahead on the prefetch
    thread, both through one pool of pinned buffers: a buffer one thread fills must not be
    handed to the other (the consumer took two in a row, the second the worker's). Under a
    side stream of the caller's, on which the copies must be ordered."""
    g = torch.Generator().manual_seed(7)
    sd = {}
    for i in range(12):
        sd[f"big{i}"] = torch.randn(1024, 2048, generator=g)  # 8 MB: the prefetch thread
        sd[f"small{i}a"] = torch.randn(64, 64, generator=g)  # 16 KB: the consumer
        sd[f"small{i}b"] = torch.randn(64, 64, generator=g)
    save_file(sd, tmp_path / "mixed.safetensors")
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            got = load_all(tmp_path / "mixed.safetensors", {}, device="cuda", dtype=torch.float16)
            stream.synchronize()
        for key, t in sd.items():
            assert got[key].device == torch.device("cuda", torch.cuda.current_device()), key
            assert same_bits(got[key].cpu(), t.half()), key


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_cuda_means_the_current_device_on_every_thread(tmp_path: Path) -> None:
    """device="cuda" after torch.cuda.set_device(1): the prefetch thread's current device is
    0, and what it built went there."""
    sd = {f"w{i}": torch.randn(512, 1024) for i in range(4)}
    save_file(sd, tmp_path / "m.safetensors")
    before = torch.cuda.current_device()
    torch.cuda.set_device(1)
    try:
        got = load_all(tmp_path / "m.safetensors", {}, device="cuda", dtype=torch.float16)
    finally:
        torch.cuda.set_device(before)
    for key, t in sd.items():
        assert got[key].device == torch.device("cuda", 1), key
        assert same_bits(got[key].cpu(), t.half()), key
