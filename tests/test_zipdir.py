"""lazyckpt's zip directory reader against Python's ``zipfile`` on real ``torch.save`` files."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
import torch

from lazyckpt.zipdir import ZipError, ZipSpan, check_layout, read_directory, record_data


def _records(path: Path, start: int = 0, length: int | None = None) -> dict[str, bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        span = ZipSpan(fd, start, size - start if length is None else length)
        records, directory = read_directory(span)
        placed = [record_data(span, r) for r in records]
        check_layout(span, records, [end for _, end in placed], directory)
        raw = path.read_bytes()
        return {r.name: raw[start + at : start + at + r.size] for r, (at, _) in zip(records, placed)}
    finally:
        os.close(fd)


def _oracle(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {i.filename: zf.read(i) for i in zf.infolist()}


@pytest.mark.parametrize(
    "obj",
    [
        {"w": torch.arange(10.0)},
        {f"layer{i}.weight": torch.randn(64, 32) for i in range(40)},
        {"big": torch.zeros(3 << 20, dtype=torch.uint8), "ids": torch.arange(7)},
    ],
    ids=["one", "many-records", "large"],
)
def test_torch_save_records_match_zipfile(tmp_path: Path, obj: dict[str, torch.Tensor]) -> None:
    path = tmp_path / "m.pt"
    torch.save(obj, path)
    assert _records(path) == _oracle(path.read_bytes())


def test_an_archive_inside_a_larger_file(tmp_path: Path) -> None:
    # DCP stores each chunk as a torch zip at an offset of a .distcp file.
    buf = io.BytesIO()
    torch.save({"w": torch.randn(100, 3)}, buf)
    inner = buf.getvalue()
    path = tmp_path / "outer.bin"
    path.write_bytes(b"x" * 777 + inner + b"y" * 99)
    assert _records(path, 777, len(inner)) == _oracle(inner)


def test_a_zip_written_by_zipfile_with_a_comment_and_prefix(tmp_path: Path) -> None:
    path = tmp_path / "c.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("a/data.pkl", b"pickle bytes")
        zf.writestr("a/data/0", bytes(range(256)) * 10)
        zf.comment = b"a comment of some length"
    data = path.read_bytes()
    assert _records(path) == _oracle(data)
    # Bytes prepended to a zip (a self-extractor's stub): every offset shifts, as zipfile allows.
    shifted = tmp_path / "shifted.zip"
    shifted.write_bytes(b"#!stub\n" * 3 + data)
    assert _records(shifted) == _oracle(shifted.read_bytes())


def test_damage_is_a_zip_error(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.arange(10.0)}, path)
    data = path.read_bytes()
    cases = {
        "no-end-record": data[:-22],
        "directory-cut": data[: data.rfind(b"PK\x01\x02")] + data[-22:],
        "bad-signature": data.replace(b"PK\x01\x02", b"PK\x01\x09", 1),
        "local-header-name": data.replace(b"/data.pkl", b"/data.pkX", 1),
    }
    for name, bad in cases.items():
        p = tmp_path / f"{name}.pt"
        p.write_bytes(bad)
        with pytest.raises(ZipError):
            _records(p)
    compressed = tmp_path / "deflated.zip"
    with zipfile.ZipFile(compressed, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a/data.pkl", b"p" * 1000)
    with pytest.raises(ZipError, match="compressed"):
        _records(compressed)


def test_a_zip64_torch_file_behind_a_prefix(tmp_path: Path) -> None:
    # torch writes zip64 end records for large files; prepended bytes must not misplace them.
    path = tmp_path / "big.pt"
    torch.save({"w": torch.zeros(40 << 20, dtype=torch.uint8)}, path)
    data = path.read_bytes()
    assert b"PK\x06\x06" in data[-200:], "expected zip64 end records"
    assert _records(path) == _oracle(data)
    shifted = tmp_path / "shifted.pt"
    shifted.write_bytes(b"\0" * 4096 + data)
    assert _records(shifted) == _oracle(shifted.read_bytes())


def _outcome(path: Path, start: int, length: int, fd: int, shapes: object | None) -> object:
    """What reading the archive at ``start`` gives: its storages and tensor, or the error."""
    from lazyckpt.errors import CorruptModelCheckpointError
    from lazyckpt.torch_zip import read_torch_archive

    try:
        a = read_torch_archive(path, window=(start, length), fd=fd, shapes=shapes)  # type: ignore[arg-type]
    except CorruptModelCheckpointError as exc:
        return ("error", str(exc))
    t = a.obj
    return (a.storage_offsets, t.dtype, t.sizes, t.strides, t.storage_offset, a.forbidden)


def test_a_chunk_recognised_by_its_shape_reads_as_a_full_parse_would(tmp_path: Path) -> None:
    """DCP chunks are ``torch.save`` zips side by side in one file. Once one is checked, another
    of the same shape is recognised by comparing bytes (``zipdir.ZipShape``). That must be as
    strict as parsing it: flip any byte of the second chunk, one bit at a time and all bits, and
    the outcome with the first chunk's shape known is the outcome of a full parse."""
    blobs = []
    for seed in (1, 2):
        buf = io.BytesIO()
        torch.save(torch.arange(24, dtype=torch.float32).reshape(4, 6) * seed, buf)
        blobs.append(buf.getvalue())
    assert len(blobs[0]) == len(blobs[1]) and blobs[0] != blobs[1]
    path = tmp_path / "chunks.distcp"
    first, second = len(b"lead"), len(b"lead") + len(blobs[0])
    length = len(blobs[1])
    clean = b"lead" + blobs[0] + blobs[1] + b"trail"
    path.write_bytes(clean)

    fd = os.open(path, os.O_RDONLY)
    try:
        shapes: dict = {}
        want = _outcome(path, second, length, fd, None)
        assert want[0] != "error"
        assert _outcome(path, first, length, fd, shapes) != want  # another storage offset
        assert sum(len(v) for v in shapes.values()) == 1
        assert _outcome(path, second, length, fd, shapes) == want
        assert sum(len(v) for v in shapes.values()) == 1  # recognised, not parsed and added
    finally:
        os.close(fd)

    recognised = 0
    for at in range(second, second + length):
        for flip in (0x01, 0xFF):
            raw = bytearray(clean)
            raw[at] ^= flip
            path.write_bytes(bytes(raw))
            fd = os.open(path, os.O_RDONLY)
            try:
                shapes = {}
                _outcome(path, first, length, fd, shapes)  # the first chunk's shape, known
                known = sum(len(v) for v in shapes.values())
                got = _outcome(path, second, length, fd, shapes)
                recognised += sum(len(v) for v in shapes.values()) == known
                assert got == _outcome(path, second, length, fd, None), (at - second, flip)
            finally:
                os.close(fd)
    # Flips in the data (and torch's random serialization id) are recognised; the rest fall
    # back to the full parse, which refuses or accepts them on its own.
    assert recognised > 2 * 24 * 4
