"""Format detection: marker files decide, mixed folders are refused with a clear error."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_workers import check_layout_helpers, spawn
from helpers import same_bits
from safetensors.torch import save_file

import lazyckpt
from lazyckpt.loaders import detect_loader


def _st(path: Path) -> None:
    save_file({"w": torch.ones(2)}, path)


def test_each_format_is_detected(tmp_path: Path) -> None:
    _st(tmp_path / "a.safetensors")
    assert detect_loader(tmp_path / "a.safetensors").name == "safetensors"
    torch.save({"w": torch.ones(2)}, tmp_path / "weights.ckpt")  # zip magic, unusual suffix
    assert detect_loader(tmp_path / "weights.ckpt").name == "torch"
    mp = tmp_path / "mp"
    mp.mkdir()
    for r in range(2):
        torch.save({"w": torch.ones(2)}, mp / f"consolidated.{r:02d}.pth")
    (mp / "params.json").write_text("{}")
    assert detect_loader(mp).name == "fairscale"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"))
    assert detect_loader(tmp_path / "dcp").name == "dcp"
    assert detect_loader(tmp_path / "dcp" / ".metadata").name == "dcp"
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="pass its folder"):
        detect_loader(next((tmp_path / "dcp").glob("*.distcp")))


def test_hub_folder_with_both_formats_prefers_safetensors(tmp_path: Path) -> None:
    _st(tmp_path / "model.safetensors")
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    assert detect_loader(tmp_path).name == "safetensors"


def test_safetensors_win_over_the_torch_files_hugging_face_ships_beside_them(
    tmp_path: Path,
) -> None:
    # transformers and diffusers load model.safetensors where a repo also has .bin files (and
    # their index): those may be stale, or not downloaded at all ("*.safetensors", "*.json").
    good = torch.arange(4.0)
    cases = {
        "bins-not-downloaded": {},
        "stale-bins": {"pytorch_model-00001-of-00001.bin": torch.full((4,), 7.0)},
    }
    for name, bins in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        save_file({"w": good}, folder / "model.safetensors")
        for b, t in bins.items():
            torch.save({"w": t}, folder / b)
        (folder / "pytorch_model.bin.index.json").write_text(
            '{"weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}'
        )
        loader = detect_loader(folder)
        assert loader.name == "safetensors", name
        assert torch.equal(dict(loader.lazy_load(folder, {}))["w"], good), name
        notes = loader.index(folder).notes
        assert any("pytorch_model.bin.index.json" in n for n in notes), notes
    # A diffusers component folder (unet/, vae/), and a file saved under one name twice.
    for st, pt in (("diffusion_pytorch_model", "diffusion_pytorch_model"), ("weights", "weights")):
        folder = tmp_path / f"{st}-twins"
        folder.mkdir()
        save_file({"w": good}, folder / f"{st}.safetensors")
        torch.save({"w": good + 1}, folder / f"{pt}.bin")
        assert torch.equal(dict(detect_loader(folder).lazy_load(folder, {}))["w"], good)
    # Only the counterparts count: an adapter's or one shard's safetensors file beside a
    # complete torch set is not those weights (the torch set is loaded, whole), and a variant
    # (fp16) is not the file diffusers loads by default.
    for name in ("adapter_model.safetensors", "model-00001-of-00002.safetensors"):
        folder = tmp_path / f"beside-{name}"
        folder.mkdir()
        save_file({"lora_A": torch.ones(2)}, folder / name)
        for i in (1, 2):
            torch.save({f"w{i}": torch.full((2,), float(i))}, folder / f"pytorch_model-0000{i}-of-00002.bin")
        (folder / "pytorch_model.bin.index.json").write_text(
            '{"weight_map": {"w1": "pytorch_model-00001-of-00002.bin", '
            '"w2": "pytorch_model-00002-of-00002.bin"}}'
        )
        loader = detect_loader(folder)
        assert loader.name == "torch", name
        assert set(dict(loader.lazy_load(folder, {}))) == {"w1", "w2"}, name
    folder = tmp_path / "variant"
    folder.mkdir()
    save_file({"w": good.half()}, folder / "diffusion_pytorch_model.fp16.safetensors")
    torch.save({"w": good}, folder / "diffusion_pytorch_model.bin")
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="both safetensors"):
        detect_loader(folder)
    # Variants beside the default file, in either format, as a Stable Diffusion unet/ ships
    # them: the default safetensors file is the checkpoint, the variants are noted.
    for family, torch_family in (
        ("model", "pytorch_model"),
        ("diffusion_pytorch_model", "diffusion_pytorch_model"),
    ):
        folder = tmp_path / f"variants-{family}"
        folder.mkdir()
        save_file({"w": good}, folder / f"{family}.safetensors")
        save_file({"w": good.half()}, folder / f"{family}.fp16.safetensors")
        for variant in ("", ".fp16", ".non_ema"):
            torch.save({"w": good + 2}, folder / f"{torch_family}{variant}.bin")
        loader = detect_loader(folder)
        assert loader.name == "safetensors", family
        assert same_bits(dict(loader.lazy_load(folder, {}))["w"], good), family
        notes = loader.index(folder).notes
        assert any(f"{family}.fp16.safetensors: a variant" in n for n in notes), notes
    # A sharded variant with its own index beside the default file: the default is loaded.
    folder = tmp_path / "variant-index"
    folder.mkdir()
    save_file({"w": good, "v": good.clone()}, folder / "diffusion_pytorch_model.safetensors")
    names = [f"diffusion_pytorch_model.fp16-0000{i}-of-00002.safetensors" for i in (1, 2)]
    save_file({"w": good.half()}, folder / names[0])
    save_file({"v": good.half()}, folder / names[1])
    (folder / "diffusion_pytorch_model.fp16.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": names[0], "v": names[1]}})
    )
    loader = detect_loader(folder)
    got = dict(loader.lazy_load(folder, {}))
    assert got["w"].dtype == torch.float32 and same_bits(got["v"], good)
    assert any("fp16.safetensors.index.json: the index of a variant" in n for n in loader.index(folder).notes)
    # A file named like a variant that holds other keys is another part: loaded with the rest.
    folder = tmp_path / "two-parts"
    folder.mkdir()
    save_file({"language_model.w": good}, folder / "model.safetensors")
    save_file({"vision_tower.w": good}, folder / "model.vision.safetensors")
    assert set(dict(detect_loader(folder).lazy_load(folder, {}))) == {"language_model.w", "vision_tower.w"}
    # A torch index of another name, or torch files of other names, are no such twins.
    folder = tmp_path / "other-index"
    folder.mkdir()
    _st(folder / "model.safetensors")
    torch.save({"w": torch.zeros(2)}, folder / "ema.bin")
    (folder / "ema.bin.index.json").write_text('{"weight_map": {"w": "ema.bin"}}')
    assert detect_loader(folder).name == "torch"
    (folder / "ema.bin.index.json").unlink()
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="both safetensors"):
        detect_loader(folder)


def test_index_wins_over_loose_files_and_says_so(tmp_path: Path) -> None:
    _st(tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"w": "model-00001-of-00001.safetensors"}}'
    )
    torch.save({"w": torch.zeros(2)}, tmp_path / "consolidated.00.pth")
    _st(tmp_path / "stray.safetensors")
    loader = detect_loader(tmp_path)
    assert loader.name == "safetensors"
    index = loader.index(tmp_path)
    assert any("stray.safetensors" in n for n in index.notes)
    assert index.files == [tmp_path / "model-00001-of-00001.safetensors"]


def test_of_several_index_files_the_usual_name_wins_else_refused(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"w": torch.zeros(3)}, tmp_path / "b.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "a.safetensors"}}')
    (tmp_path / "ema.safetensors.index.json").write_text('{"weight_map": {"w": "b.safetensors"}}')
    loader = detect_loader(tmp_path)
    index = loader.index(tmp_path)
    assert index.path == tmp_path / "model.safetensors.index.json"
    assert index.entries["w"].shape == (2,)
    assert any("b.safetensors" in n for n in index.notes)
    (tmp_path / "model.safetensors.index.json").rename(tmp_path / "base.safetensors.index.json")
    with pytest.raises(
        lazyckpt.CorruptModelCheckpointError,
        match=r"2 index files \(base\.safetensors\.index\.json, ema\.safetensors\.index\.json\)",
    ):
        loader.index(tmp_path)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (["a.safetensors", "b.pt"], "both safetensors"),
        (["consolidated.00.pth", "extra.safetensors"], "fairscale checkpoint and also"),
    ],
)
def test_mixed_folders_are_refused(tmp_path: Path, files: list[str], message: str) -> None:
    for name in files:
        if name.endswith(".safetensors"):
            _st(tmp_path / name)
        else:
            torch.save({"w": torch.ones(2)}, tmp_path / name)
    with pytest.raises(lazyckpt.UnknownCheckpointFormatError, match=message):
        detect_loader(tmp_path)


def test_dcp_beside_a_fairscale_set_is_refused(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path))
    torch.save({"w": torch.ones(2)}, tmp_path / "consolidated.00.pth")
    with pytest.raises(lazyckpt.UnknownCheckpointFormatError, match="keep one per folder"):
        detect_loader(tmp_path)


def test_supports_path(tmp_path: Path) -> None:
    loader = lazyckpt.get_model_checkpoint_loader()
    _st(tmp_path / "a.safetensors")
    assert loader.supports_path(tmp_path / "a.safetensors")
    assert not loader.supports_path(tmp_path / "missing.safetensors")
    (tmp_path / "x.txt").write_text("")
    assert not loader.supports_path(tmp_path / "x.txt")


def test_layout_helpers_on_a_real_mesh() -> None:
    spawn(check_layout_helpers, 4)


@dataclasses.dataclass
class TrainingArguments:
    lr: float = 1e-4


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_a_hugging_face_trainer_checkpoint_folder(tmp_path: Path, weights: str) -> None:
    # checkpoint-N/ of transformers' Trainer: the weights beside its training state.
    w = torch.arange(6.0).reshape(2, 3)
    if weights.endswith(".safetensors"):
        save_file({"w": w}, tmp_path / weights)
    else:
        torch.save({"w": w}, tmp_path / weights)
    torch.save(TrainingArguments(), tmp_path / "training_args.bin")
    torch.save({"state": {0: {"exp_avg": torch.zeros(2, 3)}}, "param_groups": []}, tmp_path / "optimizer.pt")
    torch.save({"last_epoch": 3}, tmp_path / "scheduler.bin")
    torch.save({"python": 1}, tmp_path / "rng_state.pth")
    (tmp_path / "trainer_state.json").write_text("{}")
    got = dict(lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, {}))
    assert list(got) == ["w"] and torch.equal(got["w"], w)


def test_a_megatron_lm_checkpoint_root_names_its_latest_iteration(tmp_path: Path) -> None:
    # Megatron-LM saves each iteration in iter_NNNNNNN/ beside a tracker file: its root got
    # the generic "holds no checkpoint files".
    latest = tmp_path / "iter_0000020"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=latest, no_dist=True)
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=tmp_path / "iter_0000010", no_dist=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    with pytest.raises(lazyckpt.UnknownCheckpointFormatError, match="Megatron-LM checkpoint root") as err:
        detect_loader(tmp_path)
    assert str(latest) in str(err.value)
    assert detect_loader(latest).name == "dcp"


def test_a_megatron_tracker_of_too_many_digits_is_still_a_root(tmp_path: Path) -> None:
    # int() of 5,000 digits raised a bare ValueError out of detection.
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("9" * 5000)
    with pytest.raises(lazyckpt.UnknownCheckpointFormatError, match="Megatron-LM checkpoint root"):
        detect_loader(tmp_path)


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    if path.name.endswith(".safetensors"):
        save_file(tensors, path)
    else:
        torch.save(tensors, path)


@pytest.mark.parametrize(("family", "suffix"), [("model", ".safetensors"), ("pytorch_model", ".bin")])
def test_a_set_of_numbered_files_without_its_index_must_be_whole(
    tmp_path: Path, family: str, suffix: str
) -> None:
    # A download that stopped: 2 of 3 shards and no index. It used to load 2/3 of the model.
    names = [f"{family}-0000{i}-of-00003{suffix}" for i in (1, 2, 3)]
    for i, name in enumerate(names):
        _save(tmp_path / name, {f"w{i}": torch.full((2,), float(i))})
    assert set(dict(lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, {}))) == {"w0", "w1", "w2"}
    (tmp_path / names[1]).unlink()
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=f"2 of the 3 files.*{names[1]} is missing"):
        list(lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path, {}))
    # One file passed alone is loaded alone: the caller asked for it.
    assert list(dict(lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / names[0], {}))) == ["w0"]
    (tmp_path / names[1].replace("00002-of", "00004-of")).write_bytes((tmp_path / names[0]).read_bytes())
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="numbered outside the set of 3"):
        detect_loader(tmp_path).index(tmp_path)
    # Only Hugging Face's numbering (the number as wide as the count) makes a set.
    other = tmp_path / "other"
    other.mkdir()
    _save(other / f"ckpt-epoch-3-of-10{suffix}", {"w": torch.ones(2)})
    assert list(dict(lazyckpt.get_model_checkpoint_loader().lazy_load(other, {}))) == ["w"]


def test_torch_variants_beside_the_default_file_are_left_to_be_passed_by_name(tmp_path: Path) -> None:
    # pytorch_model.fp16.bin beside pytorch_model.bin (no safetensors): the default is loaded,
    # as transformers does; it used to be refused as a key held twice.
    w = torch.arange(4.0)
    torch.save({"w": w}, tmp_path / "pytorch_model.bin")
    torch.save({"w": w.half()}, tmp_path / "pytorch_model.fp16.bin")
    loader = detect_loader(tmp_path)
    got = dict(loader.lazy_load(tmp_path, {}))
    assert list(got) == ["w"] and same_bits(got["w"], w)
    assert any("pytorch_model.fp16.bin: a variant" in n for n in loader.index(tmp_path).notes)
    got = dict(loader.lazy_load(tmp_path / "pytorch_model.fp16.bin", {}))
    assert got["w"].dtype == torch.float16
    # A file named like a variant that holds other keys is another part of the model.
    torch.save({"vision.w": w}, tmp_path / "pytorch_model.vision.bin")
    assert set(dict(detect_loader(tmp_path).lazy_load(tmp_path, {}))) == {"w", "vision.w"}
    # Keys compared as the load sees them: a key the key_map drops (a step count that is no
    # tensor) is no difference, and no error.
    (tmp_path / "pytorch_model.vision.bin").unlink()
    torch.save({"w": w, "step": 3}, tmp_path / "pytorch_model.bin")
    torch.save({"w": w.half(), "step": 3}, tmp_path / "pytorch_model.fp16.bin")
    options = lazyckpt.ModelCheckpointLoadOptions(key_map={"step": None})
    got = dict(detect_loader(tmp_path).lazy_load(tmp_path, {}, options))
    assert list(got) == ["w"] and same_bits(got["w"], w)
    # A variant's own index beside the default file is not the folder's index.
    folder = tmp_path / "variant-index"
    folder.mkdir()
    torch.save({"w": w}, folder / "pytorch_model.bin")
    torch.save({"w": w.half()}, folder / "pytorch_model.fp16-00001-of-00001.bin")
    (folder / "pytorch_model.fp16.bin.index.json").write_text(
        json.dumps({"weight_map": {"w": "pytorch_model.fp16-00001-of-00001.bin"}})
    )
    loader = detect_loader(folder)
    assert dict(loader.lazy_load(folder, {}))["w"].dtype == torch.float32
    assert any("fp16.bin.index.json: the index of a variant" in n for n in loader.index(folder).notes)


@pytest.mark.parametrize(
    ("weights", "adapter", "loader_name"),
    [
        ("model.safetensors", "adapter_model.safetensors", "safetensors"),
        ("model.safetensors", "adapter_model.bin", "safetensors"),
        ("pytorch_model.bin", "adapter_model.safetensors", "torch"),
        ("pytorch_model.bin", "adapter_model.bin", "torch"),
    ],
)
def test_a_peft_adapter_beside_the_weights_is_not_merged_into_them(
    tmp_path: Path, weights: str, adapter: str, loader_name: str
) -> None:
    w = torch.arange(6.0).reshape(2, 3)
    lora = "base_model.model.layer.lora_A.weight"
    _save(tmp_path / weights, {"layer.weight": w})
    _save(tmp_path / adapter, {lora: torch.ones(1, 3)})
    loader = detect_loader(tmp_path)
    assert loader.name == loader_name
    got = dict(loader.lazy_load(tmp_path, {}))
    assert list(got) == ["layer.weight"] and torch.equal(got["layer.weight"], w)
    assert any(f"{adapter}: a PEFT adapter" in n for n in loader.index(tmp_path).notes)
    # Passed by name, or alone in its folder, the adapter is the checkpoint, and not noted
    # as left out; beside its copy in the other format, that copy is noted as such.
    assert list(dict(detect_loader(tmp_path / adapter).lazy_load(tmp_path / adapter, {}))) == [lora]
    (tmp_path / weights).unlink()
    loader = detect_loader(tmp_path)
    assert list(dict(loader.lazy_load(tmp_path, {}))) == [lora]
    assert not any("PEFT" in n for n in loader.index(tmp_path).notes)
    twin = "adapter_model.bin" if adapter.endswith(".safetensors") else "adapter_model.safetensors"
    _save(tmp_path / twin, {lora: torch.ones(1, 3)})
    loader = detect_loader(tmp_path)
    assert loader.name == "safetensors" and list(dict(loader.lazy_load(tmp_path, {}))) == [lora]
    notes = loader.index(tmp_path).notes
    assert not any("PEFT" in n for n in notes)
    assert any("adapter_model.bin: the safetensors files beside it are loaded" in n for n in notes)


def test_an_adapter_beside_files_of_other_names_is_not_taken_for_one(tmp_path: Path) -> None:
    # A LLaVA LoRA folder: adapter_model.safetensors beside non_lora_trainables.bin, both
    # needed. Only a model's weights under Hugging Face's names make an adapter extra; else the
    # folder stays as ambiguous as before, not loaded as its .bin alone.
    save_file({"base_model.model.l.lora_A.weight": torch.ones(1, 3)}, tmp_path / "adapter_model.safetensors")
    torch.save({"mm_projector.weight": torch.ones(2, 2)}, tmp_path / "non_lora_trainables.bin")
    with pytest.raises(lazyckpt.UnknownCheckpointFormatError, match="both safetensors"):
        detect_loader(tmp_path)
    (tmp_path / "non_lora_trainables.bin").unlink()
    save_file({"mm_projector.weight": torch.ones(2, 2)}, tmp_path / "non_lora_trainables.safetensors")
    loader = detect_loader(tmp_path)
    assert set(dict(loader.lazy_load(tmp_path, {}))) == {"base_model.model.l.lora_A.weight", "mm_projector.weight"}
    assert not any("PEFT" in n for n in loader.index(tmp_path).notes)
