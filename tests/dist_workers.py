"""Code that runs in spawned ranks (gloo on the CPU): a tiny Llama-shaped model built from
fairscale's own model-parallel layers or from plain torch layers, and the workers the tests spawn.

Everything here is importable by a spawned child, so it lives at module level.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

DIM, VOCAB, HIDDEN, N_HEADS_DIM, N_KV_DIM, N_LAYERS = 16, 52, 24, 16, 8, 2
TOKENS = torch.tensor([[1, 5, 9, 51, 0, 33]])


# -- spawning --------------------------------------------------------------------------------


def spawn(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined by a gloo group.

    Processes come from a fork server that imported torch once (importing torch costs seconds
    per process here); each child is still a clean process that never ran tensor code.
    """
    mp.set_forkserver_preload(["torch", "torch.distributed", "dist_workers", "lazyckpt"])
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _entry,
            args=(fn, world, os.path.join(d, "pg"), args),
            nprocs=world,
            join=True,
            start_method="forkserver",
        )


def _entry(rank: int, fn: Callable[..., None], world: int, init_file: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


# -- the model -------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Rope(nn.Module):
    """Holds ``rope.freqs``, the replicated buffer of Llama-1 files."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs", torch.linspace(0.1, 1.0, DIM // 2))


def _layers(parallel: bool, llama2: bool) -> dict[str, Callable[..., nn.Module]]:
    if not parallel:
        return {
            "emb": lambda v, d: nn.Embedding(v, d),
            "col": lambda i, o, gather=False: nn.Linear(i, o, bias=False),
            "row": lambda i, o: nn.Linear(i, o, bias=False),
        }
    from fairscale.nn.model_parallel.layers import (
        ColumnParallelLinear,
        ParallelEmbedding,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    init = nn.init.normal_
    emb_cls = ParallelEmbedding if llama2 else VocabParallelEmbedding
    return {
        "emb": lambda v, d: emb_cls(v, d, init_method=init),
        "col": lambda i, o, gather=False: ColumnParallelLinear(
            i, o, bias=False, gather_output=gather, init_method=init
        ),
        "row": lambda i, o: RowParallelLinear(i, o, bias=False, input_is_parallel=True, init_method=init),
    }


class Attention(nn.Module):
    def __init__(self, L: dict[str, Callable[..., nn.Module]]) -> None:
        super().__init__()
        self.wq = L["col"](DIM, N_HEADS_DIM)
        self.wk = L["col"](DIM, N_KV_DIM)  # grouped-query: fewer k/v features than q
        self.wv = L["col"](DIM, N_KV_DIM)
        self.wo = L["row"](N_HEADS_DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        rep = N_HEADS_DIM // N_KV_DIM
        return self.wo(torch.nn.functional.silu(q) * k.repeat_interleave(rep, -1) + v.repeat_interleave(rep, -1))


class FeedForward(nn.Module):
    def __init__(self, L: dict[str, Callable[..., nn.Module]]) -> None:
        super().__init__()
        self.w1 = L["col"](DIM, HIDDEN)
        self.w2 = L["row"](HIDDEN, DIM)
        self.w3 = L["col"](DIM, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, L: dict[str, Callable[..., nn.Module]]) -> None:
        super().__init__()
        self.attention = Attention(L)
        self.feed_forward = FeedForward(L)
        self.attention_norm = RMSNorm(DIM)
        self.ffn_norm = RMSNorm(DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h))
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    """Meta's key names: tok_embeddings, layers.N.attention.wq ..., norm, output, rope.freqs."""

    def __init__(self, *, parallel: bool = False, llama2: bool = False, rope: bool = False) -> None:
        super().__init__()
        L = _layers(parallel, llama2)
        self.tok_embeddings = L["emb"](VOCAB, DIM)
        self.layers = nn.ModuleList(Block(L) for _ in range(N_LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = L["col"](DIM, VOCAB, gather=True)
        self.rope = Rope() if rope else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.rope is not None:
            h = h + self.rope.freqs.sum()
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def randomize_replicas(model: nn.Module) -> None:
    """Give norms (and rope) seeded non-trivial values, identical on every rank."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


# -- workers ---------------------------------------------------------------------------------


def logits_path(folder: Path) -> Path:
    """Where the model-parallel logits of a saved checkpoint go (beside it, not inside it)."""
    return folder.with_name(folder.name + "-logits.pt")


def save_fairscale(rank: int, world: int, out: str, llama2: bool, rope: bool, dtype: str) -> None:
    """Build the model with fairscale MP-``world``, save ``consolidated.NN.pth`` per rank and,
    on rank 0, the model-parallel logits."""
    import fairscale.nn.model_parallel.initialize as fsi

    fsi.initialize_model_parallel(world)
    torch.manual_seed(0)
    model = TinyLlama(parallel=True, llama2=llama2, rope=rope)
    randomize_replicas(model)
    model = model.to(getattr(torch, dtype))
    with torch.no_grad():
        logits = model(TOKENS)
    torch.save(model.state_dict(), Path(out) / f"consolidated.{rank:02d}.pth")
    if rank == 0:
        torch.save(logits, logits_path(Path(out)))
        (Path(out) / "params.json").write_text(json.dumps({"dim": DIM, "n_layers": N_LAYERS}))
    fsi.destroy_model_parallel()


def fairscale_forward_from_lazy_load(rank: int, world: int, src: str, out: str, llama2: bool, rope: bool) -> None:
    """A fairscale MP-``world`` model filled by ``lazy_load`` with its own TP layout."""
    import fairscale.nn.model_parallel.initialize as fsi

    import lazyckpt

    fsi.initialize_model_parallel(world)
    model = TinyLlama(parallel=True, llama2=llama2, rope=rope)
    dims = lazyckpt.get_shard_dims(model)
    opts = lazyckpt.ModelCheckpointLoadOptions(layout=lazyckpt.Layout(tp_size=world, tp_rank=rank))
    state = dict(lazyckpt.get_model_checkpoint_loader().lazy_load(src, dims, opts))
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model(TOKENS)
    if rank == 0:
        torch.save(logits, Path(out) / f"logits-tp{world}.pt")
    fsi.destroy_model_parallel()


def fsdp_forward_from_load_into(rank: int, world: int, src: str, out: str, llama2: bool, rope: bool,
                                meta: bool) -> None:
    """A plain model wrapped with FSDP2 (dim-0 shards on a CPU mesh), filled by ``load_into``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lazyckpt

    mesh = init_device_mesh("cpu", (world,))
    if meta:
        with torch.device("meta"):
            model = TinyLlama(llama2=llama2, rope=rope)
    else:
        model = TinyLlama(llama2=llama2, rope=rope)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if meta:
        model.to_empty(device="cpu")
    stats = lazyckpt.LoadStats()
    report = lazyckpt.load_into(model, src, options=lazyckpt.ModelCheckpointLoadOptions(stats=stats))
    assert not report.missing and not report.unexpected, report
    with torch.no_grad():
        logits = model(TOKENS)
    if rank == 0:
        torch.save(logits, Path(out) / f"logits-fsdp{world}.pt")
    torch.save(dict(stats.bytes_read), Path(out) / f"bytes-read-{rank}.pt")


# -- DTensor models (FSDP2, TP, FSDP2 + TP) ----------------------------------------------------


class OddModel(nn.Module):
    """Shapes that do not divide by 2 or 4, a bias of each kind, a 0-d int buffer and a
    parameter of no elements (FSDP2 holds its shards as ``(0, 0)``, not as the ``(k, 0)`` its
    placements give)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(53, 6)
        self.up = nn.Linear(6, 7)
        self.down = nn.Linear(7, 5)
        self.norm = nn.LayerNorm(5)
        self.empty = nn.Parameter(torch.empty(4, 0))
        self.register_buffer("steps", torch.tensor(3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(self.embed(tokens)))))


ODD_TP_DIMS = {"embed.weight": 0, "up.weight": 0, "up.bias": 0, "down.weight": 1}


def odd_model_truth() -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    model = OddModel()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-1, 1)
    return {k: v.clone() for k, v in model.state_dict().items()}


def build_odd(
    kind: str, world: int, *, meta: bool = False, init: dict[str, torch.Tensor] | None = None
) -> tuple[nn.Module, Any]:
    """``OddModel`` parallelized with torch's own APIs: ``fsdp2`` (1-D), ``tp`` (1-D) or ``2d``
    (``dp`` x ``tp`` mesh, TP first, then FSDP2 over the DP dim)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if meta:
        with torch.device("meta"):
            model = OddModel()
    else:
        torch.manual_seed(99)  # other values than the truth: loading must overwrite them
        model = OddModel()
        if init is not None:
            model.load_state_dict(init)
    plan = {"embed": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    if kind == "fsdp2":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        fully_shard(model, mesh=mesh)
    elif kind == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, plan)
    elif kind == "2d":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    else:
        raise ValueError(kind)
    if meta:
        model.to_empty(device="cpu")
    return model, mesh


def save_odd_dcp(rank: int, world: int, kind: str, out: str, collectives: bool = True) -> None:
    """``dcp.save`` of ``OddModel``'s state dict from a ``kind`` model holding the truth;
    without ``collectives``, each rank writes the metadata of its own chunks (``__N.metadata``)
    and no ``.metadata``."""
    import torch.distributed.checkpoint as dcp

    model, _ = build_odd(kind, world, init=odd_model_truth())
    dcp.save(model.state_dict(), checkpoint_id=out, use_collectives=collectives)


def save_replicated_rank_local(rank: int, world: int, out: str, keys: tuple[str, ...]) -> None:
    """``dcp.save(use_collectives=False)`` of the same small tensors on every rank (DDP-style
    weights), each ``torch.full((2,), len(keys))``: every rank lists every key."""
    import torch.distributed.checkpoint as dcp

    sd = {k: torch.full((2,), float(len(keys))) for k in keys}
    dcp.save(sd, checkpoint_id=out, use_collectives=False)


def save_odd_hf_pieces(rank: int, world: int, out: str) -> None:
    """``dcp.save`` of an FSDP2 ``OddModel`` through ``HuggingFaceStorageWriter(save_distributed=
    True)``: a safetensors file per rank holding its pieces."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    model, _ = build_odd("fsdp2", world, init=odd_model_truth())
    dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))


def check_load_into(rank: int, world: int, kind: str, src: str, meta: bool) -> None:
    """``load_into`` a ``kind`` model, then every ``full_tensor()`` must equal the truth; and
    ``lazy_load`` with the model's mesh must yield DTensors that agree too."""
    import lazyckpt

    truth = odd_model_truth()
    model, mesh = build_odd(kind, world, meta=meta)
    dims = lazyckpt.get_shard_dims(model)
    assert dims == ({} if kind == "fsdp2" else ODD_TP_DIMS), dims
    stats = lazyckpt.LoadStats()
    report = lazyckpt.load_into(model, src, options=lazyckpt.ModelCheckpointLoadOptions(stats=stats))
    assert not report.missing and not report.unexpected, report
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.numel() == 0:  # full_tensor() fails on FSDP2's (0, 0) shards of a (4, 0) tensor
            assert t.shape == truth[name].shape and t.dtype == truth[name].dtype, (kind, name)
            continue
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        assert full.dtype == truth[name].dtype and torch.equal(full, truth[name]), (kind, name)
    # Each rank read its own bytes, not the whole checkpoint.
    if world > 1 and kind != "tp":
        total = sum(v.nbytes for v in truth.values())
        assert stats.bytes_delivered < total, (stats.bytes_delivered, total)
    opts = lazyckpt.ModelCheckpointLoadOptions(mesh=mesh)
    for name, t in lazyckpt.get_model_checkpoint_loader().lazy_load(src, dims, opts):
        if t.numel() == 0:
            assert t.shape == truth[name].shape, ("lazy_load mesh", kind, name)
            continue
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        assert torch.equal(full, truth[name]), ("lazy_load mesh", kind, name)


def check_load_into_matches_torch_sharding(rank: int, world: int, kind: str, src: str) -> None:
    """What ``load_into`` writes into each local shard is what torch's own parallelize_module
    and fully_shard put there when they shard a model that already holds the truth."""
    import lazyckpt

    truth = odd_model_truth()
    reference, _ = build_odd(kind, world, init=truth)
    model, _ = build_odd(kind, world)
    lazyckpt.load_into(model, src)
    want, got = reference.state_dict(), model.state_dict()
    for name in truth:
        w, g = want[name], got[name]
        w = w.to_local() if hasattr(w, "to_local") else w
        g = g.to_local() if hasattr(g, "to_local") else g
        assert w.shape == g.shape and torch.equal(w, g), (rank, name, w, g)


def check_load_into_unsharded(rank: int, world: int, kind: str, src: str) -> None:
    """A ``kind`` FSDP2 model holding its parameters unsharded (``fsdp2``: after a forward,
    since a root does not reshard after forward by default; ``2d``: after ``unshard()``):
    ``load_into`` must fill the sharded parameters, as ``load_state_dict`` does, so that the
    state dict and the next forward see the checkpoint."""
    import lazyckpt

    truth = odd_model_truth()
    model, _ = build_odd(kind, world)
    tokens = torch.tensor([[1, 52, 7, 30]])
    sharded = model.up.weight
    if kind == "fsdp2":
        with torch.no_grad():
            model(tokens)
    else:
        model.unshard()  # type: ignore[operator]  # an FSDPModule method
    assert model.up.weight is not sharded, "the set-up left the parameters sharded"
    lazyckpt.load_into(model, src)
    for name, t in model.state_dict().items():
        if t.numel() == 0:  # full_tensor() fails on FSDP2's (0, 0) shards of a (4, 0) tensor
            continue
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        assert torch.equal(full, truth[name]), (rank, kind, name)
    if kind == "fsdp2":
        reference = OddModel()
        reference.load_state_dict(truth)
        with torch.no_grad():
            got, want = model(tokens), reference(tokens)
        assert torch.allclose(got, want, atol=1e-6), (rank, got, want)


def check_layout_helpers(rank: int, world: int) -> None:
    """``Layout.from_mesh`` and ``Layout.from_groups`` on a real (dp=2, tp=2) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    import lazyckpt

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    want = lazyckpt.Layout(tp_size=2, tp_rank=rank % 2, dp_size=2, dp_rank=rank // 2)
    assert lazyckpt.Layout.from_mesh(mesh) == want
    assert lazyckpt.Layout.from_mesh(mesh, tp_dim=1, dp_dim=0) == want
    # A dim left out is found by its name, whichever the other is given (not size 1: a DP
    # rank would load the whole TP chunk); given as the other's named dim, refused.
    for given in ({"tp_dim": "tp"}, {"dp_dim": "dp"}, {"tp_dim": 1}, {"dp_dim": 0}):
        assert lazyckpt.Layout.from_mesh(mesh, **given) == want, given
    assert lazyckpt.Layout.from_mesh(mesh["tp"]) == lazyckpt.Layout(tp_size=2, tp_rank=rank % 2)
    for bad in (True, 1.0, None):  # True is no mesh dim 1; None alone is refused below
        try:
            lazyckpt.Layout.from_mesh(mesh, tp_dim=bad, dp_dim=None if bad is not None else 0.5)
        except ValueError as exc:
            assert "must be a mesh dim name or index" in str(exc), exc
        else:
            raise AssertionError(f"tp_dim={bad!r} must be refused")
    for tp_dim, dp_dim in (("tp", "tp"), (1, "tp"), (0, 0), (0, None), (None, 1)):
        # half the (tp, dp) boxes unread
        try:
            lazyckpt.Layout.from_mesh(mesh, tp_dim=tp_dim, dp_dim=dp_dim)
        except ValueError as exc:
            assert "are one mesh dim" in str(exc), exc
        else:
            raise AssertionError(f"tp_dim={tp_dim!r}, dp_dim={dp_dim!r} must be refused")
    assert lazyckpt.Layout.from_groups(
        tp_group=mesh.get_group("tp"), dp_group=mesh.get_group("dp")
    ) == want
    assert lazyckpt.Layout.from_groups(tp_group=mesh.get_group("tp")) == lazyckpt.Layout(
        tp_size=2, tp_rank=rank % 2
    )
    flat = init_device_mesh("cpu", (world,))
    try:
        lazyckpt.Layout.from_mesh(flat)
    except ValueError as exc:
        assert "pass tp_dim" in str(exc)
    else:
        raise AssertionError("an unnamed 1-D mesh must be refused")
    assert lazyckpt.Layout.from_mesh(flat, dp_dim=0) == lazyckpt.Layout(dp_size=world, dp_rank=rank)
    # Through options, from_mesh's tp_dim=/dp_dim= cannot be passed: the fix is naming the dims.
    try:
        lazyckpt.ModelCheckpointLoadOptions(mesh=flat).target_layout()
    except ValueError as exc:
        assert "mesh_dim_names=" in str(exc) and "pass tp_dim" not in str(exc), exc
    else:
        raise AssertionError("options.mesh with unnamed dims must be refused")
    # A dim of size > 1 that no name accounts for beside one that is named was taken for a
    # replica dim: each rank along it held the whole of what a cut gives them together.
    odd = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "model"))
    for call in (
        lambda: lazyckpt.Layout.from_mesh(odd),
        lambda: lazyckpt.ModelCheckpointLoadOptions(mesh=odd).target_layout(),
    ):
        try:
            call()
        except ValueError as exc:
            assert "dim 'model' (size 2) is not named as TP" in str(exc), exc
        else:
            raise AssertionError("a mesh dim of size 2 named 'model' must be refused")
    assert lazyckpt.Layout.from_mesh(odd, tp_dim="model") == want  # spelled out: taken
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # copies
    assert lazyckpt.ModelCheckpointLoadOptions(mesh=hsdp).target_layout() == lazyckpt.Layout(
        dp_size=2, dp_rank=rank % 2
    )
    staged = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))  # stages hold other keys
    assert lazyckpt.Layout.from_mesh(staged) == lazyckpt.Layout(tp_size=2, tp_rank=rank % 2)
    experts = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    try:
        lazyckpt.ModelCheckpointLoadOptions(mesh=experts).target_layout()
    except ValueError as exc:
        assert "dim 'ep' (size 2)" in str(exc) and "mesh[('tp',)]" in str(exc), exc
    else:
        raise AssertionError("an ep dim must be refused")
    twice = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard"))
    try:
        lazyckpt.Layout.from_mesh(twice)
    except ValueError as exc:
        assert "dims 'dp' and 'shard' (size 2) both name FSDP's dim" in str(exc), exc
    else:
        raise AssertionError("two FSDP-named dims must be refused")
    # A Shard on a size-1 dim cuts nothing: not refused.
    thin = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "model"))
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    lone = nn.Module()
    lone.weight = nn.Parameter(distribute_tensor(torch.ones(8, 2), thin, [Replicate(), Shard(0)]))
    assert lazyckpt.get_shard_dims(lone) == {}
    # get_shard_dims read {} off a TP model on such a mesh (FSDP2 over TP on ("dp", "model")).
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = parallelize_module(nn.Sequential(nn.Linear(4, 4)), odd["model"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=odd["dp"])
    try:
        lazyckpt.get_shard_dims(model)
    except ValueError as exc:
        assert "is Shard(dim=0) on mesh dim 'model', which is not named as TP" in str(exc), exc
    else:
        raise AssertionError("get_shard_dims must refuse a TP dim it cannot tell by name")


def check_load_into_empty_tp_shard(rank: int, world: int, src: str) -> None:
    """``nn.Linear(1, 4)`` row-parallel over TP-2 gives TP rank 1 a ``(4, 0)`` shard, which
    FSDP2 over DP-2 then holds as ``(0, 0)``: ``load_into`` fills every rank as torch shards the
    truth (the non-empty shards hold their column, the empty ones are left empty)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    import lazyckpt

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build(init: dict[str, torch.Tensor] | None) -> nn.Module:
        model = nn.Sequential(nn.Linear(1, 4, bias=False))
        if init is not None:
            model.load_state_dict(init)
        parallelize_module(model, mesh["tp"], {"0": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model

    truth = torch.load(src, weights_only=True)
    want = build(truth)[0].weight.to_local()
    model = build(None)
    lazyckpt.load_into(model, src)
    got = model[0].weight.to_local()
    assert got.shape == want.shape and torch.equal(got, want), (rank, got, want)


def check_load_into_a_mesh_without_this_rank(rank: int, world: int, src: str) -> None:
    """A parameter on a mesh of ranks 0 and 1 only (a pipeline stage's): those ranks get their
    shards, the others hold none and read nothing (they raised a malformed-box error)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import lazyckpt

    truth = torch.load(src, weights_only=True)["w"]
    model = nn.Module()
    model.w = nn.Parameter(distribute_tensor(torch.zeros(5, 3), DeviceMesh("cpu", [0, 1]), [Shard(0)]))
    report = lazyckpt.load_into(model, src)
    assert report.loaded == ["w"], report
    want = torch.chunk(truth, 2, 0)[rank] if rank < 2 else torch.empty(0)
    got = model.w.to_local()
    assert got.numel() == want.numel() and torch.equal(got.reshape(want.shape), want), (rank, got)
