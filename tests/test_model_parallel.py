"""Model-parallel sources: fairscale ``consolidated.NN.pth`` written by fairscale's own layers in
real gloo process groups, and fairseq2 ``pp_XX/tp_XX/sdp_XX.pt`` shards."""

from __future__ import annotations

import collections
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from dist_workers import (
    TOKENS,
    TinyLlama,
    fairscale_forward_from_lazy_load,
    fsdp_forward_from_load_into,
    logits_path,
    save_fairscale,
    spawn,
)
from helpers import LAYOUTS, expected, load_all, opened_files, same_bits

import lazyckpt
from lazyckpt.loaders import detect_loader

pytest.importorskip("fairscale")

MP = 4


def _save(tmp: Path, *, llama2: bool, rope: bool, dtype: str = "float32") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    spawn(save_fairscale, MP, str(tmp), llama2, rope, dtype)
    return tmp


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("mp4-llama3"), llama2=False, rope=False)


@pytest.fixture(scope="module")
def llama2_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("mp4-llama2-bf16"), llama2=True, rope=True, dtype="bfloat16")


def full_tensors(folder: Path, dims: dict[str, int]) -> dict[str, torch.Tensor]:
    """The oracle: torch.load every rank file, torch.cat the shards, check the replicas agree."""
    ranks = [torch.load(folder / f"consolidated.{r:02d}.pth", weights_only=True) for r in range(MP)]
    out = {}
    for key in ranks[0]:
        if key in dims:
            out[key] = torch.cat([sd[key] for sd in ranks], dims[key])
        else:
            assert all(torch.equal(sd[key], ranks[0][key]) for sd in ranks)
            out[key] = ranks[0][key]
    return out


@pytest.mark.parametrize("preset", ["llama3", "llama2_bf16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_fairscale_into_every_layout(request: pytest.FixtureRequest, preset: str,
                                     layout: lazyckpt.Layout) -> None:
    folder = request.getfixturevalue(preset)
    keys = torch.load(folder / "consolidated.00.pth", weights_only=True).keys()
    dims = lazyckpt.preset_shard_dims(f"{preset[:6]}-fairscale", keys)
    full = full_tensors(folder, dims)
    got = load_all(folder, dims, layout=layout)
    assert list(got) == list(full)
    for key, t in full.items():
        assert same_bits(got[key], expected(t, dims.get(key), layout)), key
    if preset == "llama2_bf16":
        assert dims["tok_embeddings.weight"] == 1 and "rope.freqs" in got


def test_fairscale_reads_only_the_files_it_needs(llama3: Path) -> None:
    keys = torch.load(llama3 / "consolidated.00.pth", weights_only=True).keys()
    dims = lazyckpt.preset_shard_dims("llama3-fairscale", keys)
    loader = lazyckpt.get_model_checkpoint_loader()
    for layout, files in (
        (lazyckpt.Layout(tp_size=4, tp_rank=2), {"consolidated.02.pth"}),
        (lazyckpt.Layout(tp_size=2, tp_rank=0), {"consolidated.00.pth", "consolidated.01.pth"}),
        (lazyckpt.Layout(tp_size=8, tp_rank=7), {"consolidated.03.pth"}),
    ):
        stats = lazyckpt.LoadStats()
        stream = loader.lazy_load(llama3, dims, lazyckpt.ModelCheckpointLoadOptions(layout=layout, stats=stats))
        with opened_files() as seen:
            for _ in stream:
                pass
        assert {Path(p).name for p in seen} == files, layout
        assert {Path(p).name for p, n in stats.bytes_read.items() if n} == files


def test_fairscale_fsdp_reads_a_slice_of_every_file(llama3: Path) -> None:
    keys = torch.load(llama3 / "consolidated.00.pth", weights_only=True).keys()
    dims = lazyckpt.preset_shard_dims("llama3-fairscale", keys)
    total = sum((llama3 / f"consolidated.{r:02d}.pth").stat().st_size for r in range(MP))
    stats = lazyckpt.LoadStats()
    load_all(llama3, dims, layout=lazyckpt.Layout(dp_size=4, dp_rank=1), stats=stats)
    assert stats.bytes_delivered <= stats.total_bytes_read <= stats.bytes_delivered * 1.05 + 4096
    assert stats.total_bytes_read < total / 4 * 1.05


def test_fairscale_replica_that_differs_is_caught(tmp_path: Path, llama3: Path) -> None:
    for r in range(MP):
        sd = torch.load(llama3 / f"consolidated.{r:02d}.pth", weights_only=True)
        if r == 2:
            sd["norm.weight"] = sd["norm.weight"] + 1
        torch.save(sd, tmp_path / f"consolidated.{r:02d}.pth")
    dims = lazyckpt.preset_shard_dims("llama3-fairscale", sd.keys())
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"norm\.weight.*replica"):
        load_all(tmp_path, dims)
    # Forgetting a sharded key in shard_dims looks like a replica whose copies differ.
    dims.pop("layers.0.attention.wq.weight")
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"wq\.weight.*add it to shard_dims"):
        load_all(llama3, dims)


def test_fairscale_files_saved_from_different_pickles_are_indexed_each_on_its_own(
    tmp_path: Path, llama3: Path
) -> None:
    """Rank files of one pickle and one layout share their index work (each key checked in the
    first file only); files that differ (here rank 1 saved with its keys in reverse order, so
    its pickle and offsets differ) are indexed file by file. Both give the oracle's tensors."""
    from lazyckpt.loaders.fairscale import _alike, rank_files
    from lazyckpt.torch_zip import read_torch_set

    for r in range(MP):
        sd = torch.load(llama3 / f"consolidated.{r:02d}.pth", weights_only=True)
        if r == 1:
            sd = dict(reversed(sd.items()))
        torch.save(sd, tmp_path / f"consolidated.{r:02d}.pth")
    dims = lazyckpt.preset_shard_dims("llama3-fairscale", sd.keys())
    for folder, alike in ((llama3, True), (tmp_path, False)):
        files = rank_files(folder)
        ranks = [(f, a, flat) for f, (a, flat) in zip(files, read_torch_set(files))]
        assert _alike(ranks) == alike
        full = full_tensors(folder, dims)
        for layout in (lazyckpt.Layout(), lazyckpt.Layout(tp_size=2, tp_rank=1, dp_size=2, dp_rank=1)):
            got = load_all(folder, dims, layout=layout)
            assert list(got) == list(full)
            for key, t in full.items():
                assert same_bits(got[key], expected(t, dims.get(key), layout)), key


def test_fairscale_into_plain_model_reproduces_logits(llama3: Path, llama2_bf16: Path) -> None:
    reference = torch.load(logits_path(llama3), weights_only=True)
    model = TinyLlama()
    report = lazyckpt.load_into(model, llama3)  # shard dims inferred from the model's shapes
    assert report.shard_dims["layers.1.feed_forward.w2.weight"] == 1
    assert report.shard_dims["tok_embeddings.weight"] == 0
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), reference, rtol=1e-5, atol=1e-5)
    # A meta-device model comes out complete, llama2 layout and rope.freqs included.
    with torch.device("meta"):
        meta = TinyLlama(llama2=True, rope=True).to(torch.bfloat16)
    report = lazyckpt.load_into(meta, llama2_bf16)
    assert report.shard_dims["tok_embeddings.weight"] == 1
    assert not any(p.is_meta for p in meta.parameters()) and not meta.rope.freqs.is_meta
    with torch.no_grad():
        got, want = meta(TOKENS).float(), torch.load(logits_path(llama2_bf16)).float()
    # bf16 sums in another order (no all-reduce here): close relative to the logits' scale.
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_fairscale_mp4_into_tp2_fairscale_model(tmp_path: Path, llama3: Path) -> None:
    spawn(fairscale_forward_from_lazy_load, 2, str(llama3), str(tmp_path), False, False)
    got = torch.load(tmp_path / "logits-tp2.pt", weights_only=True)
    torch.testing.assert_close(got, torch.load(logits_path(llama3)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("meta", [False, True])
def test_fairscale_into_fsdp2_model(tmp_path: Path, llama3: Path, meta: bool) -> None:
    spawn(fsdp_forward_from_load_into, 2, str(llama3), str(tmp_path), False, False, meta)
    got = torch.load(tmp_path / "logits-fsdp2.pt", weights_only=True)
    torch.testing.assert_close(got, torch.load(logits_path(llama3)), rtol=1e-5, atol=1e-5)
    # Each FSDP rank read about half of the checkpoint, not all of it.
    total = sum(n for n in torch.load(tmp_path / "bytes-read-0.pt").values()) + sum(
        n for n in torch.load(tmp_path / "bytes-read-1.pt").values()
    )
    files = sum((llama3 / f"consolidated.{r:02d}.pth").stat().st_size for r in range(MP))
    assert total <= files


# -- fairseq2 native ---------------------------------------------------------------------------


def write_fairseq2(root: Path, full: dict[str, torch.Tensor], dims: dict[str, int], *,
                   pp: dict[str, int], tp: int, sdp: int) -> None:
    """``pp_XX/tp_XX/sdp_XX.pt`` with torch.save: TP split on each key's dim, then dim-0 split
    of each TP shard across SDP ranks (uneven where sizes do not divide)."""
    for stage in sorted(set(pp.values())):
        for t in range(tp):
            for s in range(sdp):
                part = {}
                for key, tensor in full.items():
                    if pp[key] != stage:
                        continue
                    local = torch.tensor_split(tensor, tp, dims[key])[t] if key in dims else tensor
                    part[key] = torch.tensor_split(local, sdp, 0)[s].clone() if local.dim() else local
                folder = root / f"pp_{stage:02d}" / f"tp_{t:02d}"
                folder.mkdir(parents=True, exist_ok=True)
                torch.save({"model": part, "fs2": True}, folder / f"sdp_{s:02d}.pt")


def test_fairseq2_native_into_every_layout(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    full = {
        "embed.weight": torch.randn(30, 8, generator=g),
        "layers.0.proj.weight": torch.randn(12, 8, generator=g),
        "layers.0.out.weight": torch.randn(8, 12, generator=g).bfloat16(),
        "layers.1.norm.weight": torch.randn(8, generator=g),
        "final.scale": torch.tensor(2.0),
    }
    dims = {"embed.weight": 0, "layers.0.proj.weight": 0, "layers.0.out.weight": 1}
    pp = {"embed.weight": 0, "layers.0.proj.weight": 0, "layers.0.out.weight": 0,
          "layers.1.norm.weight": 1, "final.scale": 1}
    write_fairseq2(tmp_path, full, dims, pp=pp, tp=2, sdp=3)
    for layout in LAYOUTS:
        got = load_all(tmp_path, dims, layout=layout)
        assert set(got) == set(full)
        for key, t in full.items():
            assert same_bits(got[key], expected(t, dims.get(key), layout)), (key, layout)
    index = lazyckpt.loaders.detect_loader(tmp_path).index(tmp_path, dims)
    assert index.format == "fairseq2" and index.source_layout == "PP-2 x TP-2 x SDP-3"
    # Each stage's files hold {"model": ..., "fs2": True}: what no load yields is noted.
    assert index.notes == [
        f"pp_{s:02d}/tp_00/sdp_00.pt: weights taken from its 'model' entry; left out beside "
        "it: 'fs2'"
        for s in range(2)
    ]


def test_entries_beside_the_weights_are_noted(tmp_path: Path) -> None:
    # A training checkpoint's weights are its "model" entry; the rest (optimizer state, counters,
    # tensors among them) is left out, and the index says so instead of dropping it silently.
    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(8, 4, generator=g), "n": torch.randn(4, generator=g)}
    extra = {"optimizer": {"exp_avg": torch.ones(3)}, "bias": torch.zeros(2), "step": 7}
    torch.save({"model": full, **extra}, tmp_path / "ckpt.pt")
    index = lazyckpt.loaders.detect_loader(tmp_path / "ckpt.pt").index(tmp_path / "ckpt.pt")
    assert list(index.entries) == ["w", "n"]
    assert index.notes == [
        "ckpt.pt: weights taken from its 'model' entry; left out beside it: 'optimizer', "
        "'bias', 'step'"
    ]
    # A model-parallel set says it once where every rank file holds the same beside its shard.
    mp = tmp_path / "mp"
    mp.mkdir()
    for r, part in enumerate(torch.chunk(full["w"], 2, 0)):
        torch.save({"model": {"w": part.clone(), "n": full["n"]}, **extra},
                   mp / f"consolidated.{r:02d}.pth")
    index = lazyckpt.loaders.detect_loader(mp).index(mp, {"w": 0})
    assert index.notes == [
        "every rank file: weights taken from its 'model' entry; left out beside it: "
        "'optimizer', 'bias', 'step'"
    ]
    got = load_all(mp, {"w": 0})
    assert same_bits(got["w"], full["w"]) and same_bits(got["n"], full["n"])
    # Weights alone: nothing to note.
    torch.save(full, tmp_path / "plain.pt")
    assert lazyckpt.loaders.detect_loader(tmp_path / "plain.pt").index(tmp_path / "plain.pt").notes == []


def test_general_checkpoints_with_optimizer_state(tmp_path: Path) -> None:
    # The PyTorch tutorial's "general checkpoint" keeps the weights under "model_state_dict";
    # an optimizer's state dict, under any name, has int keys (per-parameter state), which
    # are joined in decimal so that key_map can name them and drop them.
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.save(
        {"epoch": 5, "model_state_dict": model.state_dict(),
         "optimizer_state_dict": opt.state_dict(), "loss": torch.tensor(0.25)},
        tmp_path / "tutorial.pt",
    )
    want = torch.load(tmp_path / "tutorial.pt", weights_only=True)
    target = torch.nn.Linear(4, 3)
    report = lazyckpt.load_into(target, tmp_path / "tutorial.pt")
    assert report.loaded == ["weight", "bias"]
    assert same_bits(target.weight.detach(), want["model_state_dict"]["weight"])
    index = lazyckpt.loaders.detect_loader(tmp_path / "tutorial.pt").index(tmp_path / "tutorial.pt")
    assert "weights taken from its 'model_state_dict' entry" in index.notes[0]

    # DeepSpeed's mp_rank_00_model_states.pt: the weights under "module", beside its config,
    # version, counters and shapes (lists, sets, None), which are left out and noted.
    sd = model.state_dict()
    torch.save(
        {"module": sd, "buffer_names": [], "optimizer": None, "lr_scheduler": None,
         "param_shapes": [collections.OrderedDict((k, v.shape) for k, v in sd.items())],
         "sparse_tensor_module_names": set(), "global_steps": 10, "dp_world_size": 1,
         "mp_world_size": 1, "ds_config": {"train_batch_size": 8}, "ds_version": "0.14.0"},
        tmp_path / "mp_rank_00_model_states.pt",
    )
    target = torch.nn.Linear(4, 3)
    report = lazyckpt.load_into(target, tmp_path / "mp_rank_00_model_states.pt")
    assert report.loaded == ["weight", "bias"] and same_bits(target.bias.detach(), sd["bias"])
    path = tmp_path / "mp_rank_00_model_states.pt"
    assert "weights taken from its 'module' entry" in detect_loader(path).index(path).notes[0]

    torch.save({"weights": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "o.pt")
    state = want["optimizer_state_dict"]["state"]
    got = load_all(tmp_path / "o.pt", {}, key_map=lambda k: None if "param_groups" in k else k)
    assert list(got) == ["weights.weight", "weights.bias"] + [
        f"optimizer.state.{i}.{name}" for i in state for name in state[i]
    ]
    for i in state:
        for name, t in state[i].items():
            assert same_bits(got[f"optimizer.state.{i}.{name}"], t)
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"optimizer\.param_groups"):
        load_all(tmp_path / "o.pt", {})  # a list: named, with the key_map that drops it


@pytest.mark.parametrize(
    "gone", ["last-sdp-of-a-tp-rank", "last-tp-rank-of-a-stage", "last-tp-rank-of-the-first-stage"]
)
def test_fairseq2_set_missing_a_last_shard_is_refused(tmp_path: Path, gone: str) -> None:
    # Only dim-0 keys: without the check, the missing rows would simply not be there.
    full = {"emb.weight": torch.arange(32.0).reshape(8, 4), "proj.weight": torch.arange(48.0).reshape(12, 4)}
    dims = {"emb.weight": 0, "proj.weight": 0}
    write_fairseq2(tmp_path, full, dims, pp={"emb.weight": 0, "proj.weight": 1}, tp=2, sdp=2)
    if gone == "last-sdp-of-a-tp-rank":
        (tmp_path / "pp_00" / "tp_01" / "sdp_01.pt").unlink()
        where, what = "tp_01", "sdp_01.pt is missing"
    elif gone == "last-tp-rank-of-a-stage":
        shutil.rmtree(tmp_path / "pp_01" / "tp_01")
        where, what = "pp_01", "TP-1 x SDP-2 but pp_00 is TP-2 x SDP-2"
    else:  # the incomplete stage is named, whichever comes first
        shutil.rmtree(tmp_path / "pp_00" / "tp_01")
        where, what = "pp_00", "TP-1 x SDP-2 but pp_01 is TP-2 x SDP-2"
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=what) as info:
        lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, dims)
    assert info.value.path.name == where


@pytest.mark.parametrize("grows", ["tp", "sdp"])
def test_fairseq2_shards_that_grow_from_one_rank_to_a_later_one_are_refused(
    tmp_path: Path, grows: str
) -> None:
    # As a fairscale set's are: a TP rank of 3 rows before one of 5 (or an SDP shard of 1 row
    # before one of 3) loaded, and a rank's box took rows of the next file as its own.
    full = torch.arange(32.0).reshape(8, 4)
    if grows == "tp":
        cells, what = [[full[:3]], [full[3:]]], r"\[3, 5\], growing along dim 0 from one rank"
    else:
        cells, what = [[full[:1], full[1:4]], [full[4:6], full[6:]]], r"\[1, 3\], growing along dim 0 from one data"
    for t, row in enumerate(cells):
        (tmp_path / f"tp_{t:02d}").mkdir()
        for d, part in enumerate(row):
            torch.save({"w": part.clone()}, tmp_path / f"tp_{t:02d}" / f"sdp_{d:02d}.pt")
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=what):
        lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, {"w": 0})
    # Uneven the way a split is (torch.chunk: the last shards smaller or empty) loads.
    shutil.rmtree(tmp_path)
    write_fairseq2(tmp_path, {"w": full}, {"w": 0}, pp={"w": 0}, tp=3, sdp=2)
    assert torch.equal(load_all(tmp_path, {"w": 0})["w"], full)


def test_fairseq2_0d_replica_differing_between_sdp_files_is_refused(tmp_path: Path) -> None:
    # Every shard file holds a copy of a 0-d key; only the TP rows were compared, so each
    # data-parallel rank got its own file's value without a word.
    for d, value in enumerate([3.0, 99.0]):
        (tmp_path / "tp_00").mkdir(exist_ok=True)
        torch.save({"s": torch.tensor(value), "w": torch.ones(2, 2)}, tmp_path / "tp_00" / f"sdp_{d:02d}.pt")
    loader = lazyckpt.get_model_checkpoint_loader()
    for dp_rank in (0, 1):
        layout = lazyckpt.Layout(dp_size=2, dp_rank=dp_rank)
        with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"'s'.*tp_00/sdp_00\.pt.*tp_00/sdp_01\.pt") as info:
            loader.lazy_load(tmp_path, {}, lazyckpt.ModelCheckpointLoadOptions(layout=layout))
        assert "never split" in str(info.value) and "shard_dims" not in str(info.value)
    torch.save({"s": torch.tensor(3.0), "w": torch.ones(2, 2)}, tmp_path / "tp_00" / "sdp_01.pt")
    assert load_all(tmp_path, {})["s"] == 3.0


def test_fairseq2_stages_beside_top_level_tp_folders_are_refused(tmp_path: Path) -> None:
    # The stages were loaded and tp_00's keys dropped without a word.
    full = {"a": torch.ones(2, 2), "b": torch.zeros(2)}
    write_fairseq2(tmp_path, full, {}, pp={"a": 0, "b": 1}, tp=1, sdp=1)
    (tmp_path / "tp_00").mkdir()
    torch.save({"c": torch.ones(3)}, tmp_path / "tp_00" / "sdp_00.pt")
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"both pipeline-stage folders \(pp_00 \.\.\.\) and tp_00") as info:
        lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, {})
    assert info.value.path == tmp_path
    shutil.rmtree(tmp_path / "tp_00")
    assert sorted(load_all(tmp_path, {})) == ["a", "b"]


def test_fairseq2_rank_numbers_with_a_gap_are_refused_without_counting_to_the_largest(
    tmp_path: Path,
) -> None:
    # A stray tp_99999999999 made a list of every number up to it (memory, then a MemoryError).
    full = {"emb.weight": torch.arange(32.0).reshape(8, 4)}
    write_fairseq2(tmp_path, full, {"emb.weight": 0}, pp={"emb.weight": 0}, tp=2, sdp=1)
    shutil.copytree(tmp_path / "pp_00" / "tp_01", tmp_path / "pp_00" / "tp_99999999999")
    shutil.rmtree(tmp_path / "pp_00" / "tp_01")
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="lacks rank 1"):
        lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, {"emb.weight": 0})


def test_a_copied_rank_file_is_warned_of_not_read_as_one_more_rank_silently(tmp_path: Path) -> None:
    # cp consolidated.01.pth consolidated.02.pth made an MP-3 set whose split keys held rank
    # 1's rows twice, loaded, verified and resharded without a word. Its bytes cannot be told
    # from a save whose shards are equal by design (next test), so it loads, with a warning.
    import shutil

    full = {"w": torch.arange(24.0).reshape(4, 6), "n": torch.ones(6)}
    for r, part in enumerate(torch.chunk(full["w"], 2, 0)):
        torch.save({"w": part.clone(), "n": full["n"]}, tmp_path / f"consolidated.0{r}.pth")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(load_all(tmp_path, {"w": 0})["w"], full["w"])
    shutil.copy(tmp_path / "consolidated.01.pth", tmp_path / "consolidated.02.pth")
    with pytest.warns(
        lazyckpt.CheckpointWarning,
        match=r"consolidated.02.pth holds the same bytes as consolidated.01.pth.*remove it",
    ):
        got = load_all(tmp_path, {"w": 0})
    assert torch.equal(got["w"], torch.cat([full["w"], full["w"][2:]]))


def test_rank_files_equal_by_design_load(tmp_path: Path) -> None:
    # Two torch.saves of equal values have one serialization id. A fresh LoRA adapter's
    # zero-initialised split key was refused as "a copy" (it loads, with the warning); ranks
    # past the last rows of every split key, whose files are equal, load without one.
    lora_a, lora_b = torch.randn(4, 16), torch.zeros(32, 4)
    for r, part in enumerate(torch.chunk(lora_b, 2, 0)):
        torch.save({"lora_A": lora_a, "lora_B": part.clone()}, tmp_path / f"consolidated.0{r}.pth")
    with pytest.warns(lazyckpt.CheckpointWarning, match="equal by design"):
        got = load_all(tmp_path, {"lora_B": 0})
    assert torch.equal(got["lora_A"], lora_a) and torch.equal(got["lora_B"], lora_b)

    full = torch.arange(12.0).reshape(2, 6)
    parts = torch.tensor_split(full, 4, 0)  # rows 1, 1, 0, 0: ranks 2 and 3 hold the same bytes
    for r, part in enumerate(parts):
        torch.save({"w": part.clone(), "n": torch.ones(3)}, tmp_path / f"consolidated.0{r}.pth")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(load_all(tmp_path, {"w": 0})["w"], full)


def test_shards_that_grow_from_one_rank_to_a_later_one_are_refused(tmp_path: Path) -> None:
    # No split gives a later rank more rows: a middle rank of (3, 6) among (2, 6) was joined
    # into a (7, 6) tensor without a word.
    full = torch.arange(48.0).reshape(8, 6)
    parts = [full[:2], full[2:4], torch.cat([full[4:6], full[:1]]), full[6:]]
    for r, part in enumerate(parts):
        torch.save({"w": part.clone()}, tmp_path / f"consolidated.0{r}.pth")
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"sizes are \[2, 2, 3, 2\], growing along dim 0"):
        load_all(tmp_path, {"w": 0})
    uneven = [full[:3], full[3:6], full[6:]]  # torch.chunk(8, 3): 3, 3, 2 loads
    for r, part in enumerate(uneven):
        torch.save({"w": part.clone()}, tmp_path / f"consolidated.0{r}.pth")
    (tmp_path / "consolidated.03.pth").unlink()
    assert torch.equal(load_all(tmp_path, {"w": 0})["w"], full)
