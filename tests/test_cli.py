"""The ``lazyckpt`` command line, run through ``main([...])`` and once as ``python -m lazyckpt``.

Oracles: ``torch.load`` / ``safetensors.torch.load_file`` of what was written, against
``torch.chunk`` of the full tensors; for ``consolidated`` output also the records ``torch.save``
itself writes for the same dict.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SAMPLE_DIMS, expected, same_bits, sample_state_dict, write_checkpoint
from safetensors.torch import load_file, save_file

import lazyckpt
from lazyckpt import writers
from lazyckpt.cli import main
from lazyckpt.demo import LLAMA_PARAMS, build_llama_mp
from lazyckpt.writers import TensorSpec, TorchSaveWriter, parse_size

SMALL = dict(LLAMA_PARAMS, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256)
REPO = Path(__file__).resolve().parent.parent


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


@pytest.fixture
def mp4(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, int]]:
    """A Llama-3-shaped fairscale MP-4 checkpoint: folder, full tensors, shard dims."""
    folder = tmp_path / "mp4"
    full, dims = build_llama_mp(folder, mp=4, params=SMALL)
    return folder, full, dims


def _resave(path: Path, change: dict[str, torch.Tensor]) -> None:
    sd = torch.load(path, weights_only=True)
    sd.update(change)
    torch.save(sd, path)


def _listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def _ctrl_c_as_at_a_terminal() -> None:
    """A child's SIGINT back to the default: a job started in the background (``cmd &``) has
    it ignored, and Python then installs no KeyboardInterrupt handler, so Ctrl-C tests would
    find the command ignoring it, as it should there."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# -- inspect ---------------------------------------------------------------------------------


def test_inspect_fairscale_detects_the_preset(capsys: pytest.CaptureFixture[str], mp4) -> None:
    folder, full, dims = mp4
    doc = run_json(capsys, "inspect", folder)
    assert doc["format"] == "fairscale" and doc["source_layout"] == "MP-4"
    assert doc["shard_dims"] == {"source": "detected llama3-fairscale", "dims": dims}
    assert [k["key"] for k in doc["keys"]] == list(full)
    for k in doc["keys"]:
        t = full[k["key"]]
        assert k["shape"] == list(t.shape) and k["dtype"] == "bfloat16"
        assert k["bytes"] == t.nbytes
        assert (k["chunks"], k["copies"]) == ((4, 1) if k["key"] in dims else (1, 4))
    assert doc["total_bytes"] == sum(t.nbytes for t in full.values())
    assert len(doc["files"]) == 4


def test_inspect_lists_a_set_whose_split_keys_are_not_named_yet(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Keys of a model-parallel set of no known preset, taken for replicas, whose copies' CRC-32s
    differ: ``inspect`` lists every key (what a shard-dims file is written from) and says so
    once; ``verify`` names each; a load refuses them."""
    full = {f"blocks.{i}.proj.weight": torch.randn(8, 4) for i in range(3)}
    folder = tmp_path / "mp"
    folder.mkdir()
    for r in range(2):
        shard = {k: torch.chunk(v, 2, 0)[r].clone() for k, v in full.items()}
        torch.save({**shard, "norm": torch.ones(4)}, folder / f"consolidated.0{r}.pth")
    doc = run_json(capsys, "inspect", folder)
    assert [k["key"] for k in doc["keys"]] == [*full, "norm"]
    assert sum("CRC-32s differ" in n for n in doc["notes"]) == 1, doc["notes"]
    rc, out, _ = run(capsys, "verify", folder)
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert rc == 1 and len(fails) == 3 and all("add it to shard_dims" in f for f in fails), out
    dims = tmp_path / "dims.json"
    dims.write_text(json.dumps(dict.fromkeys(full, 0)))
    rc, out, _ = run(capsys, "verify", folder, "--shard-dims", dims)
    assert rc == 0, out


def test_inspect_fairscale_shows_params_json(capsys: pytest.CaptureFixture[str], mp4) -> None:
    """``params.json`` is read only when asked for (a load never looks at it), and still shown
    by ``inspect``; one that is not JSON shows as empty and does not stop a load."""
    folder, full, dims = mp4
    params = json.loads((folder / "params.json").read_text())
    assert params  # the fixture writes one
    doc = run_json(capsys, "inspect", folder)
    assert doc["metadata"] == {k: json.dumps(v) for k, v in params.items()}

    (folder / "params.json").write_text("{not json")
    assert run_json(capsys, "inspect", folder)["metadata"] == {}
    key = next(iter(full))
    loaded = dict(lazyckpt.get_model_checkpoint_loader().lazy_load(folder, dims))
    assert same_bits(loaded[key], full[key])


def test_inspect_text_of_a_hugging_face_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sd = sample_state_dict()
    path = write_checkpoint("hub-safetensors", sd, tmp_path / "hf")
    rc, out, err = run(capsys, "inspect", path)
    assert rc == 0, err
    assert "format:      safetensors" in out and "via index" in out
    for key, t in sd.items():
        line = next(line for line in out.splitlines() if line.startswith(key + " "))
        shape = "x".join(map(str, t.shape)) if t.dim() else "()"
        assert shape in line.split(), line
    assert f"total: {len(sd)} keys" in out


def test_inspect_with_a_json_shard_dims_file(
    capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path
) -> None:
    folder, full, dims = mp4
    spec = tmp_path / "dims.json"
    spec.write_text(json.dumps(dims))
    doc = run_json(capsys, "inspect", folder, "--shard-dims", spec)
    assert doc["shard_dims"]["dims"] == dims
    assert {k["key"]: k["shape"] for k in doc["keys"]} == {
        k: list(t.shape) for k, t in full.items()
    }


def test_shard_dims_that_cannot_be_meant_are_noted(
    capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path
) -> None:
    # A typo in a --shard-dims file split nothing, silently (the key was written whole into
    # every TP rank's file); a Llama 2 preset over a Llama 3 set was verified with no word.
    folder, full, dims = mp4
    spec = tmp_path / "dims.json"
    typo = {("layers.0.attention.wq.weigth" if k == "layers.0.attention.wq.weight" else k): d
            for k, d in dims.items()}
    spec.write_text(json.dumps(typo))
    save_file({k: t.contiguous() for k, t in full.items()}, tmp_path / "full.safetensors")
    rc, _, err = run(
        capsys, "reshard", tmp_path / "full.safetensors", tmp_path / "out", "--tp", "2",
        "--shard-dims", spec,
    )
    assert rc == 0
    assert f"--shard-dims {spec}: 1 key(s) the checkpoint lacks, ignored: " in err
    assert "'layers.0.attention.wq.weigth'" in err
    rc, _, err = run(capsys, "verify", folder, "--shard-dims", "llama2-fairscale")
    assert "the shapes fit preset llama3-fairscale" in err
    rc, _, err = run(capsys, "verify", folder, "--shard-dims", "llama3-fairscale")
    assert rc == 0 and "note" not in err


def test_key_map_renames_and_drops_for_every_command(
    capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path
) -> None:
    # Hugging Face-style names to Meta's, so that a preset splits them, and one key dropped.
    _, full, dims = mp4
    src = tmp_path / "renamed.safetensors"
    save_file({f"model.{k}": t.contiguous() for k, t in full.items()}, src)
    mapping: dict[str, str | None] = {f"model.{k}": k for k in full}
    mapping["model.output.weight"] = None
    spec = tmp_path / "map.json"
    spec.write_text(json.dumps(mapping))
    kept = [k for k in full if k != "output.weight"]
    doc = run_json(capsys, "inspect", src, "--key-map", spec, "--shard-dims", "llama3-fairscale")
    assert sorted(k["key"] for k in doc["keys"]) == sorted(kept)  # safetensors sorts its keys
    assert {k["key"]: k["shard_dim"] for k in doc["keys"]} == {k: dims.get(k) for k in kept}
    rc, _, err = run(capsys, "verify", src, "--key-map", spec, "--read")
    assert rc == 0 and "note" not in err, err
    dst = tmp_path / "mp2"
    rc, _, err = run(
        capsys, "reshard", src, dst, "--tp", "2", "--shard-dims", "llama3-fairscale",
        "--key-map", spec,
    )
    assert rc == 0, err
    for r in range(2):
        got = torch.load(dst / f"consolidated.{r:02d}.pth", weights_only=True)
        assert sorted(got) == sorted(kept)
        for k in kept:
            want = expected(full[k], dims.get(k), lazyckpt.Layout(tp_size=2, tp_rank=r))
            assert same_bits(got[k], want), k
    # A key the checkpoint lacks renames nothing: said, not silent.
    spec.write_text(json.dumps({"model.layers.0.attention.wq.weigth": "x", **mapping}))
    rc, _, err = run(capsys, "plan", src, "--tp", "2", "--key-map", spec)
    assert rc == 0, err
    assert f"--key-map {spec}: 1 key(s) the checkpoint lacks, ignored: " in err
    assert "'model.layers.0.attention.wq.weigth'" in err
    for bad, message in (
        ({"model.norm.weight": 3}, "maps to 3; give a new name"),
        (["a"], "expected a JSON object"),
    ):
        spec.write_text(json.dumps(bad))
        rc, _, err = run(capsys, "inspect", src, "--key-map", spec)
        assert rc == 2 and message in err, err
    rc, _, err = run(capsys, "inspect", src, "--key-map", tmp_path / "missing.json")
    assert rc == 2 and "is not a file" in err


def test_a_key_map_out_of_meta_names_keeps_the_preset(
    capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path
) -> None:
    # Renaming output.weight hid it from preset detection and from the preset's rules: the
    # healthy set was called damaged, and --shard-dims llama3-fairscale refused the rename.
    src, full, dims = mp4
    spec = tmp_path / "map.json"
    spec.write_text(json.dumps({"output.weight": "lm_head.weight"}))
    rc, _, err = run(capsys, "plan", src, "--tp", "2", "--key-map", spec)
    assert rc == 0 and "detected preset llama3-fairscale" in err, err
    dst = tmp_path / "tp2"
    rc, _, err = run(
        capsys, "reshard", src, dst, "--tp", "2", "--shard-dims", "llama3-fairscale", "--key-map", spec
    )
    assert rc == 0, err
    got = torch.load(dst / "consolidated.01.pth", weights_only=True)
    layout = lazyckpt.Layout(tp_size=2, tp_rank=1)
    assert "output.weight" not in got
    assert same_bits(got["lm_head.weight"], expected(full["output.weight"], dims["output.weight"], layout))
    # A file of dims under the old name: the command line's way out is named.
    (tmp_path / "dims.json").write_text(json.dumps(dims))
    rc, _, err = run(capsys, "plan", src, "--tp", "2", "--key-map", spec, "--shard-dims", tmp_path / "dims.json")
    assert rc == 2 and "'lm_head.weight'" in err and "--shard-dims" in err and "as --key-map leaves them" in err, err


def test_verify_goes_on_past_a_bad_key_under_a_key_map(
    capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path
) -> None:
    # verify drops each bad key and indexes again; the user's --key-map must still apply then.
    folder, full, _dims = mp4
    wq = "layers.0.attention.wq.weight"
    shard = torch.chunk(full[wq], 4, 0)[2]
    _resave(folder / "consolidated.02.pth", {wq: torch.cat([shard, shard[:, :1]], 1).clone()})
    spec = tmp_path / "map.json"
    spec.write_text(json.dumps({"norm.weight": "final_norm.weight", "output.weight": None}))
    rc, out, err = run(
        capsys, "verify", folder, "--shard-dims", "llama3-fairscale", "--key-map", spec, "--read",
        "--json",
    )
    doc = json.loads(out)
    assert rc == 1 and len(doc["problems"]) == 1 and wq in doc["problems"][0], doc
    assert doc["keys"] == len(full) - 1, doc  # output.weight stays dropped
    assert "note" not in err, err


def test_verify_under_a_key_map_that_shifts_names_drops_only_the_bad_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # l1 is bad; the map gives l0 the name l1. Dropping "l1" must drop the checkpoint's l1,
    # not l0 too (it used to: l0 went unchecked while the report counted it).
    torch.save({"l0": torch.ones(2), "l1": "oops", "l2": torch.ones(2)}, tmp_path / "m.pt")
    spec = tmp_path / "shift.json"
    spec.write_text(json.dumps({"l0": "l1", "l1": "l2", "l2": "l3"}))
    rc, out, _ = run(capsys, "verify", tmp_path / "m.pt", "--key-map", spec, "--read", "--json")
    doc = json.loads(out)
    assert rc == 1 and len(doc["problems"]) == 1 and "'l1'" in doc["problems"][0], doc
    assert doc["keys"] == 3, doc  # l0 and l2 read and checked, besides the bad l1
    # And the other way: a model-parallel set whose replica l0 differs between its ranks, under
    # a map naming it l1; the good l1 (named l2) must still be read: the same bytes as without
    # the map (it used to be dropped for the bad key's new name).
    folder = tmp_path / "mp"
    folder.mkdir()
    for r in range(2):
        sd = {"l0": torch.ones(4) + r, "l1": torch.full((4,), 2.0), "w": torch.ones(4, 2) * r}
        torch.save(sd, folder / f"consolidated.0{r}.pth")
    dims = _dims_file(tmp_path, {"w": 1})
    spec.write_text(json.dumps({"l0": "l1", "l1": "l2"}))
    docs = []
    for extra in ([], ["--key-map", spec]):
        rc, out, _ = run(capsys, "verify", folder, "--read", "--shard-dims", dims, *extra, "--json")
        docs.append(json.loads(out))
        assert rc == 1 and len(docs[-1]["problems"]) == 1, docs[-1]
    assert "checkpoint key 'l0'" in docs[1]["problems"][0]
    assert docs[0]["bytes_read"] == docs[1]["bytes_read"], docs


# -- errors and exit codes -------------------------------------------------------------------


def test_a_missing_checkpoint_is_one_line_exit_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, out, err = run(capsys, "inspect", tmp_path / "nope")
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "nope" in err and err.startswith("lazyckpt: error: ")
    rc, _, err = run(capsys, "--debug", "inspect", tmp_path / "nope")
    assert rc == 1 and "Traceback" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "{mp4}"],  # --tp is required
        ["plan", "{mp4}", "--tp", "0"],
        ["plan", "{mp4}", "--tp", "2", "--tp-rank", "2"],  # Layout rejects it
        ["plan", "{mp4}", "--tp", "2", "--shard-dims", "llama9-fairscale"],
        ["plan", "{mp4}", "--tp", "2", "--shard-dims", "{bad_json}"],
        ["inspect", "{mp4}", "--shard-dims", "{out_of_range}"],
        ["reshard", "{mp4}", "{tmp}/out", "--tp", "2", "--dp", "2"],  # consolidated has no dp
        ["reshard", "{mp4}", "{tmp}/out", "--tp", "2", "--max-shard-size", "5 parsecs"],
        ["reshard", "{mp4}", "{mp4}/inside", "--tp", "2"],
        ["reshard", "{single}", "{tmp}/out", "--tp", "2"],  # consolidated TP-2 needs shard dims
        ["frobnicate"],
    ],
)
def test_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path, argv: list[str]
) -> None:
    folder, _, _ = mp4
    (tmp_path / "bad.json").write_text(json.dumps({"output.weight": "zero"}))
    (tmp_path / "range.json").write_text(json.dumps({"output.weight": 5}))
    torch.save({"w": torch.zeros(4, 4)}, tmp_path / "single.pt")
    names = {
        "single": tmp_path / "single.pt",
        "mp4": folder,
        "tmp": tmp_path,
        "bad_json": tmp_path / "bad.json",
        "out_of_range": tmp_path / "range.json",
    }
    rc, _, err = run(capsys, *(a.format(**names) for a in argv))
    assert rc == 2, err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (folder / "inside").exists()


# -- plan ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    [
        lazyckpt.Layout(tp_size=2, tp_rank=1),
        lazyckpt.Layout(tp_size=8, tp_rank=5),
        lazyckpt.Layout(tp_size=2, tp_rank=0, dp_size=2, dp_rank=1),
    ],
    ids=str,
)
def test_plan_says_what_a_load_reads(
    capsys: pytest.CaptureFixture[str], mp4, layout: lazyckpt.Layout
) -> None:
    folder, full, dims = mp4
    argv = ["plan", folder, "--tp", layout.tp_size, "--tp-rank", layout.tp_rank]
    argv += [
        "--dp",
        layout.dp_size,
        "--dp-rank",
        layout.dp_rank,
        "--shard-dims",
        "llama3-fairscale",
    ]
    doc = run_json(capsys, *argv)
    stats = lazyckpt.LoadStats()
    opts = lazyckpt.ModelCheckpointLoadOptions(layout=layout, stats=stats)
    got = {}
    for key, t in lazyckpt.get_model_checkpoint_loader().lazy_load(folder, dims, opts):
        got[key] = tuple(t.shape)
    assert {f["path"]: f["bytes"] for f in doc["files"]} == stats.bytes_read
    assert doc["bytes_read"] == stats.total_bytes_read
    assert doc["bytes_delivered"] == stats.bytes_delivered
    assert {k["key"]: tuple(k["shape"]) for k in doc["keys"]} == got
    for k in doc["keys"]:
        assert tuple(k["shape"]) == tuple(
            expected(full[k["key"]], dims.get(k["key"]), layout).shape
        )
    read = {f["path"] for f in doc["files"]}
    assert sorted(read | set(doc["files_not_read"])) == sorted(
        str(folder / f"consolidated.{r:02d}.pth") for r in range(4)
    )
    largest = max(expected(t, dims.get(k), layout).nbytes for k, t in full.items())
    assert doc["largest_tensor_bytes"] <= largest  # zero-copy views of the files count nothing
    assert doc["largest_tensor_bytes"] <= doc["peak_memory_bytes"]


def test_plan_peak_memory_counts_keys_that_may_not_be_views(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Keys over bytes an earlier view holds (tied, a slice of another) are read into memory of
    # their own, and a DCP chunk is a view only where its bytes are aligned: the plan counted
    # them all as views, a peak of 0 for loads that took tens of MB.
    x = torch.randn(256, 64)
    torch.save({"a": x, "b": x[10:110], "c": torch.randn(32, 64)}, tmp_path / "tied.pt")
    doc = run_json(capsys, "plan", tmp_path / "tied.pt", "--tp", "1")
    assert doc["peak_memory_bytes"] >= x[10:110].nbytes
    save_file({"a": x, "c": torch.randn(32, 64)}, tmp_path / "m.safetensors")
    assert run_json(capsys, "plan", tmp_path / "m.safetensors", "--tp", "1")["peak_memory_bytes"] == 0
    import torch.distributed.checkpoint as dcp

    dcp.save({"a": x}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert run_json(capsys, "plan", tmp_path / "dcp", "--tp", "1")["peak_memory_bytes"] >= x.nbytes


def test_plan_text(capsys: pytest.CaptureFixture[str], mp4) -> None:
    folder, _, _ = mp4
    rc, out, err = run(capsys, "plan", folder, "--tp", "2", "--tp-rank", "1")
    assert rc == 0, err
    assert "reads 2 of 4 data file(s)" in out
    assert "consolidated.02.pth" in out and "consolidated.03.pth" in out
    assert "consolidated.00.pth" not in out
    assert "peak memory" in out


def test_plan_of_a_dcp_folder_counts_only_data_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """DCP's ``.metadata`` is read while indexing, never by a load: not a data file left
    unread."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    dcp.save(sample_state_dict(), checkpoint_id=folder, no_dist=True)
    data = sorted(str(f) for f in folder.glob("*.distcp"))
    doc = run_json(capsys, "plan", folder, "--tp", "2")
    assert sorted(f["path"] for f in doc["files"]) == data
    assert doc["files_not_read"] == []
    rc, out, err = run(capsys, "plan", folder, "--tp", "2")
    assert rc == 0, err
    assert f"reads {len(data)} of {len(data)} data file(s)" in out


# -- verify ----------------------------------------------------------------------------------


def test_a_training_checkpoint_needs_no_restrict_to_be_read(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A config object beside the weights is off the allow-list: every command refuses the file
    # and names the flag, and every command reads it with --no-restrict.
    path = tmp_path / "train.pt"
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    torch.save({"model": weights, "args": argparse.Namespace(lr=0.1)}, path)
    dst = tmp_path / "out"
    commands: list[tuple[Any, ...]] = [
        ("inspect", path),
        ("plan", path, "--tp", "1"),
        ("verify", path, "--read"),
        ("reshard", path, dst, "--tp", "1", "--format", "safetensors"),
    ]
    for argv in commands:
        rc, out, err = run(capsys, *argv)
        assert rc == 1, (argv, out, err)
        assert "argparse.Namespace" in out + err and "--no-restrict" in out + err, (argv, out, err)
        rc, out, err = run(capsys, *argv, "--no-restrict")
        assert rc == 0, (argv, out, err)
    (written,) = sorted(dst.glob("*.safetensors"))
    assert torch.equal(load_file(written)["w"], weights["w"])


def test_verify_a_good_checkpoint(capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path) -> None:
    folder, _, _ = mp4
    for extra in ([], ["--read"]):
        rc, out, err = run(capsys, "verify", folder, *extra)
        assert rc == 0, out + err
        assert out.startswith("OK: ")
    path = write_checkpoint("hub-safetensors", sample_state_dict(), tmp_path / "hf")
    doc = run_json(capsys, "verify", path, "--read")
    assert doc["ok"] and doc["problems"] == [] and doc["keys"] == len(sample_state_dict())
    # Each pass's bytes said apart: "read every byte: X" read as twice a torch file's size.
    size = sum(os.path.getsize(f) for f in folder.glob("consolidated.*.pth"))
    doc = run_json(capsys, "verify", folder, "--read")
    assert doc["bytes_loaded"] < size and 0 < doc["bytes_crc_checked"] < size
    assert doc["bytes_read"] == doc["bytes_loaded"] + doc["bytes_crc_checked"]
    rc, out, _ = run(capsys, "verify", folder, "--read")
    assert "loaded, and " in out and "read again for the CRC-32s" in out, out
    doc = run_json(capsys, "verify", path, "--read")
    assert doc["bytes_crc_checked"] == 0 and doc["bytes_read"] == doc["bytes_loaded"] > 0


def test_verify_names_every_inconsistent_key(capsys: pytest.CaptureFixture[str], mp4) -> None:
    folder, full, _dims = mp4
    wq, w2 = "layers.0.attention.wq.weight", "layers.1.feed_forward.w2.weight"
    rank2 = folder / "consolidated.02.pth"
    shard = torch.chunk(full[wq], 4, 0)[2]
    _resave(rank2, {wq: torch.cat([shard, shard[:, :1]], 1).clone()})  # wrong off the shard dim
    _resave(folder / "consolidated.01.pth", {w2: torch.chunk(full[w2], 4, 1)[1].float()})
    rc, out, _ = run(capsys, "verify", folder, "--shard-dims", "llama3-fairscale")
    assert rc == 1
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 2, out
    assert repr(wq) in fails[0] and repr(w2) in fails[1]
    assert "2 problem(s) found" in out


def test_verify_read_finds_damaged_bytes_and_replicas(
    capsys: pytest.CaptureFixture[str], mp4
) -> None:
    folder, full, dims = mp4
    # Flip bytes in the middle of one tensor of rank 1, as a bad disk or copy would.
    w1 = "layers.0.feed_forward.w1.weight"
    rank1 = folder / "consolidated.01.pth"
    index = lazyckpt.loaders.detect_loader(folder).index(folder, dims)
    region = next(c.data for c in index.entries[w1].chunks if c.path == rank1)
    with open(rank1, "r+b") as f:
        f.seek(region.byte_offset + 10)
        byte = f.read(1)
        f.seek(region.byte_offset + 10)
        f.write(bytes([byte[0] ^ 0xFF]))

    rc, out, _ = run(capsys, "verify", folder)
    assert rc == 0, out  # the metadata is fine: only reading finds the flipped bytes

    # A replica saved with other values: its record's CRC-32 tells, without reading.
    norm = "layers.1.ffn_norm.weight"
    _resave(folder / "consolidated.03.pth", {norm: full[norm] + 1})
    for read in ((), ("--read",)):
        rc, out, _ = run(capsys, "verify", folder, *read)
        assert rc == 1, out
        fails = [line for line in out.splitlines() if line.startswith("FAIL")]
        assert any(repr(norm) in line and "replica" in line for line in fails), out
        flipped = [line for line in fails if repr(w1) in line and "CRC-32" in line]
        assert bool(flipped) == bool(read) and all(str(rank1) in line for line in flipped), out


def test_verify_truncated_file_names_file_and_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sd = sample_state_dict()
    path = write_checkpoint("safetensors-folder", sd, tmp_path / "st")
    victim = path / "part-1.safetensors"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    doc = json.loads(_verify_json(capsys, path))
    assert not doc["ok"]
    (problem,) = doc["problems"]
    assert str(victim) in problem and "key '" in problem


def test_verify_names_every_key_a_truncation_cut_off(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Every key past the cut is named, not only the first.
    sd = {f"cut_key_{i:02d}": torch.full((64,), float(i)) for i in range(12)}
    victim = tmp_path / "cut.safetensors"
    save_file(sd, victim)
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 9 * 256 - 10])  # 10 keys lose bytes
    doc = json.loads(_verify_json(capsys, victim))
    text = " ".join(doc["problems"])
    assert [k for k in sd if repr(k) in text] == [f"cut_key_{i:02d}" for i in range(2, 12)], text
    assert str(victim) in text


def _verify_json(capsys: pytest.CaptureFixture[str], path: Path) -> str:
    rc, out, _ = run(capsys, "verify", path, "--read", "--json")
    assert rc == 1
    return out


# -- reshard ---------------------------------------------------------------------------------


def _records(path: Path) -> dict[str, bytes]:
    """A torch zip's records by name without the archive folder, serialization id left out."""
    with zipfile.ZipFile(path) as zf:
        return {
            n.split("/", 1)[1]: zf.read(n) for n in zf.namelist() if "serialization_id" not in n
        }


def test_reshard_mp4_to_consolidated_mp2_loads_back_exactly(
    capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path
) -> None:
    folder, full, dims = mp4
    dst = tmp_path / "out" / "mp2"
    rc, _out, err = run(
        capsys, "reshard", folder, dst, "--tp", "2", "--shard-dims", "llama3-fairscale"
    )
    assert rc == 0, err
    assert "\r" not in err  # no progress bar when stderr is not a terminal
    assert _listing(dst) == ["consolidated.00.pth", "consolidated.01.pth", "params.json"]
    assert (dst / "params.json").read_bytes() == (folder / "params.json").read_bytes()
    for r in range(2):
        got = torch.load(dst / f"consolidated.{r:02d}.pth", weights_only=True)
        want = {
            k: expected(t, dims.get(k), lazyckpt.Layout(tp_size=2, tp_rank=r)).clone()
            for k, t in full.items()
        }
        assert list(got) == list(want)
        for key in want:
            assert same_bits(got[key], want[key]), key
        # The very records torch.save writes for the same dict.
        (tmp_path / "oracle").mkdir(exist_ok=True)
        torch.save(want, tmp_path / "oracle" / f"consolidated.{r:02d}.pth")
        assert _records(dst / f"consolidated.{r:02d}.pth") == _records(
            tmp_path / "oracle" / f"consolidated.{r:02d}.pth"
        )
    assert _listing(tmp_path / "out") == ["mp2"]  # no temporary folder left beside it
    # lazyckpt reads its own output back as a fairscale MP-2 checkpoint.
    doc = run_json(capsys, "inspect", dst)
    assert doc["source_layout"] == "MP-2"
    assert doc["shard_dims"]["source"] == "detected llama3-fairscale"


def test_torch_save_writer_handles_every_dtype(tmp_path: Path) -> None:
    sd = dict(sample_state_dict())
    sd["f8"] = torch.randn(4, 3).to(torch.float8_e4m3fn)
    sd["u16"] = torch.arange(6, dtype=torch.int32).to(torch.uint16)
    sd["c64"] = torch.randn(3, dtype=torch.complex64)
    writer = TorchSaveWriter(
        tmp_path / "w.pth", [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in sd.items()]
    )
    for k, t in sd.items():
        writer.write(k, t)
    writer.close()
    (tmp_path / "ref").mkdir()
    torch.save(sd, tmp_path / "ref" / "w.pth")
    got = torch.load(tmp_path / "w.pth", weights_only=True)
    assert list(got) == list(sd)
    for k in sd:
        assert same_bits(got[k], sd[k]), k
    assert _records(tmp_path / "w.pth") == _records(tmp_path / "ref" / "w.pth")


def test_reshard_hugging_face_folder_to_safetensors_bit_exact(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sd = sample_state_dict()
    src = write_checkpoint("hub-safetensors", sd, tmp_path / "hf")
    dst = tmp_path / "resharded"
    doc = run_json(
        capsys,
        "reshard",
        src,
        dst,
        "--tp",
        "1",
        "--format",
        "safetensors",
        "--max-shard-size",
        "100KB",
    )
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    names = sorted(set(index["weight_map"].values()))
    assert len(names) > 1 and names == sorted(f["name"] for f in doc["files"])
    assert _listing(dst) == sorted([*names, "model.safetensors.index.json"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in sd.values())
    got: dict[str, torch.Tensor] = {}
    for name in names:
        part = load_file(dst / name)
        tensor_bytes = sum(t.nbytes for t in part.values())
        assert tensor_bytes <= 100_000 or len(part) == 1
        assert all(index["weight_map"][k] == name for k in part)
        got.update(part)
    assert set(got) == set(sd)
    for key, t in sd.items():
        assert same_bits(got[key], t), key
    for key, t in lazyckpt.get_model_checkpoint_loader().lazy_load(dst, {}):
        assert same_bits(t, sd[key]), key


def test_reshard_to_safetensors_per_rank_with_dtype(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sd = sample_state_dict()
    save_file(sd, tmp_path / "m.safetensors")
    (tmp_path / "dims.json").write_text(json.dumps(SAMPLE_DIMS))
    dst = tmp_path / "tp2"
    rc, _, err = run(
        capsys,
        "reshard",
        tmp_path / "m.safetensors",
        dst,
        "--tp",
        "2",
        "--dp",
        "2",
        "--format",
        "safetensors",
        "--dtype",
        "bf16",
        "--shard-dims",
        tmp_path / "dims.json",
    )
    assert rc == 0, err
    assert _listing(dst) == [
        f"model-tp{r:02d}-dp{d:02d}.safetensors" for r in range(2) for d in range(2)
    ]
    for r in range(2):
        for d in range(2):
            layout = lazyckpt.Layout(tp_size=2, tp_rank=r, dp_size=2, dp_rank=d)
            got = load_file(dst / f"model-tp{r:02d}-dp{d:02d}.safetensors")
            assert set(got) == set(sd)
            for key, t in sd.items():
                want = expected(t, SAMPLE_DIMS.get(key), layout)
                want = want.to(torch.bfloat16) if t.is_floating_point() else want
                assert same_bits(got[key], want), (key, layout)


@pytest.mark.parametrize("fmt", ["consolidated", "safetensors"])
def test_reshard_of_a_checkpoint_without_tensors_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fmt: str
) -> None:
    # torch.save({}) resharded to safetensors wrote an index listing no file, which inspect
    # then refused as a broken download.
    torch.save({}, tmp_path / "empty.pt")
    rc, _, err = run(capsys, "reshard", tmp_path / "empty.pt", tmp_path / "out", "--tp", "1", "--format", fmt)
    assert rc == 2 and "holds no tensors, so there is nothing to write" in err, err
    assert _listing(tmp_path) == ["empty.pt"]


def test_reshard_refuses_a_non_empty_destination_without_force(
    capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path
) -> None:
    folder, _full, _dims = mp4
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    rc, _, err = run(capsys, "reshard", folder, dst, "--tp", "2")
    assert rc == 2 and "--force" in err
    assert _listing(dst) == ["keep.txt"]
    rc, _, err = run(capsys, "reshard", folder, dst, "--tp", "2", "--force")
    assert rc == 0, err
    assert _listing(dst) == ["consolidated.00.pth", "consolidated.01.pth", "params.json"]
    assert _listing(tmp_path) == ["dst", "mp4"]
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run(capsys, "reshard", folder, empty, "--tp", "1")
    assert rc == 0, err
    assert _listing(empty) == ["consolidated.00.pth", "params.json"]
    # Links are told as links (one to an empty folder was "a folder that is not empty", a
    # dangling one "a file"): the rename would replace the link, not fill its folder.
    (tmp_path / "void").mkdir()
    (tmp_path / "to-void").symlink_to(tmp_path / "void")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for link in ("to-void", "dangling"):
        rc, _, err = run(capsys, "reshard", folder, tmp_path / link, "--tp", "1")
        assert rc == 2 and f"{tmp_path / link} is a link; choose" in err, err


def test_reshard_sidecars_and_file_modes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # A cast rewrites config.json's torch_dtype (transformers loads in that dtype); without one
    # the sidecars are copied byte for byte. Every file written follows the umask.
    sd = sample_state_dict()
    folder = write_checkpoint("safetensors-index", sd, tmp_path / "hf")
    config = {"torch_dtype": "float32", "dtype": "float32", "hidden_size": 8}
    (folder / "config.json").write_text(json.dumps(config))
    old = os.umask(0o002)
    try:
        rc, _, err = run(capsys, "reshard", folder, tmp_path / "bf16", "--tp", "1",
                         "--format", "safetensors", "--dtype", "bf16")
        assert rc == 0, err
        rc, _, err = run(capsys, "reshard", folder, tmp_path / "same", "--tp", "1",
                         "--format", "safetensors")
        assert rc == 0, err
    finally:
        os.umask(old)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text()) == {
        **config, "torch_dtype": "bfloat16", "dtype": "bfloat16"
    }
    assert (tmp_path / "same" / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "bf16").iterdir()}
    assert set(modes.values()) == {0o664}, modes


def test_reshard_refuses_a_source_whose_bytes_fail_their_crc(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Written out, a damaged record got a fresh CRC-32 that matched its bytes: the damage was
    # gone from every later check. Now nothing is written, unless asked.
    w = torch.arange(64.0).reshape(8, 8)
    src = tmp_path / "w.pt"
    torch.save({"w": w}, src)
    raw = bytearray(src.read_bytes())
    at = bytes(raw).find(w.numpy().tobytes())
    raw[at + 100] ^= 0x40
    src.write_bytes(raw)
    dst = tmp_path / "out"
    rc, _, err = run(capsys, "reshard", src, dst, "--tp", "2", "--shard-dims",
                     _dims_file(tmp_path, {"w": 0}))
    assert rc == 1 and "is damaged, so nothing was written" in err and "'w'" in err, err
    assert not dst.exists()
    # The destination is checked first (the pass reads every byte), and only the records of
    # keys written are checked: a damaged one that --key-map drops does not block.
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    rc, _, err = run(capsys, "reshard", src, tmp_path / "full", "--tp", "1", "--format",
                     "safetensors")
    assert rc == 2 and "not empty" in err, err
    torch.save({"w": w, "ok": torch.ones(3)}, tmp_path / "two.pt")
    raw = bytearray((tmp_path / "two.pt").read_bytes())
    raw[raw.find(w.numpy().tobytes()) + 100] ^= 0x40
    (tmp_path / "two.pt").write_bytes(raw)
    (tmp_path / "drop.json").write_text('{"w": null}')
    rc, _, err = run(capsys, "reshard", tmp_path / "two.pt", tmp_path / "ok", "--tp", "1",
                     "--format", "safetensors", "--key-map", tmp_path / "drop.json")
    assert rc == 0, err
    assert list(load_file(tmp_path / "ok" / "model-00001-of-00001.safetensors")) == ["ok"]
    rc, _, err = run(capsys, "reshard", src, dst, "--tp", "2", "--shard-dims",
                     _dims_file(tmp_path, {"w": 0}), "--no-crc-check")
    assert rc == 0, err
    assert torch.load(dst / "consolidated.00.pth", weights_only=True)["w"].shape == (4, 8)


def _dims_file(tmp_path: Path, dims: dict[str, int]) -> Path:
    spec = tmp_path / "dims.json"
    spec.write_text(json.dumps(dims))
    return spec


def test_reshard_destination_details(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = sample_state_dict()
    folder = write_checkpoint("safetensors-index", sd, tmp_path / "hf")
    # A sidecar that cannot be read fails before any tensor is written, named as the source.
    (folder / "config.json").symlink_to("/proc/self/mem")  # a regular file whose read fails
    rc, _, err = run(capsys, "reshard", folder, tmp_path / "x", "--tp", "1", "--format",
                     "safetensors")
    assert rc == 1 and f"cannot read {folder / 'config.json'}" in err, err
    assert not (tmp_path / "x").exists()
    (folder / "config.json").unlink()
    # An empty folder prepared for the output keeps its mode (setgid) and group; files inside
    # take the group.
    dst = tmp_path / "shared"
    dst.mkdir()
    gid = 65534 if os.geteuid() == 0 else os.getgid()
    os.chown(dst, -1, gid)
    os.chmod(dst, 0o2770)
    doc = run_json(capsys, "reshard", folder, dst, "--tp", "1", "--format", "safetensors")
    assert stat.S_IMODE(dst.stat().st_mode) == 0o2770 and dst.stat().st_gid == gid
    # One its owner may not write to is written, then given that mode.
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    rc, _, err = run(capsys, "reshard", folder, locked, "--tp", "1", "--format", "safetensors")
    assert rc == 0 and stat.S_IMODE(locked.stat().st_mode) == 0o555, err
    assert (locked / "model.safetensors.index.json").exists()
    assert {p.stat().st_gid for p in dst.iterdir()} == {gid}
    # The index written is listed with the files.
    assert doc["index"] == "model.safetensors.index.json"
    assert sorted(os.listdir(dst)) == sorted([f["name"] for f in doc["files"]] + [doc["index"]])
    # Work folders of killed runs into the same destination are named; a live run's, or
    # another destination's, are not.
    out = tmp_path / "out"
    host = writers._host()
    dead = tmp_path / f".out.999999999@{host}-abcd1234.lazyckpt-tmp"
    unnamed = tmp_path / ".out.abcd1234.lazyckpt-tmp"  # written before runs were named in it
    for name in (dead.name, unnamed.name, f".out.{os.getpid()}@{host}-abcd1234.lazyckpt-tmp",
                 ".out.999999999@elsewhere-abcd1234.lazyckpt-tmp",  # a shared file system's
                 f".out.b.999999999@{host}-abcd1234.lazyckpt-tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 3000)
    rc, _, err = run(capsys, "reshard", folder, out, "--tp", "1", "--format", "safetensors")
    assert rc == 0, err
    assert err.count("work folder of an earlier reshard") == 2, err
    assert str(dead) in err and str(unnamed) in err
    # Written over the current folder: the shell is left in the replaced one, so it is said.
    monkeypatch.chdir(out)
    rc, _, err = run(capsys, "reshard", folder, ".", "--tp", "1", "--format", "safetensors",
                     "--force")
    assert rc == 0 and "was the current folder" in err, err


def test_reshard_into_a_folder_with_the_longest_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The hidden work folder beside DST must fit a file name too (255 bytes).
    torch.save(sample_state_dict(), tmp_path / "m.pt")
    dst = tmp_path / ("d" * 255)
    rc, _, err = run(capsys, "reshard", tmp_path / "m.pt", dst, "--tp", "1")
    assert rc == 0, err
    assert _listing(dst) == ["consolidated.00.pth"]
    assert _listing(tmp_path) == sorted([dst.name, "m.pt"])


def test_a_destination_filled_while_resharding_is_not_replaced_without_force(
    capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DST is checked when the reshard starts and again when the result is put in place.
    folder, _full, _dims = mp4
    dst = tmp_path / "dst"
    original = TorchSaveWriter.write

    def write(self: TorchSaveWriter, key: str, tensor: torch.Tensor) -> None:
        original(self, key, tensor)
        dst.mkdir(exist_ok=True)
        (dst / "precious.txt").write_text("someone else's")

    monkeypatch.setattr(TorchSaveWriter, "write", write)
    rc, _, err = run(capsys, "reshard", folder, dst, "--tp", "2")
    assert rc == 2 and "was filled while resharding" in err, err
    assert _listing(dst) == ["precious.txt"]
    assert _listing(tmp_path) == ["dst", "mp4"]


def test_an_index_file_source_protects_its_data_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sd = sample_state_dict()
    folder = write_checkpoint("safetensors-index", sd, tmp_path / "hf")
    index = next(folder.glob("*.index.json"))
    shard = sorted(folder.glob("*.safetensors"))[0]
    before = shard.read_bytes()
    rc, _, err = run(capsys, "reshard", index, shard, "--tp", "1", "--force")
    assert rc == 2 and "a file of the source" in err, err
    assert shard.read_bytes() == before


def test_a_reshard_that_fails_midway_leaves_nothing(
    capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path
) -> None:
    folder, full, _dims = mp4
    # Rank 1's copy of the last norm differs: found only when that tensor is read, after
    # every other tensor has been written.
    _resave(folder / "consolidated.01.pth", {"norm.weight": full["norm.weight"] + 1})
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    rc, _, err = run(capsys, "reshard", folder, out_parent / "mp2", "--tp", "1")
    assert rc == 1
    errors = [line for line in err.splitlines() if line.startswith("lazyckpt: error:")]
    assert len(errors) == 1 and "'norm.weight'" in errors[0] and "Traceback" not in err
    assert _listing(out_parent) == []
    rc, _, err = run(capsys, "reshard", folder, tmp_path / "new" / "deeper" / "mp2", "--tp", "1")
    assert rc == 1
    assert not (tmp_path / "new").exists()  # parents made for it are removed too


@pytest.mark.parametrize("fmt", ["consolidated", "safetensors"])
def test_a_full_disk_midway_is_one_error_naming_the_file_and_leaves_nothing(
    mp4, tmp_path: Path, fmt: str
) -> None:
    # A file size limit (ulimit -f) makes writes past it fail with EFBIG, as a full disk fails
    # them with ENOSPC (Python ignores SIGXFSZ). torch's zip writer then threw again from its
    # destructor when released unfinished: the process aborted, its hidden folder left behind.
    import resource

    folder, _, _ = mp4
    argv = ["reshard", str(folder), "", "--tp", "2", "--format", fmt]
    reference = tmp_path / "reference"
    assert main([*argv[:2], str(reference), *argv[3:]]) == 0
    size = max(p.stat().st_size for p in reference.iterdir())
    for limit in (1000, size // 2, size - 64):
        out_parent = tmp_path / f"out{limit}"
        out_parent.mkdir()
        child = subprocess.run(
            [sys.executable, "-m", "lazyckpt", *argv[:2], str(out_parent / "mp2"), *argv[3:]],
            capture_output=True,
            text=True,
            cwd=REPO,
            preexec_fn=lambda n=limit: resource.setrlimit(
                resource.RLIMIT_FSIZE, (n, resource.RLIM_INFINITY)
            ),
        )
        assert child.returncode == 1, (limit, child.stderr)
        errors = [ln for ln in child.stderr.splitlines() if ln.startswith("lazyckpt: error:")]
        assert len(errors) == 1 and "Traceback" not in child.stderr, child.stderr
        assert errors[0].startswith("lazyckpt: error: cannot write "), errors
        assert str(out_parent / "mp2") in errors[0] and "lazyckpt-tmp" not in errors[0]
        assert _listing(out_parent) == []


def test_a_file_cut_before_its_zip_end_is_told_from_a_finished_one(tmp_path: Path) -> None:
    """torch 2.4's writer ignores a failed write of the zip directory at the end of a file (a
    size limit 64 bytes short: exit 0 and a file torch.load cannot open), so the reshard checks
    the end of every file it finished."""
    from lazyckpt.zipdir import ends_with_end_record

    path = tmp_path / "m.pt"
    torch.save({"w": torch.randn(64, 64)}, path)
    data = path.read_bytes()
    for cut in (0, 1, 21, 22, 64, len(data) // 2, len(data) - 1):
        path.write_bytes(data[: len(data) - cut])
        with open(path, "rb") as f:
            assert ends_with_end_record(f) == (cut == 0), cut



def test_a_writer_whose_last_write_falls_short_without_an_error_fails_to_close(
    tmp_path: Path,
) -> None:
    """What torch 2.4's writer does at a size limit, made on any torch: the zip directory's
    write "succeeds" and the file ends short. ``close`` must raise, not leave the file as
    finished (on newer torch the writer raises first, so the full-disk test never gets here)."""
    path = tmp_path / "m.pth"
    writer = TorchSaveWriter(path, [TensorSpec("w", torch.float32, (8, 8))])
    real = writer._writer

    class EndsShort:
        def write_record(self, *args: Any) -> None:
            real.write_record(*args)

        def write_end_of_file(self) -> None:
            real.write_end_of_file()
            os.truncate(path, path.stat().st_size - 10)

    writer._writer = EndsShort()
    writer.write("w", torch.ones(8, 8))
    with pytest.raises(OSError, match="zip end record"):
        writer.close()

def test_shard_dims_naming_no_key_are_told_as_such_by_reshard(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A --shard-dims file (or preset) naming none of the checkpoint's keys was told "needs
    # --shard-dims", as if none had been given.
    torch.save({"w": torch.zeros(4, 4)}, tmp_path / "single.pt")
    (tmp_path / "dims.json").write_text(json.dumps({"nope.weight": 0}))
    for dims in (str(tmp_path / "dims.json"), "llama3-fairscale"):
        rc, _, err = run(
            capsys, "reshard", tmp_path / "single.pt", tmp_path / "out", "--tp", "2", "--shard-dims", dims
        )
        assert rc == 2 and f"--shard-dims {dims} names none of the checkpoint's 1 keys ('w'" in err
    rc, _, err = run(capsys, "reshard", tmp_path / "single.pt", tmp_path / "out", "--tp", "2")
    assert rc == 2 and "needs --shard-dims" in err

_INTERRUPTED_CHILD = """
import sys, time
from pathlib import Path
from typing import Any
import lazyckpt.writers as w
from lazyckpt.cli import main

ready = Path(sys.argv[1])
original = w.TorchSaveWriter.write
count = [0]

def write(self, key, tensor):
    original(self, key, tensor)
    count[0] += 1
    if count[0] == 5:  # midway: one file open, some tensors in it
        ready.with_suffix(".tmp").write_text(str(self.path))
        ready.with_suffix(".tmp").rename(ready)
        for _ in range(6000):  # wait (at most a minute) for the parent's Ctrl-C
            time.sleep(0.01)

w.TorchSaveWriter.write = write
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_midway_leaves_nothing(mp4, tmp_path: Path, sig: str) -> None:
    # SIGHUP (the terminal closed, ssh dropped) killed the process, its partial output kept.
    if not hasattr(signal, sig):
        pytest.skip(f"no {sig} here")
    folder, _, _ = mp4
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    ready = tmp_path / "ready"
    argv = ["reshard", str(folder), str(out_parent / "mp2"), "--tp", "2"]
    child = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_CHILD, str(ready), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        preexec_fn=_ctrl_c_as_at_a_terminal,
    )
    while not ready.exists() and child.poll() is None:
        time.sleep(0.01)
    assert child.poll() is None, child.communicate()
    partial = Path(ready.read_text())
    assert partial.parent.parent == out_parent and partial.exists()  # it was writing
    child.send_signal(getattr(signal, sig))
    _out, err = child.communicate()
    assert child.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert _listing(out_parent) == []


def test_a_second_ctrl_c_while_the_first_cleans_up_still_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A second Ctrl-C ~20 ms after the first cut the removal of the partial output short,
    # leaving hundreds of MB in a hidden folder beside the destination.
    from lazyckpt.writers import atomic_folder

    real_unlink = os.unlink
    calls = [0]

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:  # where Python's handler raises the second interrupt
            raise KeyboardInterrupt
        real_unlink(path, *args, **kwargs)

    with pytest.raises(KeyboardInterrupt), atomic_folder(tmp_path / "a" / "out") as tmp:
        for i in range(10):
            (tmp / f"part{i}").write_bytes(b"x" * 100)
        monkeypatch.setattr(os, "unlink", unlink)
        raise KeyboardInterrupt  # the first
    assert calls[0] > 3 and _listing(tmp_path) == []


def test_a_mount_point_or_a_device_is_refused_before_anything_is_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # An empty volume's root got the output written on the parent's disk, then a failed
    # rename (EBUSY) naming the hidden folder; --force replaced /dev/full with a folder.
    torch.save({"w": torch.zeros(4, 4)}, tmp_path / "m.pt")
    mount = Path("/proc")
    if mount.is_mount():
        for force in ((), ("--force",)):
            rc, _, err = run(capsys, "reshard", tmp_path / "m.pt", mount, "--tp", "1", *force)
            assert rc == 2 and "is a mount point" in err and "lazyckpt-tmp" not in err, err
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    rc, _, err = run(capsys, "reshard", tmp_path / "m.pt", fifo, "--tp", "1", "--force")
    assert rc == 2 and "is a device, pipe or socket" in err, err
    assert fifo.is_fifo() and _listing(tmp_path) == ["m.pt", "pipe"]


def test_force_over_a_destination_that_cannot_move_leaves_nothing_beside_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Moving a folder needs write permission on it: the failure left a hidden
    # ".lazyckpt-old" folder and named it. (Made here by refusing the move, as a non-root
    # user meets it on a read-only folder.)
    torch.save({"w": torch.zeros(4, 4)}, tmp_path / "m.pt")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.bin").write_bytes(b"old")
    real_rename = os.rename

    def rename(src: Any, to: Any, *args: Any, **kwargs: Any) -> None:
        if Path(src) == dst:
            raise PermissionError(13, "Permission denied", str(src))
        real_rename(src, to, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    rc, _, err = run(capsys, "reshard", tmp_path / "m.pt", dst, "--tp", "1", "--force")
    assert rc == 2 and f"{dst} cannot be moved aside" in err and "lazyckpt-old" not in err, err
    assert _listing(tmp_path) == ["m.pt", "out"] and _listing(dst) == ["old.bin"]


def test_a_full_disk_at_a_sidecar_names_it(tmp_path: Path) -> None:
    # The index and the sidecars (config.json, params.json) were written unnamed: a full disk
    # there said only "No space left on device".
    import resource

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.zeros(4, 4)}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"pad": "x" * 200_000}))
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    child = subprocess.run(
        [sys.executable, "-m", "lazyckpt", "reshard", str(src), str(out_parent / "o"), "--tp", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY)),
    )
    assert child.returncode == 1, child.stderr
    assert f"lazyckpt: error: cannot write {out_parent / 'o' / 'config.json'}" in child.stderr
    assert _listing(out_parent) == []


def test_a_copied_rank_file_is_a_note_of_every_command_not_a_raw_warning(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The CheckpointWarning came out in Python's raw format (the lazyckpt script's line), and
    # verify --json said nothing of the copy.
    import shutil

    folder = tmp_path / "mp"
    folder.mkdir()
    full = torch.arange(24.0).reshape(4, 6)
    for r, part in enumerate(torch.chunk(full, 2, 0)):
        torch.save({"w": part.clone()}, folder / f"consolidated.0{r}.pth")
    shutil.copy(folder / "consolidated.01.pth", folder / "consolidated.02.pth")
    dims = tmp_path / "dims.json"
    dims.write_text(json.dumps({"w": 0}))
    said = "consolidated.02.pth holds the same bytes as consolidated.01.pth"
    for argv in (
        ("inspect", folder, "--shard-dims", dims),
        ("plan", folder, "--tp", "1", "--shard-dims", dims),
        ("verify", folder, "--shard-dims", dims),
        ("reshard", folder, tmp_path / "out", "--tp", "1", "--shard-dims", dims),
    ):
        rc, out, err = run(capsys, *argv)
        assert rc == 0 and said in out + err and "CheckpointWarning" not in err, (argv, out, err)
    for cmd in (("verify",), ("plan", "--tp", "1"), ("inspect",)):
        rc, out, _ = run(capsys, *cmd, folder, "--shard-dims", dims, "--json")
        assert rc == 0 and any(said in note for note in json.loads(out)["notes"]), (cmd, out)


def test_a_key_that_is_not_unicode_is_printed_and_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # torch.save stores a lone surrogate in a key: inspect stopped halfway through its table
    # with a UnicodeEncodeError (exit 2, no key named), and so did reshard to safetensors.
    key = "a\ud800"
    torch.save({"b": torch.zeros(2), key: torch.ones(2)}, tmp_path / "m.pt")
    child = subprocess.run(
        [sys.executable, "-m", "lazyckpt", "inspect", str(tmp_path / "m.pt")],
        capture_output=True,
        cwd=REPO,
    )
    assert child.returncode == 0 and b"a\\ud800" in child.stdout, child.stderr
    rc, _, err = run(
        capsys, "reshard", tmp_path / "m.pt", tmp_path / "out", "--tp", "1", "--format", "safetensors"
    )
    assert rc == 2 and "'a\\ud800' is not valid Unicode" in err, err
    rc, _, err = run(capsys, "reshard", tmp_path / "m.pt", tmp_path / "out", "--tp", "1")
    assert rc == 0, err


_INTERRUPTED_WHILE_PUBLISHING = """
import os, signal, sys
from pathlib import Path
import lazyckpt.writers as w
from lazyckpt.cli import main

original = w._fsync_dir
dst = Path(sys.argv[1])

def fsync_dir(path):
    if Path(path) == dst.parent:  # the new folder was just renamed into place
        os.kill(os.getpid(), signal.SIGINT)
    return original(path)

w._fsync_dir = fsync_dir
sys.exit(main(sys.argv[2:]))
"""


def test_ctrl_c_while_the_result_is_put_in_place(mp4, tmp_path: Path) -> None:
    # The interrupt waits until the new folder is in place and the old one deleted, then
    # says so: nothing half-done is left, and no rollback runs after the rename.
    folder, _, _ = mp4
    out_parent = tmp_path / "out"
    dst = out_parent / "mp2"
    dst.mkdir(parents=True)
    for i in range(50):
        (dst / f"old{i}.bin").write_bytes(b"old")
    argv = ["reshard", str(folder), str(dst), "--tp", "2", "--force"]
    child = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_WHILE_PUBLISHING, str(dst), *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        preexec_fn=_ctrl_c_as_at_a_terminal,
    )
    assert child.returncode == 130, child.stderr
    assert f"interrupted after {dst} was written" in child.stderr, child.stderr
    assert _listing(out_parent) == ["mp2"]
    assert _listing(dst) == ["consolidated.00.pth", "consolidated.01.pth", "params.json"]


def test_python_dash_m_lazyckpt(mp4) -> None:
    folder, full, _ = mp4
    proc = subprocess.run(
        [sys.executable, "-m", "lazyckpt", "inspect", str(folder), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert [k["key"] for k in json.loads(proc.stdout)["keys"]] == list(full)


# -- demo ------------------------------------------------------------------------------------


def test_demo(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = run(capsys, "demo", "--keep", tmp_path / "demo")
    assert rc == 0, err
    assert "OK: every tensor" in out
    assert "tok_embeddings.weight" in out and "FSDP-4 rank 3" in out
    files = [f"consolidated.{r:02d}.pth" for r in range(8)]
    assert _listing(tmp_path / "demo") == [*files, "params.json"]
    doc = run_json(capsys, "verify", tmp_path / "demo")
    assert doc["ok"] and doc["format"] == "fairscale"


def test_demo_json(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "demo")
    assert doc["ok"] and doc["mismatches"] == []
    ranks = {(r["target"], r["tp_rank"], r["dp_rank"]): r for r in doc["ranks"]}
    assert len(ranks) == 6
    total = doc["checkpoint"]["bytes"]
    for (target, _, _), r in ranks.items():
        assert r["bytes_read"] >= r["bytes_delivered"]  # replica copies are read to compare
        share = 2 if target == "TP-2" else 4
        assert r["bytes_delivered"] <= total // share + 1024 * 64
        assert r["peak_memory_planned_bytes"] < total // share


# -- pieces ----------------------------------------------------------------------------------


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 << 20
    assert parse_size("1.5 kb") == 1500
    assert parse_size("123") == 123
    for bad in ("", "GB", "-1MB", "5 parsecs", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler for the test, even where pytest runs as a background job
    (``cmd &``: SIGINT ignored, and then Python installs none)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_deferred_while_publishing_is_never_lost(python_sigint: None) -> None:
    # It waits for the block, then acts: saying what was done when the block succeeded, and
    # also when the block raised (then the error is its context).
    from lazyckpt.writers import _interrupts_deferred

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    deferred = _interrupts_deferred("the work was done")
    with pytest.raises(KeyboardInterrupt, match="after the work was done"), deferred:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # delivered to Python's handler while the block runs
    deferred = _interrupts_deferred("the work was done")
    with pytest.raises(KeyboardInterrupt) as info, deferred:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        raise ValueError("the block failed")
    assert isinstance(info.value.__context__, ValueError) and "after" not in str(info.value)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


# -- found by a review of the command line (each failed before its fix) ---------------------


def test_reshard_mp_n_to_tp_n_compares_the_replicas(
    capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path
) -> None:
    # Each TP-4 rank reads its one rank file, so lazy_load compares no copies; reshard reads
    # every file and must find the damaged copy before writing anything.
    folder, full, dims = mp4
    norm = next(k for k in full if k not in dims and full[k].dim() == 1)
    damaged = full[norm].clone()
    damaged[3] += 1
    _resave(folder / "consolidated.02.pth", {norm: damaged})
    rc, _, err = run(capsys, "reshard", folder, tmp_path / "out", "--tp", "4")
    assert rc == 1, err
    assert f"key {norm!r} should be a replica" in err and "consolidated.02.pth" in err, err
    assert _listing(tmp_path) == ["mp4"]


def test_reshard_to_a_destination_named_in_other_bytes_than_utf8(tmp_path: Path) -> None:
    # In a process of its own: what it prints holds the name's bytes, which are not UTF-8.
    torch.save(sample_state_dict(), tmp_path / "m.pt")
    dst = os.fsencode(tmp_path) + b"/out_\xff"
    done = subprocess.run(
        [sys.executable, "-m", "lazyckpt", "reshard", os.fsencode(tmp_path / "m.pt"), dst, "--tp", "1"],
        capture_output=True,
        cwd=REPO,
        env={**os.environ, "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8"},
    )
    assert done.returncode == 0, done.stderr
    assert b"wrote " + dst in done.stdout, done.stdout
    assert os.listdir(dst) == [b"consolidated.00.pth"]


def test_reshard_errors_name_the_destination_not_the_work_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    torch.save(sample_state_dict(), tmp_path / "m.pt")
    (tmp_path / "afile").write_text("x")
    rc, _, err = run(capsys, "reshard", tmp_path / "m.pt", tmp_path / "afile" / "sub", "--tp", "1")
    assert rc == 1 and str(tmp_path / "afile" / "sub") in err, err
    assert "lazyckpt-tmp" not in err, err


def test_reshard_from_an_index_file_copies_the_sidecars(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = write_checkpoint("safetensors-index", sample_state_dict(), tmp_path / "hf")
    (folder / "config.json").write_text('{"hidden_size": 8}')
    index = folder / "model.safetensors.index.json"
    rc, _, err = run(capsys, "reshard", index, tmp_path / "out", "--tp", "1")
    assert rc == 0, err
    assert (tmp_path / "out" / "config.json").read_bytes() == (folder / "config.json").read_bytes()


def test_max_shard_size_is_refused_where_it_does_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    torch.save(sample_state_dict(), tmp_path / "m.pt")
    for extra in (["--tp", "2", "--format", "safetensors"], ["--tp", "1"]):
        rc, _, err = run(
            capsys, "reshard", tmp_path / "m.pt", tmp_path / "out", *extra, "--max-shard-size", "1MB"
        )
        assert rc == 2 and "--max-shard-size applies to" in err, err
    assert not (tmp_path / "out").exists()


def test_plan_names_the_flags_of_a_rank_past_its_size(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    torch.save(sample_state_dict(), tmp_path / "m.pt")
    rc, _, err = run(capsys, "plan", tmp_path / "m.pt", "--tp", "2", "--dp-rank", "1")
    assert rc == 2 and "--dp-rank 1 needs --dp 2 or more" in err, err
    rc, _, err = run(capsys, "plan", tmp_path / "m.pt", "--tp", "2", "--tp-rank", "2")
    assert rc == 2 and "--tp-rank 2 needs --tp 3 or more" in err, err


def test_shard_dims_from_a_pipe(
    capsys: pytest.CaptureFixture[str], mp4, tmp_path: Path
) -> None:
    # --shard-dims <(cat dims.json): the shell passes /dev/fd/N, a pipe and not a regular file.
    folder, _full, dims = mp4
    r, w = os.pipe()
    try:
        os.write(w, json.dumps(dims).encode())
        os.close(w)
        doc = run_json(capsys, "inspect", folder, "--shard-dims", f"/dev/fd/{r}")
    finally:
        os.close(r)
    assert doc["shard_dims"]["dims"] == dims


def test_verify_json_reports_a_file_it_cannot_read(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A symlink loop fails with an OSError (ELOOP) as an unreadable file does; the JSON report
    # must still come out, saying what failed.
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "model.safetensors")
    rc, out, err = run(capsys, "verify", tmp_path / "model.safetensors", "--json")
    assert rc == 1, err
    doc = json.loads(out)
    assert doc["ok"] is False and doc["problems"], doc


def test_output_closed_early_ends_quietly(tmp_path: Path) -> None:
    # `lazyckpt inspect ... | head -1`: no "Broken pipe" error once the reader has gone.
    torch.save({f"k{i}": torch.zeros(1) for i in range(3000)}, tmp_path / "many.pt")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lazyckpt", "inspect", str(tmp_path / "many.pt")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and err == "", err


def test_a_folder_of_per_rank_files_says_to_pass_one_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    torch.save(sample_state_dict(), tmp_path / "m.pt")
    out = tmp_path / "tp2"
    rc, _, err = run(capsys, "reshard", tmp_path / "m.pt", out, "--tp", "2", "--format",
                     "safetensors", "--shard-dims", "llama3-fairscale")
    assert rc == 0, err
    rc, _, err = run(capsys, "inspect", out)
    assert rc == 1 and "pass the rank's file" in err, err
    rc, _, err = run(capsys, "inspect", out / "model-tp01.safetensors")
    assert rc == 0, err


def test_options_refuse_what_they_would_ignore() -> None:
    with pytest.raises(ValueError, match="only floating-point tensors are cast"):
        lazyckpt.ModelCheckpointLoadOptions(dtype=torch.int8)
    with pytest.raises(ValueError, match=r"options\.mesh must be a torch\.distributed DeviceMesh"):
        lazyckpt.ModelCheckpointLoadOptions(mesh="x")  # type: ignore[arg-type]


def test_an_empty_path_is_a_usage_error_and_replaces_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "$OUT" with OUT unset: "" was the current folder, which --force replaced (its files lost).
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pt")
    work = tmp_path / "work"
    work.mkdir()
    (work / "precious.txt").write_text("keep me")
    monkeypatch.chdir(work)
    rc, _, err = run(capsys, "reshard", tmp_path / "m.pt", "", "--tp", "1", "--force")
    assert rc == 2 and "the path is empty" in err
    assert (work / "precious.txt").read_text() == "keep me"
    for argv in (["inspect", ""], ["reshard", "", work / "out", "--tp", "1"]):
        assert run(capsys, *argv)[0] == 2
    (tmp_path / "afile").write_text("")
    rc, _, err = run(capsys, "demo", "--keep", tmp_path / "afile")
    assert rc == 2 and "not a folder" in err


def test_a_key_named_as_the_safetensors_header_metadata_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Its entry replaced the header's metadata: a file no reader opens, written with exit 0.
    torch.save({"__metadata__": torch.ones(2), "w": torch.ones(3)}, tmp_path / "m.pt")
    rc, _, err = run(
        capsys, "reshard", tmp_path / "m.pt", tmp_path / "out", "--tp", "1", "--format", "safetensors"
    )
    assert rc == 2 and "'__metadata__'" in err and "--format consolidated" in err
    assert not (tmp_path / "out").exists()
    rc, _, err = run(capsys, "reshard", tmp_path / "m.pt", tmp_path / "pth", "--tp", "1")
    assert rc == 0, err
    assert torch.equal(torch.load(tmp_path / "pth" / "consolidated.00.pth")["__metadata__"], torch.ones(2))


def test_keys_an_index_does_not_place_in_a_file_are_noted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The index decides what loads; a key of a listed file it leaves out was dropped unsaid.
    src = tmp_path / "src"
    src.mkdir()
    save_file({"a": torch.ones(2), "c": torch.zeros(3)}, src / "f1.safetensors")
    save_file({"b": torch.ones(4)}, src / "f2.safetensors")
    weight_map = {"a": "f1.safetensors", "b": "f2.safetensors"}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    said = "ignored 1 key(s) of f1.safetensors that model.safetensors.index.json does not place there: 'c'"
    assert said in run_json(capsys, "inspect", src)["notes"]
    assert said in run_json(capsys, "verify", src)["notes"]
    rc, out, _ = run(capsys, "verify", src)
    assert rc == 0 and f"note: {said}" in out
    rc, _, err = run(capsys, "reshard", src, tmp_path / "out", "--tp", "1")
    assert rc == 0 and f"lazyckpt: note: {said}" in err
    assert sorted(torch.load(tmp_path / "out" / "consolidated.00.pth")) == ["a", "b"]


def test_plan_gives_each_key_its_bytes_in_the_output_dtype(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    save_file({"w": torch.ones(10, 4, dtype=torch.bfloat16), "i": torch.arange(6)}, tmp_path / "m.safetensors")
    doc = run_json(capsys, "plan", tmp_path / "m.safetensors", "--tp", "1", "--dtype", "fp32")
    keys = {k["key"]: k for k in doc["keys"]}
    assert keys["w"]["dtype"] == "float32" and keys["w"]["bytes"] == 10 * 4 * 4
    assert keys["i"]["dtype"] == "int64" and keys["i"]["bytes"] == 6 * 8
    assert doc["bytes_delivered"] == 10 * 4 * 2 + 6 * 8  # as LoadStats counts: before the cast


def test_an_index_named_without_its_shards_format_is_told_how_to_name_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    (tmp_path / "foo.index.json").write_text(json.dumps({"weight_map": {"w": "m.safetensors"}}))
    rc, _, err = run(capsys, "inspect", tmp_path / "foo.index.json")
    assert rc == 1 and "*.safetensors.index.json" in err and "name it" in err


def test_verify_read_checks_the_crc_of_every_dcp_chunk(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Each chunk of a .distcp file is a torch.save zip of its own, with CRC-32s; verify --read
    # checked only torch files' and said OK over a flipped bit a load then yields.
    import torch.distributed.checkpoint as dcp

    sd = {"a": torch.randn(64, 8), "b": torch.arange(32.0)}
    dcp.save(sd, checkpoint_id=tmp_path / "dcp", no_dist=True)
    rc, out, _ = run(capsys, "verify", tmp_path / "dcp", "--read")
    assert rc == 0, out
    index = lazyckpt.loaders.detect_loader(tmp_path / "dcp").index(tmp_path / "dcp")
    region = index.entries["a"].copies[0][0].data.resolve()
    with open(region.path, "r+b") as f:
        f.seek(region.byte_offset + 100)
        byte = f.read(1)
        f.seek(region.byte_offset + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    rc, out, _ = run(capsys, "verify", tmp_path / "dcp", "--read")
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert rc == 1 and len(fails) == 1, out
    assert "key 'a'" in fails[0] and "the chunk at byte" in fails[0] and "CRC-32" in fails[0]
    # A chunk whose zip cannot be opened at all is a problem named by its key, not a crash.
    offset, length = index.entries["b"].copies[0][0].data.window
    distcp = index.entries["b"].copies[0][0].data.path
    with open(distcp, "r+b") as f:
        f.seek(offset + length - 22)  # its end-of-directory record
        f.write(b"\0" * 4)
    rc, out, err = run(capsys, "verify", tmp_path / "dcp", "--read")
    assert rc == 1 and "unexpected" not in err, err
    assert any("key 'b'" in line for line in out.splitlines() if line.startswith("FAIL")), out


def test_progress_bars_reach_their_totals(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, mp4, tmp_path: Path
) -> None:
    """Every bar a command or a load shows ends at its total: verify --read's CRC-32 bar
    counted only the records' payloads against whole files (90-98%), and showed an empty bar
    for safetensors files, which have no zip."""
    from tqdm.auto import tqdm

    import lazyckpt.cli
    import lazyckpt.stats

    ended: list[tuple[str, float, float]] = []

    class Recorded(tqdm):  # type: ignore[misc]
        def close(self) -> None:
            if not self.disable and self.total is not None:
                ended.append((self.desc, self.n, self.total))
            super().close()

    monkeypatch.setattr(lazyckpt.stats, "tqdm", Recorded)
    monkeypatch.setattr(lazyckpt.cli, "_progress_enabled", lambda: True)
    folder, full, dims = mp4
    torch.save(full, tmp_path / "whole.pt")
    save_file({k: v.contiguous() for k, v in full.items()}, tmp_path / "whole.safetensors")
    for path in (folder, tmp_path / "whole.pt", tmp_path / "whole.safetensors"):
        ended.clear()
        rc, out, _ = run(capsys, "verify", path, "--read")
        assert rc == 0, out
        descs = [d for d, _, _ in ended]
        assert "loading" in descs and (
            ("checking CRC-32" in descs) == (path.suffix != ".safetensors")
        ), (path, ended)
        assert all(n == total for _, n, total in ended), (path, ended)
    ended.clear()
    opts = lazyckpt.ModelCheckpointLoadOptions(progress=True)
    for _ in lazyckpt.get_model_checkpoint_loader().lazy_load(folder, dims, opts):
        pass
    assert [d for d, _, _ in ended] == ["loading"] and ended[0][1] == ended[0][2], ended
