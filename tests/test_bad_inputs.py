"""Issue 7: every bad checkpoint gets a clear error, nothing wrong is yielded, no pickle code runs.

Each case builds a valid checkpoint with the real writer (``safetensors.torch.save_file``,
``torch.save``, ``torch.distributed.checkpoint.save``), damages it with plain Python, and checks
the error *type* (``CorruptModelCheckpointError`` for bad data, ``FileNotFoundError`` for a
missing path, ``ValueError`` for an impossible layout or shard dim) and that the message names the
file and, where one is at fault, the key. Cases that can read past the end of a file run in a
child process, so a SIGBUS fails the test instead of killing the run.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pickle
import struct
import subprocess
import sys
import traceback
import warnings
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import expected, load_all, pickle_long1, rewrite_zip, same_bits
from safetensors.torch import load_file, save_file

import lazyckpt
from lazyckpt.loaders import detect_loader

CORRUPT = lazyckpt.CorruptModelCheckpointError

# -- running a load and judging its outcome ---------------------------------------------------

Outcome = dict[str, Any]
"""``error`` (None or the class name), ``mro`` (qualified class names), ``message``, ``stage``
(``call``: raised by ``lazy_load()`` itself; ``iterate``: while streaming), ``tb``."""


def _describe(exc: BaseException | None, stage: str) -> Outcome:
    if exc is None:
        return {"error": None, "stage": stage}
    return {
        "error": type(exc).__name__,
        "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__],
        "message": str(exc),
        "stage": stage,
        "tb": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }


def attempt(
    path: Path,
    shard_dims: dict[str, int] | None = None,
    layout: lazyckpt.Layout | None = None,
    **options: Any,
) -> Outcome:
    """Load everything in this process; what was raised, and where."""
    loader = lazyckpt.get_model_checkpoint_loader()
    opts = lazyckpt.ModelCheckpointLoadOptions(layout=layout, **options)
    try:
        stream = loader.lazy_load(path, shard_dims or {}, opts)
    except Exception as exc:
        return _describe(exc, "call")
    try:
        for _ in stream:
            pass
    except Exception as exc:
        return _describe(exc, "iterate")
    return _describe(None, "iterate")


_CHILD = r"""
import json, os, sys, traceback
import lazyckpt

def describe(exc, stage):
    if exc is None:
        return {"error": None, "stage": stage}
    return {
        "error": type(exc).__name__,
        "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__],
        "message": str(exc),
        "stage": stage,
        "tb": traceback.format_exc(),
    }

for job in json.loads(sys.argv[1]):
    loader = lazyckpt.get_model_checkpoint_loader()
    opts = lazyckpt.ModelCheckpointLoadOptions(
        layout=lazyckpt.Layout(**job["layout"]), mmap=job["mmap"]
    )
    try:
        stream = loader.lazy_load(job["path"], job["shard_dims"], opts)
    except Exception as exc:
        out = describe(exc, "call")
    else:
        if job["truncate_after_call"]:
            name, size = job["truncate_after_call"]
            os.truncate(name, size)
        try:
            for _ in stream:
                pass
            out = describe(None, "iterate")
        except Exception as exc:
            out = describe(exc, "iterate")
    print("RESULT " + json.dumps(out), flush=True)
"""


def attempt_isolated(jobs: Sequence[dict[str, Any]]) -> list[Outcome]:
    """Run loads in a child process: a crash (SIGBUS, SIGSEGV, abort) fails the test."""
    full = [
        {
            "shard_dims": {},
            "layout": {},
            "mmap": True,
            "truncate_after_call": None,
            **job,
            "path": str(job["path"]),
        }
        for job in jobs
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(full)], capture_output=True, text=True
    )
    assert proc.returncode == 0, (
        f"the loader crashed (exit status {proc.returncode}"
        + (f", signal {-proc.returncode}" if proc.returncode < 0 else "")
        + f"):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    results = [
        json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")
    ]
    assert len(results) == len(full), proc.stdout + proc.stderr
    return results


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check(
    outcome: Outcome,
    exc_type: type[BaseException],
    names: Sequence[str | tuple[str, ...]] = (),
    *,
    eager: bool = False,
) -> None:
    """``outcome`` is ``exc_type`` and its message names each of ``names`` (a tuple: any one of
    them). ``eager``: it must come from ``lazy_load()`` itself, not from iterating."""
    assert outcome["error"] is not None, f"no error: expected {exc_type.__name__}"
    assert _qualname(exc_type) in outcome["mro"], (
        f"expected {exc_type.__name__}, got {outcome['mro'][0]}: {outcome['message']}\n"
        f"{outcome['tb']}"
    )
    if exc_type is ValueError:
        # A ValueError from json or a codec deep inside is not a clear error about the layout.
        assert not {"json.decoder.JSONDecodeError", "builtins.UnicodeError"} & set(
            outcome["mro"]
        ), outcome["tb"]
    if eager:
        assert outcome["stage"] == "call", (
            f"raised only while iterating, not by lazy_load(): {outcome['message']}"
        )
    message = outcome["message"]
    for name in names:
        options = name if isinstance(name, tuple) else (name,)
        assert any(o in message for o in options), (
            f"the message does not name {' or '.join(map(repr, options))}: {message!r}"
        )


def fails(
    path: Path,
    exc_type: type[BaseException],
    names: Sequence[str | tuple[str, ...]] = (),
    *,
    eager: bool = False,
    shard_dims: dict[str, int] | None = None,
    layout: lazyckpt.Layout | None = None,
    **options: Any,
) -> Outcome:
    outcome = attempt(path, shard_dims, layout, **options)
    check(outcome, exc_type, names, eager=eager)
    return outcome


def load(
    path: Path, shard_dims: dict[str, int] | None = None, **options: Any
) -> dict[str, torch.Tensor]:
    opts = lazyckpt.ModelCheckpointLoadOptions(**options)
    loader = lazyckpt.get_model_checkpoint_loader()
    return {k: v.clone() for k, v in loader.lazy_load(path, shard_dims or {}, opts)}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        assert same_bits(got[k], want[k]), k


class Payload:
    """Pickles as a call of ``os.system`` that would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class ExecPayload:
    """Pickles as ``builtins.exec`` of code that would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


class MyTensor(torch.Tensor):
    """A tensor subclass: torch.save pickles it by reference to this module."""


# -- safetensors ------------------------------------------------------------------------------

ST_SD = {
    "st_key_alpha": torch.arange(12, dtype=torch.float32).reshape(4, 3),
    "st_key_beta": torch.arange(6, dtype=torch.int64),
    "st_key_gamma": torch.tensor([1.5, -2.0], dtype=torch.float16),
}


def st_split(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def st_join(header: dict[str, Any] | bytes, data: bytes, declared: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if declared is None else declared) + text + data


def _by_offset(header: dict[str, Any]) -> list[str]:
    keys = [k for k in header if k != "__metadata__"]
    return sorted(keys, key=lambda k: header[k]["data_offsets"][0])


def _set(key: str, field: str, value: Any) -> Callable[[dict[str, Any], bytes], bytes]:
    def edit(h: dict[str, Any], d: bytes) -> bytes:
        h[key][field] = value
        return st_join(h, d)

    return edit


def _offsets(key_of: Callable[[dict[str, Any]], str], fn: Callable[[int, int, int], Any]):
    """Edit one key's ``data_offsets`` with ``fn(begin, end, data_len)``."""

    def edit(h: dict[str, Any], d: bytes) -> bytes:
        key = key_of(h)
        b, e = h[key]["data_offsets"]
        h[key]["data_offsets"] = fn(b, e, len(d))
        return st_join(h, d)

    return edit


def _first(h: dict[str, Any]) -> str:
    return _by_offset(h)[0]


def _second(h: dict[str, Any]) -> str:
    return _by_offset(h)[1]


def _last(h: dict[str, Any]) -> str:
    return _by_offset(h)[-1]


def _hole(h: dict[str, Any], d: bytes) -> bytes:
    last = _last(h)
    b, e = h[last]["data_offsets"]
    h[last]["data_offsets"] = [b + 4, e + 4]
    return st_join(h, d[:b] + b"\0" * 4 + d[b:])


def _overlap(h: dict[str, Any], d: bytes) -> bytes:
    # The second tensor starts 2 bytes inside the first; the others move with it.
    order = _by_offset(h)
    for k in order[1:]:
        b, e = h[k]["data_offsets"]
        h[k]["data_offsets"] = [b - 2, e - 2]
    return st_join(h, d[:-2])


def _duplicate(h: dict[str, Any], d: bytes) -> bytes:
    text = json.dumps(h)
    entry = json.dumps(h["st_key_alpha"])
    return st_join(('{"st_key_alpha": ' + entry + ", " + text[1:]).encode(), d)


def _duplicate_field(h: dict[str, Any], d: bytes) -> bytes:
    # Inside an entry: the message named the field ("key 'dtype'"), not the key.
    entry = json.dumps(h["st_key_alpha"])
    h["st_key_alpha"] = "ENTRY"
    text = json.dumps(h).replace('"ENTRY"', '{"dtype": "F16", ' + entry[1:])
    return st_join(text.encode(), d)


def _zero_size_huge_dim(h: dict[str, Any], d: bytes) -> bytes:
    # numel 0, so the byte span (0) matches, but 2**64 fits no 64-bit integer.
    h["st_key_delta"] = {"dtype": "F32", "shape": [2**64, 0], "data_offsets": [len(d), len(d)]}
    return st_join(h, d)


def _huge_dim_not_in_int64(h: dict[str, Any], d: bytes) -> bytes:
    h["st_key_delta"] = {"dtype": "F32", "shape": [2**63, 0], "data_offsets": [len(d), len(d)]}
    return st_join(h, d)


def _zero_size_strides_past_int64(h: dict[str, Any], d: bytes) -> bytes:
    # Every dim fits int64 and numel is 0, but the row-major stride of dim 0 (2 * 2**62) does
    # not: torch cannot make the tensor ("Stride calculation overflowed"), so neither can a load.
    shape = [0, 2, 2**62]
    h["st_key_delta"] = {"dtype": "F32", "shape": shape, "data_offsets": [len(d), len(d)]}
    return st_join(h, d)


def _zero_size_sizes_past_int64_from_the_left(h: dict[str, Any], d: bytes) -> bytes:
    # Every stride fits, but torch multiplies the sizes from the left, 64-bit, and 2**62 * 2**62
    # overflows before the 0: "Storage size calculation overflowed", where (2**62, 0, 2**62) is
    # made.
    shape = [2**62, 2**62, 0]
    h["st_key_delta"] = {"dtype": "F32", "shape": shape, "data_offsets": [len(d), len(d)]}
    return st_join(h, d)


ALPHA, GAMMA = "st_key_alpha", "st_key_gamma"
ANY_KEY = tuple(ST_SD)

# (id, damage(header, data) -> file bytes, names the message must hold besides the file)
SAFETENSORS_CASES: list[tuple[str, Callable[[dict[str, Any], bytes], bytes], tuple[Any, ...]]] = [
    ("empty-file", lambda h, d: b"", ()),
    ("shorter-than-8-bytes", lambda h, d: b"\x10\x00\x00\x00\x00", ()),
    ("header-length-past-end", lambda h, d: st_join(h, d, len(json.dumps(h)) + len(d) + 1), ()),
    ("header-length-past-end-of-header", lambda h, d: st_join(h, b"", len(json.dumps(h)) + 5), ()),
    ("header-over-100MB", lambda h, d: st_join(h, d, 100_000_001), ()),
    ("header-length-2**64-1", lambda h, d: st_join(h, d, 2**64 - 1), ()),
    ("header-not-utf8", lambda h, d: st_join(b'{"st_key_\xff\xfe": {}}', d), ()),
    ("header-not-json", lambda h, d: st_join(json.dumps(h).encode()[:-3], d), ()),
    ("header-json-array", lambda h, d: st_join(b"[1, 2]  ", d), ()),
    ("header-json-string", lambda h, d: st_join(b'"st_key_alpha"', d), ()),
    ("header-json-null", lambda h, d: st_join(b"null", d), ()),
    ("header-empty-text", lambda h, d: st_join(b"", d), ()),
    ("entry-not-an-object", lambda h, d: st_join({**h, ALPHA: [1, 2]}, d), (ALPHA,)),
    ("unknown-dtype", _set(ALPHA, "dtype", "F33"), (ALPHA,)),
    ("dtype-the-format-lacks", _set(ALPHA, "dtype", "C128"), (ALPHA, "unknown dtype 'C128'")),  # as safetensors
    (
        "dtype-missing",
        lambda h, d: st_join({**h, ALPHA: {k: v for k, v in h[ALPHA].items() if k != "dtype"}}, d),
        (ALPHA,),
    ),
    ("dtype-lowercase", _set(ALPHA, "dtype", "f32"), (ALPHA,)),
    ("negative-dim", _set(ALPHA, "shape", [-4, 3]), (ALPHA,)),
    ("negative-dim-product-matches", _set(ALPHA, "shape", [-4, -3]), (ALPHA,)),
    ("float-dim", _set(ALPHA, "shape", [4.0, 3]), (ALPHA,)),
    ("string-dim", _set(ALPHA, "shape", ["4", 3]), (ALPHA,)),
    ("bool-dim", _set(ALPHA, "shape", [True, 12]), (ALPHA,)),
    ("shape-not-a-list", _set(ALPHA, "shape", "4x3"), (ALPHA,)),
    ("negative-offset", _offsets(_first, lambda b, e, n: [b - 1, e]), (ANY_KEY,)),
    ("float-offsets", _offsets(_first, lambda b, e, n: [float(b), float(e)]), (ANY_KEY,)),
    ("string-offsets", _offsets(_first, lambda b, e, n: [str(b), str(e)]), (ANY_KEY,)),
    ("three-offsets", _offsets(_first, lambda b, e, n: [b, e, e]), (ANY_KEY,)),
    ("one-offset", _offsets(_first, lambda b, e, n: [b]), (ANY_KEY,)),
    ("offsets-past-end", _offsets(_last, lambda b, e, n: [b + 8, e + 8]), (ANY_KEY,)),
    ("offsets-far-past-end", _offsets(_last, lambda b, e, n: [2**62, 2**62 + e - b]), (ANY_KEY,)),
    ("end-before-begin", _offsets(_second, lambda b, e, n: [e, b]), (ANY_KEY,)),
    ("overlapping-tensors", _overlap, (ANY_KEY,)),
    ("hole-between-tensors", _hole, (ANY_KEY,)),
    ("trailing-bytes", lambda h, d: st_join(h, d + b"\0" * 8), ()),
    ("shape-times-itemsize-not-span", _set(ALPHA, "shape", [4, 4]), (ALPHA,)),
    ("dtype-itemsize-not-span", _set(ALPHA, "dtype", "F64"), (ALPHA,)),
    ("shape-overflow", _set(ALPHA, "shape", [2**62, 2**62, 4]), (ALPHA,)),
    ("shape-overflow-wraps-to-span", _set(ALPHA, "shape", [2**64 + 12]), (ALPHA,)),
    ("shape-overflow-zero-size", _zero_size_huge_dim, ("st_key_delta",)),
    ("dim-past-int64-zero-size", _huge_dim_not_in_int64, ("st_key_delta",)),
    ("strides-past-int64-zero-size", _zero_size_strides_past_int64, ("st_key_delta",)),
    ("sizes-past-2**64-from-the-left-zero-size", _zero_size_sizes_past_int64_from_the_left, ("st_key_delta",)),
    ("duplicate-key", _duplicate, (ALPHA,)),
    ("duplicate-field-of-an-entry", _duplicate_field, (ALPHA, "lists 'dtype' twice")),
    (
        "metadata-not-an-object",
        lambda h, d: st_join({"__metadata__": "pt", **h}, d),
        ("__metadata__",),
    ),
    ("metadata-list", lambda h, d: st_join({"__metadata__": ["pt"], **h}, d), ("__metadata__",)),
    (
        "metadata-int-value",
        lambda h, d: st_join({"__metadata__": {"format": 1}, **h}, d),
        ("__metadata__",),
    ),
    (
        "metadata-nested-value",
        lambda h, d: st_join({"__metadata__": {"a": {"b": "c"}}, **h}, d),
        ("__metadata__",),
    ),
]


@pytest.fixture(scope="module")
def st_original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file(ST_SD, path)
    assert_same(load(path), ST_SD)  # the undamaged file loads: the damage is what fails
    return path


@pytest.mark.parametrize(
    "damage,names", [pytest.param(c[1], c[2], id=c[0]) for c in SAFETENSORS_CASES]
)
def test_safetensors_bad_file(
    tmp_path: Path, st_original: Path, damage: Callable[..., bytes], names: tuple[Any, ...]
) -> None:
    header, data = st_split(st_original)
    path = tmp_path / "broken.safetensors"
    path.write_bytes(damage(header, data))
    fails(path, CORRUPT, ("broken.safetensors", *names))


def test_a_name_twice_in_the_metadata_is_taken_as_safetensors_takes_it(
    tmp_path: Path, st_original: Path
) -> None:
    # No tensor depends on __metadata__: its last value holds, as in safetensors' own reader
    # (a duplicate there used to refuse the file, naming "__metadata__" as a key).
    header, data = st_split(st_original)
    header["__metadata__"] = "META"
    text = json.dumps(header).replace('"META"', '{"format": "np", "format": "pt"}')
    path = tmp_path / "m.safetensors"
    path.write_bytes(st_join(text.encode(), data))
    assert_same(load(path), load_file(path))
    # Each value must be a string, though a later one hides it, as safetensors checks.
    header["__metadata__"] = "META"
    text = json.dumps(header).replace('"META"', '{"format": 1, "format": "pt"}')
    path.write_bytes(st_join(text.encode(), data))
    fails(path, CORRUPT, ("m.safetensors", "__metadata__ must be an object of strings"))


@pytest.mark.parametrize("name", ["broken.safetensors"])
def test_safetensors_in_a_folder_names_the_file(tmp_path: Path, name: str) -> None:
    save_file({"good_key": torch.ones(3)}, tmp_path / "a-good.safetensors")
    save_file(ST_SD, tmp_path / name)
    header, data = st_split(tmp_path / name)
    header[ALPHA]["dtype"] = "X9"
    (tmp_path / name).write_bytes(st_join(header, data))
    fails(tmp_path, CORRUPT, (name, ALPHA))


def test_safetensors_truncated_never_crashes(tmp_path: Path, st_original: Path) -> None:
    raw = st_original.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    jobs = []
    for cut in (0, 5, 8, 8 + n // 2, 8 + n, 8 + n + 7, len(raw) - 1):
        p = tmp_path / f"cut{cut}.safetensors"
        p.write_bytes(raw[:cut])
        for mmap in (True, False):
            jobs.append({"path": p, "mmap": mmap})
    # Truncated after lazy_load() validated it, before the first byte is read: the reader
    # must check the size it maps, not trust the header (SIGBUS otherwise).
    for mmap in (True, False):
        p = tmp_path / f"late-{mmap}.safetensors"
        p.write_bytes(raw)
        jobs.append({"path": p, "mmap": mmap, "truncate_after_call": [str(p), 8 + n + 10]})
    for job, outcome in zip(jobs, attempt_isolated(jobs)):
        check(outcome, CORRUPT, (Path(job["path"]).name,))


# -- folders and indexes ----------------------------------------------------------------------

FMTS = {
    "safetensors": (".safetensors", "model.safetensors.index.json", save_file),
    "torch": (".bin", "pytorch_model.bin.index.json", lambda sd, p: torch.save(sd, p)),
}


def _write_index(folder: Path, index_name: str, weight_map: dict[str, str]) -> Path:
    path = folder / index_name
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


def _sharded(folder: Path, fmt: str) -> tuple[list[str], Path]:
    """Two shard files and an index; returns the shard names and the index path."""
    suffix, index_name, save = FMTS[fmt]
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"model-0000{i}-of-00002{suffix}" for i in (1, 2)]
    save({"idx_key_one": torch.arange(4.0)}, folder / names[0])
    save({"idx_key_two": torch.ones(2, 2)}, folder / names[1])
    index = _write_index(folder, index_name, {"idx_key_one": names[0], "idx_key_two": names[1]})
    return names, index


def test_missing_path_is_file_not_found(tmp_path: Path) -> None:
    for p in (tmp_path / "nope.safetensors", tmp_path / "nope", tmp_path / "nope.pt"):
        fails(p, FileNotFoundError, (p.name,), eager=True)


def test_empty_folder(tmp_path: Path) -> None:
    folder = tmp_path / "empty_ckpt"
    folder.mkdir()
    fails(folder, CORRUPT, ("empty_ckpt",), eager=True)


def test_a_file_of_one_bare_tensor_says_so(tmp_path: Path) -> None:
    # Not "holds a StoredTensor" (lazyckpt's own placeholder) nor "save the state dict instead
    # of the model": the file holds a tensor, and needs names.
    torch.save(torch.randn(3, 2), tmp_path / "bare.pt")
    fails(tmp_path / "bare.pt", CORRUPT, ("bare.pt", "one tensor of shape (3, 2)"), eager=True)


def test_message_names_the_path_even_where_its_name_is_a_word_of_the_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A relative path whose text occurs in the message ("holds no checkpoint files", "the file
    # holds a list") must still lead it.
    monkeypatch.chdir(tmp_path)
    Path("checkpoint").mkdir()
    torch.save([torch.ones(2)], "model")
    for name in ("checkpoint", "model"):
        with pytest.raises(CORRUPT) as info:
            lazyckpt.get_model_checkpoint_loader().lazy_load(name, {})
        assert str(info.value).startswith(f"{name}: "), str(info.value)
        assert info.value.path == Path(name)


@pytest.mark.parametrize("fmt", FMTS)
def test_index_names_a_missing_file(tmp_path: Path, fmt: str) -> None:
    names, index = _sharded(tmp_path / "ckpt", fmt)
    (tmp_path / "ckpt" / names[1]).unlink()
    fails(tmp_path / "ckpt", CORRUPT, (index.name, names[1]), eager=True)
    fails(index, CORRUPT, (index.name, names[1]), eager=True)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"{not json",
        b"\xff\xfe",
        b"[]",
        b'{"metadata": {}}',
        b'{"weight_map": []}',
        b'{"weight_map": {}}',
        b'{"metadata": {"total_size": 1' + b"0" * 5000 + b'}, "weight_map": {"k": "f"}}',
        b'{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b', "weight_map": {"k": "f"}}',
        b'{"weight_map": {"idx_key_one": "model-00001-of-00002.bin\\u0000"}}',
        None,
    ],
    ids=[
        "empty",
        "not-json",
        "not-utf8",
        "array",
        "no-weight-map",
        "weight-map-list",
        "no-keys",
        "int-too-long",
        "nested-too-deep",
        "nul-in-file-name",
        "a-folder",
    ],
)
def test_index_file_not_an_index(tmp_path: Path, fmt: str, text: bytes | None) -> None:
    _, index = _sharded(tmp_path / "ckpt", fmt)
    if text is None:
        index.unlink()
        index.mkdir()
    else:
        index.write_bytes(text)
    fails(tmp_path / "ckpt", CORRUPT, (index.name,), eager=True)


@pytest.mark.parametrize("fmt", FMTS)
def test_index_places_a_key_in_a_file_that_lacks_it(tmp_path: Path, fmt: str) -> None:
    names, index = _sharded(tmp_path / "ckpt", fmt)
    _write_index(
        tmp_path / "ckpt",
        index.name,
        {"idx_key_one": names[0], "idx_key_two": names[1], "idx_key_ghost": names[1]},
    )
    fails(tmp_path / "ckpt", CORRUPT, (names[1], "idx_key_ghost"), eager=True)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink-out", "dotdot-missing"])
def test_index_path_escapes_the_folder(tmp_path: Path, fmt: str, how: str) -> None:
    suffix, index_name, save = FMTS[fmt]
    names, _ = _sharded(tmp_path / "ckpt", fmt)
    outside = tmp_path / f"outside{suffix}"
    save({"idx_key_two": torch.ones(2, 2)}, outside)
    (tmp_path / "ckpt" / names[1]).unlink()
    weight_map = {"idx_key_one": names[0]}
    if how == "dotdot":
        weight_map["idx_key_two"] = f"../outside{suffix}"
        culprit = f"../outside{suffix}"
    elif how == "dotdot-missing":
        weight_map["idx_key_two"] = f"../../nowhere/x{suffix}"
        culprit = f"../../nowhere/x{suffix}"
    elif how == "absolute":
        weight_map["idx_key_two"] = str(outside)
        culprit = str(outside)
    else:
        (tmp_path / "ckpt" / names[1]).symlink_to(outside)
        weight_map["idx_key_two"] = names[1]
        culprit = names[1]
    _write_index(tmp_path / "ckpt", index_name, weight_map)
    fails(tmp_path / "ckpt", CORRUPT, (culprit,), eager=True)


@pytest.mark.parametrize(
    "name", ["..", ".", "../x.bin", "a/../../x.bin", "/etc/hosts", "C:x.bin", "..\\x.bin", ""]
)
def test_member_names_that_could_leave_the_folder_are_refused(tmp_path: Path, name: str) -> None:
    # Plain names skip the path parsing (a rank set's files): a name with a separator, a drive,
    # a dot entry, or none at all must still be refused, whatever the folder holds.
    from lazyckpt.paths import member_path

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "x.bin").write_bytes(b"x")
    (tmp_path / "x.bin").write_bytes(b"x")
    with pytest.raises(lazyckpt.CorruptModelCheckpointError):
        member_path(folder, name, cited_by=folder)
    assert member_path(folder, "x.bin", cited_by=folder) == folder / "x.bin"


@pytest.mark.parametrize("fmt", FMTS)
def test_symlink_out_of_a_folder_without_index(tmp_path: Path, fmt: str) -> None:
    suffix, _, save = FMTS[fmt]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save({"loose_key_a": torch.ones(3)}, folder / f"a{suffix}")
    save({"loose_key_b": torch.ones(3)}, tmp_path / f"elsewhere{suffix}")
    (folder / f"b{suffix}").symlink_to(tmp_path / f"elsewhere{suffix}")
    fails(folder, CORRUPT, (f"b{suffix}",), eager=True)


@pytest.mark.parametrize("sub", ["", "transformer"])
def test_hugging_face_hub_cache_links_into_its_blobs(tmp_path: Path, sub: str) -> None:
    # The hub cache links snapshots/<rev>/[<model folder>/]<name> to ../(../)blobs/<hash>: the
    # files lie outside the folder passed but inside the repo's own blobs, and load (a diffusers
    # repo keeps each model in a folder of its own). A blob of another repo stays refused.
    repo = tmp_path / "models--org--name"
    folder = repo / "snapshots" / "0123abcd" / sub
    folder.mkdir(parents=True)
    (repo / "blobs").mkdir()
    up = os.path.relpath(repo / "blobs", folder)
    sd = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.weight": torch.ones(4)}
    weight_map = {}
    for i, key in enumerate(sd):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({key: sd[key]}, repo / "blobs" / f"hash{i}")
        (folder / name).symlink_to(f"{up}/hash{i}")
        weight_map[key] = name
    (repo / "blobs" / "hashindex").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "model.safetensors.index.json").symlink_to(f"{up}/hashindex")
    for path in (folder, folder / "model.safetensors.index.json"):
        got = dict(lazyckpt.get_model_checkpoint_loader().lazy_load(path, {}))
        assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    other = tmp_path / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (repo / "blobs" / "hash1").rename(other / "hash1")
    (folder / "model-00002-of-00002.safetensors").unlink()
    (folder / "model-00002-of-00002.safetensors").symlink_to(other / "hash1")
    fails(folder, CORRUPT, ("model-00002-of-00002.safetensors", "outside"), eager=True)


@pytest.mark.parametrize("fmt", FMTS)
def test_same_key_in_two_files_without_index(tmp_path: Path, fmt: str) -> None:
    suffix, _, save = FMTS[fmt]
    save({"dup_key_w": torch.zeros(3), "uniq_a": torch.ones(1)}, tmp_path / f"part-a{suffix}")
    save({"dup_key_w": torch.ones(3), "uniq_b": torch.ones(1)}, tmp_path / f"part-b{suffix}")
    fails(tmp_path, CORRUPT, ("dup_key_w", f"part-a{suffix}", f"part-b{suffix}"), eager=True)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("how", ["pair", "self", "index", "the-path-itself"])
def test_symlink_loops(tmp_path: Path, fmt: str, how: str) -> None:
    suffix, index_name, save = FMTS[fmt]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save({"loop_key_ok": torch.ones(2)}, folder / f"ok{suffix}")
    a, b = folder / f"loop-a{suffix}", folder / f"loop-b{suffix}"
    if how == "self":
        a.symlink_to(a.name)
        target, names = folder, (a.name,)
    elif how == "pair":
        a.symlink_to(b.name)
        b.symlink_to(a.name)
        target, names = folder, (("loop-a", "loop-b"),)
    elif how == "index":
        a.symlink_to(b.name)
        b.symlink_to(a.name)
        _write_index(folder, index_name, {"loop_key_ok": f"ok{suffix}", "loop_key_x": a.name})
        target, names = folder, (a.name,)
    else:
        a.symlink_to(b.name)
        b.symlink_to(a.name)
        target, names = a, (a.name,)
    fails(target, CORRUPT, names, eager=True)


@pytest.mark.parametrize("fmt", FMTS)
def test_folder_with_index_ignores_an_unlisted_file(tmp_path: Path, fmt: str) -> None:
    suffix, _, save = FMTS[fmt]
    folder = tmp_path / "ckpt"
    _sharded(folder, fmt)
    # A consolidated copy beside the shards, with other values and an extra key, and a damaged
    # stray file: the index alone decides, so neither is read nor complained about.
    save(
        {
            "idx_key_one": torch.full((4,), 7.0),
            "idx_key_two": torch.zeros(2, 2),
            "extra": torch.ones(1),
        },
        folder / f"consolidated{suffix}",
    )
    (folder / f"stray-damaged{suffix}").write_bytes(b"\x00garbage")
    got = load(folder)
    assert_same(got, {"idx_key_one": torch.arange(4.0), "idx_key_two": torch.ones(2, 2)})
    notes = " ".join(detect_loader(folder).index(folder).notes)
    assert f"consolidated{suffix}" in notes and f"stray-damaged{suffix}" in notes, notes


# -- torch files ------------------------------------------------------------------------------

PT_SD = {
    "pt_key_weight": torch.arange(24, dtype=torch.float32).reshape(4, 6),
    "pt_key_bias": torch.arange(7, dtype=torch.int64),
}


def _storage_key(path: Path, key: str) -> str:
    """The zip record name (``<archive>/data/<n>``) holding ``key``'s storage."""
    with zipfile.ZipFile(path) as zf:
        pkl_name = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
        pkl = zf.read(pkl_name)
    prefix = pkl_name[: -len("data.pkl")]
    loaded: dict[str, Any] = {}

    class Probe(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return pid

        def find_class(self, module: str, name: str) -> Any:
            if name.startswith("_rebuild_tensor"):
                return lambda storage, *a: storage
            if module == "collections":
                return dict
            return str

    loaded = Probe(__import__("io").BytesIO(pkl)).load()
    return prefix + "data/" + loaded[key][2]


@pytest.fixture
def pt_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.pt"
    torch.save(PT_SD, path)
    assert_same(load(path), PT_SD)
    return path


def _set_local_extra_length(path: Path, record: str, n_extra: int) -> None:
    """Overwrite the extra-field length in the local header of ``record`` (2 bytes at 28)."""
    with zipfile.ZipFile(path) as zf:
        offset = zf.getinfo(record).header_offset
    raw = bytearray(path.read_bytes())
    raw[offset + 28 : offset + 30] = struct.pack("<H", n_extra)
    path.write_bytes(bytes(raw))


def test_torch_local_extra_length_damage_is_caught(pt_file: Path) -> None:
    # torch pads each record's data to 64 bytes with an extra field; a length of 0 is still a
    # well-formed header, and would move the data start onto the padding. The data descriptor
    # that torch writes after every record no longer follows the data: refused.
    record = _storage_key(pt_file, "pt_key_weight")
    with zipfile.ZipFile(pt_file) as zf:
        assert zf.getinfo(record).flag_bits & 0x08  # torch writes data descriptors
    _set_local_extra_length(pt_file, record, 0)
    fails(pt_file, CORRUPT, ("model.pt", "local header"), eager=True)


def test_torch_data_moved_onto_its_descriptor_signature_is_caught(pt_file: Path) -> None:
    """An extra length grown by 4 moves a record's data 4 bytes on: its last 4 bytes are then
    the data descriptor's signature, and the descriptor's rest reads as a descriptor without
    one (the signature is optional in zip). ``torch.load`` reads the moved bytes (found by
    ``test_torch_zip_byte_flips``, a bit flip in the extra length); lazyckpt refuses the file
    by name."""
    record = _storage_key(pt_file, "pt_key_weight")
    with zipfile.ZipFile(pt_file) as zf:
        offset = zf.getinfo(record).header_offset
    raw = pt_file.read_bytes()
    (n_extra,) = struct.unpack_from("<H", raw, offset + 28)
    _set_local_extra_length(pt_file, record, n_extra + 4)
    moved = torch.load(pt_file, weights_only=True)["pt_key_weight"]
    assert not torch.equal(moved, PT_SD["pt_key_weight"])  # what this test guards against
    fails(pt_file, CORRUPT, ("model.pt", "descriptor"), eager=True)


@pytest.mark.parametrize("shift", ["later", "earlier"])
def test_torch_rewritten_zip_with_shifted_data_is_caught(tmp_path: Path, shift: str) -> None:
    # A zip rewritten without data descriptors (zipfile), so only the place of the next record
    # tells where a record must end. "later": the first four tensor bytes read as an empty
    # extra field (id 0x0201, length 0), so a local header claiming 4 bytes of extra is
    # well-formed and moves the data 4 bytes on. "earlier": the record carries a 4-byte extra
    # field whose length is set to 0, moving the data 4 bytes back. Either way refused.
    ids = torch.tensor([0x0201, 7, 8, 9], dtype=torch.int32)
    src, path = tmp_path / "src.pt", tmp_path / "rezipped.pt"
    torch.save({"ids": ids}, src)
    record = _storage_key(src, "ids")
    with zipfile.ZipFile(src) as zin:
        records = [(i.filename, zin.read(i.filename)) for i in zin.infolist()]
    with zipfile.ZipFile(path, "w") as zout:
        for name, data in records:
            info = zipfile.ZipInfo(name)
            if name == record and shift == "earlier":
                info.extra = struct.pack("<2H", 0xCAFE, 0)
            zout.writestr(info, data)
    assert_same(load(path), {"ids": ids})
    _set_local_extra_length(path, record, 4 if shift == "later" else 0)
    fails(path, CORRUPT, ("rezipped.pt",), eager=True)


def test_torch_not_a_zip(tmp_path: Path) -> None:
    (tmp_path / "noise.pt").write_bytes(b"this is not a zip archive at all" * 4)
    (tmp_path / "tiny.bin").write_bytes(b"PK")
    (tmp_path / "zero.pth").write_bytes(b"")
    for name in ("noise.pt", "tiny.bin", "zero.pth"):
        fails(tmp_path / name, CORRUPT, (name,), eager=True)


def test_torch_legacy_pickle_format(tmp_path: Path) -> None:
    torch.save(PT_SD, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    fails(tmp_path / "legacy.pt", CORRUPT, ("legacy.pt",), eager=True)


def test_torch_truncated_never_crashes(tmp_path: Path, pt_file: Path) -> None:
    raw = pt_file.read_bytes()
    with zipfile.ZipFile(pt_file) as zf:
        data_start = min(i.header_offset for i in zf.infolist() if "/data/" in i.filename)
    jobs = []
    for cut in (2, 30, len(raw) // 2, data_start + 40, len(raw) - 22, len(raw) - 1):
        p = tmp_path / f"cut{cut}.pt"
        p.write_bytes(raw[:cut])
        for mmap in (True, False):
            jobs.append({"path": p, "mmap": mmap})
    for job, outcome in zip(jobs, attempt_isolated(jobs)):
        check(outcome, CORRUPT, (Path(job["path"]).name,))


@pytest.mark.parametrize("payload", [Payload, ExecPayload], ids=["os.system", "builtins.exec"])
@pytest.mark.parametrize("where", ["file", "index-folder", "nested-dict", "mp-set"])
def test_torch_pickle_with_forbidden_global_never_runs(
    tmp_path: Path, payload: type, where: str
) -> None:
    marker = tmp_path / "PAYLOAD_RAN"
    if where == "file":
        path = tmp_path / "evil.pt"
        torch.save({"w": torch.ones(2), "evil_key": payload(marker)}, path)
        names: tuple[Any, ...] = ("evil.pt",)
    elif where == "nested-dict":
        path = tmp_path / "evil.pt"
        torch.save({"model": {"w": torch.ones(2)}, "extra": {"deep": [payload(marker)]}}, path)
        names = ("evil.pt",)
    elif where == "mp-set":
        shards = mp_shards(2)
        path = write_mp(tmp_path / "mp_set", shards)
        torch.save({**shards[1], "evil_key": payload(marker)}, path / "consolidated.01.pth")
        names = ("consolidated.01.pth",)
    else:
        path = tmp_path / "ckpt"
        names_, _ = _sharded(path, "torch")
        torch.save({"idx_key_two": torch.ones(2, 2), "x": payload(marker)}, path / names_[1])
        names = (names_[1],)
    outcome = fails(path, CORRUPT, names)
    assert not marker.exists(), "the pickle payload ran"
    assert "system" in outcome["message"] or "exec" in outcome["message"], outcome["message"]


@dataclasses.dataclass
class TrainConfig:
    lr: float = 0.1


class ConfigDict(dict):  # type: ignore[type-arg]
    pass


class ConfigList(list):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize(
    "extra",
    [
        argparse.Namespace(lr=0.1),
        TrainConfig(),
        ConfigDict(lr=0.1),
        ConfigList([0.1]),
        collections.defaultdict(int, {"lr": 1}),
        collections.deque([1, 2]),
    ],
    ids=["argparse.Namespace", "dataclass", "dict-subclass", "list-subclass", "defaultdict", "deque"],
)
def test_training_checkpoint_with_objects_beside_the_weights(tmp_path: Path, extra: Any) -> None:
    # Training checkpoints keep their config beside the weights. Pickle builds such objects
    # with NEWOBJ, which needs a class: the stand-in for a global off the allow-list must be
    # one, so that the error names the global and the way out (and restrict=False loads).
    path = tmp_path / "train.pt"
    torch.save({"model": {"w": torch.arange(3.0)}, "args": extra}, path)
    outcome = fails(path, CORRUPT, ("train.pt", type(extra).__name__, "restrict=False"))
    assert "NEWOBJ" not in outcome["message"], outcome["message"]
    assert_same(load(path, restrict=False), {"w": torch.arange(3.0)})


def test_a_counter_beside_the_weights_loads_restricted_as_torch_load_does(tmp_path: Path) -> None:
    # collections.Counter is on torch.load(weights_only=True)'s allow-list (token counts kept
    # beside the weights): refusing the file would make restrict=True stricter than torch.
    path = tmp_path / "train.pt"
    weights = {"w": torch.arange(3.0)}
    torch.save({"model": weights, "token_counts": collections.Counter(a=2)}, path)
    assert torch.load(path, weights_only=True)["token_counts"] == collections.Counter(a=2)
    assert_same(load(path), weights)


@pytest.mark.parametrize(
    "value,kind",
    [
        (3, "int"),
        ("a string", "str"),
        ([torch.ones(2)], "list"),
        (None, "NoneType"),
    ],
    ids=["int", "str", "list-of-tensors", "none"],
)
def test_torch_non_tensor_values(tmp_path: Path, value: Any, kind: str) -> None:
    torch.save({"pt_key_weight": torch.ones(3), "odd_value_key": value}, tmp_path / "m.pt")
    fails(tmp_path / "m.pt", CORRUPT, ("m.pt", "odd_value_key", "key_map"))


def test_torch_non_tensor_values_dropped_by_key_map(tmp_path: Path) -> None:
    # A module's get_extra_state() lands in its state dict (Transformer Engine, quantized
    # modules): a key_map that drops those keys loads the rest, as DESIGN.md's key_map
    # promises ("rename or drop keys before anything is read"); a model-parallel set too.
    class WithExtra(torch.nn.Linear):
        def get_extra_state(self) -> Any:
            return {"scale": 1.5, "recipe": "delayed"}

        def set_extra_state(self, state: Any) -> None:
            pass

    sd = torch.nn.Sequential(WithExtra(4, 3)).state_dict()
    assert "0._extra_state" in sd
    torch.save(sd, tmp_path / "m.pt")
    folder = tmp_path / "mp"
    folder.mkdir()
    for r in range(2):
        shard = {k: (v.chunk(2, 0)[r].clone() if k == "0.weight" else v) for k, v in sd.items()}
        torch.save(shard, folder / f"consolidated.{r:02d}.pth")

    def drop_extra(key: str) -> str | None:
        return None if "._extra_state" in key else key

    want = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    assert_same(load(tmp_path / "m.pt", key_map=drop_extra), want)
    assert_same(load(folder, {"0.weight": 0}, key_map=drop_extra), want)
    fails(tmp_path / "m.pt", CORRUPT, ("m.pt", "0._extra_state.scale", "key_map"))


def test_torch_top_level_not_a_state_dict(tmp_path: Path) -> None:
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    fails(tmp_path / "list.pt", CORRUPT, ("list.pt",))
    torch.save(torch.ones(2), tmp_path / "bare.pt")
    fails(tmp_path / "bare.pt", CORRUPT, ("bare.pt",))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.eye(3).to_sparse(),
        lambda: torch.eye(3).to_sparse_csr(),
        lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8),
        lambda: torch.ones(3).as_subclass(MyTensor),
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        # torch.save keeps these bits in the pickle's metadata and the raw bytes in the
        # record: read as the bytes say, their values came out conjugated / negated.
        lambda: torch.tensor([[1 + 2j, 3 - 4j]]).conj(),
        lambda: torch.tensor([1 + 1j, 2 - 3j]).conj().imag,
    ],
    ids=["sparse-coo", "sparse-csr", "quantized", "subclass", "nested", "conj-view", "neg-view"],
)
def test_torch_unsupported_tensor_kinds(tmp_path: Path, make: Callable[[], torch.Tensor]) -> None:
    torch.save({"plain_key": torch.ones(2), "special_key": make()}, tmp_path / "m.pt")
    fails(tmp_path / "m.pt", CORRUPT, ("m.pt", "special_key"))


def test_torch_compressed_records(tmp_path: Path, pt_file: Path) -> None:
    rewrite_zip(pt_file, tmp_path / "deflated.pt", compression=zipfile.ZIP_DEFLATED)
    fails(tmp_path / "deflated.pt", CORRUPT, ("deflated.pt",))


@pytest.mark.parametrize("key", list(PT_SD))
def test_torch_record_shorter_than_its_storage(tmp_path: Path, pt_file: Path, key: str) -> None:
    record = _storage_key(pt_file, key)
    out = tmp_path / "short.pt"
    rewrite_zip(pt_file, out, edit=lambda name, data: data[:-8] if name == record else data)
    for mmap in (True, False):
        fails(out, CORRUPT, ("short.pt", key), mmap=mmap)


def _replace_in_pickle(src: Path, dst: Path, old: bytes, new: bytes, *, count: int) -> None:
    """Copy the torch file ``src`` to ``dst`` with the ``count`` occurrences of ``old`` in its
    ``data.pkl`` replaced by ``new`` (CRCs recomputed: only what the pickle says is wrong)."""

    def edit(name: str, data: bytes) -> bytes:
        if not name.endswith("data.pkl"):
            return data
        assert data.count(old) == count, data
        return data.replace(old, new)

    rewrite_zip(src, dst, edit=edit)


@pytest.mark.parametrize(
    "old,new",
    [
        (b"K\x25\x85", b"K\x2c\x85"),  # size 37 -> 44: offset 7 + 44 > 50 elements
        (b"K\x07K\x25", b"K\x14K\x25"),  # storage offset 7 -> 20: 20 + 37 > 50
        (b"K\x01\x85", b"K\x02\x85"),  # stride 1 -> 2: 7 + 2 * 36 + 1 > 50
        (b"K2t", b"K(t"),  # storage numel 50 -> 40, the record keeps 200 bytes: 7 + 37 > 40
    ],
    ids=["size", "offset", "stride", "storage-numel"],
)
def test_torch_view_past_its_storage(tmp_path: Path, old: bytes, new: bytes) -> None:
    base = torch.arange(50, dtype=torch.float32)
    torch.save({"view_key": base[7:44]}, tmp_path / "view.pt")
    assert same_bits(load(tmp_path / "view.pt")["view_key"], base[7:44])

    _replace_in_pickle(tmp_path / "view.pt", tmp_path / "bad_view.pt", old, new, count=1)
    for mmap in (True, False):
        fails(tmp_path / "bad_view.pt", CORRUPT, ("bad_view.pt", "view_key"), mmap=mmap)


def test_torch_pickle_edits_torch_save_never_writes(tmp_path: Path) -> None:
    """One changed byte of a data.pkl whose CRC-32 was made right again (a crafted or badly
    repaired file): each case below is refused, naming the file, where lazyckpt read other
    values than torch.load gives (one record as two dtypes), lost keys without a word
    (arguments shifted, records no tensor refers to), or failed with a RecursionError (a dict
    that holds itself)."""
    torch.save(
        {"h": torch.arange(6, dtype=torch.float16), "bf": torch.arange(6, dtype=torch.bfloat16)},
        tmp_path / "two.pt",
    )
    torch.save({"a": torch.arange(4.0), "b": torch.ones(4)}, tmp_path / "ab.pt")
    torch.save({"a": torch.arange(4.0), "b": {}}, tmp_path / "nested.pt")
    key0, key1 = b"X\x01\x00\x00\x000", b"X\x01\x00\x00\x001"
    cases = [
        # bf's storage key made h's: one 12-byte record, as float16 and as bfloat16.
        ("two.pt", key1, key0, 1, "declared twice, as 6 x torch.float16 and as 6 x torch.bfloat16"),
        # b's made a's (one dtype, one size): torch.load gives b a's values; data/1 is orphaned.
        ("ab.pt", key1, key0, 1, "data/1 that data.pkl never refers to"),
        # requires_grad an int, not NEWFALSE.
        ("ab.pt", b"\x89c", b"K\x02c", 1, "requires_grad 2 is not a bool"),
        # One argument more than _rebuild_tensor_v2 takes.
        ("ab.pt", b")Rq\x0bt", b")Rq\x0bK\x00K\x00t", 1, "cannot be unpickled (TypeError"),
        # b's value the top-level dict (BINGET 0).
        ("nested.pt", b"}q\x0fu.", b"h\x00u.", 1, "key 'b' holds a dict that holds it"),
    ]
    # What torch.save does write: an empty tensor and a view of it as another dtype (it skips
    # its own check for a storage with no data).
    empty = torch.empty(0, 4)
    torch.save({"e": empty, "e32": empty.view(torch.int32)}, tmp_path / "empty.pt")
    got = load(tmp_path / "empty.pt")
    assert (got["e"].dtype, got["e32"].dtype, got["e32"].shape) == (torch.float32, torch.int32, (0, 4))
    for i, (name, old, new, count, said) in enumerate(cases):
        bad = tmp_path / f"edited{i}.pt"
        _replace_in_pickle(tmp_path / name, bad, old, new, count=count)
        for mmap in (True, False):
            outcome = fails(bad, CORRUPT, (bad.name,), mmap=mmap)
            assert said in outcome["message"], (i, outcome["message"])


@pytest.mark.parametrize("protocol", [0, 1, 2])
def test_torch_legacy_format_is_refused_with_the_fix_whatever_its_pickle_protocol(
    tmp_path: Path, protocol: int
) -> None:
    # Protocols 0 and 1 write torch's magic number as text: only protocol 2's b"\x80" was told
    # to be the legacy format, the others "not a torch zip archive".
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    fails(path, CORRUPT, ("legacy.pt", "legacy torch.save format"))


def test_torch_zip_listing_a_record_twice_is_refused(tmp_path: Path) -> None:
    # The last of two records of one name held the tensor's bytes, silently: zeros here, where
    # torch.load reads the first (and verify --read said OK).
    import warnings
    import zipfile

    torch.save({"w": torch.arange(1.0, 7.0)}, tmp_path / "src.pt")
    with zipfile.ZipFile(tmp_path / "src.pt") as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    name, data = next(m for m in members if m[0].endswith("/data/0"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile's own "Duplicate name" warning
        with zipfile.ZipFile(tmp_path / "twice.pt", "w", zipfile.ZIP_STORED) as z:
            for n, d in [*members, (name, bytes(len(data)))]:
                z.writestr(n, d)
    fails(tmp_path / "twice.pt", CORRUPT, ("twice.pt", f"lists record {name} twice"))


def test_torch_dicts_holding_one_dict_twice_level_after_level_are_refused(tmp_path: Path) -> None:
    # A 2 KB file of dicts each holding the next twice: flattening it doubled its keys with
    # each level and never ended. A dict under two keys, as a training checkpoint may hold
    # its weights under "model" and "ema", still loads.
    nested: dict[str, Any] = {"w": torch.zeros(1)}
    for _ in range(60):
        nested = {"a": nested, "b": nested}
    torch.save({"m": nested}, tmp_path / "doubling.pt")
    fails(tmp_path / "doubling.pt", CORRUPT, ("doubling.pt", "hold one another so often"), eager=True)
    sd = {"w": torch.arange(3.0)}
    torch.save({"weights": sd, "ema": sd}, tmp_path / "twice.pt")
    assert_same(load(tmp_path / "twice.pt"), {"weights.w": sd["w"], "ema.w": sd["w"]})
    # 2,000 keys holding one dict of 200 keys: 400,000 keys of a small file.
    leaf = {f"k{i}": torch.zeros(1) for i in range(200)}
    torch.save({str(i): leaf for i in range(2000)}, tmp_path / "fanned.pt")
    fails(tmp_path / "fanned.pt", CORRUPT, ("fanned.pt", "hold one another so often"), eager=True)
    # One config beside each of 200 layers, dropped by key_map, is one dict held 200 times.
    config = {"act": "silu"}
    layers = {f"l{i}": {"w": torch.full((2,), float(i)), "config": config} for i in range(200)}
    torch.save(layers, tmp_path / "shared.pt")
    got = load(tmp_path / "shared.pt", key_map=lambda k: None if ".config." in k else k)
    assert_same(got, {f"l{i}.w": torch.full((2,), float(i)) for i in range(200)})


@pytest.mark.parametrize(
    "stride", [2**62, 2**63 - 1, 2**63, 2**70], ids=["2**62", "2**63-1", "2**63", "2**70"]
)
def test_torch_stride_of_a_size_one_dim(tmp_path: Path, stride: int) -> None:
    """A dim of size 1 places no element, so the stride a pickle gives it bounds nothing, and
    ``torch.load`` takes any value that fits int64. So does lazyckpt, though the value in bytes
    (stride x itemsize) passes int64: the tensor loads as saved, through views and copies alike
    (float32 is copied byte by byte here, its data unaligned after the rewrite; uint8 is always
    aligned). A stride past int64, which ``torch.load`` refuses, is refused by name."""
    sd = {
        "f_key": torch.arange(3, dtype=torch.float32).reshape(1, 3),
        "u_key": torch.arange(3, dtype=torch.uint8).reshape(1, 3),
    }
    torch.save(sd, tmp_path / "ok.pt")
    # The stride (3, 1) of both keys, made (stride, 1).
    old, new = b"K\x03K\x01\x86", pickle_long1(stride) + b"K\x01\x86"
    _replace_in_pickle(tmp_path / "ok.pt", tmp_path / "strided.pt", old, new, count=2)
    refusals = (TypeError, RuntimeError, OverflowError)
    _loads_as_torch_does(tmp_path / "strided.pt", sd, stride < 2**63, "f_key", refusals)


def _loads_as_torch_does(
    path: Path,
    sd: dict[str, torch.Tensor],
    fits: bool,
    key: str,
    refusals: tuple[type[Exception], ...],
) -> None:
    """``path``, ``sd`` saved with an int of its pickle edited, loads as saved (views and
    copies alike) where ``torch.load`` takes the int (``fits``); else ``torch.load`` raises one
    of ``refusals`` and lazyckpt refuses the file, naming it and ``key``."""
    try:
        reference = torch.load(path, weights_only=True)
    except refusals:
        reference = None
    assert (reference is not None) == fits  # torch.load's own limit
    for mmap in (True, False):
        if fits:
            assert_same(load(path, mmap=mmap), sd)
        else:
            fails(path, CORRUPT, (path.name, key), mmap=mmap)


@pytest.mark.parametrize("offset", [2**62, 2**63 - 1, 2**63], ids=["2**62", "2**63-1", "2**63"])
def test_torch_storage_offset_of_an_empty_view(tmp_path: Path, offset: int) -> None:
    """An empty view reads no element, so its storage offset bounds nothing, and ``torch.load``
    takes any value that fits int64: lazyckpt loads the file as saved. Past int64 ``torch.load``
    cannot unpickle the offset, and lazyckpt refuses the file by name (found by the fuzz test
    ``test_torch_pickle_int_edits``: it used to load it)."""
    sd = {"e_key": torch.empty(0, 3), "k_key": torch.arange(3, dtype=torch.float32)}
    torch.save(sd, tmp_path / "ok.pt")
    # e_key's storage offset 0, then its size (0, 3).
    old, new = b"K\x00K\x00K\x03\x86", pickle_long1(offset) + b"K\x00K\x03\x86"
    _replace_in_pickle(tmp_path / "ok.pt", tmp_path / "offset.pt", old, new, count=1)
    _loads_as_torch_does(
        tmp_path / "offset.pt", sd, offset < 2**63, "e_key", (ValueError, OverflowError)
    )


# -- model-parallel sets (fairscale consolidated.NN.pth) ---------------------------------------

MP_FULL = {
    "layers.0.attention.wq.weight": torch.arange(48, dtype=torch.float32).reshape(8, 6),
    "layers.0.attention.wo.weight": torch.arange(48, dtype=torch.float32).reshape(6, 8) * -1,
    "norm.weight": torch.linspace(0, 1, 6),
}
MP_DIMS = {"layers.0.attention.wq.weight": 0, "layers.0.attention.wo.weight": 1}
WQ, WO, NORM = list(MP_FULL)


def mp_shards(n: int, full: dict[str, torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]:
    full = full or MP_FULL
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for k, t in full.items():
        dim = MP_DIMS.get(k)
        parts = torch.chunk(t, n, dim) if dim is not None else [t] * n
        for r in range(n):
            out[r][k] = parts[r].clone()
    return out


def write_mp(
    folder: Path, shards: list[dict[str, torch.Tensor]], names: list[str] | None = None
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    names = names or [f"consolidated.{r:02d}.pth" for r in range(len(shards))]
    for sd, name in zip(shards, names):
        torch.save(sd, folder / name)
    return folder


def test_mp_valid_set_loads(tmp_path: Path) -> None:
    folder = write_mp(tmp_path / "mp", mp_shards(4))
    assert_same(load(folder, MP_DIMS), MP_FULL)
    layout = lazyckpt.Layout(tp_size=2, tp_rank=1)
    got = load(folder, MP_DIMS, layout=layout)
    assert_same(got, {k: expected(t, MP_DIMS.get(k), layout) for k, t in MP_FULL.items()})


def test_mp_wrong_or_out_of_range_shard_dim_is_said(tmp_path: Path) -> None:
    # A sound set split unevenly on dim 0 (wq: 8 rows over 3 ranks), loaded with wq on dim 1:
    # shard_dims is wrong, not the files, though nothing tells that from rank files of two
    # checkpoints. The error says both, naming the dim the shards differ along, for fairscale
    # files and a fairseq2 folder alike.
    shards = mp_shards(3)
    folder = write_mp(tmp_path / "mp", shards)
    fs2 = tmp_path / "fs2"
    for r, sd in enumerate(shards):
        (fs2 / f"tp_{r:02d}").mkdir(parents=True)
        torch.save({"model": sd}, fs2 / f"tp_{r:02d}" / "sdp_00.pt")
    for path in (folder, fs2):
        with pytest.raises(CORRUPT, match=r"if the key is split on dim 0, fix shard_dims") as info:
            load(path, {**MP_DIMS, WQ: 1})
        assert WQ in str(info.value)
        assert_same(load(path, MP_DIMS), MP_FULL)
        # Out of range, negative or not, on a set whose shards differ in size.
        for dim in (2, -3):
            with pytest.raises(ValueError, match=rf"shard dim {dim} is out of range"):
                load(path, {**MP_DIMS, WQ: dim})
    # Shards that differ off the shard dim in two dims are the files' fault alone.
    bad = mp_shards(2)
    bad[1][WO] = torch.zeros(5, 3)
    with pytest.raises(CORRUPT, match=r"disagree off the shard dim 1: \(6, 4\) in consolidated.00.pth, \(5, 3\) in consolidated.01.pth$"):
        load(write_mp(tmp_path / "bad", bad), MP_DIMS)


@pytest.mark.parametrize("where", ["descriptor-crc", "local-name", "pickle"])
def test_mp_damage_in_a_later_rank_file(tmp_path: Path, where: str) -> None:
    """Rank files after the first are recognised by comparing their bytes with a checked one
    (``zipdir.ZipShape``); damage there is still found when the set is indexed, and the error
    names the damaged file."""
    folder = write_mp(tmp_path / "mp_set", mp_shards(4))
    victim = folder / "consolidated.02.pth"
    raw = bytearray(victim.read_bytes())
    if where == "descriptor-crc":  # the CRC-32 after the first storage's data
        at = raw.index(b"PK\x07\x08", raw.index(b"consolidated.02/data/0")) + 4
    elif where == "local-name":  # the archive name in a storage record's local header
        at = raw.index(b"consolidated.02/data/0") + len("consolidated.0")
    else:
        at = raw.index(b"consolidated.02/data.pkl") + 200  # inside the pickle
    raw[at] ^= 0x01
    victim.write_bytes(bytes(raw))
    fails(folder, CORRUPT, ("consolidated.02.pth",), eager=True, shard_dims=MP_DIMS)


@pytest.mark.parametrize(
    "ranks,names",
    [
        ([0, 1, 3], ("consolidated.02.pth",)),  # a gap
        ([1, 2], ("consolidated.00.pth",)),  # numbered from 1
        ([0, 2], ("consolidated.01.pth",)),
    ],
    ids=["gap-00-01-03", "starts-at-01", "gap-00-02"],
)
def test_mp_missing_rank_file(tmp_path: Path, ranks: list[int], names: tuple[str, ...]) -> None:
    shards = mp_shards(4)
    folder = write_mp(
        tmp_path / "mp_set",
        [shards[r] for r in ranks],
        [f"consolidated.{r:02d}.pth" for r in ranks],
    )
    fails(folder, CORRUPT, ("mp_set", *names), eager=True, shard_dims=MP_DIMS)


def test_mp_missing_last_rank_file_is_told_by_metas_checklist(tmp_path: Path) -> None:
    # A lost last rank leaves no gap in the numbers: the set loaded as MP-3, smaller tensors
    # and no word. Meta's downloads list every file in checklist.chk (md5sum lines).
    import hashlib

    names = [f"consolidated.{r:02d}.pth" for r in range(4)]
    folder = write_mp(tmp_path / "mp_set", mp_shards(4), names)
    lines = [f"{hashlib.md5((folder / n).read_bytes()).hexdigest()}  {n}" for n in names]
    (folder / "checklist.chk").write_text("\n".join([*lines, "0123  params.json"]) + "\n")
    load_all(folder, MP_DIMS)  # whole: loads
    (folder / names[3]).unlink()
    fails(folder, CORRUPT, ("mp_set", "consolidated.03.pth", "checklist.chk"), eager=True, shard_dims=MP_DIMS)


@pytest.mark.parametrize(
    "names,culprit",
    [
        (
            ["consolidated.0.pth", "consolidated.01.pth"],
            ("consolidated.0.pth", "consolidated.01.pth"),
        ),
        (
            ["consolidated.00.pth", "consolidated.01.pth", "consolidated.1.pth"],
            ("consolidated.1.pth",),
        ),
        (
            ["consolidated.00.pth", "consolidated.001.pth"],
            ("consolidated.001.pth", "consolidated.00.pth"),
        ),
    ],
    ids=["mixed-widths", "two-files-for-rank-1", "three-digit-beside-two"],
)
def test_mp_misnumbered_files(tmp_path: Path, names: list[str], culprit: tuple[str, ...]) -> None:
    shards = mp_shards(len(names))
    folder = write_mp(tmp_path / "mp_set", shards, names)
    fails(folder, CORRUPT, ("mp_set", culprit), eager=True, shard_dims=MP_DIMS)


@pytest.mark.parametrize("n,fmt", [(11, "{}"), (101, "{:02d}")])
def test_mp_files_numbered_one_way_load_past_their_width(tmp_path: Path, n: int, fmt: str) -> None:
    # Numbers not padded run to two digits at rank 10, and were refused as "different widths";
    # so were a {:02d} set's past rank 99 (100 runs longer).
    full = torch.arange(n * 2.0).reshape(n, 2)
    for r in range(n):
        torch.save({"w": full[r : r + 1].clone()}, tmp_path / f"consolidated.{fmt.format(r)}.pth")
    assert torch.equal(load(tmp_path, {"w": 0})["w"], full)
    (tmp_path / f"consolidated.{fmt.format(5)}.pth").unlink()
    fails(tmp_path, CORRUPT, (f"lacks consolidated.{fmt.format(5)}.pth",), eager=True, shard_dims={"w": 0})


def test_mp_extra_rank_file_from_another_set(tmp_path: Path) -> None:
    shards = mp_shards(2)
    other = dict(mp_shards(2)[1])
    other["layers.1.attention.wq.weight"] = torch.ones(4, 6)
    folder = write_mp(tmp_path / "mp_set", [*shards, other])
    fails(
        folder, CORRUPT, ("consolidated.02.pth", "layers.1.attention.wq.weight"), shard_dims=MP_DIMS
    )


@pytest.mark.parametrize("key", [WQ, NORM])
@pytest.mark.parametrize("rank", [0, 1])
def test_mp_key_missing_on_some_ranks(tmp_path: Path, key: str, rank: int) -> None:
    shards = mp_shards(3)
    del shards[rank][key]
    folder = write_mp(tmp_path / "mp_set", shards)
    fails(folder, CORRUPT, (key, f"consolidated.{rank:02d}.pth"), eager=True, shard_dims=MP_DIMS)


@pytest.mark.parametrize(
    "key,bad",
    [
        (WQ, torch.zeros(4, 5)),  # off the shard dim 0
        (WO, torch.zeros(5, 4)),  # off the shard dim 1
        (WQ, torch.zeros(4, 6, 1)),  # different rank
        (NORM, torch.zeros(7)),  # a replica of another shape
    ],
    ids=["wq-cols", "wo-rows", "wq-ndim", "replica-shape"],
)
def test_mp_shard_shapes_disagree(tmp_path: Path, key: str, bad: torch.Tensor) -> None:
    shards = mp_shards(2)
    shards[1][key] = bad
    folder = write_mp(tmp_path / "mp_set", shards)
    fails(folder, CORRUPT, (key, "consolidated.01.pth"), eager=True, shard_dims=MP_DIMS)


@pytest.mark.parametrize("key", [WQ, NORM])
def test_mp_shard_dtypes_disagree(tmp_path: Path, key: str) -> None:
    shards = mp_shards(2)
    shards[1][key] = shards[1][key].to(torch.bfloat16)
    folder = write_mp(tmp_path / "mp_set", shards)
    fails(folder, CORRUPT, (key, "consolidated.01.pth"), eager=True, shard_dims=MP_DIMS)


@pytest.mark.parametrize("mmap", [True, False])
def test_mp_replicas_that_differ(tmp_path: Path, mmap: bool) -> None:
    shards = mp_shards(2)
    shards[1][NORM] = shards[1][NORM] + 1  # same shape and dtype, other bytes
    folder = write_mp(tmp_path / "mp_set", shards)
    fails(
        folder,
        CORRUPT,
        (NORM, ("consolidated.00.pth", "consolidated.01.pth")),
        shard_dims=MP_DIMS,
        mmap=mmap,
    )


def test_mp_replicas_that_differ_one_bit(tmp_path: Path) -> None:
    shards = mp_shards(2)
    t = shards[1][NORM].clone()
    t.view(torch.int32)[3] ^= 1
    shards[1][NORM] = t
    folder = write_mp(tmp_path / "mp_set", shards)
    fails(folder, CORRUPT, (NORM,), shard_dims=MP_DIMS)


def test_mp_split_keys_without_shard_dims_are_not_taken_as_replicas(tmp_path: Path) -> None:
    # Every key split in equal halves: the shards look like replicas (same shape and dtype) but
    # differ. Forgetting shard_dims must not yield rank 0's shard as the whole tensor.
    full = {
        "layers.0.attention.wq.weight": torch.arange(32.0).reshape(8, 4),
        "layers.0.attention.wo.weight": torch.arange(32.0).reshape(4, 8),
    }
    shards = [
        {
            "layers.0.attention.wq.weight": full[WQ][:4].clone(),
            "layers.0.attention.wo.weight": full[WO][:, :4].clone(),
        },
        {
            "layers.0.attention.wq.weight": full[WQ][4:].clone(),
            "layers.0.attention.wo.weight": full[WO][:, 4:].clone(),
        },
    ]
    folder = write_mp(tmp_path / "mp_set", shards)
    # Refused as the set is indexed (the copies' CRC-32s differ), before the warning that
    # shard_dims names none of its keys; compared by reading, after it.
    fails(folder, CORRUPT, ((WQ, WO), "add it to shard_dims"), shard_dims={}, eager=True)
    import torch.utils.serialization as serialization

    saved = serialization.config.save.compute_crc32
    serialization.config.save.compute_crc32 = False
    try:
        folder = write_mp(tmp_path / "no_crcs", shards)
    finally:
        serialization.config.save.compute_crc32 = saved
    with pytest.warns(lazyckpt.ShardDimsWarning, match="names none of its 2 keys"):
        fails(folder, CORRUPT, ((WQ, WO), "add it to shard_dims"), shard_dims={})


def test_shard_dims_that_name_no_key_are_warned_of_where_splitting_matters(tmp_path: Path) -> None:
    """A preset given a checkpoint of other names (Hugging Face's) gives ``{}``: a TP rank then
    gets every tensor whole, and a model-parallel set's keys are read as replicas; where the
    replicas are not compared, rank 0's shard came out under the key, and nothing said so."""
    mp = write_mp(tmp_path / "mp", mp_shards(2))
    st = tmp_path / "m.safetensors"
    save_file(MP_FULL, st)
    loader = lazyckpt.get_model_checkpoint_loader()
    hf_names = {"model.layers.0.self_attn.q_proj.weight": 0}
    unchecked = lazyckpt.ModelCheckpointLoadOptions(verify_replicas=False)
    with pytest.warns(lazyckpt.ShardDimsWarning, match="none of its 3 keys, so each key of this MP-2") as got:
        stream = loader.lazy_load(mp, hf_names, unchecked)
    assert [w.filename for w in got] == [__file__]  # the caller's line, not lazyckpt's
    assert dict(stream)[WQ].shape == (4, 6)  # what the warning says: one rank's shard
    tp2 = lazyckpt.ModelCheckpointLoadOptions(layout=lazyckpt.Layout(tp_size=2))
    with pytest.warns(lazyckpt.ShardDimsWarning, match="each of the 2 TP ranks gets every tensor whole"):
        loader.lazy_load(st, hf_names, tp2).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(loader.lazy_load(st, {}))) == 3  # TP 1 and one file: nothing to split
        assert len(list(loader.lazy_load(st, MP_DIMS, tp2))) == 3
        assert len(list(loader.lazy_load(mp, MP_DIMS))) == 3


def test_a_fairseq2_set_without_tensor_parallelism_is_not_warned_of(tmp_path: Path) -> None:
    """SDP shards (dim 0) and pipeline stages need no shard_dims: only copies in several TP
    files are read as replicas, and only they are warned of."""
    full = {"w": torch.arange(24.0).reshape(8, 3), "b": torch.arange(4.0)}
    (tmp_path / "sdp" / "tp_00").mkdir(parents=True)
    for r in range(2):
        shard = {k: torch.chunk(v, 2, 0)[r].clone() for k, v in full.items()}
        shard["scale"] = torch.tensor(2.0)  # a 0-d key: every file holds it whole
        torch.save(shard, tmp_path / "sdp" / "tp_00" / f"sdp_{r:02d}.pt")
    for s, k in enumerate(full):
        (tmp_path / "pp" / f"pp_{s:02d}" / "tp_00").mkdir(parents=True)
        torch.save({k: full[k]}, tmp_path / "pp" / f"pp_{s:02d}" / "tp_00" / "sdp_00.pt")
    for r in range(2):
        (tmp_path / "tp" / f"tp_{r:02d}").mkdir(parents=True)
        torch.save({"w": torch.chunk(full["w"], 2, 0)[r].clone(), "b": full["b"]},
                   tmp_path / "tp" / f"tp_{r:02d}" / "sdp_00.pt")
    loader = lazyckpt.get_model_checkpoint_loader()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("sdp", "pp"):
            got = dict(loader.lazy_load(tmp_path / name, {}))
            assert all(torch.equal(got[k], full[k]) for k in full), name
        assert float(dict(loader.lazy_load(tmp_path / "sdp", {}))["scale"]) == 2.0
        assert torch.equal(dict(loader.lazy_load(tmp_path / "tp", {"w": 0}))["w"], full["w"])
    with pytest.warns(lazyckpt.ShardDimsWarning, match="TP-2"):
        loader.lazy_load(tmp_path / "tp", {}, lazyckpt.ModelCheckpointLoadOptions(verify_replicas=False))


def test_mp_split_key_left_out_of_shard_dims_is_caught_by_crc_past_the_compare_limit(
    tmp_path: Path,
) -> None:
    """A split key missing from ``shard_dims`` is read as a replica; too large to be compared
    by reading (here: a limit of 0), it came out as rank 0's shard. Its copies' zip CRC-32s,
    read with the directories, prove them different: refused when ``lazy_load`` is called,
    before any tensor byte is read. Files saved alike (one pickle) and apart, both."""
    no_compare = {"verify_replicas_max_bytes": 0}
    alike = write_mp(tmp_path / "alike", mp_shards(4))
    shards = mp_shards(4)
    shards[2] = dict(reversed(list(shards[2].items())))  # another pickle: indexed file by file
    apart = write_mp(tmp_path / "apart", shards)
    fs2 = tmp_path / "fs2"  # fairseq2: TP-4 x SDP-2, each TP row's keys split on dim 0
    for r, sd in enumerate(mp_shards(4)):
        (fs2 / f"tp_{r:02d}").mkdir(parents=True)
        for d in range(2):
            part = {k: torch.chunk(v, 2, 0)[d].clone() for k, v in sd.items()}
            torch.save({"model": part}, fs2 / f"tp_{r:02d}" / f"sdp_{d:02d}.pt")
    for folder in (alike, apart, fs2):
        # The index holds them, and says so once: inspect lists a set whose shard dims are
        # yet to be written.
        index = detect_loader(folder).index(folder, {WO: 1})
        assert set(index.differing_copies) == {WQ}
        assert sum("CRC-32s differ" in n and repr(WQ) in n for n in index.notes) == 1
        stats = lazyckpt.LoadStats()
        with pytest.raises(CORRUPT, match=r"differ \(their zip records' CRC-32s differ\); if the key is split") as info:
            load(folder, {WO: 1}, stats=stats, **no_compare)
        assert WQ in str(info.value) and info.value.key == WQ
        assert stats.total_bytes_read == 0
        # True replicas pass, and so does the key with the check turned off (as documented,
        # rank 0's shard then).
        got = load(folder, MP_DIMS, **no_compare)
        assert_same({k: got[k] for k in MP_FULL}, MP_FULL)
        got = load(folder, {WO: 1}, verify_replicas=False)
        assert same_bits(got[WQ], torch.chunk(MP_FULL[WQ], 4, 0)[0])


def test_a_damaged_replica_under_swapped_names_is_not_blamed_on_shard_dims(tmp_path: Path) -> None:
    # key_map swaps two keys and shard_dims names the split one by its new name, correctly: a
    # damaged copy of the other is the files' fault, not "shard_dims names 'b'".
    full = torch.arange(16.0).reshape(4, 4)
    norm = torch.ones(4)
    for r in range(2):
        n = norm + r  # rank 1's copy differs
        torch.save({"a": torch.chunk(full, 2, 0)[r].clone(), "b": n}, tmp_path / f"consolidated.0{r}.pth")
    swap = {"a": "b", "b": "a"}
    with pytest.raises(CORRUPT, match="should be a replica") as info:
        load(tmp_path, {"b": 0}, key_map=swap)
    assert "shard_dims names" not in str(info.value)


def test_mp_replicas_stored_alike_in_value_but_not_in_bytes_load(tmp_path: Path) -> None:
    # A replica saved contiguous in one rank file and as a transposed view in another holds
    # the same values in other bytes: no CRC comparison, no error; a view of a larger storage
    # or files saved without CRCs alike.
    import torch.utils.serialization as serialization

    norm = torch.arange(12.0).reshape(3, 4)
    shards = mp_shards(2)
    shards[0]["norm2"] = norm.clone()
    shards[1]["norm2"] = norm.t().contiguous().t()
    shards[0]["tail"] = norm[1].clone()
    shards[1]["tail"] = norm.clone()[1]
    folder = write_mp(tmp_path / "mp", shards)
    got = load(folder, MP_DIMS, verify_replicas_max_bytes=0)
    assert same_bits(got["norm2"], norm) and same_bits(got["tail"], norm[1])
    saved = serialization.config.save.compute_crc32
    serialization.config.save.compute_crc32 = False
    try:
        folder = write_mp(tmp_path / "nocrc", mp_shards(2))
    finally:
        serialization.config.save.compute_crc32 = saved
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor are they taken for copies of one file
        got = load(folder, {WO: 1}, verify_replicas_max_bytes=0)  # nothing tells them apart
    assert same_bits(got[WQ], torch.chunk(MP_FULL[WQ], 2, 0)[0])


@pytest.mark.parametrize("dim", [2, -3, 7])
def test_mp_shard_dim_out_of_range(tmp_path: Path, dim: int) -> None:
    folder = write_mp(tmp_path / "mp_set", mp_shards(2))
    fails(folder, ValueError, (WQ,), eager=True, shard_dims={**MP_DIMS, WQ: dim})


def test_shard_dim_out_of_range_single_file(tmp_path: Path, pt_file: Path) -> None:
    fails(
        pt_file,
        ValueError,
        ("pt_key_weight",),
        eager=True,
        shard_dims={"pt_key_weight": 2},
        layout=lazyckpt.Layout(tp_size=2, tp_rank=0),
    )
    fails(pt_file, ValueError, ("pt_key_weight",), eager=True, shard_dims={"pt_key_weight": "0"})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"tp_size": 8, "tp_rank": 9}, "tp_rank"),
        ({"tp_size": 2, "tp_rank": -1}, "tp_rank"),
        ({"dp_size": 4, "dp_rank": 4}, "dp_rank"),
        ({"tp_size": 0}, "tp_size"),
        ({"dp_size": -2}, "dp_size"),
    ],
)
def test_target_rank_not_below_size(fields: dict[str, int], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        lazyckpt.Layout(**fields)


# -- torch.distributed.checkpoint --------------------------------------------------------------

DCP_SD = {
    "dcp_key_matrix": torch.arange(24, dtype=torch.float32).reshape(6, 4),
    "dcp_key_ids": torch.arange(10, dtype=torch.int64),
    "dcp_key_scalar": torch.tensor(0.25),
}
MATRIX = "dcp_key_matrix"


def write_dcp(folder: Path, sd: dict[str, torch.Tensor] | None = None) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(dict(sd or DCP_SD), checkpoint_id=folder)
    return folder


def read_meta(folder: Path) -> Any:
    return pickle.loads((folder / ".metadata").read_bytes())


def write_meta(folder: Path, meta: Any) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def _storage_item(meta: Any, fqn: str) -> tuple[Any, Any]:
    return next((k, v) for k, v in meta.storage_data.items() if k.fqn == fqn)


@pytest.fixture
def dcp_folder(tmp_path: Path) -> Path:
    folder = write_dcp(tmp_path / "dcp_ckpt")
    assert_same(load(folder), DCP_SD)
    return folder


def test_dcp_missing_metadata(dcp_folder: Path) -> None:
    (dcp_folder / ".metadata").unlink()
    fails(dcp_folder, CORRUPT, ("dcp_ckpt",), eager=True)
    fails(dcp_folder / ".metadata", FileNotFoundError, (".metadata",), eager=True)


@pytest.mark.parametrize("payload", [Payload, ExecPayload], ids=["os.system", "builtins.exec"])
@pytest.mark.parametrize("field", ["planner_data", "storage_meta"])
def test_dcp_metadata_with_forbidden_global(
    tmp_path: Path, dcp_folder: Path, payload: type, field: str
) -> None:
    marker = tmp_path / "PAYLOAD_RAN"
    meta = read_meta(dcp_folder)
    setattr(meta, field, {"x": payload(marker)})
    write_meta(dcp_folder, meta)
    outcome = fails(dcp_folder, CORRUPT, (".metadata",), eager=True)
    assert not marker.exists(), "the pickle payload ran"
    assert "system" in outcome["message"] or "exec" in outcome["message"], outcome["message"]


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage, not a pickle", pickle.dumps({"not": "metadata"}), pickle.dumps([1])[:-1]],
    ids=["empty", "garbage", "other-object", "cut-pickle"],
)
def test_dcp_metadata_not_metadata(dcp_folder: Path, data: bytes) -> None:
    (dcp_folder / ".metadata").write_bytes(data)
    fails(dcp_folder, CORRUPT, (".metadata",), eager=True)


def test_dcp_missing_distcp(dcp_folder: Path) -> None:
    [distcp] = list(dcp_folder.glob("*.distcp"))
    distcp.unlink()
    fails(dcp_folder, CORRUPT, (distcp.name,), eager=True)


def test_dcp_truncated_distcp_never_crashes(tmp_path: Path) -> None:
    jobs = []
    for cut in ("half", "minus-1", "first-chunk-only", "late"):
        folder = write_dcp(tmp_path / f"dcp_{cut}")
        [distcp] = list(folder.glob("*.distcp"))
        size = distcp.stat().st_size
        first_end = min(v.offset + v.length for v in read_meta(folder).storage_data.values())
        if cut == "late":
            # Truncated after lazy_load() has indexed it: caught by the reader, not by SIGBUS.
            for mmap in (True, False):
                again = write_dcp(tmp_path / f"dcp_late_{mmap}")
                [d] = list(again.glob("*.distcp"))
                jobs.append(
                    {"path": again, "mmap": mmap, "truncate_after_call": [str(d), first_end + 100]}
                )
            continue
        os.truncate(distcp, {"half": size // 2, "minus-1": size - 1}.get(cut, first_end))
        jobs += [{"path": folder, "mmap": True}, {"path": folder, "mmap": False}]
    for outcome in attempt_isolated(jobs):
        check(outcome, CORRUPT, (".distcp", "dcp_key_"))


def _move_chunk(meta: Any, fqn: str, offsets: tuple[int, ...]) -> None:
    """Give ``fqn``'s only chunk new global offsets, in both places the metadata keeps them."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = meta.state_dict_metadata[fqn]
    md.chunks[0].offsets = torch.Size(offsets)
    key, info = _storage_item(meta, fqn)
    del meta.storage_data[key]
    meta.storage_data[MetadataIndex(fqn, torch.Size(offsets), key.index)] = info


def _overlap_chunks(meta: Any) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md = meta.state_dict_metadata[MATRIX]
    md.size = torch.Size([9, 4])
    md.chunks.append(ChunkStorageMetadata(offsets=torch.Size([3, 0]), sizes=torch.Size([6, 4])))
    _, info = _storage_item(meta, MATRIX)
    meta.storage_data[MetadataIndex(MATRIX, torch.Size([3, 0]), 1)] = info


def _overlap_same_volume(meta: Any) -> None:
    # Two 3x4 chunks at rows 0 and 2 of a 6x4 tensor: volumes add up (24) but rows 2 overlap
    # and row 5 is missing. Both chunks point at the same stored 6x4 data, resized.
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md = meta.state_dict_metadata[MATRIX]
    key, info = _storage_item(meta, MATRIX)
    md.chunks = [
        ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([6, 2])),
        ChunkStorageMetadata(offsets=torch.Size([0, 1]), sizes=torch.Size([6, 2])),
    ]
    del meta.storage_data[key]
    meta.storage_data[MetadataIndex(MATRIX, torch.Size([0, 0]), 0)] = info
    meta.storage_data[MetadataIndex(MATRIX, torch.Size([0, 1]), 1)] = info


def _storage_offset(delta: Callable[[int, int], int]) -> Callable[[Any, Path], None]:
    def edit(meta: Any, folder: Path) -> None:
        _, info = _storage_item(meta, MATRIX)
        size = next(folder.glob("*.distcp")).stat().st_size
        info.offset = delta(info.offset, size)

    return edit


DCP_CASES: list[tuple[str, Callable[..., None], tuple[Any, ...]]] = [
    ("chunk-offsets-past-the-end", lambda m, f: _move_chunk(m, MATRIX, (6, 0)), (MATRIX,)),
    ("chunk-offsets-past-the-end-dim1", lambda m, f: _move_chunk(m, MATRIX, (0, 1)), (MATRIX,)),
    ("chunk-offsets-negative", lambda m, f: _move_chunk(m, MATRIX, (-1, 0)), (MATRIX,)),
    ("storage-offset-past-the-file", _storage_offset(lambda o, n: n + 10), (MATRIX, ".distcp")),
    ("storage-offset-far-past-the-file", _storage_offset(lambda o, n: 2**62), (MATRIX, ".distcp")),
    (
        "storage-length-past-the-file",
        lambda m, f: setattr(_storage_item(m, MATRIX)[1], "length", 10**9),
        (MATRIX, ".distcp"),
    ),
    ("storage-offset-negative", _storage_offset(lambda o, n: -5), (MATRIX,)),
    (
        "chunks-do-not-cover",
        lambda m, f: setattr(m.state_dict_metadata[MATRIX], "size", torch.Size([8, 4])),
        (MATRIX,),
    ),
    (
        "chunks-do-not-cover-dim1",
        lambda m, f: setattr(m.state_dict_metadata[MATRIX], "size", torch.Size([6, 5])),
        (MATRIX,),
    ),
    ("no-chunks", lambda m, f: setattr(m.state_dict_metadata[MATRIX], "chunks", []), (MATRIX,)),
    (
        "chunk-outside-smaller-tensor",
        lambda m, f: setattr(m.state_dict_metadata[MATRIX], "size", torch.Size([5, 4])),
        (MATRIX,),
    ),
    ("chunks-overlap", lambda m, f: _overlap_chunks(m), (MATRIX,)),
    ("chunks-overlap-same-volume", lambda m, f: _overlap_same_volume(m), (MATRIX,)),
    (
        "chunk-without-storage-entry",
        lambda m, f: m.storage_data.pop(_storage_item(m, MATRIX)[0]),
        (MATRIX,),
    ),
    (
        "storage-path-escapes",
        lambda m, f: setattr(_storage_item(m, MATRIX)[1], "relative_path", "../x.distcp"),
        ("../x.distcp",),
    ),
    (
        "negative-size",
        lambda m, f: setattr(m.state_dict_metadata[MATRIX], "size", torch.Size([-6, 4])),
        (MATRIX,),
    ),
]


@pytest.mark.parametrize("edit,names", [pytest.param(c[1], c[2], id=c[0]) for c in DCP_CASES])
def test_dcp_bad_metadata(
    dcp_folder: Path, edit: Callable[..., None], names: tuple[Any, ...]
) -> None:
    meta = read_meta(dcp_folder)
    edit(meta, dcp_folder)
    write_meta(dcp_folder, meta)
    for mmap in (True, False):
        fails(dcp_folder, CORRUPT, names, mmap=mmap)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: setattr(m.state_dict_metadata[MATRIX].properties, "dtype", torch.float64),
        lambda m: setattr(m.state_dict_metadata[MATRIX].properties, "dtype", torch.int32),
        lambda m: (
            setattr(m.state_dict_metadata[MATRIX], "size", torch.Size([4, 6])),
            setattr(m.state_dict_metadata[MATRIX].chunks[0], "sizes", torch.Size([4, 6])),
        ),
        # The matrix's chunk now points at the ids' stored zip (another shape and dtype).
        lambda m: setattr(
            _storage_item(m, MATRIX)[1], "offset", _storage_item(m, "dcp_key_ids")[1].offset
        ),
    ],
    ids=["dtype-f64", "dtype-i32", "shape-transposed", "points-at-other-chunk"],
)
def test_dcp_metadata_disagrees_with_the_data(dcp_folder: Path, edit: Callable[[Any], Any]) -> None:
    meta = read_meta(dcp_folder)
    edit(meta)
    write_meta(dcp_folder, meta)
    for mmap in (True, False):
        fails(dcp_folder, CORRUPT, (MATRIX,), mmap=mmap)


@pytest.mark.parametrize("edit", ["runs-over-the-next", "the-same-window"])
def test_dcp_windows_that_overlap_are_refused(tmp_path: Path, edit: str) -> None:
    # Chunks of one shape and dtype differ only in their data: an entry whose window runs over
    # the next chunk (whose zip directory would be found at its end), or that names the next
    # chunk's window, would read that chunk for this key.
    folder = write_dcp(tmp_path / "dcp", {"a": torch.zeros(4, 4), "b": torch.ones(4, 4)})
    meta = read_meta(folder)
    a, b = _storage_item(meta, "a")[1], _storage_item(meta, "b")[1]
    assert (a.relative_path, a.offset + a.length) == (b.relative_path, b.offset)
    if edit == "runs-over-the-next":
        a.length += b.length
    else:
        a.offset = b.offset
    write_meta(folder, meta)
    for mmap in (True, False):
        fails(folder, CORRUPT, ("'a'", "'b'", a.relative_path, "overlap"), mmap=mmap)


@pytest.mark.filterwarnings("ignore::lazyckpt.ShardDimsWarning")
def test_errors_carry_the_key_at_fault(tmp_path: Path) -> None:
    """``CorruptModelCheckpointError.key`` names the key, for callers that act on it."""
    torch.save({"good": torch.ones(2), "bad": 3}, tmp_path / "m.pt")
    with pytest.raises(lazyckpt.CorruptModelCheckpointError) as info:
        lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "m.pt", {})
    assert info.value.key == "bad" and info.value.path == tmp_path / "m.pt"
    mp = tmp_path / "mp"
    mp.mkdir()
    for r in range(2):
        torch.save({"w": torch.full((2, 2), float(r))}, mp / f"consolidated.{r:02d}.pth")
    with pytest.raises(lazyckpt.CorruptModelCheckpointError) as info:
        list(lazyckpt.get_model_checkpoint_loader().lazy_load(mp, {}))
    assert info.value.key == "w"
    import pickle

    again = pickle.loads(pickle.dumps(info.value))
    assert again.key == "w" and str(again) == str(info.value)


@pytest.mark.parametrize("header", [b"[" * 100_000, b'{"w": ' + b"9" * 5000 + b"}"])
def test_a_safetensors_header_json_cannot_read_is_a_checkpoint_error(
    tmp_path: Path, header: bytes
) -> None:
    # Nesting too deep (RecursionError) or an int of too many digits (ValueError) escaped raw.
    path = tmp_path / "m.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match="header"):
        lazyckpt.get_model_checkpoint_loader().lazy_load(path, {})


def test_a_file_truncated_mid_stream_is_told_where_it_now_ends(tmp_path: Path) -> None:
    # The message gave the read's start as the file's end ("ended at byte 262576").
    save_file({f"k{i}": torch.randn(64, 1024) for i in range(3)}, tmp_path / "a.safetensors")
    opts = lazyckpt.ModelCheckpointLoadOptions(mmap=False, prefetch_bytes=0)
    stream = lazyckpt.get_model_checkpoint_loader().lazy_load(tmp_path / "a.safetensors", {}, opts)
    next(stream)
    os.truncate(tmp_path / "a.safetensors", 4096)
    with pytest.raises(lazyckpt.CorruptModelCheckpointError, match=r"key 'k1': the file ends at byte 4096, short of"):
        next(stream)
