"""The integer planner against torch: ``torch.chunk`` is the oracle for boxes, ``torch.cat`` for
reassembly; no files involved."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from helpers import chunk_of, expected, same_bits
from hypothesis import example, given
from hypothesis import strategies as st

import lazyckpt
from lazyckpt.plan import (
    Box,
    Piece,
    PlanError,
    check_tiling,
    chunk_bounds,
    concat_order,
    contiguous_runs,
    intersect,
    mesh_box,
    plan_pieces,
    plan_stitch,
    target_box,
)


@given(n=st.integers(0, 200), parts=st.integers(1, 17))
def test_chunk_bounds_is_torch_chunk(n: int, parts: int) -> None:
    t = torch.arange(n)
    for i in range(parts):
        start, stop = chunk_bounds(n, parts, i)
        assert torch.equal(t[start:stop], chunk_of(t, parts, 0, i))
    # Every element lands in exactly one chunk, in order.
    bounds = [chunk_bounds(n, parts, i) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def test_chunk_bounds_uneven_vocab() -> None:
    sizes = [b - a for a, b in (chunk_bounds(30522, 8, i) for i in range(8))]
    assert sizes == [3816] * 7 + [3810]
    assert chunk_bounds(5, 4, 3) == (5, 5)  # torch.chunk makes 3 chunks; rank 3 gets none


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple)


@st.composite
def layouts(draw: st.DrawFn) -> lazyckpt.Layout:
    tp = draw(st.integers(1, 6))
    dp = draw(st.integers(1, 6))
    return lazyckpt.Layout(
        tp_size=tp, tp_rank=draw(st.integers(0, tp - 1)),
        dp_size=dp, dp_rank=draw(st.integers(0, dp - 1)),
    )


@given(shape=shapes, layout=layouts(), data=st.data())
def test_target_box_is_chunk_of_chunk(shape: tuple[int, ...], layout: lazyckpt.Layout,
                                      data: st.DataObject) -> None:
    dim = data.draw(st.none() | st.integers(0, len(shape) - 1)) if shape else None
    full = torch.arange(torch.Size(shape).numel()).reshape(shape) if shape else torch.tensor(7)
    box = target_box(shape, dim, layout.tp_size, layout.tp_rank, layout.dp_size, layout.dp_rank)
    want = expected(full, dim, layout)
    got = full[box.slices()] if shape else full
    assert got.shape == want.shape and torch.equal(got, want)


@st.composite
def meshes(draw: st.DrawFn) -> tuple[tuple[int, ...], list[int], list[int], list[int | None]]:
    """A shape, a mesh, a rank's coordinate in it and the dim each mesh dim shards."""
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    mesh = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    coordinate = [draw(st.integers(0, n - 1)) for n in mesh]
    dims = [draw(st.none() | st.integers(-len(shape), len(shape) - 1)) for _ in mesh]
    return shape, mesh, coordinate, dims


@given(case=meshes())
@example(case=((3,), [3, 2], [0, 1], [0, 0]))  # a shard emptied by the second mesh dim
def test_mesh_box_is_dtensor_shard(
    case: tuple[tuple[int, ...], list[int], list[int], list[int | None]],
) -> None:
    """``mesh_box`` is the box DTensor gives: the ``torch.chunk`` of the ``torch.chunk`` of a
    real tensor, and exactly torch's own ``(local shape, global offset)``, empty shards included."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape, mesh, coordinate, dims = case
    box = mesh_box(shape, mesh, coordinate, dims)

    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    want = full
    for parts, index, dim in zip(mesh, coordinate, dims):
        if dim is not None:
            pieces = torch.chunk(want, parts, dim) if want.shape[dim] else ()
            want = pieces[index] if index < len(pieces) else want.narrow(dim, 0, 0)
    assert torch.equal(full[box.slices()], want)
    placements = [Replicate() if d is None else Shard(d % len(shape)) for d in dims]
    sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh, coordinate, placements)
    assert (box.sizes, box.offsets) == (tuple(sizes), tuple(offsets))


@given(
    rows=st.integers(0, 40),
    cols=st.integers(1, 3),
    dp=st.integers(1, 4),
    tp=st.integers(1, 4),
    tp_first=st.booleans(),
)
@example(rows=27, cols=1, dp=3, tp=4, tp_first=False)  # torch's own function is off here
def test_fsdp2_over_tp_box_is_the_chunk_of_the_tp_chunk(
    rows: int, cols: int, dp: int, tp: int, tp_first: bool
) -> None:
    """FSDP2 over TP on dim 0 (``_StridedShard(0, split_factor=tp)`` on the DP mesh dim, then
    TP's ``Shard(0)``): each rank holds ``chunk(chunk(full, tp)[t], dp)[d]``, FSDP2's own layout."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from lazyckpt.model_load import _mesh_plan

    full = torch.arange(rows * cols).reshape(rows, cols)
    if tp_first:  # mesh (tp, dp): plain Shard on both, applied in mesh order
        placements, sizes = [Shard(0), Shard(0)], (tp, dp)
    else:
        placements, sizes = [_StridedShard(0, split_factor=tp), Shard(0)], (dp, tp)
    plan = _mesh_plan("w", placements, sizes)
    assert plan is not None
    for d in range(dp):
        for t in range(tp):
            coordinate = (t, d) if tp_first else (d, t)
            box = mesh_box(full.shape, sizes, coordinate, *plan)
            tp_part = chunk_of(full, tp, 0, t)
            assert torch.equal(full[box.slices()], chunk_of(tp_part, dp, 0, d)), (d, t, box)
    # What the plan does not model is left to torch; Partial is refused.
    assert _mesh_plan("w", [_StridedShard(0, split_factor=tp + 1), Shard(0)], (dp, tp)) is None
    from torch.distributed.tensor import Partial

    with pytest.raises(ValueError, match="Partial"):
        _mesh_plan("w", [Partial(), Replicate()], (dp, tp))


@st.composite
def grids(draw: st.DrawFn) -> tuple[torch.Tensor, int | None, list[list[torch.Tensor]]]:
    """A full tensor cut into an uneven [tp][dp] grid the way model-parallel sources store it."""
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(0, 7)) for _ in range(ndim)]
    dim = draw(st.none() | st.integers(0, ndim - 1))
    tp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 3))
    full = torch.randn(shape) if draw(st.booleans()) else torch.arange(
        torch.Size(shape).numel(), dtype=torch.int64
    ).reshape(shape)

    def cuts(n: int, parts: int) -> list[int]:
        points = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
        edges = [0, *points, n]
        return [b - a for a, b in itertools.pairwise(edges)]

    tp_parts = [full] * tp if dim is None else list(torch.split(full, cuts(shape[dim], tp), dim))
    grid = [list(torch.split(p, cuts(p.shape[0], dp), 0)) for p in tp_parts]
    return full, dim, grid


@given(case=grids(), layout=layouts())
def test_reshard_tensor_matches_oracle(case: tuple[torch.Tensor, int | None, list[list[torch.Tensor]]],
                                       layout: lazyckpt.Layout) -> None:
    full, dim, grid = case
    dims = {} if dim is None else {"k": dim}
    got = lazyckpt.reshard_tensor(
        "k", grid, (len(grid), len(grid[0])), (layout.tp_size, layout.dp_size),
        (layout.tp_rank, layout.dp_rank), dims,
    )
    # Oracle: torch.cat of the sources, then torch.chunk.
    rows = [torch.cat(row, 0) for row in grid]
    rebuilt = rows[0] if dim is None else torch.cat(rows, dim)
    assert same_bits(rebuilt, full)
    assert same_bits(got, expected(full, dim, layout))


def test_reshard_tensor_fairseq2_example() -> None:
    full = torch.arange(8 * 3).reshape(8, 3)
    splits = [[full[:4]], [full[4:]]]
    got = lazyckpt.reshard_tensor("model.weight", splits, (2, 1), (4, 1), (2, 0), {"model.weight": 0})
    assert torch.equal(got, full[4:6])


def test_reshard_tensor_uneven_never_drops_rows() -> None:
    full = torch.arange(30522 * 2).reshape(30522, 2)
    splits = [[p] for p in torch.chunk(full, 4, 0)]
    parts = [lazyckpt.reshard_tensor("e", splits, (4, 1), (8, 1), (r, 0), {"e": 0}) for r in range(8)]
    assert torch.equal(torch.cat(parts), full)
    assert [p.shape[0] for p in parts] == [3816] * 7 + [3810]


def test_reshard_tensor_rejects_bad_input() -> None:
    t = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="source_splits must be a 2 x 1 grid"):
        lazyckpt.reshard_tensor("k", [[t]], (2, 1), (1, 1), (0, 0), {"k": 0})
    with pytest.raises(ValueError, match="tp_rank"):
        lazyckpt.reshard_tensor("k", [[t]], (1, 1), (2, 1), (2, 0), {"k": 0})
    with pytest.raises(ValueError, match="off the shard dim"):
        lazyckpt.reshard_tensor("k", [[t], [torch.zeros(4, 3)]], (2, 1), (1, 1), (0, 0), {"k": 0})
    with pytest.raises(ValueError, match="add it to shard_dims"):
        lazyckpt.reshard_tensor("k", [[t], [torch.zeros(2, 4)]], (2, 1), (1, 1), (0, 0), {})
    with pytest.raises(ValueError, match="out of range"):
        lazyckpt.reshard_tensor("k", [[t]], (1, 1), (1, 1), (0, 0), {"k": 2})
    # Dims that are not ints: a raw TypeError, a slicing error, and True taken as dim 1.
    for dim in ("0", 0.0, True):
        with pytest.raises(ValueError, match=r"shard_dims\['k'\] must be an int"):
            lazyckpt.reshard_tensor("k", [[t], [t]], (2, 1), (1, 1), (0, 0), {"k": dim})
    with pytest.raises(TypeError, match=r"source_splits\[0\]\[0\] is a torch.sparse_coo tensor"):
        lazyckpt.reshard_tensor("k", [[t.to_sparse()]], (1, 1), (1, 1), (0, 0), {})


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple), data=st.data())
def test_check_tiling_accepts_exact_grids_and_rejects_damage(shape: tuple[int, ...],
                                                              data: st.DataObject) -> None:
    # A grid of boxes from per-dim cuts tiles the shape.
    cuts = []
    for n in shape:
        points = sorted(set(data.draw(st.lists(st.integers(1, n), max_size=3))) - {n})
        edges = [0, *points, n]
        cuts.append(list(itertools.pairwise(edges)))
    boxes = [
        Box(tuple(a for a, _ in combo), tuple(b - a for a, b in combo))
        for combo in itertools.product(*cuts)
    ]
    check_tiling(shape, boxes)
    if len(boxes) > 1:
        with pytest.raises(PlanError, match="missing"):
            check_tiling(shape, boxes[1:])
        with pytest.raises(PlanError, match="overlap"):
            check_tiling(shape, [*boxes, boxes[0]])
    grown = Box(boxes[0].offsets, tuple(s + 1 for s in boxes[0].sizes))
    with pytest.raises(PlanError):
        check_tiling(shape, [grown, *boxes[1:]])


def test_plan_pieces_cover_box_exactly() -> None:
    chunks = [Box((0, 0), (3, 4)), Box((3, 0), (5, 4))]
    box = Box((2, 1), (4, 2))
    pieces = plan_pieces(box, chunks)
    assert [(p.chunk, p.src_offsets, p.dst_offsets, p.sizes) for p in pieces] == [
        (0, (2, 1), (0, 0), (1, 2)),
        (1, (0, 1), (1, 0), (3, 2)),
    ]
    assert intersect(Box((0,), (2,)), Box((2,), (2,))) is None
    assert plan_pieces(Box((0, 0), (0, 4)), chunks) == []


@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    data=st.data(),
)
def test_concat_order_joins_the_pieces_back_into_the_box(
    shape: tuple[int, ...], data: st.DataObject
) -> None:
    # Chunks split along up to two dims; the box is a sub-box of the tensor. Wherever
    # concat_order answers, the pieces' source elements joined in its order along its dim are
    # the box (brute force on an arange tensor); it answers for every split along one dim.
    full = torch.arange(math.prod(shape)).view(shape)
    cuts = []
    for n in shape:
        k = data.draw(st.integers(1, n))
        cuts.append(
            sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=k - 1)) if n > 1 else [])
        )
    split_dims = [d for d, c in enumerate(cuts) if c]
    one_dim = data.draw(st.booleans())
    if one_dim and len(split_dims) > 1:  # keep one split dim in half of the cases
        for d in split_dims[1:]:
            cuts[d] = []
    chunks = [
        Box(tuple(o for o, _ in corner), tuple(n for _, n in corner))
        for corner in itertools.product(
            *[[(a, b - a) for a, b in zip([0, *c], [*c, n])] for c, n in zip(cuts, shape)]
        )
    ]
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    box = Box(offsets, tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets)))
    pieces = plan_pieces(box, chunks)
    pieces = data.draw(st.permutations(pieces))
    found = concat_order(pieces, box.sizes)
    along = [d for d in range(len(shape)) if any(p.sizes[d] != box.sizes[d] for p in pieces)]
    if len(pieces) < 2 or len(along) != 1:
        assert found is None
        return
    assert found is not None and found[0] == along[0]
    dim, order = found
    parts = []
    for i in order:
        p, c = pieces[i], chunks[pieces[i].chunk]
        parts.append(
            full[Box(tuple(a + b for a, b in zip(c.offsets, p.src_offsets)), p.sizes).slices()]
        )
    assert torch.equal(torch.cat(parts, dim=dim), full[box.slices()])


def test_concat_order_refuses_gaps_and_partial_pieces() -> None:
    a = Piece(0, (0, 0), (0, 0), (4, 2))
    b = Piece(1, (0, 0), (0, 2), (4, 3))
    assert concat_order([b, a], (4, 5)) == (1, [1, 0])
    assert concat_order([a, b], (4, 6)) is None  # a column is missing
    assert concat_order([a, Piece(1, (0, 0), (0, 3), (4, 2))], (4, 5)) is None  # a gap
    assert concat_order([a, Piece(1, (0, 0), (1, 2), (3, 3))], (4, 5)) is None  # short rows
    assert concat_order([a], (4, 2)) is None
    assert concat_order([a, Piece(1, (0, 0), (0, 2), (4, 0)), b], (4, 5)) is None  # empty


def test_contiguous_runs_merge_trailing_dims() -> None:
    # Rows of a dim-1 shard: 4 runs of 3 elements.
    runs = contiguous_runs((4, 3), (12, 1), (3, 1))
    assert (runs.length, runs.count) == (3, 4)
    assert runs.offsets() == [(0, 0), (12, 3), (24, 6), (36, 9)]
    # A dim-0 shard is one run.
    runs = contiguous_runs((4, 12), (12, 1), (12, 1))
    assert (runs.length, runs.count) == (48, 1)
    # Size-1 dims never split a run.
    assert contiguous_runs((1, 5, 1), (99, 1, 7), (5, 1, 1)).count == 1


@given(data=st.data(), page=st.sampled_from([8, 64, 4096]), congruent=st.booleans())
def test_stitch_plan_lays_the_runs_back_to_back(
    data: st.DataObject, page: int, congruent: bool
) -> None:
    """Maps (whole pages, page-aligned on both sides) and seam copies rebuild the runs'
    bytes in order, each byte once; runs whose offsets disagree modulo the page are refused."""
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    shift = data.draw(st.integers(0, page - 1))
    lengths = data.draw(st.lists(st.integers(1, 5 * page), min_size=1, max_size=6))
    files, runs, dst = [], [], 0
    for length in lengths:
        if congruent:
            src = dst + shift + page * data.draw(st.integers(0, 3))
        else:
            src = data.draw(st.integers(0, 3 * page))
        files.append(rng.randbytes(src + length + data.draw(st.integers(0, page))))
        runs.append((dst, src, length))
        dst += length
    plan = plan_stitch(runs, page)
    agree = len({(src - d) % page for d, src, _ in runs}) == 1
    if not agree:
        assert plan is None
        return
    assert plan is not None
    assert plan.size % page == 0 and plan.shift == (runs[0][1] - runs[0][0]) % page
    memory, covered = bytearray(plan.size), [0] * plan.size
    for _, at, offset, length in plan.maps:
        assert at % page == 0 and offset % page == 0 and length % page == 0 and length > 0
    for run, at, offset, length in (*plan.maps, *plan.copies):
        memory[at : at + length] = files[run][offset : offset + length]
        for i in range(at, at + length):
            covered[i] += 1
    want = b"".join(files[k][src : src + n] for k, (_, src, n) in enumerate(runs))
    assert bytes(memory[plan.shift : plan.shift + dst]) == want
    assert covered[plan.shift : plan.shift + dst] == [1] * dst
    assert not any(covered[: plan.shift]) and not any(covered[plan.shift + dst :])
    assert plan.mapped_bytes == sum(m[3] for m in plan.maps)


def test_stitch_plan_refuses_runs_that_do_not_tile() -> None:
    assert plan_stitch([(0, 0, 8), (16, 8, 8)], 8) is None  # a gap in the destination
    assert plan_stitch([(0, 0, 0)], 8) is None
    assert plan_stitch([], 8) is None


@given(
    shape=st.lists(st.integers(0, 4), max_size=3).map(tuple),
    ranks=st.integers(1, 4),
    dim=st.one_of(st.none(), st.integers(-4, 3)),
)
def test_assemble_alike_is_assemble_grid_of_a_uniform_grid(
    shape: tuple[int, ...], ranks: int, dim: int | None
) -> None:
    """``assemble_alike`` (one shard per rank, all of one shape: fairscale files of one pickle)
    gives what ``assemble_grid`` gives for that grid, errors included."""
    from lazyckpt.assemble import Cell, assemble_alike, assemble_grid

    datas = [torch.zeros(0) for _ in range(ranks)]
    grid = [[Cell(shape, torch.bfloat16, d, f"rank {r}")] for r, d in enumerate(datas)]

    def outcome(f, *args):  # type: ignore[no-untyped-def]
        try:
            dtype, full, copies = f(*args)
        except ValueError as exc:
            return type(exc), str(exc)
        return dtype, full, [[(c.offsets, c.sizes, id(c.data)) for c in copy] for copy in copies]

    got = outcome(assemble_alike, shape, torch.bfloat16, datas, dim)
    assert got == outcome(assemble_grid, grid, dim)

