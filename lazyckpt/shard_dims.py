"""``get_shard_dims``: read each parameter's tensor-parallel dim off a model.

Two sources of truth: fairscale's model-parallel layers (matched by class name, so fairscale need
not be installed) and DTensor parameters, whose placement on the TP mesh dim says ``Shard(d)``.
"""

from __future__ import annotations

from torch import nn

from lazyckpt.imported import fsdp_module_class, is_dtensor
from lazyckpt.layout import TP_DIM_NAMES, named_mesh_dims
from lazyckpt.state_names import model_keys

__all__ = ["get_shard_dims"]

# fairscale.nn.model_parallel.layers: which dim of the weight each layer splits.
_FAIRSCALE_WEIGHT_DIMS = {
    "ColumnParallelLinear": 0,
    "VocabParallelEmbedding": 0,
    "RowParallelLinear": 1,
    "ParallelEmbedding": 1,
}


def get_shard_dims(model: nn.Module) -> dict[str, int]:
    """``{parameter name: TP shard dim}`` for every tensor-parallel parameter of ``model``.

    Replicated parameters are left out. A ``ColumnParallelLinear`` bias is split like its
    output dim (0); a ``RowParallelLinear`` bias is replicated. Names are the model's
    state-dict keys (a ``checkpoint_wrapper``'s inner name is dropped, as its state dict does).
    """
    dims: dict[str, int] = {}
    fsdp = _has_fsdp(model)
    keys = model_keys(model)  # every path of a shared module or tied weight, and its name
    for path, module, attr, tensor, is_param in keys.tensors:
        layer = _fairscale_layer(type(module))
        if layer is not None and attr == "weight":
            dims[path] = _FAIRSCALE_WEIGHT_DIMS[layer]
        elif layer == "ColumnParallelLinear" and attr == "bias":
            dims[path] = 0
        tp_dim = _dtensor_tp_dim(path, tensor, fsdp) if is_param else None
        if tp_dim is not None:
            dims[path] = tp_dim
    return {keys.key(path): dim for path, dim in dims.items()}


def _fairscale_layer(cls: type) -> str | None:
    """The fairscale layer ``cls`` is or derives from (by class name), or None."""
    return next((c.__name__ for c in cls.__mro__ if c.__name__ in _FAIRSCALE_WEIGHT_DIMS), None)


def _has_fsdp(model: nn.Module) -> bool:
    cls = fsdp_module_class()
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def _dtensor_tp_dim(name: str, param: object, fsdp: bool) -> int | None:
    if not is_dtensor(param):
        return None
    from torch.distributed.tensor import DTensor, Shard

    assert isinstance(param, DTensor)  # is_dtensor said so; this narrows the type
    mesh = param.device_mesh
    names = tuple(mesh.mesh_dim_names or ())
    tp_index, dp_index = named_mesh_dims(names)
    if tp_index is None:
        cut = [
            i
            for i, p in enumerate(param.placements)
            if type(p) is Shard and i != dp_index and mesh.size(i) > 1
        ]
        if dp_index is not None and cut and names:
            raise ValueError(
                f"parameter {name!r} is {param.placements[cut[0]]!r} on mesh dim "
                f"{names[cut[0]]!r}, which is not named as TP, beside FSDP's {names[dp_index]!r}; "
                f"name it so when making the mesh ({', '.join(TP_DIM_NAMES)})"
            )
        if dp_index is not None or (mesh.ndim == 1 and fsdp):
            return None  # a data-parallel mesh only
        if mesh.ndim != 1:
            said = f"names {names} name neither" if names else "are not named, so none says"
            raise ValueError(
                f"parameter {name!r} lives on a {mesh.ndim}-D mesh whose dims {said} which is "
                "tensor-parallel and which FSDP's; name them (TP: 'tp', FSDP: 'dp' or 'shard')"
            )
        tp_index = 0
    placement = param.placements[tp_index]
    # Exactly Shard (not its _StridedShard subclass, which FSDP uses on the DP dim).
    if type(placement) is Shard:
        return int(placement.dim)
    return None
