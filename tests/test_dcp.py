"""torch.distributed.checkpoint folders written by ``dcp.save`` from FSDP2 and 2-D (FSDP2 + TP)
models in real gloo process groups, read into every layout and compared bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_workers import (
    ODD_TP_DIMS,
    odd_model_truth,
    save_odd_dcp,
    save_odd_hf_pieces,
    save_replicated_rank_local,
    spawn,
)
from helpers import LAYOUTS, expected, load_all, opened_files, same_bits
from safetensors.torch import save_file

import lazyckpt


@pytest.fixture(scope="module")
def dcp_saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dcp")
    saves = {"fsdp2": (root / "fsdp2", 3), "2d": (root / "2d", 4), "tp": (root / "tp", 2)}
    for kind, (folder, world) in saves.items():
        spawn(save_odd_dcp, world, kind, str(folder))
    rank_local = root / "fsdp2-rank-local"  # use_collectives=False: a __N.metadata per rank
    spawn(save_odd_dcp, 3, "fsdp2", str(rank_local), False)
    single = root / "single"
    dcp.save(odd_model_truth(), checkpoint_id=str(single))  # one process, no process group
    return {
        **{k: f for k, (f, _) in saves.items()},
        "fsdp2-rank-local": rank_local,
        "single": single,
    }


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("kind", ["fsdp2", "2d", "tp", "fsdp2-rank-local", "single"])
def test_dcp_into_every_layout(dcp_saves: dict[str, Path], kind: str, layout: lazyckpt.Layout) -> None:
    truth = odd_model_truth()
    got = load_all(dcp_saves[kind], ODD_TP_DIMS, layout=layout)
    assert set(got) == set(truth)
    for key, t in truth.items():
        assert same_bits(got[key], expected(t, ODD_TP_DIMS.get(key), layout)), (kind, key)


def test_dcp_chunks_come_from_the_metadata(dcp_saves: dict[str, Path]) -> None:
    index = lazyckpt.loaders.detect_loader(dcp_saves["2d"]).index(dcp_saves["2d"])
    assert index.format == "dcp"
    # FSDP2 over TP: 2 x 2 chunks for a dim-0 TP weight, TP-sharded on dim 1 for "down".
    assert len(index.entries["up.weight"].chunks) == 4
    assert {c.offsets for c in index.entries["down.weight"].chunks} == {(0, 0), (0, 4), (3, 0), (3, 4)}


def test_dcp_reads_only_needed_chunks_and_bytes(dcp_saves: dict[str, Path]) -> None:
    folder = dcp_saves["fsdp2"]
    loader = lazyckpt.get_model_checkpoint_loader()
    # FSDP dp-3 rank 0 of an FSDP2 dp-3 save: the same boxes, so rank 0's .distcp file holds
    # them all, but for the replicated buffer, which DCP's dedup writes into one rank's file
    # (its choice balances the files' sizes). A key of no elements reads nothing.
    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    needed = sorted(
        {
            info.relative_path
            for index, info in meta.storage_data.items()
            if not any(index.offset) and meta.state_dict_metadata[index.fqn].size.numel() > 0
        }
    )
    assert "__0_0.distcp" in needed
    stats = lazyckpt.LoadStats()
    stream = loader.lazy_load(folder, {}, lazyckpt.ModelCheckpointLoadOptions(
        layout=lazyckpt.Layout(dp_size=3, dp_rank=0), stats=stats))
    with opened_files() as seen:
        got = {k: v.clone() for k, v in stream}
    # Opened once: each chunk's zip is located through the reader's descriptor.
    assert sorted(Path(p).name for p in seen if p.endswith(".distcp")) == needed
    assert stats.read_amplification == 1.0
    truth = odd_model_truth()
    assert same_bits(got["embed.weight"], truth["embed.weight"][:18])


@pytest.mark.parametrize("save", ["fsdp2", "2d", "tp", "single"])
def test_verify_passes_every_save_torch_writes(
    dcp_saves: dict[str, Path], save: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # FSDP2 stores the shards of OddModel's (4, 0) parameter as (0, 0) tensors under chunks of
    # (2, 0): torch's own layout, not damage.
    from lazyckpt.cli import main

    assert main(["verify", "--read", str(dcp_saves[save])]) == 0, capsys.readouterr()


def test_a_nested_state_dict_saved_unflattened_is_named(tmp_path: Path) -> None:
    # flatten_state_dict=False makes DCP pickle a nested dict whole: no tensor item at all.
    # Refused with the planner named, not loaded as an empty checkpoint; beside a tensor it is
    # a note, which load_into's key mismatch passes on.
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    sd = {"w": torch.randn(6, 4), "b": torch.arange(5)}
    flat = DefaultSavePlanner(flatten_state_dict=False)
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "a"), no_dist=True, planner=flat)
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="flatten_state_dict=False"):
        load_all(tmp_path / "a")
    dcp.save(
        {"model": sd, "step": torch.tensor(3)},
        checkpoint_id=str(tmp_path / "b"),
        no_dist=True,
        planner=DefaultSavePlanner(flatten_state_dict=False),
    )
    assert list(load_all(tmp_path / "b")) == ["step"]
    model = torch.nn.Linear(4, 6)
    with pytest.raises(lazyckpt.KeyMismatchError, match="skipped 'model': a pickled object"):
        lazyckpt.load_into(model, tmp_path / "b")


def test_dcp_metadata_globals_are_allow_listed(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "ok"))
    meta = (tmp_path / "ok" / ".metadata").read_bytes()
    assert b"torch.distributed.checkpoint.metadata" in meta
    assert torch.equal(load_all(tmp_path / "ok")["w"], torch.ones(3))


@pytest.mark.parametrize("keys", [1, 2, 3])
def test_a_dcp_save_in_safetensors_format_is_named_as_such(tmp_path: Path, keys: int) -> None:
    # FileSystemWriter(serialization_format=SAFETENSORS) writes safetensors files whose
    # .metadata gives every item offset 0; torch's FileSystemReader cannot read them either. Two
    # items in one file looked like overlapping (damaged) entries, one like a bad torch zip.
    # With a pickled item (written first) the safetensors data starts after it: the entries
    # overlap there, and were told apart as damaged metadata.
    import io

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    sd = {"a": torch.randn(3, 4), "b": torch.arange(5), "blob": io.BytesIO(b"12345")}
    folder = tmp_path / "ck"
    writer = FileSystemWriter(folder, serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save(dict(list(sd.items())[:keys]), storage_writer=writer, no_dist=True)
    with pytest.raises(lazyckpt.UnknownCheckpointFormatError, match="serialization_format=SAFE"):
        load_all(folder)


def test_every_torch_layout_is_found_by_its_pickled_name() -> None:
    # DCP metadata pickles each chunk's layout as torch.serialization._get_layout("torch.strided");
    # lazyckpt answers it without torch's scan of torch.__dict__, and must answer the same.
    from torch.serialization import _get_layout

    from lazyckpt.torch_zip import layout_by_name

    layouts = [v for v in vars(torch).values() if isinstance(v, torch.layout)]
    assert torch.strided in layouts
    for layout in layouts:
        assert layout_by_name(str(layout)) is layout is _get_layout(str(layout))


def test_a_dcp_folder_is_read_without_importing_torch_distributed_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The metadata's classes were imported to unpickle it: 0.9 s of a fresh process, and an
    # import broken there (a first import interrupted by Ctrl-C leaves modules half made) was
    # reported as a damaged file. They are read as records of their fields now: with the
    # package unimportable, the folder loads and gives torch's own tensors.
    import sys

    sd = {"w": torch.randn(4, 4), "b": torch.randn(3)}
    dcp.save(sd, checkpoint_id=tmp_path / "ck", no_dist=True)
    for name in ("torch.distributed.checkpoint", "torch.distributed.checkpoint.metadata"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    got = dict(lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "ck", {}))
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_a_save_written_under_python_3_13_loads(layout: lazyckpt.Layout) -> None:
    """``tests/data/dcp-python3.13`` was written by ``dcp.save`` (torch 2.13.0) under Python
    3.13 with a ``Path`` checkpoint id, whose pickle names ``pathlib._local.PosixPath``: every
    such save was refused as naming a forbidden global. Made with
    ``dcp.save({"w": torch.arange(24.0).reshape(4, 6), "b": torch.arange(4)},
    checkpoint_id=Path(...), no_dist=True)``."""
    folder = Path(__file__).parent / "data" / "dcp-python3.13"
    assert b"pathlib._local" in (folder / ".metadata").read_bytes()
    full = {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6), "b": torch.arange(4)}
    dims = {"w": 1}
    got = load_all(folder, dims, layout=layout)
    assert sorted(got) == sorted(full)
    for key, t in full.items():
        assert same_bits(got[key], expected(t, dims.get(key), layout)), (key, layout)


_MEGATRON_TRUTH = {
    "decoder.layers.0.mlp.linear_fc1.weight": torch.arange(48, dtype=torch.float32).reshape(8, 6),
    "embedding.word_embeddings.weight": torch.arange(40, dtype=torch.bfloat16).reshape(10, 4),
    "decoder.final_layernorm.bias": torch.arange(6, dtype=torch.float32) / 7,
}
_MEGATRON_DIMS = {"decoder.layers.0.mlp.linear_fc1.weight": 0, "embedding.word_embeddings.weight": 1}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_a_megatron_torch_dist_save_loads(layout: lazyckpt.Layout) -> None:
    """``tests/data/megatron-torch-dist`` was written by megatron-core 0.16.1's
    ``dist_checkpointing.save`` (torch_dist, torch 2.13.0) from 2 gloo ranks: the fc1 weight
    as ``ShardedTensor.from_rank_offsets(key, chunk(2, 0)[rank], (0, rank, 2))``, the
    embedding so on dim 1, the bias replicated (``replica_id=rank``), and ``"iteration": 7``
    (the script stubbed ``torch.cuda.synchronize`` and ``current_device``, which its writer
    calls). Megatron writes ``common.pt`` and ``metadata.json`` beside the DCP files, and keeps
    every rank's save plan in ``.metadata``: the folder was refused as mixing a DCP save with a
    torch file, and its ``.metadata`` as naming globals outside the allow-list."""
    folder = Path(__file__).parent / "data" / "megatron-torch-dist"
    assert b"all_local_plans" in (folder / ".metadata").read_bytes()
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".distcp")) == [
        ".metadata", "common.pt", "metadata.json"
    ]
    got = load_all(folder, _MEGATRON_DIMS, layout=layout)
    assert list(got) == list(_MEGATRON_TRUTH)
    for key, t in _MEGATRON_TRUTH.items():
        assert same_bits(got[key], expected(t, _MEGATRON_DIMS.get(key), layout)), (key, layout)
    index = lazyckpt.loaders.detect_loader(folder).index(folder)
    assert any("common.pt" in note for note in index.notes), index.notes


def test_a_dcp_save_beside_a_torch_file_that_is_not_megatrons_is_still_refused(
    tmp_path: Path,
) -> None:
    """Only Megatron's pair (``common.pt`` with ``metadata.json``) is its convention."""
    folder = tmp_path / "save"
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=folder, no_dist=True)
    torch.save({"iteration": 7}, folder / "common.pt")
    with pytest.raises(lazyckpt.UnknownCheckpointFormatError, match=r"common\.pt"):
        lazyckpt.loaders.detect_loader(folder)


def test_a_save_whose_ranks_wrote_their_own_metadata_is_read_as_one(
    dcp_saves: dict[str, Path],
) -> None:
    """``dcp.save(use_collectives=False)`` writes no ``.metadata``: each rank lists its own
    chunks in ``__N.metadata`` (and the 0-d buffer, which every rank holds, in each). The folder
    was taken for one holding no checkpoint; now the ranks' lists are joined, each chunk taken
    once, and a rank's file may be passed for the folder."""
    folder = dcp_saves["fsdp2-rank-local"]
    assert sorted(p.name for p in folder.glob("*.metadata")) == [
        "__0.metadata", "__1.metadata", "__2.metadata"
    ]
    assert not (folder / ".metadata").exists()
    index = lazyckpt.loaders.detect_loader(folder / "__1.metadata").index(folder / "__1.metadata")
    assert len(index.entries["embed.weight"].chunks) == 3
    assert len(index.entries["steps"].chunks) == 1
    assert index.metadata_files == [folder / f"__{r}.metadata" for r in range(3)]
    truth = odd_model_truth()
    got = load_all(folder / "__1.metadata", ODD_TP_DIMS)
    assert all(same_bits(got[k], t) for k, t in truth.items())


def test_a_dcp_save_that_did_not_finish_is_told_so(tmp_path: Path) -> None:
    """DCP writes ``.metadata`` after every rank's data (Megatron writes its ``common.pt``
    first): an interrupted save left data files that were taken for nothing, or a Megatron
    folder's ``common.pt`` for the checkpoint."""
    folder = tmp_path / "save"
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=folder, no_dist=True)
    torch.save({"iteration": torch.tensor(7)}, folder / "common.pt")  # a tensor: loadable
    (folder / ".metadata").unlink()
    with pytest.raises(lazyckpt.UnknownCheckpointFormatError, match="did not finish"):
        lazyckpt.get_model_checkpoint_loader().lazy_load(folder, {})


def test_a_dcp_save_with_transformed_chunks_is_refused_with_the_fix(tmp_path: Path) -> None:
    """``FileSystemWriter(_extensions=[...])`` (torch's ZStandard, or one of the user's) writes
    each chunk through a stream transform, which lazyckpt does not undo: the refusal is told as
    a format lazyckpt does not read, with the fix, not as damage."""
    import io
    import zlib

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class Deflate(StreamTransformExtension):
        @staticmethod
        def registry_name() -> str:
            return "stream.deflate"

        @staticmethod
        def from_descriptor(version: str) -> Deflate:
            return Deflate()

        def get_descriptor(self) -> str:
            return "stream.deflate/1"

        def transform_to(self, output: Any) -> Any:
            class Compressing(io.RawIOBase):
                def __init__(self) -> None:
                    self.data = bytearray()

                def writable(self) -> bool:
                    return True

                def write(self, b: Any) -> int:
                    self.data += bytes(b)
                    return len(b)

                def close(self) -> None:
                    if not self.closed:
                        output.write(zlib.compress(bytes(self.data)))
                    super().close()

            return Compressing()

        def transform_from(self, input: Any) -> Any:
            return io.BytesIO(zlib.decompress(input.read()))

    folder = tmp_path / "ck"
    writer = FileSystemWriter(folder, _extensions=[Deflate()])
    dcp.save({"w": torch.randn(6, 4)}, storage_writer=writer, no_dist=True)
    with pytest.raises(lazyckpt.UnknownCheckpointFormatError, match="without _extensions"):
        lazyckpt.get_model_checkpoint_loader().lazy_load(folder, {})


def test_a_pickled_item_is_noted_as_one_without_a_wrong_guess(tmp_path: Path) -> None:
    # Every non-tensor item of a flattened save is pickled: the note had guessed it to be a
    # nested state dict saved with flatten_state_dict=False.
    dcp.save({"w": torch.ones(2), "step": 5}, checkpoint_id=tmp_path / "ck", no_dist=True)
    index = lazyckpt.loaders.detect_loader(tmp_path / "ck").index(tmp_path / "ck")
    assert index.notes == ["skipped 'step': a pickled object, not a tensor"]


def test_a_ranks_pieces_in_hugging_face_format_are_not_taken_for_a_checkpoint(
    tmp_path: Path,
) -> None:
    """``HuggingFaceStorageWriter(save_distributed=True)`` writes each rank's pieces to a
    safetensors file, with their offsets in its ``__metadata__`` (``DCP_SHARDING_INFO``) and no
    record of the full shapes. A rank's file was loaded as if its pieces were whole tensors (the
    folder's error advised passing one); both are refused, naming the way to consolidate."""
    folder = tmp_path / "hf-pieces"
    spawn(save_odd_hf_pieces, 2, str(folder))
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 2
    for path in (folder, *files):
        with pytest.raises(lazyckpt.UnknownCheckpointFormatError, match="consolidate") as err:
            lazyckpt.get_model_checkpoint_loader().lazy_load(path, {})
        assert "DCP_SHARDING_INFO" in str(err.value)


def test_rank_metadata_that_do_not_belong_to_one_save_are_refused(
    dcp_saves: dict[str, Path], tmp_path: Path
) -> None:
    """Each rank's ``__N.metadata`` gives the full shape of every tensor: two that disagree are
    not one save's (one rank's file left from another save), and joining them would misplace
    chunks."""
    import pickle
    import shutil

    folder = tmp_path / "mixed"
    shutil.copytree(dcp_saves["fsdp2-rank-local"], folder)
    meta = pickle.loads((folder / "__1.metadata").read_bytes())  # torch's own classes
    meta.state_dict_metadata["embed.weight"].size = torch.Size([54, 6])
    (folder / "__1.metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="do not belong to one save") as err:
        lazyckpt.get_model_checkpoint_loader().lazy_load(folder, {})
    assert err.value.key == "embed.weight" and err.value.path == folder / "__1.metadata"


def test_a_rank_local_save_missing_a_ranks_metadata_is_refused(
    dcp_saves: dict[str, Path], tmp_path: Path
) -> None:
    """A rank that died leaves its data and no ``__N.metadata``: its keys (a pipeline stage's)
    were dropped without a word, or its chunks blamed on another file."""
    import shutil

    folder = tmp_path / "cut"
    shutil.copytree(dcp_saves["fsdp2-rank-local"], folder)
    (folder / "__1.metadata").unlink()
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"lacks __1\.metadata"):
        lazyckpt.get_model_checkpoint_loader().lazy_load(folder, {})
    (folder / "__1_0.distcp").unlink()  # rank 1 wholly gone: the numbering still shows it
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"lacks __1\.metadata"):
        lazyckpt.get_model_checkpoint_loader().lazy_load(folder, {})
    # The last rank's metadata lost leaves no gap in the numbers: its data file tells (a key
    # only it saved was dropped without a word, and verify --read said "no problem found").
    last = tmp_path / "last"
    shutil.copytree(dcp_saves["fsdp2-rank-local"], last)
    (last / "__2.metadata").unlink()
    with pytest.raises(
        lazyckpt.CorruptModelCheckpointError,
        match=r"holds __2_0\.distcp, rank 2's data, but no __2\.metadata",
    ):
        lazyckpt.get_model_checkpoint_loader().lazy_load(last, {})


def test_a_folder_holding_two_saves_metadata_is_refused(tmp_path: Path) -> None:
    """torch saves over an earlier save without removing its metadata: a ``.metadata`` beside
    ``__N.metadata`` files is two saves' (the new keys of a rank-local save over a collective
    one were dropped, the old ones read at old offsets). Which one is current the files cannot
    tell (copies and archives rewrite file times), so either order is refused."""
    new = {"w": torch.arange(6.0) * 10, "new": torch.ones(3)}
    for first, second in ((True, False), (False, True)):
        folder = tmp_path / f"ck-{first}"
        dcp.save({"w": torch.arange(6.0)}, checkpoint_id=folder, no_dist=True, use_collectives=first)
        dcp.save(new, checkpoint_id=folder, no_dist=True, use_collectives=second)
        assert (folder / ".metadata").exists() and (folder / "__0.metadata").exists()
        with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="metadata of two saves"):
            lazyckpt.get_model_checkpoint_loader().lazy_load(folder, {})
        (folder / (".metadata" if second is False else "__0.metadata")).unlink()
        got = load_all(folder)
        assert set(got) == set(new) and all(same_bits(got[k], t) for k, t in new.items())


def test_a_hugging_face_folder_written_by_dcp_loads(tmp_path: Path) -> None:
    # HuggingFaceStorageWriter puts DCP_SHARDING_INFO (offsets 0) in every file it writes;
    # without save_distributed the files hold whole tensors and an index: a checkpoint.
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    truth = odd_model_truth()
    dcp.save(truth, storage_writer=HuggingFaceStorageWriter(str(tmp_path / "hf")), no_dist=True)
    files = list((tmp_path / "hf").glob("*.safetensors"))
    assert files and all(b"DCP_SHARDING_INFO" in f.read_bytes()[:4096] for f in files)
    for layout in LAYOUTS:
        got = load_all(tmp_path / "hf", ODD_TP_DIMS, layout=layout)
        assert set(got) == set(truth)
        for key, t in truth.items():
            assert same_bits(got[key], expected(t, ODD_TP_DIMS.get(key), layout)), key


def test_a_rank_local_save_in_safetensors_format_is_named_as_such(tmp_path: Path) -> None:
    # With the ranks' metadata joined, the data files were looked for beside the folder, and
    # the save was told as damaged metadata.
    import shutil

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    folder = tmp_path / "ck"
    writer = FileSystemWriter(folder, serialization_format=SerializationFormat.SAFETENSORS)
    sd = {"a": torch.randn(3, 4), "b": torch.arange(5)}
    dcp.save(sd, storage_writer=writer, no_dist=True, use_collectives=False)
    shutil.copy(folder / "__0.metadata", folder / "__1.metadata")  # a rank listing the same
    with pytest.raises(lazyckpt.UnknownCheckpointFormatError, match="serialization_format=SAFE"):
        load_all(folder)


def test_an_unreadable_sharding_record_leaves_the_file_as_it_is(tmp_path: Path) -> None:
    # A DCP_SHARDING_INFO that is not the writer's JSON (too deep, too long a number) raised a
    # bare RecursionError or ValueError; the file's own shapes stand.
    t = torch.arange(6.0).reshape(2, 3)
    for i, info in enumerate(["[" * 100_000, '{"w": {"saved_offsets": [' + "9" * 5000 + "]}}"]):
        save_file({"w": t}, tmp_path / f"m{i}.safetensors", metadata={"DCP_SHARDING_INFO": info})
        assert torch.equal(load_all(tmp_path / f"m{i}.safetensors")["w"], t)


_MANY_FILES_CHILD = """
import resource, sys
import torch
import lazyckpt

folder, soft, hard = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
for use_mmap in (True, False):
    options = lazyckpt.ModelCheckpointLoadOptions(mmap=use_mmap)
    try:
        got = {k: t.clone() for k, t in lazyckpt.get_model_checkpoint_loader().lazy_load(folder, {}, options)}
    except OSError as exc:
        print("error", use_mmap, exc)
        continue
    ok = len(got) == 150 and all(torch.equal(got[f"w{i}"], torch.full((3, 2), float(i))) for i in range(150))
    print("loaded", use_mmap, ok, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def test_a_folder_of_more_files_than_the_soft_limit_on_descriptors(tmp_path: Path) -> None:
    # FileSystemWriter(single_file_per_rank=False) writes a file per tensor, and a load keeps
    # each file it reads open (twice where mapped): past the soft limit (1,024 on many systems)
    # it stopped halfway with a bare "[Errno 24] Too many open files". The soft limit is raised
    # to the hard one; past that, the error names the file and the fix.
    import subprocess
    import sys

    folder = tmp_path / "dcp"
    state = {f"w{i}": torch.full((3, 2), float(i)) for i in range(150)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, single_file_per_rank=False))
    assert len(list(folder.glob("*.distcp"))) == 150

    def child(soft: int, hard: int) -> list[str]:
        run = subprocess.run(
            [sys.executable, "-c", _MANY_FILES_CHILD, str(folder), str(soft), str(hard)],
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0, run.stderr
        return run.stdout.splitlines()

    assert child(64, 1024) == ["loaded True True 1024", "loaded False True 1024"]
    (mapped, read) = child(64, 64)
    assert mapped.startswith("error True [Errno 24] cannot open") and "ulimit -n" in mapped
    assert ".distcp" in mapped and "mmap=False" in mapped
    assert read.startswith("error False [Errno 24] cannot open"), read
    assert "ulimit -n" in read and "mmap=False" not in read  # already so: no use saying it


def test_a_chunk_lazyckpt_cannot_load_says_what_it_holds(tmp_path: Path) -> None:
    # A quantized tensor's chunk was "holds a Unsupported, not a tensor": the reason and the
    # fix that a torch file's error gives were dropped.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    dcp.save({"q": q, "w": torch.ones(2)}, checkpoint_id=tmp_path)
    with pytest.raises(lazyckpt.CorruptModelCheckpointError) as got:
        load_all(tmp_path, {})
    message = str(got.value)
    assert got.value.key == "q" and "Unsupported" not in message, message
    assert "which lazyckpt cannot load" in message and "dense tensor" in message, message


def test_metadata_whose_record_holds_itself_is_refused(tmp_path: Path) -> None:
    # One byte of .metadata (no CRC guards it) makes a MetadataIndex's fqn the MetadataIndex
    # itself: a RecursionError escaped from the message that names the key.
    import pickletools
    import shutil
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says so
        dcp.save({"m": torch.randn(6, 4), "ids": torch.arange(10)}, checkpoint_id=tmp_path / "ok")
    raw = (tmp_path / "ok" / ".metadata").read_bytes()
    ops = list(pickletools.genops(raw))
    slots, memo = [], 0  # the memo slot each MEMOIZE fills
    for op, _, _ in ops:
        slots.append(memo if op.name == "MEMOIZE" else None)
        memo += op.name == "MEMOIZE"
    cls = next(
        slots[i + 3]
        for i, (op, arg, _) in enumerate(ops)
        if arg == "MetadataIndex" and ops[i + 2][0].name == "STACK_GLOBAL"
    )
    edit = None
    for i, (op, arg, _) in enumerate(ops):  # BINGET cls, (), NEWOBJ, MEMOIZE, {}, ..., fqn
        if op.name == "BINGET" and arg == cls and ops[i + 2][0].name == "NEWOBJ":
            own, (value, _, at) = slots[i + 3], ops[i + 8]
            if value.name == "BINGET" and own is not None and own < 256:
                edit = (at + 1, own)
                break
    assert edit is not None
    bad = bytearray(raw)
    bad[edit[0]] = edit[1]
    shutil.copytree(tmp_path / "ok", tmp_path / "bad")
    (tmp_path / "bad" / ".metadata").write_bytes(bytes(bad))
    for mmap in (True, False):
        with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"\.metadata"):
            load_all(tmp_path / "bad", mmap=mmap)


def test_a_load_into_stopped_by_a_damaged_chunk_says_what_it_left(tmp_path: Path) -> None:
    # What only the data shows raises during the fill: the model's tensors written before it
    # hold the checkpoint's values, the rest their own. The error says so (and a meta model,
    # whose new tensors are never put in, is left as it was).
    import re

    from torch import nn

    torch.manual_seed(0)

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

    dcp.save(make().state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    (data,) = tmp_path.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    headers = [m.start() for m in re.finditer(rb"PK\x03\x04", bytes(raw))]
    last = [h for h in headers if raw[h + 30 : h + 44] == b"archive/data/0"][-1]
    raw[last + 30 : last + 44] = b"archive/data/9"  # the last chunk's zip names another record
    data.write_bytes(raw)
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(lazyckpt.CorruptModelCheckpointError) as caught:
        lazyckpt.load_into(model, tmp_path)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed  # the fill did start
    (note,) = getattr(caught.value, "__notes__", [])
    finished = re.search(r"came after (\d+) of the 4 to load were finished", note)
    assert "the model is partly loaded" in note and finished, note
    assert int(finished.group(1)) <= len(changed) < 4
    with torch.device("meta"):
        meta = make()
    with pytest.raises(lazyckpt.CorruptModelCheckpointError) as caught:
        lazyckpt.load_into(meta, tmp_path)
    assert "the model was left as it was" in caught.value.__notes__[0]
    assert all(t.is_meta for t in meta.state_dict().values())


def test_an_earlier_saves_rank_files_left_in_the_folder_are_told(
    dcp_saves: dict[str, Path], tmp_path: Path
) -> None:
    """A ``use_collectives=False`` save with fewer ranks into a folder holding one with more
    overwrites ``__0.metadata`` ... and leaves the rest: no gap in the ranks' numbers, so they
    were joined as one save. Chunks placed over one another by two ranks' files are refused as
    two saves (not as damaged metadata); keys only some ranks list are noted (pipeline stages
    list their own, FSDP and TP ranks every key), so an earlier save's key is not loaded
    without a word."""
    import shutil

    folder = tmp_path / "fsdp"
    shutil.copytree(dcp_saves["fsdp2-rank-local"], folder)
    spawn(save_odd_dcp, 2, "fsdp2", str(folder), False)
    assert (folder / "__2.metadata").exists()
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="the ranks' metadata are of two saves"):
        lazyckpt.loaders.detect_loader(folder).index(folder)
    folder = tmp_path / "ddp"
    spawn(save_replicated_rank_local, 3, str(folder), ("w", "old"))
    spawn(save_replicated_rank_local, 2, str(folder), ("w",))
    index = lazyckpt.loaders.detect_loader(folder).index(folder)
    assert any("'old' is in __2.metadata only" in n for n in index.notes), index.notes
    got = load_all(folder, {})
    assert same_bits(got["w"], torch.full((2,), 1.0))  # the latest save's, from rank 0
