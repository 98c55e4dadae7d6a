"""lazyckpt.claims: which bytes of a mapping views hold. Oracle: the set of byte offsets each
piece holds, enumerated element by element."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lazyckpt.claims import Claims, Footprint, footprint, overlap


def _bytes(first: int, sizes: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> set[int]:
    out: set[int] = set()
    for index in itertools.product(*(range(n) for n in sizes)):
        at = first + itemsize * sum(i * s for i, s in zip(index, strides))
        out.update(range(at, at + itemsize))
    return out


def _holds(fp: Footprint, b: int) -> bool:
    if not fp.start <= b < fp.stop:
        return False
    return not fp.period or (b - fp.start) % fp.period < fp.width


@st.composite
def matrix_boxes(draw: st.DrawFn) -> tuple[int, int, int, list[tuple[int, int, int, int]]]:
    """A row-major matrix (rows, cols, itemsize) at some byte and boxes of it."""
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    itemsize = draw(st.sampled_from([1, 2, 4]))
    boxes = []
    for _ in range(draw(st.integers(1, 6))):
        r0 = draw(st.integers(0, rows - 1))
        c0 = draw(st.integers(0, cols - 1))
        r1 = draw(st.integers(r0 + 1, rows))
        c1 = draw(st.integers(c0 + 1, cols))
        boxes.append((r0, r1, c0, c1))
    return rows, cols, itemsize, boxes


def _box(base: int, cols: int, itemsize: int, box: tuple[int, int, int, int]):
    """The footprint, the bytes and ``Claims.claim``'s arguments of a box of the matrix."""
    r0, r1, c0, c1 = box
    first, sizes, strides = base + (r0 * cols + c0) * itemsize, (r1 - r0, c1 - c0), (cols, 1)
    fp = footprint(first, sizes, strides, itemsize)
    return fp, _bytes(first, sizes, strides, itemsize), (first, fp.stop, sizes, strides, itemsize)


@given(matrix_boxes(), st.integers(0, 50))
def test_boxes_of_one_matrix_overlap_exactly_when_they_share_a_byte(drawn, base: int) -> None:
    # q, k, v saved as qkv.split(n, dim=1), a TP dim-1 shard beside its neighbours: told apart.
    _, cols, itemsize, boxes = drawn
    made = [_box(base, cols, itemsize, b)[:2] for b in boxes]
    for (fa, ba), (fb, bb) in itertools.product(made, repeat=2):
        assert {b for b in range(fa.start - 1, fa.stop + 1) if _holds(fa, b)} == ba
        assert overlap(fa, fb) == bool(ba & bb), (fa, fb)


@given(
    st.lists(
        st.tuples(
            st.integers(0, 40),
            st.lists(st.tuples(st.integers(0, 4), st.integers(0, 9)), min_size=0, max_size=3),
            st.sampled_from([1, 2]),
        ),
        min_size=2,
        max_size=6,
    )
)
def test_any_strided_pieces_that_share_a_byte_overlap(pieces) -> None:
    # Whatever the strides (several periods, rows that overlap, stride 0), never a miss: a
    # footprint holds every byte of its piece, and pieces sharing a byte overlap.
    made = []
    for first, dims, itemsize in pieces:
        sizes = tuple(n for n, _ in dims)
        strides = tuple(s for _, s in dims)
        fp = footprint(first, sizes, strides, itemsize)
        held = _bytes(first, sizes, strides, itemsize)
        assert all(_holds(fp, b) for b in held)
        made.append((fp, held))
    for (fa, ba), (fb, bb) in itertools.product(made, repeat=2):
        if ba & bb:
            assert overlap(fa, fb)


@given(matrix_boxes(), st.lists(st.booleans(), min_size=6, max_size=6), st.booleans())
def test_a_view_is_claimed_only_over_bytes_no_view_or_copy_holds(
    drawn, copy_first, reverse: bool
) -> None:
    # In file order most views are only noted, their footprints worked out when first needed;
    # in reverse, each is checked as it comes: the answers are the same.
    _, cols, itemsize, boxes = drawn
    if reverse:
        boxes = boxes[::-1]
    claims = Claims()
    held: set[int] = set()
    for box, copy in zip(boxes, copy_first):
        fp, mine, piece = _box(3, cols, itemsize, box)
        free = held.isdisjoint(mine)
        assert claims.clean(fp) == free
        if copy:  # a copy under way: no view over its bytes meanwhile, any after it
            with claims.copying([fp]) as ok:
                assert ok == free
                assert not claims.claim(*piece)
            continue
        assert claims.claim(*piece) == free
        if free:
            held |= mine
    for box in boxes:  # afterwards, every box is clean exactly where no view holds its bytes
        fp, mine, _ = _box(3, cols, itemsize, box)
        assert claims.clean(fp) == held.isdisjoint(mine)


def test_an_interrupt_while_noted_views_are_worked_out_loses_none(monkeypatch) -> None:
    # Views noted on the fast path get their footprints when bytes before the furthest one are
    # first asked about; an exception then (an interrupt) must leave every view still held.
    import lazyckpt.claims as module

    claims = Claims()
    assert claims.claim(0, 400, (100,), (1,), 4)
    assert claims.claim(400, 800, (100,), (1,), 4)
    real = module.footprint

    def interrupted(*args):
        monkeypatch.setattr(module, "footprint", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "footprint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        claims.clean(Footprint(0, 4))
    assert not claims.claim(0, 400, (100,), (1,), 4)
    assert not claims.clean(Footprint(400, 800))
    with claims.copying([Footprint(600, 700)]) as ok:
        assert not ok


@st.composite
def boxes_of_many_matrices(draw: st.DrawFn) -> list[tuple[int, int, int, tuple[int, int, int, int]]]:
    """Boxes of several row-major matrices at different places of one file (some of them
    overlapping), in any order: ``(base, cols, itemsize, box)``. One row length for all, as
    windows of different periods whose spans meet are taken to overlap (see ``overlap``)."""
    out = []
    cols, itemsize = draw(st.integers(1, 8)), draw(st.sampled_from([1, 2, 4]))
    for _ in range(draw(st.integers(2, 12))):
        base = draw(st.integers(0, 400))
        rows = draw(st.integers(1, 5))
        r0 = draw(st.integers(0, rows - 1))
        c0 = draw(st.integers(0, cols - 1))
        box = (r0, draw(st.integers(r0 + 1, rows)), c0, draw(st.integers(c0 + 1, cols)))
        out.append((base, cols, itemsize, box))
    return out


@given(boxes_of_many_matrices(), st.lists(st.booleans(), min_size=12, max_size=12))
def test_views_of_many_tensors_anywhere_are_checked_against_every_one_they_may_touch(
    drawn, copy_first
) -> None:
    # Windows (column slices) are looked up by where they start and the longest one's span,
    # not scanned: made out of file order, long beside short, the answers are the byte sets'.
    claims = Claims()
    held: set[int] = set()
    for (base, cols, itemsize, box), copy in zip(drawn, copy_first):
        fp, mine, piece = _box(base, cols, itemsize, box)
        free = held.isdisjoint(mine)
        assert claims.clean(fp) == free
        if copy:
            with claims.copying([fp]) as ok:
                assert ok == free
            continue
        assert claims.claim(*piece) == free
        if free:
            held |= mine
    for base, cols, itemsize, box in drawn:
        fp, mine, _ = _box(base, cols, itemsize, box)
        assert claims.clean(fp) == held.isdisjoint(mine)
