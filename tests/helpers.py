"""Shared test helpers: the oracle (``torch.chunk`` on full tensors) and checkpoint writers that
use the real writers (``torch.save``, ``safetensors``, ``huggingface_hub``)."""

from __future__ import annotations

import json
import sys
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lazyckpt

GPU = torch.cuda.is_available()


def rewrite_zip(
    src: Path,
    dst: Path,
    *,
    edit: Callable[[str, bytes], bytes] | None = None,
    compression: int = zipfile.ZIP_STORED,
) -> None:
    """Copy a torch zip record by record (CRCs recomputed), editing or compressing records."""
    with zipfile.ZipFile(src) as zin:
        records = [(i.filename, zin.read(i.filename)) for i in zin.infolist()]
    with zipfile.ZipFile(dst, "w", compression=compression) as zout:
        for name, data in records:
            zout.writestr(name, edit(name, data) if edit else data)


def pickle_long1(value: int) -> bytes:
    """``value`` as a pickle LONG1 opcode (any int, in two's complement)."""
    n = (value.bit_length() + 8) // 8 if value else 0
    return b"\x8a" + bytes([n]) + value.to_bytes(n, "little", signed=True)


def chunk_of(t: torch.Tensor, parts: int, dim: int, index: int) -> torch.Tensor:
    """``torch.chunk(t, parts, dim)[index]``, or an empty slice past the last chunk (DTensor)."""
    pieces = torch.chunk(t, parts, dim)
    if index < len(pieces):
        return pieces[index]
    return t.narrow(dim, t.shape[dim], 0)


def expected(full: torch.Tensor, dim: int | None, layout: lazyckpt.Layout) -> torch.Tensor:
    """What DESIGN.md says a rank receives, computed from the full tensor with torch alone."""
    t = full
    if dim is not None and layout.tp_size > 1:
        t = chunk_of(t, layout.tp_size, dim, layout.tp_rank)
    if layout.dp_size > 1 and t.dim() > 0:
        t = chunk_of(t, layout.dp_size, 0, layout.dp_rank)
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (bit for bit, NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # A fresh tensor has standard strides even where .contiguous() would keep odd ones (size 1).
    a = torch.empty(a.shape, dtype=a.dtype).copy_(a.detach().cpu())
    b = torch.empty(b.shape, dtype=b.dtype).copy_(b.detach().cpu())
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_layout_matches(
    got: Mapping[str, torch.Tensor],
    full: Mapping[str, torch.Tensor],
    shard_dims: Mapping[str, int],
    layout: lazyckpt.Layout,
) -> None:
    assert list(got) == list(full) or set(got) == set(full), (list(got), list(full))
    for key, t in full.items():
        want = expected(t, shard_dims.get(key), layout)
        assert same_bits(got[key], want), (
            f"{key}: got {got[key].dtype} {tuple(got[key].shape)}, "
            f"want {want.dtype} {tuple(want.shape)} for {layout}"
        )


def load_all(path: Path | str, shard_dims: Mapping[str, int] | None = None,
             **options: object) -> dict[str, torch.Tensor]:
    opts = lazyckpt.ModelCheckpointLoadOptions(**options)  # type: ignore[arg-type]
    loader = lazyckpt.get_model_checkpoint_loader()
    return {k: v.clone() for k, v in loader.lazy_load(path, shard_dims or {}, opts)}


def sample_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Small tensors with the awkward cases: uneven vocab, bf16, int64, 0-d, empty, odd dims."""
    g = torch.Generator().manual_seed(seed)
    return {
        "tok_embeddings.weight": torch.randn(30522, 8, generator=g),
        "layers.0.attention.wq.weight": torch.randn(24, 16, generator=g).to(torch.bfloat16),
        "layers.0.attention.wo.weight": torch.randn(16, 24, generator=g).to(torch.bfloat16),
        "layers.0.feed_forward.w1.weight": torch.randn(37, 16, generator=g),
        "layers.0.attention_norm.weight": torch.randn(16, generator=g),
        "position_ids": torch.arange(13, dtype=torch.int64),
        "scale": torch.tensor(0.5),
        "empty": torch.empty(0, 5),
        "mask": torch.rand(5, 3, generator=g) > 0.5,
        "output.weight": torch.randn(11, 16, generator=g).to(torch.float16),
    }


SAMPLE_DIMS = {
    "tok_embeddings.weight": 0,
    "layers.0.attention.wq.weight": 0,
    "layers.0.attention.wo.weight": 1,
    "layers.0.feed_forward.w1.weight": 0,
    "output.weight": 1,
    "empty": 0,
}


def split_keys(sd: Mapping[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    keys = list(sd)
    return [{k: sd[k] for k in keys[i::parts]} for i in range(parts)]


def write_index(folder: Path, name: str, files: list[dict[str, torch.Tensor]],
                names: list[str]) -> None:
    weight_map = {k: n for part, n in zip(files, names) for k in part}
    (folder / name).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def write_checkpoint(kind: str, sd: dict[str, torch.Tensor], root: Path) -> Path:
    """Write ``sd`` as checkpoint ``kind`` under ``root`` with the real writers; the path to load."""
    root.mkdir(parents=True, exist_ok=True)
    if kind == "safetensors-file":
        save_file(sd, root / "model.safetensors")
        return root / "model.safetensors"
    if kind == "safetensors-folder":
        for i, part in enumerate(split_keys(sd, 3)):
            save_file(part, root / f"part-{i}.safetensors")
        return root
    if kind == "safetensors-index":
        parts = split_keys(sd, 3)
        names = [f"model-{i + 1:05d}-of-00003.safetensors" for i in range(3)]
        for part, name in zip(parts, names):
            save_file(part, root / name)
        write_index(root, "model.safetensors.index.json", parts, names)
        return root
    if kind == "hub-safetensors":
        from huggingface_hub import save_torch_state_dict

        save_torch_state_dict(sd, root, max_shard_size=200_000)
        return root
    if kind == "hub-torch":
        from huggingface_hub import save_torch_state_dict

        save_torch_state_dict(sd, root, max_shard_size=200_000, safe_serialization=False)
        return root
    if kind == "torch-file":
        torch.save(sd, root / "model.pt")
        return root / "model.pt"
    if kind == "torch-wrapped":
        torch.save({"model": sd, "step": 3, "optimizer": {"lr": 0.1}}, root / "ckpt.pt")
        return root / "ckpt.pt"
    if kind == "torch-folder":
        for i, part in enumerate(split_keys(sd, 2)):
            torch.save(part, root / f"shard{i}.bin")
        return root
    if kind == "torch-index":
        parts = split_keys(sd, 2)
        names = [f"pytorch_model-{i + 1:05d}-of-00002.bin" for i in range(2)]
        for part, name in zip(parts, names):
            torch.save(part, root / name)
        write_index(root, "pytorch_model.bin.index.json", parts, names)
        return root
    raise ValueError(kind)


FILE_KINDS = [
    "safetensors-file",
    "safetensors-folder",
    "safetensors-index",
    "hub-safetensors",
    "hub-torch",
    "torch-file",
    "torch-wrapped",
    "torch-folder",
    "torch-index",
]

LAYOUTS = [
    lazyckpt.Layout(),
    lazyckpt.Layout(tp_size=2, tp_rank=1),
    lazyckpt.Layout(tp_size=8, tp_rank=3),
    lazyckpt.Layout(tp_size=8, tp_rank=7),
    lazyckpt.Layout(dp_size=4, dp_rank=3),
    lazyckpt.Layout(tp_size=4, tp_rank=1, dp_size=2, dp_rank=1),
    lazyckpt.Layout(tp_size=3, tp_rank=2, dp_size=3, dp_rank=0),
]


@contextmanager
def opened_files() -> Iterator[list[str]]:
    """Record every file Python opens (``open``/``os.open``/``mmap`` audit events) in the block.

    Audit hooks cannot be removed, so the hook checks a flag that the block switches off.
    """
    seen: list[str] = []
    state = _AUDIT_STATE
    state["sink"] = seen
    try:
        yield seen
    finally:
        state["sink"] = None


_AUDIT_STATE: dict[str, list[str] | None] = {"sink": None}


def _audit(event: str, args: tuple[object, ...]) -> None:
    sink = _AUDIT_STATE["sink"]
    if sink is not None and event == "open" and args and isinstance(args[0], (str, bytes, Path)):
        sink.append(str(Path(args[0] if not isinstance(args[0], bytes) else args[0].decode())))


sys.addaudithook(_audit)


needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
needs_openmp = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not torch.backends.openmp.is_available()
    or torch.get_num_threads() < 2,
    reason="needs Linux, torch built with OpenMP and at least two intra-op threads",
)
"""For ``lazyckpt.threads``: per-thread OpenMP settings, with more than one thread to cut."""


def fork_mid_stream(
    tmp_path: Path,
    child: Callable[[Iterator[tuple[str, torch.Tensor]]], int],
    options: lazyckpt.ModelCheckpointLoadOptions | None = None,
) -> int:
    """Fork in the middle of a stream and run ``child(stream)`` in the child, which exits with
    its result (1 if it raises; killed by an alarm after 30 s if it hangs). By default the
    stream's copies are built by the prefetch worker (8 keys of 512 KiB cast to float16);
    ``options`` may ask for another kind (views, no prefetch). The parent finishes the stream,
    checks every tensor against the file's, and returns the child's exit code (negative: a
    signal)."""
    import os
    import signal

    sd = {f"w{i}": torch.randn(512, 256) for i in range(8)}  # 512 KiB: built on the worker
    save_file(sd, tmp_path / "m.safetensors")
    if options is None:
        options = lazyckpt.ModelCheckpointLoadOptions(dtype=torch.float16)  # on the worker
    dtype = options.dtype or torch.float32
    stream = lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.safetensors", {}, options)
    got = dict([next(stream)])
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        signal.alarm(30)
        code = 1
        try:
            code = child(stream)
        finally:
            os._exit(code)
    got.update(stream)
    _, status = os.waitpid(pid, 0)
    assert all(torch.equal(got[k], sd[k].to(dtype)) for k in sd)
    return os.waitstatus_to_exitcode(status)
