"""``load_into``: fill a model's parameters and buffers in place, from any supported source.

Each target tensor says what it needs: a plain tensor its whole box, a DTensor (FSDP2, TP,
FSDP2 + TP) the box of its local shard, computed from its mesh and placements. The planner reads
exactly that box from the source and the reader copies it straight into the tensor's storage: no
full tensor is built, no collective runs, each rank reads only its own bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lazyckpt import alloc
from lazyckpt.build import PinnedPool, fill_all, output_dtype, same_bits
from lazyckpt.claims import Footprint, footprint, overlap
from lazyckpt.errors import ModelCheckpointError, warn
from lazyckpt.gcpause import gc_paused
from lazyckpt.imported import fsdp_module_class, is_dtensor
from lazyckpt.index import CheckpointIndex, FileRegion, TensorEntry
from lazyckpt.layout import Layout
from lazyckpt.load_plan import TensorPlan, entry_path, plan_entry, plan_load
from lazyckpt.loaders import detect_loader
from lazyckpt.options import (
    ModelCheckpointLoadOptions,
    apply_key_map,
    convertible,
    options_or_default,
)
from lazyckpt.plan import Box, mesh_box, repeats_elements, span
from lazyckpt.read import Reader
from lazyckpt.state_names import model_keys
from lazyckpt.stats import LoadStats, byte_bar

__all__ = ["KeyMismatchError", "LoadReport", "load_into"]


@dataclass
class LoadReport:
    """What ``load_into`` did."""

    loaded: list[str] = field(default_factory=list)
    """Model keys filled from the checkpoint, in checkpoint order."""
    missing: list[str] = field(default_factory=list)
    """Model keys the checkpoint lacks (left as they were; still on meta for a meta model)."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint keys (after ``key_map``) the model lacks; never read."""
    tied: list[str] = field(default_factory=list)
    """Model keys filled through a loaded key they share storage with: keys the checkpoint
    lacks, and keys it holds beside another key of the same tensor that comes later in the
    model's state dict (that one is loaded, as ``load_state_dict`` leaves it; the others are
    not read)."""
    shard_dims: dict[str, int] = field(default_factory=dict)
    """The source shard dims used (given, or inferred from shapes)."""
    stats: LoadStats = field(default_factory=LoadStats)

    @property
    def bytes_read(self) -> int:
        return self.stats.total_bytes_read

    def __str__(self) -> str:
        return (
            f"loaded {len(self.loaded)} keys ({len(self.tied)} more through ties), "
            f"{len(self.missing)} missing, {len(self.unexpected)} unexpected; {self.stats.summary()}"
        )


class KeyMismatchError(ModelCheckpointError):
    """The model and the checkpoint disagree on shapes or on dtypes torch cannot convert
    between, or (``strict``) on keys."""

    def __init__(self, message: str, report: LoadReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class _Target:
    """One state-dict key of the model: the tensor and every (module, attribute) holding it."""

    tensor: torch.Tensor
    owners: list[tuple[nn.Module, str, bool]]

    # Cached: asked several times per key before the first read, and a DTensor's shape costs
    # microseconds a call (more in a fresh process).
    @functools.cached_property
    def is_dtensor(self) -> bool:
        return is_dtensor(self.tensor)

    @functools.cached_property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @functools.cached_property
    def memory(self) -> object:
        """What makes two keys one tensor for ties: the same tensor object, or, on a real
        device, the same view of the same storage (two ``Parameter``s made over one tensor),
        which two parallel writes would tear."""
        t = self.tensor
        if self.is_dtensor or t.is_meta or t.numel() == 0:
            return id(t)
        return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


def _reshard_fsdp(model: nn.Module) -> None:
    """Put FSDP2 modules holding their parameters unsharded back on their sharded ones, as
    ``load_state_dict``'s pre-hook does. A root module is left unsharded after every forward
    (``reshard_after_forward`` is False for it by default), and ``unshard()`` leaves any so: the
    module then holds all-gathered copies, and what is written into them is lost at the next
    reshard while the sharded parameters keep their old values."""
    cls = fsdp_module_class()
    if cls is None:
        return
    for module in model.modules():
        if isinstance(module, cls):
            module.reshard()  # type: ignore[operator]  # an FSDPModule method


def _targets(model: nn.Module) -> tuple[dict[str, _Target], dict[str, nn.Module]]:
    """The model's state-dict keys (parameters and persistent buffers), ties included, and
    the keys of its modules' extra state, under the names its state dict gives them
    (:mod:`lazyckpt.state_names`)."""
    keys = model_keys(model)
    out: dict[str, _Target] = {}
    for path, module, attr, t, is_param in keys.tensors:
        key = keys.key(path)
        _refuse_lazy(key, t)
        out.setdefault(key, _Target(t, [])).owners.append((module, attr, is_param))
    return out, {keys.key(path): module for path, module in keys.extras.items()}


def _refuse_lazy(key: str, t: torch.Tensor) -> None:
    """A lazy module's parameter has no shape until its first forward: nothing to plan for."""
    if nn.parameter.is_lazy(t):
        raise ValueError(
            f"{key!r} is an uninitialized parameter of a lazy module (nn.LazyLinear and the "
            "like): run one forward pass (or build the module with its sizes) before load_into"
        )


def _local(t: Any) -> torch.Tensor:
    """A DTensor's local shard, sharing its storage (without an autograd node per call)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


def _box(name: str, target: _Target, cache: dict[tuple[Any, ...], Box]) -> Box:
    """The box of the global tensor that this process holds for ``target``.

    For ``Shard``/``Replicate`` placements, and FSDP2's ``_StridedShard`` over TP on the same
    dim, it is worked out by :func:`mesh_box`; other placements ask torch's
    ``compute_local_shape_and_global_offset``, and a rank outside the mesh holds nothing. The
    box is cached by (shape, mesh, placements): layers repeat them, and working a box out costs
    ~10 us, a millisecond for a model's keys. ``Partial`` holds partial sums, which no box of
    the checkpoint gives: refused."""
    shape = target.global_shape
    if not target.is_dtensor:
        return Box((0,) * len(shape), shape)
    t: Any = target.tensor
    mesh, placements = _mesh_and_placements(t)
    cache_key = (shape, mesh, placements)
    box = cache.get(cache_key)
    if box is None:
        plan = _mesh_plan(name, placements, tuple(mesh.shape))
        coordinate = mesh.get_coordinate()
        if coordinate is None:  # a mesh without this rank (another pipeline stage's): no shard
            box = Box((0,) * len(shape), (0,) * len(shape))
        elif plan is not None:
            box = mesh_box(shape, mesh.shape, coordinate, *plan)
        else:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
            box = Box(tuple(offset), tuple(local_shape))
        cache[cache_key] = box
    local = _local(t)
    # A shard of no elements may be held in any empty shape: FSDP2 keeps a (4, 0) parameter's
    # shards as (0, 0), where the placements give (2, 0). Nothing is read into it.
    if tuple(local.shape) != box.sizes and (local.numel() or box.numel):
        raise ValueError(
            f"{name}: the DTensor's local shard has shape {tuple(local.shape)} but its placements "
            f"{t.placements} give {box.sizes}"
        )
    return box


def _mesh_and_placements(t: Any) -> tuple[Any, tuple[Any, ...]]:
    """A DTensor's mesh and placements, from its spec where it has one: the public properties
    cost ~2 us each a call (~0.3 ms for a model's keys), the spec's fields a tenth of that."""
    spec = getattr(t, "_spec", None)
    mesh = getattr(spec, "mesh", None)
    placements = getattr(spec, "placements", None)
    if mesh is None or not isinstance(placements, tuple):
        return t.device_mesh, tuple(t.placements)
    return mesh, placements


def _mesh_plan(
    name: str, placements: Sequence[Any], mesh_sizes: tuple[int, ...]
) -> tuple[list[int | None], list[int]] | None:
    """For :func:`mesh_box`: the tensor dim each mesh dim shards (``None`` where it
    replicates) and the order the mesh dims cut in; None for placements it does not model.

    FSDP2 over TP on the same dim puts ``_StridedShard(d, split_factor=tp)`` on the DP mesh
    dim before TP's ``Shard(d)``: FSDP2 chunks TP's local shard, so TP cuts first. torch's
    ``compute_local_shape_and_global_offset`` applies the mesh dims in order and places the
    rows elsewhere when sizes do not divide (27 rows over dp 3 x tp 4)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    dims: list[int | None] = []
    strided: list[tuple[int, int]] = []
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(
                f"{name}: its DTensor is Partial ({p}) on mesh dim {i}: its local shards add up "
                "to the value, which no piece of the checkpoint gives; redistribute it to "
                "Replicate() before load_into"
            )
        if type(p) is Shard:
            dims.append(p.dim)
        elif isinstance(p, Replicate):
            dims.append(None)
        elif isinstance(getattr(p, "split_factor", None), int) and isinstance(p.dim, int):
            dims.append(p.dim)  # _StridedShard (a Shard subclass in some torch versions)
            strided.append((i, p.split_factor))
        else:
            return None
    order = list(range(len(dims)))
    for i, factor in strided:
        later = [j for j in range(i + 1, len(dims)) if dims[j] == dims[i]]
        if not later or any(j == k for j in later for k, _ in strided):
            return None
        if math.prod(mesh_sizes[j] for j in later) != factor:
            return None
        order.remove(i)
        order.insert(order.index(later[-1]) + 1, i)
    return dims, order


def infer_shard_dim(
    key: str, per_rank: Sequence[tuple[int, ...]], want: tuple[int, ...]
) -> int | None:
    """A key's TP dim, read off the model's full shape and the source's per-rank shapes.

    A key whose shards all have the full shape is a replica (``None``). Otherwise exactly one
    dim must add up to the full size with the others equal; anything else is refused.
    """
    if all(s == want for s in per_rank):
        return None
    candidates = [
        d
        for d in range(len(want))
        if all(len(s) == len(want) for s in per_rank)
        and sum(s[d] for s in per_rank) == want[d]
        and all(s[e] == want[e] for s in per_rank for e in range(len(want)) if e != d)
    ]
    if len(candidates) != 1:
        raise ValueError(
            f"cannot infer the shard dim of {key!r}: the model's shape is {want} and the "
            f"source's shards are {list(per_rank)}; pass shard_dims (lazyckpt.get_shard_dims(model) "
            "or a preset from lazyckpt.presets)"
        )
    return candidates[0]


@gc_paused()
def load_into(
    model: nn.Module,
    path: str | os.PathLike[str],
    shard_dims: Mapping[str, int] | None = None,
    options: ModelCheckpointLoadOptions | None = None,
    strict: bool = True,
) -> LoadReport:
    """Fill ``model``'s parameters and persistent buffers from the checkpoint at ``path``.

    Plain tensors are filled in place (cast to their dtype); meta tensors are materialized on
    ``options.device`` (CPU by default); DTensors (FSDP2, TP, FSDP2 + TP) receive the box of
    their local shard, read straight from the source. ``shard_dims`` says how a model-parallel
    source is split; left out, it is inferred from the model's shapes. With ``strict`` a key
    missing on either side raises :class:`KeyMismatchError` before anything is read; shape
    mismatches always do. Each target's own box, dtype and storage decide what it gets (a
    checkpoint tensor is cast to its target's dtype): ``options.layout`` (but ``Layout()``),
    ``mesh`` are refused with a ``ValueError`` before anything is read, rather than ignored, and
    so is a ``dtype`` unless the model comes out as ``lazy_load`` with it would give it (each
    floating-point checkpoint tensor already in it or filling a model tensor of it, a meta one
    made in it); ``contiguous`` and ``prefetch_bytes`` change nothing (no view is handed out,
    nothing is read ahead of its place).
    """
    options = options_or_default(options)
    stats = options.stats if options.stats is not None else LoadStats()
    # The load's time is the whole call: indexing and planning a many-key checkpoint is a good
    # part of it (38% of a 3,000-key MP-8 load), which its GB/s left out.
    with stats.timing(whole=True) as clock:
        return _load_into(model, path, shard_dims, options, strict, stats, clock)


def _load_into(
    model: nn.Module,
    path: str | os.PathLike[str],
    shard_dims: Mapping[str, int] | None,
    options: ModelCheckpointLoadOptions,
    strict: bool,
    stats: LoadStats,
    clock: list[float],
) -> LoadReport:
    _refuse_unused_options(options)
    _reshard_fsdp(model)
    targets, extras = _targets(model)
    # The device only serves meta tensors, which are made there: refused only if it would be.
    meta = any(not t.is_dtensor and t.tensor.is_meta for t in targets.values())
    device = options.usable_device() if meta else options.target_device
    loader = detect_loader(path)
    report = LoadReport(stats=stats)

    # Model-parallel sources do not record how keys are split: without shard_dims, each key's
    # dim is read off the model's full shape while the index is built (one metadata pass).
    inferred: dict[str, int] = {}

    def infer(key: str, per_rank: Sequence[tuple[int, ...]]) -> int | None:
        target = targets.get(key)
        dim = None if target is None else infer_shard_dim(key, per_rank, target.global_shape)
        if dim is not None:
            inferred[key] = dim
        return dim

    given: Mapping[str, int] = {} if shard_dims is None else shard_dims

    unexpected: list[str] = []

    def route(source_key: str) -> str | None:
        key = apply_key_map(options.key_map, source_key)
        if key is not None and key not in targets and key not in extras:
            unexpected.append(key)
            return None
        return key

    index = loader.index(
        path,
        given,
        dataclasses.replace(options, key_map=route),
        infer_shard_dim=infer if shard_dims is None else None,
    )
    shard_dims = {**given, **inferred}
    report.shard_dims = dict(shard_dims)
    report.unexpected = unexpected
    for key in extras:  # a module's extra state: the checkpoint's tensor, whole, made on the CPU
        entry = index.entries.get(key)
        if entry is not None:  # cast as lazy_load casts it
            dtype = output_dtype(entry.dtype, options.dtype)
            targets[key] = _Target(torch.empty(entry.shape, dtype=dtype, device="meta"), [])
    _refuse_other_dtype(options.dtype, index.entries, targets)
    reshaped = [
        key for key, entry in index.entries.items() if entry.shape != targets[key].global_shape
    ]
    if reshaped:
        mismatched = [
            f"{key}: checkpoint {index.entries[key].shape}, model {targets[key].global_shape}"
            for key in reshaped
        ]
        raise KeyMismatchError(
            f"{index.path}: shapes differ between checkpoint and model for "
            f"{len(mismatched)} key(s): "
            + "; ".join(mismatched[:10])
            + _tp_shard_hint(
                {key: (index.entries[key].shape, targets[key]) for key in reshaped}, extras
            ),
            report,
        )
    unconvertible = [
        f"{key}: checkpoint {entry.dtype}, model {targets[key].tensor.dtype}"
        for key, entry in index.entries.items()
        if not convertible(entry.dtype, targets[key].tensor.dtype)
    ]
    if unconvertible:  # else copy_ stops the load halfway, naming no key
        raise KeyMismatchError(
            f"{index.path}: torch cannot convert between the checkpoint's and the model's dtype "
            f"for {len(unconvertible)} key(s): " + "; ".join(unconvertible[:10]) + "; give "
            "the model's tensors the checkpoint's dtype, or drop the keys with options.key_map",
            report,
        )
    _account_keys(report, targets, index.entries)
    report.missing += [key for key in extras if key not in index.entries]
    shadowed = _shadowed(targets, index.entries)
    report.tied += shadowed
    if strict and (report.missing or report.unexpected):
        raise KeyMismatchError(
            f"{index.path}: model and checkpoint disagree: missing {report.missing[:20]}"
            f"{' ...' if len(report.missing) > 20 else ''}, unexpected {report.unexpected[:20]}"
            f"{' ...' if len(report.unexpected) > 20 else ''}; pass strict=False to load the "
            f"common keys, or options.key_map to rename"
            f"{_prefix_hint(report, list(index.entries), options.key_map is not None)}"
            f"{_notes_hint(index.notes)}",
            report,
        )
    box_cache: dict[tuple[Any, ...], Box] = {}
    boxes = {key: _box(key, targets[key], box_cache) for key in index.entries}
    plans = plan_load(
        index,
        shard_dims,
        Layout(),
        verify_replicas=options.verify_replicas,
        verify_max_bytes=options.verify_replicas_max_bytes,
        boxes=boxes,
    )
    ties: list[tuple[TensorPlan, str]] = []
    if shadowed:  # two reads into one tensor would race (the threads take reads from both ends)
        ties = _ties_to_compare(plans, shadowed, targets, index, options)
        plans = [p for p in plans if p.key not in shadowed]
    _refuse_overlaps([p.key for p in plans], targets)
    _warn_bypassed_hooks(model, index.path)
    cpu = torch.device("cpu")
    destinations: dict[str, torch.Tensor] = {}
    in_place: list[torch.Tensor] = []  # filled behind autograd's back: see _mark_written
    for p in plans:
        target = targets[p.key]
        dest = destinations[p.key] = _destination(p.key, target, cpu if p.key in extras else device)
        if target.is_dtensor:
            in_place += (target.tensor, dest)
        elif dest is target.tensor and not dest.is_inference():  # an inference one has none
            in_place.append(dest)
    for p in plans:  # an empty shard held in another empty shape (see _box) takes the box's
        if tuple(destinations[p.key].shape) != p.box.sizes:
            destinations[p.key] = destinations[p.key].view(p.box.sizes)
    pool = None
    if any(d.device.type == "cuda" for d in destinations.values()):
        pool = PinnedPool()
    bar = byte_bar(sum(p.nbytes for p in plans), "load_into", enabled=options.progress)

    written: list[str] = []

    def done(plan: TensorPlan) -> None:
        stats.add_delivered(plan.nbytes, view=False, span=clock)
        bar.update(plan.nbytes)
        written.append(plan.key)

    try:
        with (
            torch.no_grad(),
            Reader(use_mmap=options.mmap, stats=stats, stamps=index.stamps) as reader,
            bar,
        ):
            fill_all(plans, destinations, reader, pool=pool, done=done)
            differ = _differing_ties(ties, destinations, reader, pool) if ties else []
            if pool is not None:
                pool.synchronize()
    except BaseException as exc:
        in_model = [p.key for p in plans if not targets[p.key].tensor.is_meta]
        _say_partly_written(exc, index.path, written, in_model)
        raise
    _mark_written(in_place)
    _install_materialized(targets, destinations)
    for key, module in extras.items():
        if key in destinations:
            module.set_extra_state(destinations[key])
    for key, other in differ:  # once the model is whole: a warning made an error leaves it so
        warn(
            f"{index.path}: the model ties {key!r} to {other!r}, and the checkpoint holds them "
            f"with different values (saved untied): {other!r} was loaded, as load_state_dict "
            f"leaves it, and the tensor does not hold the checkpoint's {key!r}; untie them in "
            "the model to load both"
        )
    report.loaded = [key for key in index.entries if key not in shadowed]
    _run_post_hooks(model, report)
    return report


_TORCH_PRE_HOOKS = (
    "to_sharded_hook",
    "_pre_load_state_dict_hook",
    "_lazy_load_hook",
    "_weight_norm_compat_hook",
    "SpectralNormLoadStateDictPreHook",
)
"""torch's own load pre-hooks (matched by name in torch's modules only), whose work
``load_into`` does its way or that a current checkpoint does not need: FSDP2's reshard
(:func:`_reshard_fsdp`), ``checkpoint_wrapper``'s name prefix (:mod:`lazyckpt.state_names`), a
lazy module's shapes (refused: :func:`_refuse_lazy`), ``weight_norm``'s and ``spectral_norm``'s
renaming of old versions' keys (which the key check reports as missing and unexpected)."""
_TORCH_LOADERS = ("torch.nn.modules.batchnorm", "torch.nn.modules.instancenorm")
"""Where torch's own ``_load_from_state_dict`` overrides live: the norms' handling of old
versions' keys (``num_batches_tracked``), which a checkpoint of this torch does not need."""


def _hook_name(fn: Any) -> tuple[str, str]:
    """A hook's name and module: a function's, a ``functools.partial``'s function's, a callable
    object's class's (its repr holds an address), else its repr."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    what = getattr(named, "__qualname__", None) or repr(fn)
    return what, getattr(named, "__module__", None) or ""


def _warn_bypassed_hooks(model: nn.Module, path: Path) -> None:
    """Warn, before anything is written, of the modules whose ``load_state_dict`` does more
    than copy: load pre-hooks (which rename legacy keys, convert values) and overrides of
    ``_load_from_state_dict``. ``load_into`` writes each tensor in place and calls neither, so
    what they do is not done; torch's own, whose work it does its way, are not named."""
    plain: dict[type, bool] = {}  # a class whose load_state_dict only copies, by class
    found = []
    for name, module in model.named_modules():
        for hook in module._load_state_dict_pre_hooks.values():
            what, where = _hook_name(getattr(hook, "hook", hook))
            if not (where.startswith("torch.") and what.endswith(_TORCH_PRE_HOOKS)):
                found.append(f"{name or 'the model'}: load_state_dict pre-hook {what}")
        kind = type(module)
        if kind not in plain:
            impl = kind._load_from_state_dict
            plain[kind] = (
                impl is nn.Module._load_from_state_dict or impl.__module__ in _TORCH_LOADERS
            )
        if not plain[kind]:
            found.append(f"{name or 'the model'}: {kind._load_from_state_dict.__qualname__}")
    if found:
        more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
        warn(
            f"{path}: load_into writes the model's tensors in place and does not run "
            f"load_state_dict's per-module code, which these modules change: "
            f"{'; '.join(found[:5])}{more}. What it does (renaming old keys, converting "
            "values) is not done: load them with lazy_load and model.load_state_dict, or check "
            "that they need nothing from it (their post-hooks are run)"
        )


def _run_post_hooks(model: nn.Module, report: LoadReport) -> None:
    """Run the modules' ``load_state_dict`` post-hooks once the model is loaded, as
    ``load_state_dict`` does (children first, all given the same missing and unexpected
    keys): a module that derives state from its loaded tensors (a cache, FSDP2's padded
    shards) keeps it right."""
    keys = _INCOMPATIBLE(list(report.missing), list(report.unexpected))

    def visit(module: nn.Module) -> None:
        for child in module._modules.values():
            if child is not None:
                visit(child)
        for hook in module._load_state_dict_post_hooks.values():
            hook(module, keys)

    visit(model)


_INCOMPATIBLE: Any = getattr(
    torch.nn.modules.module,
    "_IncompatibleKeys",
    collections.namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"]),
)
"""What ``load_state_dict`` gives its post-hooks (torch's own type where it has it)."""


def _say_partly_written(
    exc: BaseException, path: Path, written: Sequence[str], in_model: Sequence[str]
) -> None:
    """Add to ``exc``, raised while the model was being filled (what only the data shows: a
    damaged DCP chunk's zip, replicas that differ, an I/O error, Ctrl-C), what it left: the
    model's own tensors (all but meta ones, whose new tensors are never put in) were written in
    place up to it, so the model may be part checkpoint, part what it held before."""
    if not in_model:
        note = f"load_into({path}): the model was left as it was (its tensors are on meta)"
    else:
        inside = set(in_model)
        done = [k for k in written if k in inside]
        shown = ", ".join(repr(k) for k in done[:5]) + (" ..." if len(done) > 5 else "")
        note = (
            f"load_into({path}): the model is partly loaded: its tensors are filled in place, "
            f"and this error came after {len(done)} of the {len(in_model)} to load were "
            "finished" + (f" ({shown})" if done else "") + "; the others may hold part of the "
            "checkpoint's values, or what they held before: load it again from a good "
            "checkpoint before using the model"
        )
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:  # Python 3.11+
        add_note(note)
    else:
        warn(note)


def _refuse_unused_options(options: ModelCheckpointLoadOptions) -> None:
    """Refuse the options that would have ``load_into`` load something else than what it loads:
    a layout or mesh (each tensor's own box decides: a plain tensor's whole key, a DTensor's
    local shard), a dtype (each tensor's own dtype decides). Ignored, a rank-local model given
    its ``Layout`` failed on shapes, naming no fix, and a meta model asked for bfloat16 came
    out in float32 without a word. ``Layout()`` (whole tensors) is what ``load_into`` does for
    a plain tensor, and is taken. ``contiguous`` and ``prefetch_bytes`` are taken: no view is
    handed out and nothing is read ahead, whatever they say. ``dtype`` is checked against the
    model by :func:`_refuse_other_dtype`."""
    said = []
    refused = []
    named = []  # each as said, with its value where one helps
    if options.layout is not None and options.layout != Layout():
        refused.append("options.layout")
        named.append(f"options.layout ({options.layout})")
    if options.mesh is not None:
        refused.append("options.mesh")
        named.append("options.mesh")
    if named:
        said.append(
            f"{' or '.join(named)}: each tensor's own box decides what it reads, a plain "
            "tensor its whole key, a DTensor (FSDP2, TP) its local shard from its own mesh and "
            "placements. For a rank-local model of plain tensors (fairscale's "
            "ColumnParallelLinear, RowParallelLinear), " + _rank_local_advice("...")
        )
    if said:
        raise ValueError(
            f"load_into takes no {'; nor '.join(said)}; leave {', '.join(refused)} None"
        )


def _refuse_other_dtype(
    dtype: torch.dtype | None, entries: Mapping[str, TensorEntry], targets: Mapping[str, _Target]
) -> None:
    """Take ``options.dtype`` where the model comes out as ``lazy_load`` with it, then
    ``load_state_dict``, would give it (one options object for both): each floating-point
    checkpoint tensor is already in ``dtype`` or fills a model tensor of ``dtype``, and a meta
    tensor, which ``load_into`` makes, is made in ``dtype``. Else refuse it, naming a key:
    ignored, a float32 meta model asked for bfloat16 came out in float32 without a word, and a
    float32 buffer of a bfloat16 model (or an integer one filled from floats) would get values
    other than the ones ``lazy_load`` rounds to ``dtype``."""
    if dtype is None:
        return
    for key, entry in entries.items():
        tensor = targets[key].tensor
        has = tensor.dtype
        if output_dtype(entry.dtype, dtype) != dtype or has == dtype:
            continue  # not cast, or cast to what the model holds
        if entry.dtype == dtype and not tensor.is_meta:
            continue  # already in dtype: what lazy_load gives is what is copied in
        if has.is_floating_point:
            fix = f"give the model that dtype first (model.to({dtype}), which a meta model takes too), or leave options.dtype None"
        else:
            fix = f"leave options.dtype None (a {has} tensor does not take {dtype})"
        made = "is made as a" if tensor.is_meta else "fills a"
        raise ValueError(
            f"load_into cannot give the model options.dtype ({dtype}): each checkpoint tensor "
            f"is cast to the dtype of the model's tensor it fills, and {key!r} "
            f"({entry.dtype} in the checkpoint) {made} {has} one; {fix}"
        )


_MAX_TP_SIZE = 64
"""The largest tensor-parallel size :func:`_tp_shard_hint` tries."""


def _tp_sizes(full: int, local: int) -> set[int]:
    """The TP sizes (2 to ``_MAX_TP_SIZE``) for which a ``torch.chunk`` of ``full`` elements
    has ``local`` in it."""
    sizes = set()
    for n in range(2, min(full, _MAX_TP_SIZE) + 1):
        size = -(-full // n)
        if local == size or (local == full % size and local):
            sizes.add(n)
    return sizes


def _tp_shard_hint(
    shapes: Mapping[str, tuple[tuple[int, ...], _Target]], extras: Mapping[str, nn.Module]
) -> str:
    """For keys whose shapes differ (each the checkpoint's shape and its target), where every
    target is a plain tensor of the checkpoint's shape cut on one dim as ``torch.chunk`` cuts it
    for one TP size: that a rank-local model (fairscale's parallel layers) is loaded through
    ``lazy_load`` with a ``Layout``; else empty."""
    dims: dict[str, int] = {}
    common: set[int] | None = None
    for key, (full, target) in shapes.items():
        local = target.global_shape
        if target.is_dtensor or key in extras or len(full) != len(local):
            return ""
        cut = [d for d in range(len(full)) if full[d] != local[d]]
        if len(cut) != 1:
            return ""
        d = dims[key] = cut[0]
        fits = _tp_sizes(full[d], local[d])
        common = fits if common is None else common & fits
        if not common:
            return ""
    tp = "..." if not common else str(min(common))
    said = ", ".join(f"{k!r}: {d}" for k, d in list(dims.items())[:10])
    return (
        f"; the model's tensors are the checkpoint's cut on one dim ({{{said}}}), as one rank "
        "of a tensor-parallel model of plain tensors holds them (fairscale's parallel layers): "
        "load_into fills a plain tensor with its whole key; for such a model, "
        + _rank_local_advice(tp)
    )


def _rank_local_advice(tp: str) -> str:
    """How a rank-local model of plain tensors (TP size ``tp``) is loaded instead."""
    return (
        "load its rank's tensors with lazyckpt.get_model_checkpoint_loader().lazy_load(path, "
        f"shard_dims, ModelCheckpointLoadOptions(layout=Layout(tp_size={tp}, tp_rank=...))) "
        "and pass them to model.load_state_dict (or copy_ each one)"
    )


def _notes_hint(notes: Sequence[str]) -> str:
    """The index's notes (what it left out: a training checkpoint's optimizer state, a pickled
    object), where they may say where missing keys went; else empty."""
    if not notes:
        return ""
    more = f" (and {len(notes) - 3} more)" if len(notes) > 3 else ""
    return "; the checkpoint's index notes: " + "; ".join(notes[:3]) + more


def _prefix_hint(report: LoadReport, matched: Sequence[str], user_map: bool = False) -> str:
    """The ``key_map`` that mends the usual cause of a mismatch, a prefix one side's keys carry
    and the other's lack: a DCP save of ``{"model": model.state_dict(), "optim": ...}`` (keys
    ``model.*``), a ``DistributedDataParallel`` (``module.*``) or ``torch.compile``
    (``_orig_mod.*``) model. Said only where the prefix accounts for at least half the missing
    keys; else empty.

    The ``key_map`` given loads the model when copied as written (:func:`_key_map_hint` checks
    it): ``matched``, the checkpoint keys that already name a model key (a Hugging Face
    checkpoint's ``lm_head.weight`` beside its ``model.*`` keys), keep their names; an
    unexpected key is renamed where the prefix makes it a missing key, and dropped otherwise.
    ``user_map``: the names are those after the caller's own ``key_map``, which the hint says."""
    missing, unexpected = set(report.missing), set(report.unexpected)
    if not missing or not unexpected:
        return ""

    def best(have: set[str], want: set[str]) -> tuple[str, int]:
        """The prefix that, cut off the most keys of ``have``, gives keys of ``want`` (the
        shortest, then the first in order, of those that tie: the same hint every run)."""
        counts: dict[str, int] = {}
        for key in have:
            at = key.find(".")
            while at != -1:
                if key[at + 1 :] in want:
                    counts[key[: at + 1]] = counts.get(key[: at + 1], 0) + 1
                at = key.find(".", at + 1)
        return max(sorted(counts.items()), key=lambda kv: kv[1], default=("", 0))

    strip, stripped = best(unexpected, missing)
    add, added = best(missing, unexpected)
    if max(stripped, added) * 2 < len(missing):
        return ""
    if stripped >= added:
        said = f"{stripped} checkpoint key(s) are the model's under the prefix {strip!r}"
        renamed = {k: k[len(strip) :] for k in unexpected if k.startswith(strip)}
    else:
        said = f"{added} model key(s) are the checkpoint's under the prefix {add!r}"
        renamed = {k: add + k for k in unexpected}
    renamed = {k: new for k, new in renamed.items() if new in missing}
    if user_map:
        said += " (the names your key_map gives: apply this one to what yours returns)"
    kept = set(matched) - unexpected  # the checkpoint keys that are model keys as they are
    return _key_map_hint(
        said,
        strip if stripped >= added else add,
        stripped >= added,
        renamed,
        kept,
        unexpected - set(renamed),
    )


_HINT_KEYS = 20
"""The most keys a suggested ``key_map`` names; past it the hint says what the map must do."""


def _keys_literal(keys: Iterable[str]) -> str:
    """A set display of ``keys`` (sorted: the message is the same run to run)."""
    return "{" + ", ".join(repr(k) for k in sorted(keys)) + "}"


def _key_map_hint(
    said: str,
    prefix: str,
    strip: bool,
    renamed: Mapping[str, str],
    matched: set[str],
    drop: set[str],
) -> str:
    """``said``, then the ``key_map`` that renames ``renamed``'s keys, keeps ``matched`` and
    drops ``drop``: the lambda naming the fewest keys among a few forms, each run here on every
    checkpoint key to check that it does exactly that (a form that renames a key the prefix
    does not make a model key, or keeps one the model lacks, is not given). Where each right
    form names more than ``_HINT_KEYS`` keys, what the map must do is said instead."""
    p = repr(prefix)
    r, m, d = _keys_literal(renamed), _keys_literal(matched), _keys_literal(drop)
    if strip:
        move, moved = f"k.removeprefix({p})", lambda k: k.removeprefix(prefix)
    else:
        move, moved = f"{p} + k", lambda k: prefix + k
    # Each form as written, how many keys it names, and what it does (which the tests check
    # against the text, run as written).
    forms: list[tuple[str, int, Callable[[str], str | None]]] = [
        (move, 0, moved),
        (f"None if k in {d} else {move}", len(drop), lambda k: None if k in drop else moved(k)),
        (
            f"None if k in {d} else (k if k in {m} else {move})",
            len(drop) + len(matched),
            lambda k: None if k in drop else (k if k in matched else moved(k)),
        ),
        (
            f"{move} if k in {r} else (None if k in {d} else k)",
            len(renamed) + len(drop),
            lambda k: moved(k) if k in renamed else (None if k in drop else k),
        ),
    ]
    if strip:
        has = f"k.startswith({p})"
        forms += [
            (
                f"{move} if {has} else None",
                0,
                lambda k: moved(k) if k.startswith(prefix) else None,
            ),
            (
                f"k if k in {m} else ({move} if {has} else None)",
                len(matched),
                lambda k: k if k in matched else (moved(k) if k.startswith(prefix) else None),
            ),
        ]
    want = {**{k: k for k in matched}, **renamed, **dict.fromkeys(drop)}
    right = [
        (named, len(body), body)
        for body, named, fn in forms
        if all(fn(k) == new for k, new in want.items())
    ]
    dropped = f" and drops the checkpoint's {len(drop)} other key(s)" if drop else ""
    if matched:
        kept = f" (keeps the keys that already match{dropped})"
    else:
        kept = f" (drops the checkpoint's {len(drop)} other key(s))" if drop else ""
    if not right or min(right)[0] > _HINT_KEYS:
        what = ("cuts " if strip else "puts ") + p + (" off" if strip else " before")
        return (
            f"; {said}: a key_map that {what} the {len(renamed)} unexpected key(s) it makes "
            f"model keys, keeps the {len(matched)} that already match and drops the "
            f"{len(drop)} other(s) loads them"
        )
    return f"; {said}: key_map=lambda k: {min(right)[2]} loads them{kept}"


def _shadowed(targets: Mapping[str, _Target], loaded: Mapping[str, Any]) -> list[str]:
    """Checkpoint keys whose target tensor another key of the checkpoint, later in the model's
    state-dict order, fills too (tied weights saved under both names): ``load_state_dict``
    copies in that order, so the last one is what it leaves."""
    last = {t.memory: key for key, t in targets.items() if key in loaded}
    return [key for key in loaded if last[targets[key].memory] != key]


def _ties_to_compare(
    plans: Sequence[TensorPlan],
    shadowed: Sequence[str],
    targets: Mapping[str, _Target],
    index: CheckpointIndex,
    options: ModelCheckpointLoadOptions,
) -> list[tuple[TensorPlan, str]]:
    """The shadowed keys to read and compare with the key that fills their tensor, each as
    (its plan, that key): a checkpoint that holds a tied weight under both names with other
    values (saved untied) would otherwise lose one without a word, where Hugging Face's
    ``from_pretrained`` warns. Not where both names are the same bytes of the file (a torch
    file of a tied model). A box beyond ``verify_replicas_max_bytes`` (an embedding, often) is
    compared on its first rows within that many bytes: weights saved untied differ in every
    row, and the check reads no more than a replica check does."""
    if not options.verify_replicas:
        return []
    entries, index_path = index.entries, index.path
    winner = {t.memory: key for key, t in targets.items() if key in entries}  # as _shadowed
    chosen = set(shadowed)
    out = []
    for plan in plans:
        if plan.key not in chosen:
            continue
        other = winner[targets[plan.key].memory]
        if _same_bytes(entries[plan.key], entries[other]):
            continue
        if plan.nbytes > options.verify_replicas_max_bytes and plan.box.sizes:
            plan = _first_rows(plan, options.verify_replicas_max_bytes, index_path)
        out.append((plan, other))
    return out


def _first_rows(plan: TensorPlan, nbytes: int, index_path: Path) -> TensorPlan:
    """``plan`` cut to the first rows of its box (dim 0) that fit ``nbytes``, one at least."""
    sizes = plan.box.sizes
    row = max(1, plan.nbytes // max(1, sizes[0]))
    box = Box(plan.box.offsets, (max(1, min(sizes[0], nbytes // row)), *sizes[1:]))
    where = functools.partial(entry_path, index_path, plan.entry)
    dim, box, pieces = plan_entry(plan.entry, {}, Layout(), where, box)
    return TensorPlan(plan.entry, dim, box, plan.copy, pieces[plan.copy])


def _same_bytes(a: TensorEntry, b: TensorEntry) -> bool:
    """Whether two keys are stored as the same bytes of one file (one storage saved under both
    names)."""
    return (
        a.dtype == b.dtype
        and len(a.chunks) == len(b.chunks)
        and all(
            ca.offsets == cb.offsets and ca.sizes == cb.sizes and _same_place(ca.data, cb.data)
            for ca, cb in zip(a.chunks, b.chunks)
        )
    )


def _same_place(a: object, b: object) -> bool:
    if a is b:
        return True
    return (
        isinstance(a, FileRegion)
        and isinstance(b, FileRegion)
        and (a.path, a.byte_offset, a.strides) == (b.path, b.byte_offset, b.strides)
    )


def _differing_ties(
    ties: Sequence[tuple[TensorPlan, str]],
    destinations: Mapping[str, torch.Tensor],
    reader: Reader,
    pool: PinnedPool | None,
) -> list[tuple[str, str]]:
    """Read each shadowed key as its tensor would hold it: (key, the key that filled the
    tensor) for those that differ."""
    held = {}  # each box is the winner's, or its first rows (dim 0): those of its tensor
    for plan, other in ties:
        dest = destinations[other]
        held[plan.key] = dest[: plan.box.sizes[0]] if plan.box.sizes else dest
    got = {
        key: torch.empty_like(t, memory_format=torch.contiguous_format) for key, t in held.items()
    }
    fill_all([plan for plan, _ in ties], got, reader, pool=pool)
    if pool is not None:
        pool.synchronize()
    if reader.stats is not None:  # read only to be compared
        for plan, _ in ties:
            reader.stats.add_verified(plan.nbytes)
    return [
        (plan.key, other) for plan, other in ties if not same_bits(got[plan.key], held[plan.key])
    ]


def _refuse_overlaps(keys: Sequence[str], targets: Mapping[str, _Target]) -> None:
    """Two keys to load whose tensors share an element (views of one buffer: slices that
    overlap, a parameter and its transpose) would be written at once by the two threads (a
    mix of both, run to run): refused by name, as ``load_state_dict``'s result there is its
    copy order's. Tensors whose spans meet are told apart by the bytes they hold
    (:func:`lazyckpt.claims.footprint`): exactly for dense tensors and for windows of the rows
    of one matrix (``w[::2]`` beside ``w[1::2]``, column slices side by side); other strided
    views whose spans meet are taken to share one."""
    spans: dict[torch.device, list[tuple[int, int, str, torch.Tensor]]] = {}
    for key in keys:
        target = targets[key]
        t = _local(target.tensor) if target.is_dtensor else target.tensor
        if t.is_meta or t.numel() == 0:
            continue
        size = t.element_size()
        start = t.untyped_storage().data_ptr() + int(t.storage_offset()) * size
        n = t.numel() if t.is_contiguous() else span(t.shape, t.stride())
        spans.setdefault(t.device, []).append((start, start + n * size, key, t))
    for on_device in spans.values():
        on_device.sort()  # keys are unique: tensors are never compared
        live: list[tuple[int, int, str, torch.Tensor]] = []  # spans reaching this one's start
        for this in on_device:
            start = this[0]
            if live:
                live = [s for s in live if s[1] > start]
            for other in live:
                if overlap(_footprint(other[0], other[3]), _footprint(start, this[3])):
                    raise ValueError(
                        f"{other[2]!r} and {this[2]!r} share memory (views of one buffer that "
                        "overlap): load_into writes keys in parallel; drop one with "
                        "options.key_map, or load them with load_state_dict"
                    )
            live.append(this)


def _footprint(start: int, t: torch.Tensor) -> Footprint:
    return footprint(start, tuple(t.shape), tuple(t.stride()), t.element_size())


def _account_keys(
    report: LoadReport, targets: Mapping[str, _Target], loaded: Mapping[str, Any]
) -> None:
    """Split the model keys the checkpoint lacks into missing and filled-through-a-tie."""
    loaded_memory = {targets[k].memory for k in loaded}
    for key, target in targets.items():
        if key in loaded:
            continue
        (report.tied if target.memory in loaded_memory else report.missing).append(key)


def _destination(key: str, target: _Target, device: torch.device) -> torch.Tensor:
    """The tensor to write ``key``'s box into: the target itself (a DTensor's local shard), or a
    new one for meta. Written under ``torch.no_grad()``, as ``load_state_dict`` writes, so no
    ``detach()`` is needed: it made a tensor per key, 0.15 ms of a 75-key load in a fresh
    process, before the first read."""
    t: Any = target.tensor
    if target.is_dtensor:
        local = _local(t)
        if local.is_meta:
            raise ValueError(
                f"{key} is a DTensor on the meta device; call model.to_empty(device=...) before "
                "load_into so that FSDP/TP keep their own storage"
            )
        return _refuse_shared_elements(key, local)
    if t.is_meta:
        if device.type == "cpu":
            return alloc.empty(t.shape, t.dtype)
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    return _refuse_shared_elements(key, t)


def _refuse_shared_elements(key: str, t: torch.Tensor) -> torch.Tensor:
    """``t``, unless several of its elements are one in memory (a stride of 0: an expanded
    tensor), which no copy may write (``copy_`` refuses it): refused by name before anything
    is written, where it would have stopped the load halfway with torch's message."""
    if repeats_elements(t.shape, t.stride()):
        raise ValueError(
            f"{key!r} is an expanded tensor (stride 0 on a dim of size > 1, shape "
            f"{tuple(t.shape)}, strides {t.stride()}): its elements share memory, so it cannot "
            "be filled; give the module a tensor of its own (.clone()) or drop the key with "
            "options.key_map"
        )
    return t


def _mark_written(tensors: list[torch.Tensor]) -> None:
    """Bump the autograd version of every tensor filled in place, as ``copy_`` would: reads
    write their memory behind autograd's back, and a graph that saved the old values must
    refuse to run backward ("modified by an inplace operation"), not use the new ones. A
    DTensor counts its versions apart from its local shard: both are bumped."""
    from torch.autograd.graph import increment_version

    try:
        increment_version(tensors)  # one call (torch 2.5+ takes a list)
    except TypeError:
        for t in tensors:
            increment_version(t)


def _install_materialized(
    targets: Mapping[str, _Target], dests: Mapping[str, torch.Tensor]
) -> None:
    """Put tensors built for meta targets into their modules, keeping ties tied."""
    replaced: dict[int, torch.Tensor] = {}
    for key, target in targets.items():
        old = target.tensor
        if old.is_meta and not target.is_dtensor and key in dests and id(old) not in replaced:
            made = dests[key]
            if isinstance(old, nn.Parameter):
                made = nn.Parameter(made, requires_grad=old.requires_grad)
                # Attributes set on the parameter (Megatron tags its TP layout so:
                # ``tensor_model_parallel``, ``partition_dim``) come along; its class, as with
                # ``load_state_dict(assign=True)``, does not.
                made.__dict__.update(old.__dict__)
            replaced[id(old)] = made
    for target in targets.values():
        new = replaced.get(id(target.tensor))
        if new is None:
            continue  # not meta, or missing from the checkpoint: stays on meta, reported missing
        for module, attr, is_param in target.owners:
            if is_param:
                module._parameters[attr] = new  # type: ignore[assignment]
            else:
                module._buffers[attr] = new
