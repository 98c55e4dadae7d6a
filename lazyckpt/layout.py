"""The target layout: which tensor-parallel and data-parallel rank we load for."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DP_DIM_NAMES",
    "TP_DIM_NAMES",
    "UNCUT_DIM_NAMES",
    "Layout",
    "named_mesh_dims",
    "unnamed_cut",
]

DP_DIM_NAMES = ("dp", "dp_shard", "fsdp", "data_parallel", "shard")
"""Mesh dim names taken for FSDP's dim, in this order of preference (``shard`` beside
``replicate``: torch's own HSDP mesh, whose ``replicate`` dim holds copies)."""
TP_DIM_NAMES = ("tp", "tensor_parallel", "model_parallel", "mp")
"""Mesh dim names taken for the TP dim."""
UNCUT_DIM_NAMES = (
    "replicate",
    "dp_replicate",
    "ddp",
    "cp",
    "context_parallel",
    "pp",
    "pipeline_parallel",
)
"""Mesh dim names along which no key is cut: replica dims, whose ranks hold the same
parameters (HSDP's and torchtitan's replicate dims, context parallelism), and pipeline dims,
whose ranks hold other keys, each whole along it. Another dim of size > 1 that no name above
accounts for is refused where the mesh's dims are found by name: taken for one of these, a
misnamed TP dim's ranks would each hold the whole of what a cut gives them together."""


def named_mesh_dims(names: Sequence[str]) -> tuple[int | None, int | None]:
    """The indices of a mesh's TP and FSDP dims among its dim ``names``, found by the names
    above (None where no name says so)."""
    tp = next((names.index(n) for n in TP_DIM_NAMES if n in names), None)
    dp = next((names.index(n) for n in DP_DIM_NAMES if n in names), None)
    return tp, dp


@dataclass(frozen=True)
class Layout:
    """A target rank in a TP x FSDP grid.

    Each key's tensor is cut with ``torch.chunk`` on its TP shard dim for ``tp_rank``, then the
    result on dim 0 for ``dp_rank`` (FSDP2's rule); see DESIGN.md "What a target rank receives".
    """

    tp_size: int = 1
    """Number of tensor-parallel ranks."""
    tp_rank: int = 0
    """This process's tensor-parallel rank, in ``[0, tp_size)``."""
    dp_size: int = 1
    """Number of FSDP (dim-0 sharding) ranks."""
    dp_rank: int = 0
    """This process's FSDP rank, in ``[0, dp_size)``."""

    def __post_init__(self) -> None:
        for name in ("tp_size", "tp_rank", "dp_size", "dp_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Layout.{name} must be an int, got {value!r}")
        for size, rank in (("tp_size", "tp_rank"), ("dp_size", "dp_rank")):
            n, r = getattr(self, size), getattr(self, rank)
            if n < 1:
                raise ValueError(f"Layout.{size} must be >= 1, got {n}")
            if not 0 <= r < n:
                raise ValueError(f"Layout.{rank} must be in [0, {size}={n}), got {r}")

    def __str__(self) -> str:
        return f"tp {self.tp_rank}/{self.tp_size}, dp {self.dp_rank}/{self.dp_size}"

    @classmethod
    def from_mesh(
        cls,
        mesh: DeviceMesh,
        *,
        tp_dim: str | int | None = None,
        dp_dim: str | int | None = None,
    ) -> Layout:
        """This process's layout on a ``DeviceMesh``.

        ``tp_dim``/``dp_dim`` name (or index) the mesh dims; left out, they are looked up by the
        usual names (TP: ``tp``, ``tensor_parallel``, ``model_parallel``, ``mp``; FSDP: ``dp``,
        ``dp_shard``, ``fsdp``, ``data_parallel``, ``shard``), each on its own: ``tp_dim="tp"``
        on a ``("dp", "tp")`` mesh still shards on ``dp`` (pass ``mesh["tp"]`` for TP alone). A
        1-D unnamed mesh needs one of them spelled out, since nothing says whether it is TP or
        FSDP; so does a mesh with a dim of size > 1 that no name makes TP's, FSDP's or one along
        which nothing is cut (:data:`UNCUT_DIM_NAMES`).
        """
        names = tuple(mesh.mesh_dim_names or ())
        tp_named, dp_named = named_mesh_dims(names)
        if tp_dim is None and dp_dim is None and tp_named is None and dp_named is None:
            raise ValueError(
                f"Layout.from_mesh: cannot tell the TP and DP dims of a mesh with dim names "
                f"{names or 'None'}; pass tp_dim= and/or dp_dim= (a name or an index), or name "
                "the mesh dims (init_device_mesh(..., mesh_dim_names=('tp',)) or ('dp',))"
            )
        tp_arg = "tp_dim" if tp_dim is not None else "tp_dim (found by name)"
        dp_arg = "dp_dim" if dp_dim is not None else "dp_dim (found by name)"
        tp_at, tp_size, tp_rank = _mesh_dim(
            mesh, tp_dim if tp_dim is not None else tp_named, names, tp_arg
        )
        dp_at, dp_size, dp_rank = _mesh_dim(
            mesh, dp_dim if dp_dim is not None else dp_named, names, dp_arg
        )
        if tp_at is not None and tp_at == dp_at:  # the ranks along it would skip half the boxes
            raise ValueError(
                f"Layout.from_mesh: {tp_arg} and {dp_arg} are one mesh dim, "
                f"{names[tp_at] if names else tp_at!r}; give TP and DP dims of their own"
            )
        odd = unnamed_cut(mesh) if tp_dim is None and dp_dim is None else None
        if odd is not None:
            raise ValueError(
                f"Layout.from_mesh: {odd}, or pass tp_dim=/dp_dim= (the dims not passed are "
                "then left uncut)"
            )
        return cls(tp_size=tp_size, tp_rank=tp_rank, dp_size=dp_size, dp_rank=dp_rank)

    @classmethod
    def from_groups(
        cls, *, tp_group: ProcessGroup | None = None, dp_group: ProcessGroup | None = None
    ) -> Layout:
        """This process's layout from its TP and DP process groups (either may be left out)."""
        import torch.distributed as dist

        def size_rank(group: Any) -> tuple[int, int]:
            if group is None:
                return 1, 0
            return dist.get_world_size(group), dist.get_rank(group)

        tp_size, tp_rank = size_rank(tp_group)
        dp_size, dp_rank = size_rank(dp_group)
        return cls(tp_size=tp_size, tp_rank=tp_rank, dp_size=dp_size, dp_rank=dp_rank)


def unnamed_cut(mesh: DeviceMesh) -> str | None:
    """What to say of a mesh dim of size > 1 that its name makes neither TP's, FSDP's, nor one
    along which nothing is cut (``("dp", "model")``), or None: taken for a replica dim, each rank
    along it got, and held, the whole of what a cut would give them together, without a
    word."""
    names = tuple(mesh.mesh_dim_names or ())
    found = named_mesh_dims(names)
    for i, name in enumerate(names):
        if i in found or name in UNCUT_DIM_NAMES or mesh.size(i) == 1:
            continue
        for role, taken, index in (
            ("TP", TP_DIM_NAMES, found[0]),
            ("FSDP", DP_DIM_NAMES, found[1]),
        ):
            if name in taken and index is not None:
                return (
                    f"its dims {names[index]!r} and {name!r} (size {mesh.size(i)}) both name "
                    f"{role}'s dim; name one otherwise (an HSDP mesh's copies: 'replicate')"
                )
        kept = tuple(n for j, n in enumerate(names) if j in found)
        return (
            f"its dim {name!r} (size {mesh.size(i)}) is not named as TP "
            f"({', '.join(TP_DIM_NAMES)}), FSDP ({', '.join(DP_DIM_NAMES)}), or a dim along "
            f"which no key is cut ({', '.join(UNCUT_DIM_NAMES)}); name it so when making the "
            f"mesh, or give the sub-mesh of the dims that cut (mesh[{kept!r}])"
        )
    return None


def _mesh_dim(
    mesh: DeviceMesh, dim: str | int | None, names: tuple[str, ...], arg: str
) -> tuple[int | None, int, int]:
    """The mesh dim's index, and this process's size and rank along it."""
    if dim is None:
        return None, 1, 0
    if isinstance(dim, str):
        if dim not in names:
            raise ValueError(f"Layout.from_mesh: {arg}={dim!r} is not a mesh dim name {names}")
        index = names.index(dim)
    else:
        try:
            if isinstance(dim, bool):  # True would be taken as dim 1
                raise TypeError
            index = operator.index(dim)
        except TypeError:
            raise ValueError(
                f"Layout.from_mesh: {arg} must be a mesh dim name or index, got {dim!r}"
            ) from None
        if not 0 <= index < mesh.ndim:
            raise ValueError(
                f"Layout.from_mesh: {arg}={dim} is out of range for a {mesh.ndim}-D mesh"
            )
    return index, mesh.size(index), mesh.get_local_rank(index)
