"""Hand a built tensor to the caller: as is, or as a DTensor on the caller's mesh."""

from __future__ import annotations

from typing import Any

import torch

from lazyckpt.imported import require_dtensor
from lazyckpt.index import contiguous_strides
from lazyckpt.layout import named_mesh_dims
from lazyckpt.load_plan import TensorPlan
from lazyckpt.options import ModelCheckpointLoadOptions

__all__ = ["Deliverer", "placements_for"]


class Deliverer:
    """Checks the target device once, then wraps each tensor as the options ask."""

    def __init__(self, options: ModelCheckpointLoadOptions) -> None:
        self.options = options
        options.usable_device()
        self.mesh = options.mesh
        if self.mesh is not None:
            require_dtensor()
            self.layout = options.target_layout()
            names = tuple(self.mesh.mesh_dim_names or ())
            self.dims = named_mesh_dims(names)

    def deliver(self, plan: TensorPlan, tensor: torch.Tensor) -> torch.Tensor:
        if self.mesh is None:
            return tensor
        from torch.distributed.tensor import DTensor

        placements = placements_for(
            self.mesh.ndim,
            self.dims,
            plan.shard_dim,
            len(plan.entry.shape),
            self.layout.tp_size,
            self.layout.dp_size,
        )
        shape = torch.Size(plan.entry.shape)
        return DTensor.from_local(
            tensor,
            self.mesh,
            placements,
            run_check=False,
            shape=shape,
            stride=contiguous_strides(tuple(shape)),
        )


def placements_for(
    ndim_mesh: int,
    dims: tuple[int | None, int | None],
    shard_dim: int | None,
    tensor_ndim: int,
    tp_size: int,
    dp_size: int,
) -> list[Any]:
    """DTensor placements that describe a lazyckpt target box on a (dp, tp) mesh.

    lazyckpt cuts TP first, then dim 0 of the TP shard for FSDP: when both cut dim 0, FSDP's
    chunk is strided over the TP chunks, which torch spells ``_StridedShard(0, split_factor=tp)``
    when the DP mesh dim comes first (DTensor applies placements in mesh-dim order).
    """
    from torch.distributed.tensor import Replicate, Shard

    tp_dim, dp_dim = dims
    placements: list[Any] = [Replicate() for _ in range(ndim_mesh)]
    if tp_dim is not None and shard_dim is not None and tp_size > 1:
        placements[tp_dim] = Shard(shard_dim)
    if dp_dim is not None and tensor_ndim > 0 and dp_size > 1:
        if shard_dim == 0 and tp_size > 1 and tp_dim is not None and dp_dim < tp_dim:
            from torch.distributed.tensor.placement_types import _StridedShard

            placements[dp_dim] = _StridedShard(0, split_factor=tp_size)
        else:
            placements[dp_dim] = Shard(0)
    return placements
