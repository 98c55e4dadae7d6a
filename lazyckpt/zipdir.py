"""Read the directory of an uncompressed zip (a ``torch.save`` file) with a handful of reads.

Python's :mod:`zipfile` reads the central directory through a buffered file object and builds a
``ZipInfo`` per record; for a fairscale MP-8 set (8 files x 81 records) or a DCP folder (one small
zip per chunk) that cost as much as copying a rank's bytes. Here the directory comes from one
read of the archive's tail, each record's local header from a read that is usually served from a
block already in memory, and every field is checked as it is parsed: any damage is a
:class:`ZipError` (its message says what is wrong), never an ``IndexError`` or a wrong offset.

Only what torch writes is supported: stored records (zip64 or not), one disk, no encryption.
Offsets are relative to the archive's start, which may lie inside a larger file (DCP).
"""

from __future__ import annotations

import bisect
import operator
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

__all__ = [
    "HEAD_BLOCK",
    "LOCAL_HEADER_BYTES",
    "ZipError",
    "ZipRecord",
    "ZipShape",
    "ZipSpan",
    "check_layout",
    "ends_with_end_record",
    "read_directory",
    "record_data",
    "zip_shape",
]

_EOCD = struct.Struct("<4s4H2IH")
_EOCD_SIG = b"PK\x05\x06"
_LOCATOR = struct.Struct("<4sIQI")
_LOCATOR_SIG = b"PK\x06\x07"
_EOCD64 = struct.Struct("<4sQ2H2I4Q")
_EOCD64_SIG = b"PK\x06\x06"
_CENTRAL = struct.Struct("<4s6H3I5HII")
_CENTRAL_SIG = b"PK\x01\x02"
_LOCAL = struct.Struct("<4s5H3I2H")
_LOCAL_SIG = b"PK\x03\x04"
LOCAL_HEADER_BYTES = _LOCAL.size
"""The fixed part of a local header; its name and extra field follow."""
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")


def ends_with_end_record(f: IO[bytes]) -> bool:
    """Whether the open file ends with an end record and no comment, as torch's writer ends
    every file it finished (a file cut short would have to end in those bytes by chance): torch
    2.4's writer ignores a failed write of its last records, and the reshard checks this."""
    size = f.seek(0, os.SEEK_END)
    if size < _EOCD.size:
        return False
    f.seek(size - _EOCD.size)
    return f.read(len(_EOCD_SIG)) == _EOCD_SIG


_TAIL_GUESS = 16 << 10
"""Bytes read from the end first: the end records and, for torch files, the whole directory."""
_MAX_COMMENT = 0xFFFF
HEAD_BLOCK = 4 << 10
"""Bytes kept from the archive's start: the first local headers and a small ``data.pkl``."""
_LOCAL_GUESS = 256
"""Bytes read past a local header in the same call: its name and padding fit in most files."""
_STORED = 0
_DESCRIPTOR = 0x08
_UTF8 = 0x800
_ENCRYPTED = 0x01


class ZipError(Exception):
    """The archive is not a readable stored zip; the message says why (without the path)."""


@dataclass(slots=True)
class ZipRecord:
    """One entry of the central directory."""

    name: str
    raw_name: bytes
    flags: int
    crc: int
    size: int
    header_offset: int
    entry: int
    """Where this entry of the central directory starts in the archive."""


class ZipSpan:
    """Bytes ``[start, start + length)`` of an open file, read with few system calls.

    Blocks passed to :meth:`keep` stay in memory, and reads inside one are served from it.
    """

    __slots__ = ("_blocks", "before", "eocd", "fd", "length", "start")

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length = fd, start, length
        self._blocks: list[tuple[int, bytes]] = []
        self.before: dict[int, bytes] = {}
        """Up to ``_DESCRIPTOR_MAX`` bytes right before each local header read so far, by its
        offset: the data descriptor of the record before it, read in the same call."""
        self.eocd = -1
        """Where the end-of-directory record starts, once :func:`read_directory` found it."""

    def read(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at the archive's end)."""
        n = min(n, self.length - offset)
        if n <= 0 or offset < 0:
            return b""
        end = offset + n
        for base, block in self._blocks:  # kept blocks lie inside the archive
            if base <= offset and end <= base + len(block):
                return block[offset - base : end - base]
        return os.pread(self.fd, n, self.start + offset)

    def keep(self, offset: int, n: int) -> bytes:
        block = self.read(offset, n)
        if (offset, len(block)) not in ((base, len(b)) for base, b in self._blocks):
            self._blocks.append((offset, block))
        return block


def read_directory(span: ZipSpan) -> tuple[list[ZipRecord], int]:
    """The records of the central directory, and the directory's offset.

    Raises :class:`ZipError` for anything torch would not have written or that is damaged.
    """
    length = span.length
    span.keep(0, min(length, HEAD_BLOCK))
    tail_start = max(0, length - _TAIL_GUESS)
    tail = span.keep(tail_start, length - tail_start)
    at = _find_eocd(tail)
    if at < 0 and tail_start > 0:
        tail_start = max(0, length - _EOCD.size - _MAX_COMMENT - _LOCATOR.size - _EOCD64.size)
        tail = span.keep(tail_start, length - tail_start)
        at = _find_eocd(tail)
    if at < 0:
        raise ZipError("no end-of-directory record: the file is truncated or not a zip")
    _, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
    span.eocd = end = tail_start + at  # where the directory ends, if no zip64 records follow
    loc = at - _LOCATOR.size
    if loc >= 0 and tail[loc : loc + 4] == _LOCATOR_SIG:
        # The zip64 end record sits right before its locator; it is read there, as zipfile
        # does, and its offsets are then checked like the 32-bit ones.
        eocd64_at = tail_start + loc - _EOCD64.size
        rec = span.read(eocd64_at, _EOCD64.size) if eocd64_at >= 0 else b""
        if len(rec) < _EOCD64.size or rec[:4] != _EOCD64_SIG:
            raise ZipError("the zip64 end-of-directory record is missing or damaged")
        _, _, _, _, disk, cd_disk, n_disk, n_total, cd_size, cd_offset = _EOCD64.unpack(rec)
        end = eocd64_at
    elif 0xFFFF in (n_disk, n_total) or 0xFFFFFFFF in (cd_size, cd_offset):
        raise ZipError("the zip64 end records are missing")
    if disk != 0 or cd_disk != 0 or n_disk != n_total:
        raise ZipError("a multi-disk zip is not a torch file")
    # Nothing may come before the archive: torch.save writes nothing there and torch.load
    # refuses it. zipfile would shift every offset past such bytes, which would read the second
    # of two archives back to back, or the next DCP chunk through a window that covers both.
    shift = end - cd_size - cd_offset
    if shift > 0:
        raise ZipError(
            f"{shift} bytes come before the archive (its directory ends {shift} bytes later than "
            "it says): the data holds more than one zip, or was edited"
        )
    if shift < 0:
        raise ZipError("the central directory lies past the end of the archive")
    directory = span.read(cd_offset, cd_size)
    if len(directory) != cd_size:
        raise ZipError("the central directory is truncated")
    return _parse_central(directory, n_total, cd_offset), cd_offset


def _find_eocd(tail: bytes) -> int:
    at = len(tail) - _EOCD.size
    if at >= 0 and tail[at : at + 4] == _EOCD_SIG:
        return at
    at = tail.rfind(_EOCD_SIG, 0, max(0, len(tail) - _EOCD.size + 4))
    while at >= 0:
        if at + _EOCD.size + _U16.unpack_from(tail, at + 20)[0] == len(tail):
            return at
        at = tail.rfind(_EOCD_SIG, 0, at)
    return -1


def _parse_central(data: bytes, count: int, limit: int) -> list[ZipRecord]:
    records: list[ZipRecord] = []
    names: set[str] = set()
    pos = 0
    unpack = _CENTRAL.unpack_from
    for _ in range(count):
        if pos + _CENTRAL.size > len(data):
            raise ZipError("the central directory is shorter than its record count")
        (sig, _, _, flags, method, _, _, crc, csize, size, n_name, n_extra, n_comment, _, _, _,
         offset) = unpack(data, pos)  # fmt: skip
        if sig != _CENTRAL_SIG:
            raise ZipError("the central directory is damaged (bad record signature)")
        name_end = pos + _CENTRAL.size + n_name
        extra_end = name_end + n_extra
        if extra_end + n_comment > len(data):
            raise ZipError("the central directory is damaged (a record runs past its end)")
        raw_name = data[pos + _CENTRAL.size : name_end]
        if 0xFFFFFFFF in (size, csize, offset):
            size, csize, offset = _zip64_fields(data[name_end:extra_end], size, csize, offset)
        name = raw_name.decode("utf-8" if flags & _UTF8 else "cp437", errors="replace")
        if method != _STORED or csize != size:
            raise ZipError(
                f"record {name} is compressed; torch files store records uncompressed, so the "
                "file was rewritten by another tool: save it again with torch.save"
            )
        if flags & _ENCRYPTED:
            raise ZipError(f"record {name} is encrypted")
        if not 0 <= offset <= limit - _LOCAL.size:
            raise ZipError(
                f"record {name}: its header offset {offset} lies outside the archive; the zip "
                "directory is damaged"
            )
        if name in names:  # which of the two holds the data? The last would win, silently
            raise ZipError(f"the directory lists record {name} twice")
        names.add(name)
        records.append(ZipRecord(name, raw_name, flags, crc, size, offset, limit + pos))
        pos = extra_end + n_comment
    return records


def _zip64_fields(extra: bytes, size: int, csize: int, offset: int) -> tuple[int, int, int]:
    """The 64-bit values of the fields that hold 0xFFFFFFFF, from the zip64 extra block."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<2H", extra, pos)
        body = extra[pos + 4 : pos + 4 + n]
        pos += 4 + n
        if tag != 1:
            continue
        values = [size, csize, offset]
        at = 0
        for i in range(3):
            if values[i] == 0xFFFFFFFF:
                if at + 8 > len(body):
                    raise ZipError("a zip64 extra field is truncated")
                values[i] = _U64.unpack_from(body, at)[0]
                at += 8
        return values[0], values[1], values[2]
    raise ZipError("a record needs a zip64 extra field and has none")


def record_data(span: ZipSpan, record: ZipRecord) -> tuple[int, int]:
    """Where ``record``'s data starts and ends, after checking its local header against the
    directory.

    A damaged name or extra length in the local header would silently shift where the data is
    read from, and an extra length of 0 is well-formed. So where the data ends is checked too,
    by :func:`check_layout`: against the data descriptor that follows (torch writes one after
    every record) and the next record's start."""
    # Runs once per record of every file indexed: offsets into one buffer, few slices.
    at = record.header_offset
    raw_name = record.raw_name
    lead = min(at, _DESCRIPTOR_MAX)
    buf = span.read(at - lead, lead + _LOCAL.size + len(raw_name) + _LOCAL_GUESS)
    span.before[at] = buf[:lead]
    if len(buf) < lead + _LOCAL.size:
        raise ZipError(f"record {record.name}: its local header is truncated")
    fields = _LOCAL.unpack_from(buf, lead)
    n_name, n_extra = fields[9], fields[10]
    name_at = lead + _LOCAL.size
    end = name_at + n_name + n_extra  # where the data starts, in buf
    if len(buf) < end:
        buf = span.read(at - lead, end)
    if fields[0] != _LOCAL_SIG or buf[name_at : name_at + n_name] != raw_name:
        raise ZipError(
            f"record {record.name}: the local header does not match the zip directory; "
            "the file is damaged: copy it again"
        )
    pos = name_at + n_name
    truncated = len(buf) < end
    if not truncated:
        while pos + 4 <= end:
            pos += 4 + _U16.unpack_from(buf, pos + 2)[0]
    if truncated or pos != end:
        raise ZipError(f"record {record.name}: malformed extra field in its local header")
    start = at + end - lead
    stop = start + record.size
    if stop > span.length:
        raise ZipError(
            f"record {record.name} ({record.size} bytes at {start}) runs past the end of the "
            f"{span.length}-byte archive; the file is truncated: copy it again"
        )
    return start, stop


_DESCRIPTOR_SIG = b"PK\x07\x08"
_DESCRIPTOR_MAX = 24
"""The longest data descriptor: signature, CRC-32 and two 64-bit sizes (zip64)."""


_DESCRIPTOR_BODIES = (struct.Struct("<3I"), struct.Struct("<I2Q"))
"""CRC-32 and the two sizes, 32- or 64-bit (zip64)."""
_SIGNED_DESCRIPTORS = tuple(len(_DESCRIPTOR_SIG) + body.size for body in _DESCRIPTOR_BODIES)
"""The lengths of a data descriptor that starts with its signature (16, 24); without it, 12 or
20."""


def _descriptor_length(data: bytes, record: ZipRecord) -> int:
    """The length of the data descriptor at the start of ``data`` (with or without its
    optional signature, 32- or 64-bit sizes) that repeats the record's CRC and size, or 0."""
    want = (record.crc, record.size, record.size)
    for at in (4, 0) if data[:4] == _DESCRIPTOR_SIG else (0,):
        for body in _DESCRIPTOR_BODIES:
            n = at + body.size
            if len(data) >= n and body.unpack_from(data, at) == want:
                return n
    return 0


def check_layout(
    span: ZipSpan, records: list[ZipRecord], ends: list[int | None], directory: int
) -> None:
    """Records lie back to back, as every zip writer lays them: where the data of a record
    whose local header was read ends (``ends[i]``), its data descriptor follows if it is
    flagged with one, repeating the directory's CRC and size, and then the next record or the
    central directory starts. ``ends[i] is None``: a record not read, only checked to start
    before the next one (names and padding unknown)."""
    limits = _limits(records, directory)
    order = sorted(range(len(records)), key=lambda i: records[i].header_offset)
    if order and records[order[0]].header_offset != 0:
        raise ZipError(
            f"the first record starts at byte {records[order[0]].header_offset}, not 0: the data "
            "holds something before the archive, or the zip directory is damaged"
        )
    for i in order:
        r = records[i]
        limit = limits[i]
        end = ends[i]
        if end is None:
            if r.header_offset + LOCAL_HEADER_BYTES + len(r.raw_name) + r.size > limit:
                raise ZipError(
                    f"record {r.name} overlaps what follows it; the zip directory is damaged: "
                    "copy the file again"
                )
            continue
        gap = limit - end
        if r.flags & _DESCRIPTOR and 0 < gap <= _DESCRIPTOR_MAX:
            kept = span.before.get(limit, b"")
            tail = kept[len(kept) - gap :] if len(kept) >= gap else span.read(end, gap)
            if _descriptor_length(tail, r) == gap:
                if gap in _SIGNED_DESCRIPTORS or span.read(end - 4, 4) != _DESCRIPTOR_SIG:
                    continue
                # A descriptor without its signature, right after the signature's bytes: the
                # signed descriptor of a record whose data was moved 4 bytes on (an extra length
                # grown by 4 in its local header) reads so, its signature as the data's last
                # bytes. torch.load would read the moved bytes; torch writes signed descriptors.
                raise ZipError(
                    f"record {r.name}: its data runs into the signature of its data descriptor "
                    "(the extra length in its local header is likely damaged, which moves the "
                    "data); the file is damaged: copy it again"
                )
            raise ZipError(
                f"record {r.name}: its data does not end where its local header says (no data "
                "descriptor with its CRC and size follows it); the file is damaged: copy it again"
            )
        if gap != 0 or r.flags & _DESCRIPTOR:
            raise ZipError(
                f"record {r.name} {'overlaps' if gap < 0 else 'ends before'} what follows it; a "
                "local header or the zip directory is damaged: copy the file again"
            )


_CENTRAL_CRC = 16
"""Where a central directory record holds its CRC-32."""
_CENTRAL_NAME = _CENTRAL.size
"""Where a central directory record's name starts."""
_MAX_SHAPE_BYTES = 64 << 20
"""Most bytes a :class:`ZipShape` keeps: the pickle and the directory of a rank file of a
65B-class model are about 150 KB, of one holding 15,400 MoE expert keys 4.5 MB (parsing each
such file again cost twice as long as recognising it)."""


_MERGE_GAP = 8 << 10
"""Segments this close are read by one ``pread``, the data between them read and ignored: a
system call costs about as much as copying 8 KiB here (a rank file's norms are 4-16 KiB)."""


@dataclass(frozen=True, slots=True)
class ZipShape:
    """The bytes of a checked archive that its checks depend on: all of it but the data of its
    payload records (the tensor storages).

    Its segments are the ranges between the payloads' data: the archive before the first, the
    data descriptor of each and the local header of the next, the directory after the last.
    An archive of the same length whose segments equal these, except in the bytes masked out,
    passes :func:`read_directory`, :func:`record_data` and :func:`check_layout` exactly as this
    one did, and its records lie at the same places. Masked out are what those checks never
    look at, and what differs between two tensors of one shape saved alike:

    * the spans of the records whose local headers were not read (torch's ``version`` and
      ``serialization_id``, as in :func:`check_layout`);
    * each payload's CRC-32, in its data descriptor and in its directory entry: the one check
      left is :func:`check_layout`'s, that the two agree;
    * the archive name that starts every record's name (``torch.save`` takes it from the file
      name, so rank files differ there): another archive's must be the same at every place,
      ASCII, and end in its only ``/``, so that its records split into the same parts.

    DCP stores every tensor chunk as such a small zip, so a folder's chunks have a few shapes
    between them; the rank files of a model-parallel set usually share one.

    The segments are read (``reads``, close ones merged) into one buffer, and the ranges to
    compare are cut from it and joined by ``operator.itemgetter`` in C: comparing them range by
    range in Python cost 0.25 ms an MP-8 rank file of 77 segments.
    """

    length: int
    reads: tuple[tuple[int, int], ...]
    """``(offset, length)`` of each ``pread``, from the archive's start, in order."""
    total: int
    """Bytes of all the reads: the length of the buffer they make."""
    keep: Callable[[bytes], Sequence[bytes]]
    """The buffer's ranges that must equal :attr:`keep_bytes`: all but the masked bytes and
    the archive names."""
    keep_bytes: bytes
    crcs: tuple[Callable[[bytes], Sequence[bytes]], Callable[[bytes], Sequence[bytes]]]
    """Per payload, in the order of their data in the archive, its CRC-32 in its data
    descriptor and in its directory entry: the two joined must be equal."""
    names: Callable[[bytes], Sequence[bytes]] | None
    """Every place the archive name is written (None: it is empty)."""

    def matches(self, fd: int, start: int) -> bytes | None:
        """Whether the archive at ``start`` of ``fd`` (of this length) repeats this shape: its
        payloads' CRC-32s if so (4 bytes each, little-endian, in the order of their data in
        the archive), else None."""
        parts = [os.pread(fd, n, start + at) for at, n in self.reads]
        got = b"".join(parts) if len(parts) > 1 else parts[0]
        if len(got) != self.total or b"".join(self.keep(got)) != self.keep_bytes:
            return None
        if self.names is not None:
            written = set(self.names(got))
            if len(written) != 1 or not _plain_prefix(written.pop()):
                return None
        first, second = self.crcs
        crcs = b"".join(first(got))
        return crcs if crcs == b"".join(second(got)) else None


def _cutter(ranges: Sequence[tuple[int, int]]) -> Callable[[bytes], Sequence[bytes]]:
    """A function cutting ``ranges`` (``(start, stop)``) out of a buffer, always as a tuple
    (``itemgetter`` of one item returns it bare)."""
    if len(ranges) == 1:
        (a, b), *_ = ranges
        return lambda buf: (buf[a:b],)
    if not ranges:
        return lambda buf: ()
    return operator.itemgetter(*(slice(a, b) for a, b in ranges))


def _plain_prefix(prefix: bytes) -> bool:
    """An archive name that splits record names as torch's do: ASCII (decoded alike however
    the record is flagged), ending in its only ``/``."""
    return prefix.isascii() and prefix.find(b"/") == len(prefix) - 1


def zip_shape(
    span: ZipSpan,
    records: list[ZipRecord],
    spans: list[tuple[int, int] | None],
    directory: int,
    payloads: list[int],
    prefix: bytes,
) -> ZipShape | None:
    """The :class:`ZipShape` of an archive that passed :func:`check_layout`, around the data of
    the records ``payloads`` (in any order); ``spans[i]`` is where record ``i``'s data lies
    (``None`` for records whose local header was not read), ``prefix`` the archive name that
    starts every record's name (may be empty). None where the shape would not be safe or
    small: a payload has no data descriptor (its CRC-32 would sit in its local header), a
    record's name lacks the prefix, or the kept bytes pass ``_MAX_SHAPE_BYTES``."""
    found = []
    for i in payloads:
        where = spans[i]
        if where is None or not records[i].flags & _DESCRIPTOR:
            return None
        found.append((where, i))
    found.sort()
    if prefix and not (
        _plain_prefix(prefix) and all(r.raw_name.startswith(prefix) for r in records)
    ):
        return None
    bounds = [0]
    for (start, end), _ in found:
        bounds += [start, end]
    bounds.append(span.length)
    pairs_of_bounds = list(zip(bounds[::2], bounds[1::2]))
    if sum(hi - lo for lo, hi in pairs_of_bounds) > _MAX_SHAPE_BYTES:
        return None
    limits = _limits(records, directory)
    masks = [(r.header_offset, limits[i]) for i, r in enumerate(records) if spans[i] is None]
    if masks and min(a for a, _ in masks) < len(_LOCAL_SIG):
        return None  # the archive's magic is checked before anything else: never mask it
    # The directory follows every record's data: its entries lie in the last segment.
    tail_at = pairs_of_bounds[-1][0]
    if directory < tail_at:
        return None
    starts = [lo for lo, _ in pairs_of_bounds]
    n = len(prefix)
    names = []  # where the archive name is written
    name_masks = []
    payload_set = set(payloads)
    for i, r in enumerate(records):
        at = r.entry + _CENTRAL_CRC
        if spans[i] is None or i in payload_set:
            masks.append((at, at + 4))
        if n:
            at = r.entry + _CENTRAL_NAME
            name_masks.append((at, at + n))
            names.append(at)
            if spans[i] is not None:  # its local header was read: the name is kept there too
                at = r.header_offset + LOCAL_HEADER_BYTES
                k = bisect.bisect_right(starts, at) - 1
                if k < 0 or at + n > pairs_of_bounds[k][1]:
                    return None
                name_masks.append((at, at + n))
                names.append(at)
    crcs = []  # where each payload's CRC-32 lies in its descriptor and its directory entry
    for (_, end), i in found:
        # Where the CRC-32 sits follows from the descriptor's length, which check_layout found
        # to be the gap: 16 or 24 bytes with the signature, 12 or 20 without. Not from its first
        # bytes, which are the CRC itself when there is no signature.
        descriptor = end + (4 if limits[i] - end in _SIGNED_DESCRIPTORS else 0)
        masks.append((descriptor, descriptor + 4))
        crcs.append((descriptor, records[i].entry + _CENTRAL_CRC))
    # read_directory looks for the zip64 locator's signature 20 bytes before the end record; in
    # an archive without one those bytes lie in the last directory entry, maybe in its name.
    probe = span.eocd - _LOCATOR.size
    if any(a < probe + 4 and probe < b for a, b in masks + name_masks):
        return None

    reads: list[tuple[int, int]] = []  # segments closer than _MERGE_GAP read together
    for lo, hi in pairs_of_bounds:
        if reads and lo - reads[-1][1] <= _MERGE_GAP:
            lo = reads.pop()[0]
        reads.append((lo, hi))
    at = 0
    into = []  # each read's place in the buffer
    parts = []
    for lo, hi in reads:
        data = span.read(lo, hi - lo)
        if len(data) != hi - lo:
            return None
        parts.append(data)
        into.append(at)
        at += hi - lo
    buf = b"".join(parts)
    last_at, last_into = reads[-1][0], into[-1]
    read_at = [lo for lo, _ in reads]

    def place(offset: int) -> int:
        """Where archive byte ``offset`` (read) is in the buffer."""
        if offset >= last_at:  # the directory: most CRCs and names
            return last_into + offset - last_at
        k = bisect.bisect_right(read_at, offset) - 1
        return into[k] + offset - read_at[k]

    # The payloads' data lies between segments read together: masked as well.
    keeps = _keeps(masks + name_masks + [where for where, _ in found], reads)
    keep = _cutter([(p + a, p + b) for p, kept in zip(into, keeps) for a, b in kept])
    return ZipShape(
        length=span.length,
        reads=tuple((lo, hi - lo) for lo, hi in reads),
        total=len(buf),
        keep=keep,
        keep_bytes=b"".join(keep(buf)),
        crcs=(
            _cutter([(p, p + 4) for p in [place(a) for a, _ in crcs]]),
            _cutter([(p, p + 4) for p in [place(b) for _, b in crcs]]),
        ),
        names=_cutter([(p, p + n) for p in [place(a) for a in sorted(names)]]) if names else None,
    )


def _limits(records: list[ZipRecord], directory: int) -> list[int]:
    """Where what follows each record starts: the next record's local header, or the central
    directory after the last."""
    order = sorted(range(len(records)), key=lambda i: records[i].header_offset)
    limits = [directory] * len(records)
    for j, i in enumerate(order[:-1]):
        limits[i] = records[order[j + 1]].header_offset
    return limits


def _keeps(
    masks: list[tuple[int, int]], ranges: list[tuple[int, int]]
) -> list[tuple[tuple[int, int], ...]]:
    """For each of ``ranges`` (sorted, disjoint), its parts outside every mask, relative to
    its start: one sweep over the sorted masks."""
    masks = sorted(masks)
    out = []
    first = 0  # masks before this one end before the current range
    count = len(masks)
    for lo, hi in ranges:
        while first < count and masks[first][1] <= lo:
            first += 1
        kept = []
        at = lo  # kept up to here
        for j in range(first, count):
            a, b = masks[j]
            if a >= hi:
                break
            if a > at:
                kept.append((at - lo, a - lo))
            if b > at:
                at = b
        if at < hi:
            kept.append((at - lo, hi - lo))
        out.append(tuple(kept))
    return out
