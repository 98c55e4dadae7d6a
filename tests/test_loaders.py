"""Every one-chunk-per-key format x every layout, against ``torch.load``/``load_file`` + ``torch.chunk``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from helpers import (
    FILE_KINDS,
    LAYOUTS,
    SAMPLE_DIMS,
    assert_layout_matches,
    expected,
    load_all,
    needs_gpu,
    same_bits,
    sample_state_dict,
    write_checkpoint,
)
from safetensors.torch import load_file, save_file

import lazyckpt
from lazyckpt.loaders import detect_loader


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    sd = sample_state_dict()
    root = tmp_path_factory.mktemp("ckpts")
    return {kind: write_checkpoint(kind, sd, root / kind) for kind in FILE_KINDS}


def oracle(kind: str, path: Path) -> dict[str, torch.Tensor]:
    """The full tensors as the reference readers give them."""
    if path.is_file() and path.suffix == ".safetensors":
        return load_file(path)
    if path.is_file():
        obj = torch.load(path, weights_only=True)
        return obj.get("model", obj)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.iterdir()):
        if f.suffix == ".safetensors":
            out.update(load_file(f))
        elif f.suffix in (".bin", ".pt"):
            out.update(torch.load(f, weights_only=True))
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_format_by_layout(checkpoints: dict[str, Path], kind: str, layout: lazyckpt.Layout) -> None:
    path = checkpoints[kind]
    full = oracle(kind, path)
    assert set(full) == set(sample_state_dict())
    got = load_all(path, SAMPLE_DIMS, layout=layout)
    assert_layout_matches(got, full, SAMPLE_DIMS, layout)


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("prefetch", [0, 1 << 20, 64 << 20])
@pytest.mark.parametrize("kind", ["safetensors-index", "torch-folder"])
def test_read_paths_agree(checkpoints: dict[str, Path], kind: str, mmap: bool, prefetch: int) -> None:
    path = checkpoints[kind]
    full = oracle(kind, path)
    for layout in (LAYOUTS[0], LAYOUTS[5]):
        got = load_all(path, SAMPLE_DIMS, layout=layout, mmap=mmap, prefetch_bytes=prefetch)
        assert_layout_matches(got, full, SAMPLE_DIMS, layout)


def test_keys_come_once_in_checkpoint_order(tmp_path: Path) -> None:
    sd = sample_state_dict()
    torch.save(sd, tmp_path / "m.pt")
    keys = [k for k, _ in lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.pt", {})]
    assert keys == list(sd)
    save_file(sd, tmp_path / "m.safetensors")
    keys = [k for k, _ in lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", {})]
    assert keys == list(load_file(tmp_path / "m.safetensors"))


def test_dtype_casts_floats_only(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["safetensors-file"]
    full = oracle("safetensors-file", path)
    layout = lazyckpt.Layout(tp_size=2, tp_rank=0)
    got = load_all(path, SAMPLE_DIMS, layout=layout, dtype=torch.bfloat16)
    for key, t in full.items():
        want = expected(t, SAMPLE_DIMS.get(key), layout)
        if t.is_floating_point():
            want = want.to(torch.bfloat16)
        assert same_bits(got[key], want), key


def test_tied_tensors_each_key_appears(tmp_path: Path) -> None:
    w = torch.randn(6, 4)
    torch.save({"embed.weight": w, "lm_head.weight": w, "half": w[3:]}, tmp_path / "tied.pt")
    got = load_all(tmp_path / "tied.pt", {"embed.weight": 0}, layout=lazyckpt.Layout(tp_size=2, tp_rank=1))
    assert list(got) == ["embed.weight", "lm_head.weight", "half"]
    assert torch.equal(got["embed.weight"], w[3:])
    assert torch.equal(got["lm_head.weight"], w)
    assert torch.equal(got["half"], w[3:])


def test_files_saved_without_crcs_load(tmp_path: Path) -> None:
    # torch.utils.serialization.config.save.compute_crc32 = False writes a CRC of 0 in every
    # zip header, and torch.load reads such files; a torch file and a DCP folder saved so.
    import torch.distributed.checkpoint as dcp
    import torch.utils.serialization as serialization

    sd = {"w": torch.randn(6, 4), "n": torch.arange(5)}
    saved = serialization.config.save.compute_crc32
    serialization.config.save.compute_crc32 = False
    try:
        torch.save(sd, tmp_path / "nocrc.pt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no process group: DCP says so
            dcp.save(sd, checkpoint_id=tmp_path / "dcp", no_dist=True)
    finally:
        serialization.config.save.compute_crc32 = saved
    assert torch.equal(torch.load(tmp_path / "nocrc.pt")["w"], sd["w"])
    for source in (tmp_path / "nocrc.pt", tmp_path / "dcp"):
        for mmap in (True, False):
            for layout in LAYOUTS:
                got = load_all(source, {"w": 1}, layout=layout, mmap=mmap)
                assert_layout_matches(got, sd, {"w": 1}, layout)


def test_non_contiguous_saved_views(tmp_path: Path) -> None:
    base = torch.randn(7, 5)
    sd = {"t": base.t(), "col": base[:, 2], "strided": base[::2, 1:4]}
    torch.save(sd, tmp_path / "views.pt")
    for mmap in (True, False):
        for layout in LAYOUTS:
            got = load_all(tmp_path / "views.pt", {"t": 1, "strided": 1}, layout=layout, mmap=mmap)
            assert_layout_matches(got, sd, {"t": 1, "strided": 1}, layout)


def test_pread_short_rows_use_slabs_and_stay_exact(tmp_path: Path) -> None:
    # Dim-1 shards of a wide matrix: many short rows, read through the slab path with mmap=False.
    full = torch.randn(300, 64).to(torch.bfloat16)
    save_file({"w": full}, tmp_path / "w.safetensors")
    for tp in (2, 3):
        for r in range(tp):
            layout = lazyckpt.Layout(tp_size=tp, tp_rank=r)
            stats = lazyckpt.LoadStats()
            got = load_all(tmp_path / "w.safetensors", {"w": 1}, layout=layout, mmap=False, stats=stats)
            assert same_bits(got["w"], expected(full, 1, layout))
            # Coalesced reads may take the gaps along, but never more than twice the need.
            assert stats.bytes_delivered <= stats.total_bytes_read <= 2 * stats.bytes_delivered


def test_yielded_views_are_safe_to_modify(tmp_path: Path) -> None:
    sd = {"a": torch.randn(64, 32), "b": torch.arange(10)}
    save_file(sd, tmp_path / "m.safetensors")
    before = (tmp_path / "m.safetensors").read_bytes()
    stats = lazyckpt.LoadStats()
    opts = lazyckpt.ModelCheckpointLoadOptions(stats=stats)
    for _, t in lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", {}, opts):
        t.add_(1)
    assert stats.views == 2  # whole tensors of a safetensors file are zero-copy views
    assert (tmp_path / "m.safetensors").read_bytes() == before
    assert torch.equal(load_file(tmp_path / "m.safetensors")["a"], sd["a"])


def test_views_outlive_the_loader(tmp_path: Path) -> None:
    sd = {"a": torch.randn(256, 256)}
    save_file(sd, tmp_path / "m.safetensors")
    kept = dict(lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", {}))
    import gc

    gc.collect()
    assert torch.equal(kept["a"], sd["a"])


def test_key_map_renames_and_drops(tmp_path: Path) -> None:
    sd = sample_state_dict()
    save_file(sd, tmp_path / "m.safetensors")
    key_map = {"tok_embeddings.weight": "embed.weight", "scale": None}
    layout = lazyckpt.Layout(tp_size=8, tp_rank=2)
    got = load_all(tmp_path / "m.safetensors", {"embed.weight": 0}, layout=layout, key_map=key_map)
    assert "scale" not in got and "tok_embeddings.weight" not in got
    assert same_bits(got["embed.weight"], expected(sd["tok_embeddings.weight"], 0, layout))
    got = load_all(tmp_path / "m.safetensors", {}, key_map=lambda k: "model." + k)
    assert set(got) == {"model." + k for k in sd}
    with pytest.raises(ValueError, match="maps both"):
        load_all(tmp_path / "m.safetensors", {}, key_map=lambda k: "same")
    for bad in (5, ("x",)):  # as a function's result, so a mapping's value
        with pytest.raises(ValueError, match="must return a str or None"):
            load_all(tmp_path / "m.safetensors", {}, key_map=lambda k, bad=bad: bad)
        with pytest.raises(ValueError, match=r"maps 'scale' to .*must map to a str or None"):
            lazyckpt.ModelCheckpointLoadOptions(key_map={"scale": bad})


def test_shard_dims_under_the_checkpoint_name_of_a_renamed_key_is_refused(tmp_path: Path) -> None:
    # shard_dims takes the names after key_map. Given the checkpoint's name of a renamed key,
    # the key would be read whole (a replica) where the user meant it split: refused, saying
    # which name to use. A name that another key takes after key_map is not a mistake.
    sd = {"a": torch.randn(8, 4), "b": torch.randn(6, 4)}
    save_file(sd, tmp_path / "m.safetensors")
    layout = lazyckpt.Layout(tp_size=2, tp_rank=1)
    rename = {"a": "model.a"}
    with pytest.raises(ValueError, match=r"shard_dims\['model.a'\] = 0") as info:
        load_all(tmp_path / "m.safetensors", {"a": 0}, layout=layout, key_map=rename)
    assert "m.safetensors" in str(info.value) and "renames to 'model.a'" in str(info.value)
    got = load_all(tmp_path / "m.safetensors", {"model.a": 0}, layout=layout, key_map=rename)
    assert same_bits(got["model.a"], expected(sd["a"], 0, layout))
    swap = {"a": "b", "b": "a"}
    got = load_all(tmp_path / "m.safetensors", {"a": 0}, layout=layout, key_map=swap)
    assert same_bits(got["a"], expected(sd["b"], 0, layout))
    assert same_bits(got["b"], sd["a"])
    # A model-parallel set fails while its index is built (the shards' shapes differ): the
    # same message, not "add it to shard_dims", which already names the key.
    full = torch.randn(8, 4)
    (tmp_path / "mp").mkdir()
    for r, part in enumerate(torch.chunk(full, 2, 0)):
        torch.save({"w": part.clone(), "n": torch.ones(3)}, tmp_path / "mp" / f"consolidated.0{r}.pth")
    for dims in ({"w": 0}, {"w": 0, "n": 0}):
        with pytest.raises(ValueError, match=r"shard_dims\['x.w'\] = 0"):
            load_all(tmp_path / "mp", dims, key_map=lambda k: "x." + k)
    got = load_all(tmp_path / "mp", {"x.w": 0}, key_map=lambda k: "x." + k)
    assert same_bits(got["x.w"], full)


def test_stats_count_only_target_bytes(tmp_path: Path) -> None:
    full = torch.randn(800, 100)
    save_file({"w": full}, tmp_path / "w.safetensors")
    stats = lazyckpt.LoadStats()
    load_all(tmp_path / "w.safetensors", {"w": 0}, layout=lazyckpt.Layout(tp_size=8, tp_rank=5), stats=stats)
    assert stats.bytes_delivered == full.nbytes // 8
    assert stats.total_bytes_read == full.nbytes // 8
    assert stats.read_amplification == 1.0


@needs_gpu
def test_cuda_target_through_pinned_buffers(tmp_path: Path) -> None:
    sd = sample_state_dict()
    save_file(sd, tmp_path / "m.safetensors")
    layout = lazyckpt.Layout(tp_size=2, tp_rank=1, dp_size=2, dp_rank=0)
    got = load_all(tmp_path / "m.safetensors", SAMPLE_DIMS, layout=layout, device="cuda", dtype=torch.float16)
    for key, t in sd.items():
        want = expected(t, SAMPLE_DIMS.get(key), layout)
        want = want.to(torch.float16) if t.is_floating_point() else want
        assert got[key].device.type == "cuda"
        assert same_bits(got[key], want), key


def test_cuda_device_without_gpu_fails_eagerly(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    save_file({"a": torch.zeros(2)}, tmp_path / "m.safetensors")
    opts = lazyckpt.ModelCheckpointLoadOptions(device="cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", {}, opts)


def test_a_device_torch_cannot_use_or_meta_fails_eagerly(tmp_path: Path) -> None:
    # Refused when lazy_load is called, naming options.device, not at the first next() with
    # torch's own error (xpu: an AssertionError; hpu: ModuleNotFoundError); meta would "read"
    # every byte into nothing.
    save_file({"a": torch.zeros(2)}, tmp_path / "m.safetensors")
    loader = lazyckpt.get_model_checkpoint_loader()
    bad = ["meta"] + [d for d in ("xpu", "hpu") if not getattr(torch, d, None) or not getattr(torch, d).is_available()]
    for device in bad:
        opts = lazyckpt.ModelCheckpointLoadOptions(device=device)
        with pytest.raises(ValueError, match=f"options.device is {device}"):
            loader.lazy_load(tmp_path / "m.safetensors", {}, opts)


def test_column_shards_are_strided_views_unless_contiguous_is_asked(tmp_path: Path) -> None:
    full = torch.randn(64, 48)
    save_file({"w": full}, tmp_path / "w.safetensors")
    layout = lazyckpt.Layout(tp_size=4, tp_rank=2)
    stats = lazyckpt.LoadStats()
    got = load_all(tmp_path / "w.safetensors", {"w": 1}, layout=layout, stats=stats)
    assert stats.views == 1 and stats.total_bytes_read == full.nbytes // 4
    loader = lazyckpt.get_model_checkpoint_loader()
    (_, view), = loader.lazy_load(tmp_path / "w.safetensors", {"w": 1},
                                  lazyckpt.ModelCheckpointLoadOptions(layout=layout))
    assert not view.is_contiguous() and view.stride() == (48, 1)
    assert torch.equal(view, expected(full, 1, layout)) and torch.equal(got["w"], view)
    stats = lazyckpt.LoadStats()
    (_, copy), = loader.lazy_load(tmp_path / "w.safetensors", {"w": 1},
                                  lazyckpt.ModelCheckpointLoadOptions(layout=layout, contiguous=True,
                                                                      stats=stats))
    assert copy.is_contiguous() and stats.views == 0 and torch.equal(copy, view)


def test_large_buffers_are_mappings_released_with_the_tensor() -> None:
    from lazyckpt import alloc

    small = alloc.empty((10, 10), torch.float32)
    big = alloc.empty((1024, 1024), torch.bfloat16)  # 2 MiB: a huge-page advised mapping
    big.fill_(1.5)
    assert small.shape == (10, 10) and big.shape == (1024, 1024) and big.is_contiguous()
    assert float(big.float().sum()) == 1.5 * 1024 * 1024


_EVERY_DTYPE = [
    getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
        "int64", "int32", "int16", "int8", "uint8", "bool", "uint16", "uint32", "uint64",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if hasattr(torch, name)
]


def _random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes seen as ``dtype`` (bool kept to 0/1)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _safetensors_writes(dtype: torch.dtype, tmp_path: Path) -> bool:
    try:
        save_file({"t": torch.zeros(1, dtype=dtype)}, tmp_path / "probe.safetensors")
    except Exception:
        return False
    return True


@pytest.mark.parametrize("source", ["torch", "dcp", "fairscale", "safetensors"])
def test_every_dtype_the_writers_write_loads_bit_exact(tmp_path: Path, source: str) -> None:
    # uint16/32/64 and complex32 have no typed storage class: torch pickles them with
    # _rebuild_tensor_v3 over an UntypedStorage whose numel counts bytes.
    sd = {f"t_{str(d).split('.')[1]}": _random_bits(d, (4, 6), i) for i, d in enumerate(_EVERY_DTYPE)}
    if source == "safetensors":
        sd = {k: v for k, v in sd.items() if _safetensors_writes(v.dtype, tmp_path)}
        assert {torch.float8_e4m3fnuz, torch.uint16} <= {v.dtype for v in sd.values()}
    dims = {k: 1 for k in sd}
    if source == "safetensors":
        path = tmp_path / "all.safetensors"
        save_file(sd, path)
    elif source == "torch":
        path = tmp_path / "all.pt"
        torch.save(sd, path)
    elif source == "dcp":
        import torch.distributed.checkpoint as dcp

        path = tmp_path / "dcp"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(dict(sd), checkpoint_id=path, no_dist=True)
    else:
        path = tmp_path / "mp2"
        path.mkdir()
        for rank in range(2):
            torch.save({k: v.chunk(2, 1)[rank].clone() for k, v in sd.items()},
                       path / f"consolidated.0{rank}.pth")
    if source == "dcp":
        # Each DCP chunk is a torch zip written wherever the last one ended: some elements lie
        # at addresses that are not multiples of their size. They must be copied, not viewed
        # (torch's complex128 copy crashes on such a view).
        index = detect_loader(path).index(path, {})
        offsets = {k: e.chunks[0].data.resolve().byte_offset for k, e in index.entries.items()}
        assert any(offsets[k] % sd[k].element_size() for k in sd), offsets
    for layout in (lazyckpt.Layout(), lazyckpt.Layout(tp_size=2, tp_rank=1)):
        for mmap in (True, False):
            opts = lazyckpt.ModelCheckpointLoadOptions(layout=layout, mmap=mmap)
            loader = lazyckpt.get_model_checkpoint_loader()
            keys = []
            for key, t in loader.lazy_load(path, dims, opts):
                keys.append(key)
                assert t.data_ptr() % t.element_size() == 0, (key, layout, mmap)
                assert same_bits(t, expected(sd[key], 1, layout)), (key, layout, mmap)
            assert keys == (list(load_file(path)) if source == "safetensors" else list(sd))
    # A cast copies through an aligned buffer where the source is not aligned.
    cast = load_all(path, dims, layout=lazyckpt.Layout(tp_size=2, tp_rank=1), dtype=torch.float64)
    for key, t in sd.items():
        want = expected(t, 1, lazyckpt.Layout(tp_size=2, tp_rank=1))
        if want.is_floating_point():
            want = want.to(torch.float64)
        assert same_bits(cast[key], want), key


def test_pread_bounce_buffer_serves_any_dtype_after_an_odd_sized_slab(tmp_path: Path) -> None:
    # mmap=False reads short strided rows through one reused buffer: a first slab of an odd
    # byte count (8.4 MB of int8 rows) must leave it usable for float32 rows next.
    g = torch.Generator().manual_seed(0)
    full = {
        "odd_int8": torch.randint(-128, 127, (1, 4101, 2046), dtype=torch.int8, generator=g),
        "then_f32": torch.randn(64, 32, generator=g),
    }
    torch.save(full, tmp_path / "m.pt")
    dims = {"odd_int8": 2, "then_f32": 1}
    layout = lazyckpt.Layout(tp_size=2, tp_rank=0)
    got = load_all(tmp_path / "m.pt", dims, layout=layout, mmap=False, prefetch_bytes=0)
    for key, t in full.items():
        assert same_bits(got[key], expected(t, dims[key], layout)), key


def test_an_empty_view_past_its_empty_storage_loads(tmp_path: Path) -> None:
    # A chunk of an empty tensor saved without clone(): offset 4 into a storage of 0 elements.
    # torch.load reads it; it needs no bytes.
    empty = torch.empty(0, 8).chunk(2, 1)[1]
    assert empty.storage_offset() == 4 and empty.untyped_storage().nbytes() == 0
    sd = {"x": empty, "w": torch.arange(3.0)}
    torch.save(sd, tmp_path / "m.pt")
    want = torch.load(tmp_path / "m.pt", weights_only=True)
    for mmap in (True, False):
        got = load_all(tmp_path / "m.pt", {}, mmap=mmap)
        assert list(got) == ["x", "w"]
        assert got["x"].shape == want["x"].shape and same_bits(got["w"], want["w"])


def test_packed_float4_keeps_its_dtype_under_a_cast(tmp_path: Path) -> None:
    # torch converts nothing to or from float4_e2m1fn_x2 (two values a byte): a cast of the
    # load leaves it as it is, as it leaves integers, and it is refused as the target dtype.
    x = torch.arange(24, dtype=torch.uint8).reshape(4, 6).view(torch.float4_e2m1fn_x2)
    torch.save({"a": torch.ones(2), "x": x}, tmp_path / "m.pt")
    got = load_all(tmp_path / "m.pt", dtype=torch.bfloat16)
    assert got["a"].dtype == torch.bfloat16
    assert got["x"].dtype == torch.float4_e2m1fn_x2 and same_bits(got["x"], x)
    with pytest.raises(ValueError, match="only floating-point tensors are cast"):
        lazyckpt.ModelCheckpointLoadOptions(dtype=torch.float4_e2m1fn_x2)


def test_packed_float4_in_safetensors_loads_and_is_written_back(tmp_path: Path) -> None:
    # safetensors writes float4_e2m1fn_x2 as "F4", its shape counting 4-bit values (the last
    # dim twice torch's): read as safetensors.load_file reads it, sharded on either dim, and
    # written back by `reshard --format safetensors` as safetensors reads it.
    from lazyckpt.writers import reshard

    x = _random_bits(torch.float4_e2m1fn_x2, (4, 6), 7)
    y = _random_bits(torch.float4_e2m1fn_x2, (6, 2), 8)
    save_file({"x": x, "y": y}, tmp_path / "m.safetensors")
    assert same_bits(load_file(tmp_path / "m.safetensors")["x"], x)
    dims = {"x": 1, "y": 0}
    for mmap in (True, False):
        for layout in LAYOUTS:
            got = load_all(tmp_path / "m.safetensors", dims, layout=layout, mmap=mmap)
            assert_layout_matches(got, {"x": x, "y": y}, dims, layout)
    reshard(tmp_path / "m.safetensors", tmp_path / "out", dims, tp=2, fmt="safetensors")
    for rank, f in enumerate(sorted((tmp_path / "out").glob("*.safetensors"))):
        back = load_file(f)
        assert same_bits(back["x"], x.chunk(2, 1)[rank]) and same_bits(back["y"], y.chunk(2, 0)[rank])


def test_reshard_to_safetensors_writes_every_dtype_safetensors_writes(tmp_path: Path) -> None:
    # Whatever the real writer stores (float8 "fnuz" included), a safetensors checkpoint that
    # lazyckpt reads it also writes back: probed dtype by dtype, so a new one shows up here.
    from lazyckpt.writers import reshard

    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    for dtype in {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}:
        if dtype.itemsize == 0:
            continue
        t = torch.randint(0, 256, (4, 2 * dtype.itemsize), dtype=torch.uint8, generator=g)
        try:
            t = t.view(dtype)
            save_file({"x": t}, tmp_path / "probe.safetensors")
        except (TypeError, RuntimeError, ValueError, KeyError):
            continue  # not a dtype safetensors stores
        sd[str(dtype).removeprefix("torch.")] = t
    assert {"float8_e4m3fnuz", "float8_e5m2fnuz", "bfloat16", "uint64"} <= set(sd)
    save_file(sd, tmp_path / "m.safetensors")
    reshard(tmp_path / "m.safetensors", tmp_path / "out", {k: 0 for k in sd}, tp=2, fmt="safetensors")
    for rank, f in enumerate(sorted((tmp_path / "out").glob("*.safetensors"))):
        back = load_file(f)
        assert back.keys() == sd.keys()
        for key, t in sd.items():
            assert same_bits(back[key], t.chunk(2, 0)[rank]), key


def test_reshard_to_safetensors_refuses_what_it_cannot_store_before_writing(
    tmp_path: Path,
) -> None:
    # complex128 has no safetensors dtype here, nor has a 0-d F4 a dim for its pairs: refused
    # by key before any file is written.
    from lazyckpt.writers import reshard

    scalar4 = torch.tensor(7, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    for key, t in (("z", torch.ones(2, dtype=torch.complex128)), ("s", scalar4)):
        torch.save({"w": torch.ones(2), key: t}, tmp_path / f"{key}.pt")
        # --dtype casts floating-point tensors only: not offered where it cannot help.
        with pytest.raises(ValueError, match=f"key '{key}' has dtype .*cannot store; use --format"):
            reshard(tmp_path / f"{key}.pt", tmp_path / f"out_{key}", {}, fmt="safetensors")
        assert not (tmp_path / f"out_{key}").exists() or not any((tmp_path / f"out_{key}").iterdir())


def test_a_safetensors_header_longer_than_the_first_read_is_read_whole(tmp_path: Path) -> None:
    # The header is read with one 16 KiB pread where it fits; 3,000 keys take ~200 KiB.
    from lazyckpt.loaders.safetensors import _FIRST_READ

    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.a_long_parameter_name.weight": torch.randn(3, generator=g) for i in range(3000)}
    path = tmp_path / "many.safetensors"
    save_file(sd, path)
    assert int.from_bytes(path.read_bytes()[:8], "little") > _FIRST_READ
    got = {k: v.clone() for k, v in lazyckpt.get_model_checkpoint_loader().lazy_load(path, {})}
    want = load_file(path)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("dim", [0, 1])
def test_packed_float4_split_over_model_parallel_files(tmp_path: Path, dim: int) -> None:
    # Column blocks of a key split on dim 1 are joined with one torch.cat, which torch lacks
    # for float4_e2m1fn_x2: they are joined as bytes (a crash before, naming nothing).
    full = torch.randint(0, 256, (6, 8), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    for r, part in enumerate(torch.chunk(full, 2, dim)):
        torch.save({"w": part.clone(), "n": torch.ones(3)}, tmp_path / f"consolidated.0{r}.pth")
    for tp, rank in [(1, 0), (3, 1), (2, 1)]:
        layout = lazyckpt.Layout(tp_size=tp, tp_rank=rank)
        for mmap in (True, False):
            got = load_all(tmp_path, {"w": dim}, layout=layout, mmap=mmap)
            assert got["w"].dtype == torch.float4_e2m1fn_x2
            assert same_bits(got["w"], expected(full, dim, layout))
