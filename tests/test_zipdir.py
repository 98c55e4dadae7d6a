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
        return {
            r.name: raw[start + at : start + at + r.size] for r, (at, _) in zip(records, placed)
        }
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


def test_a_zip_written_by_zipfile_with_a_comment(tmp_path: Path) -> None:
    path = tmp_path / "c.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("a/data.pkl", b"pickle bytes")
        zf.writestr("a/data/0", bytes(range(256)) * 10)
        zf.comment = b"a comment of some length"
    data = path.read_bytes()
    assert _records(path) == _oracle(data)


def _torch_zip(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_bytes_before_the_archive_are_refused(tmp_path: Path) -> None:
    # zipfile (3.11's; later releases refuse some of these) reads past a prefix by shifting
    # every offset; torch.load refuses it, and so must we: the prefix may be another archive
    # (two written back to back: zipfile would read the second, torch the first), or a DCP
    # window may cover the chunk before the one it names.
    first = _torch_zip({"w": torch.zeros(10, dtype=torch.uint8)})
    second = _torch_zip({"w": torch.ones(10, dtype=torch.uint8)})
    assert b"PK\x06\x06" in second[-200:]  # torch writes zip64 end records: they are checked too
    for name, data in {
        "stub": b"#!stub\n" * 3 + second,
        "zeros": b"\0" * 4096 + second,
        "two-archives": first + second,
    }.items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(data)
        with pytest.raises(ZipError, match="before the archive"):
            _records(path)
    # A window over both archives of a larger file, as a damaged DCP entry would give.
    outer = tmp_path / "outer.bin"
    outer.write_bytes(b"x" * 100 + first + second)
    assert _records(outer, 100, len(first)) == _oracle(first)
    with pytest.raises(ZipError, match="before the archive"):
        _records(outer, 100, len(first) + len(second))


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


def test_a_zip64_torch_file(tmp_path: Path) -> None:
    # torch writes zip64 end records for large files.
    path = tmp_path / "big.pt"
    torch.save({"w": torch.zeros(40 << 20, dtype=torch.uint8)}, path)
    data = path.read_bytes()
    assert b"PK\x06\x06" in data[-200:], "expected zip64 end records"
    assert _records(path) == _oracle(data)


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


def _file_outcome(path: Path, shapes: dict | None) -> tuple[object, bool]:
    """What reading the torch file at ``path`` gives (its storages and tensors, or the error),
    and whether it was recognised: its pickle's objects are those of an archive in
    ``shapes``."""
    from lazyckpt.errors import CorruptModelCheckpointError
    from lazyckpt.torch_zip import read_torch_archive

    known = [k.obj for same in (shapes or {}).values() for k in same]  # before it is read
    try:
        a = read_torch_archive(path, shapes=shapes)
    except CorruptModelCheckpointError as exc:
        return ("error", str(exc)), False
    tensors = {
        k: (t.dtype, t.sizes, t.strides, t.storage_offset, t.storage.key, t.storage.numel)
        for k, t in a.obj.items()
    }
    return (a.storage_offsets, tensors, a.forbidden), any(a.obj is k for k in known)


@pytest.mark.parametrize("big", [False, True], ids=["one-read", "two-reads"])
def test_a_rank_file_recognised_by_its_shape_reads_as_a_full_parse_would(
    tmp_path: Path, big: bool
) -> None:
    """The rank files of a model-parallel set are ``torch.save`` zips of one shape: the same
    bytes but for the data, its CRCs, torch's serialization id and the archive name that
    torch takes from the file name (``consolidated.00/`` against ``consolidated.01/``). Once
    one is checked, the others are recognised by comparing bytes. Flip any byte of the second
    file, one bit and all bits: reading it with the first one's shape known must give what a
    full parse gives.

    The shape reads segments closer than ``zipdir._MERGE_GAP`` at once; with ``big``, a
    storage wider than that splits them into two reads (its own bytes are not flipped: data,
    and 12 KiB of full parses)."""
    from lazyckpt.zipdir import _MERGE_GAP

    folder = tmp_path / "mp"
    folder.mkdir()
    for rank in (0, 1):
        obj = {
            "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank,
            "norm": torch.ones(5, dtype=torch.bfloat16) * (rank + 2),
            "ids": torch.arange(3) * (rank + 1),
        }
        if big:
            obj["big"] = torch.arange(_MERGE_GAP // 4 + 1000, dtype=torch.float32) + rank
        torch.save(obj, folder / f"consolidated.0{rank}.pth")
    first, second = folder / "consolidated.00.pth", folder / "consolidated.01.pth"
    clean = second.read_bytes()
    assert len(clean) == first.stat().st_size and b"consolidated.01/data.pkl" in clean
    skip = range(0)
    if big:
        from lazyckpt.torch_zip import read_torch_archive

        at, size = read_torch_archive(second).storage_offsets["3"]  # "big", the fourth storage
        assert size > _MERGE_GAP
        skip = range(at, at + size)

    shapes: dict = {}
    want, _ = _file_outcome(second, None)
    assert want[0] != "error"
    _file_outcome(first, shapes)
    (known,) = [k for same in shapes.values() for k in same]
    assert len(known.shape.reads) == (2 if big else 1)
    assert _file_outcome(second, shapes) == (want, True)

    # The archive name rewritten at every place it is written: another name that splits record
    # names alike is recognised; one with a second "/" or a non-ASCII byte is not, and the full
    # parse decides.
    for name, same_shape in (
        (b"consolidated-01/", True),
        (b"consolidated/01/", False),
        (b"consolidated\xe901/", False),
    ):
        assert len(name) == len(b"consolidated.01/")
        second.write_bytes(clean.replace(b"consolidated.01/", name))
        shapes = {}
        _file_outcome(first, shapes)
        got, recognised = _file_outcome(second, shapes)
        assert recognised == same_shape, name
        assert got == _file_outcome(second, None)[0], name

    recognised = 0
    for at in range(len(clean)):
        if at in skip:
            continue
        for flip in (0x01, 0xFF):
            raw = bytearray(clean)
            raw[at] ^= flip
            second.write_bytes(bytes(raw))
            shapes = {}
            _file_outcome(first, shapes)
            got, known = _file_outcome(second, shapes)
            recognised += known
            assert got == _file_outcome(second, None)[0], (at, flip)
    # Flips in the data (48 + 10 + 24 bytes) and in records never read are recognised; the
    # rest fall back to the full parse, which refuses or accepts them on its own.
    assert recognised > 2 * (48 + 10 + 24)


def _rezip(entries: list[tuple[bytes, bytes]], *, signed: bool, crcs: dict[bytes, int]) -> bytes:
    """A stored zip of ``(name, data)`` records as a minimal writer lays it out: a data
    descriptor after each record (with or without its signature), no zip64 end records.
    ``crcs`` overrides the CRC-32 that a record's descriptor and directory entry hold."""
    import struct
    import zlib

    out = bytearray()
    central = bytearray()
    for name, data in entries:
        crc = crcs.get(name, zlib.crc32(data))
        at = len(out)
        out += struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0x08, 0, 0, 0, 0, 0, 0, len(name), 0)
        out += name + data
        out += (b"PK\x07\x08" if signed else b"") + struct.pack("<3I", crc, len(data), len(data))
        central += struct.pack(
            "<4s6H3I5HII", b"PK\x01\x02", 20, 20, 0x08, 0, 0, 0, crc, len(data), len(data),
            len(name), 0, 0, 0, 0, 0, at,
        )  # fmt: skip
        central += name
    directory = len(out)
    out += central
    n = len(entries)
    out += struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, n, n, len(central), directory, 0)
    return bytes(out)


def _entries(obj: dict[str, torch.Tensor], name: str, last: str | None = None) -> list:
    """The records ``torch.save`` writes for ``obj`` as the archive ``name`` (``last`` moved to
    the end)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as zf:
        entries = [
            (f"{name}/{i.filename.split('/', 1)[1]}".encode(), zf.read(i)) for i in zf.infolist()
        ]
    if last is not None:
        entries.sort(key=lambda e: e[0].endswith(last.encode()))
    return entries


def _ranks() -> list[dict[str, torch.Tensor]]:
    return [
        {"w": torch.arange(12.0).reshape(3, 4) + r, "i": torch.arange(3) * (r + 1)} for r in (0, 1)
    ]


def test_a_descriptor_whose_crc_reads_as_its_signature_is_not_misplaced(tmp_path: Path) -> None:
    """Without their signature, a data descriptor's first four bytes are the CRC-32, which may
    happen to read as the signature. The shape must place the CRC by the descriptor's length,
    as the full parse did: else it masks a size field, and an archive whose CRC and directory
    differ from the full parse's view is recognised."""
    import struct

    sig = int.from_bytes(b"PK\x07\x08", "little")
    first = tmp_path / "consolidated.00.pth"
    second = tmp_path / "consolidated.01.pth"
    e0 = _entries(_ranks()[0], "consolidated.00")
    e1 = _entries(_ranks()[1], "consolidated.01")
    first.write_bytes(_rezip(e0, signed=False, crcs={b"consolidated.00/data/0": sig}))
    clean = _rezip(e1, signed=False, crcs={})
    # The second rank, with its data/0 descriptor's CRC set to the signature and the directory's
    # CRC for data/0 set to the record's size: what a shape that took the first size field for
    # the CRC would pair.
    name = b"consolidated.01/data/0"
    size = len(dict(e1)[name])
    raw = bytearray(clean)
    end = raw.index(name) + len(name) + size
    raw[end : end + 4] = b"PK\x07\x08"
    entry = raw.index(b"PK\x01\x02" + b"\x14\x00\x14\x00\x08\x00", raw.rindex(name) - 46)
    assert raw[entry + 46 : entry + 46 + len(name)] == name
    raw[entry + 16 : entry + 20] = struct.pack("<I", size)
    for data in (clean, bytes(raw)):
        second.write_bytes(data)
        shapes: dict = {}
        _file_outcome(first, shapes)
        assert shapes, "the first file must give a shape for this test to mean anything"
        got, recognised = _file_outcome(second, shapes)
        assert got == _file_outcome(second, None)[0]
        assert recognised == (data is clean)


def test_a_zip64_locator_cannot_come_from_a_masked_archive_name(tmp_path: Path) -> None:
    """An archive without zip64 end records has its last directory entry where the zip64
    locator would be (20 bytes before the end record). If the archive name is masked there, a
    second archive could write the locator's signature into its name, consistently at every
    place, and be recognised although the full parse refuses it."""
    first = tmp_path / "consolidated.00.pth"
    second = tmp_path / "consolidated.01.pth"
    first.write_bytes(
        _rezip(_entries(_ranks()[0], "consolidated.00", last="/version"), signed=True, crcs={})
    )
    clean = _rezip(_entries(_ranks()[1], "consolidated.01", last="/version"), signed=True, crcs={})
    renamed = clean.replace(b"consolidated.01/", b"conPK\x06\x07dated.01/")
    assert len(renamed) == len(clean)
    assert renamed[-22 - 20 : -22 - 16] == b"PK\x06\x07"  # the locator's place
    for data in (clean, renamed):
        second.write_bytes(data)
        shapes: dict = {}
        _file_outcome(first, shapes)
        got, _ = _file_outcome(second, shapes)
        assert got == _file_outcome(second, None)[0]
