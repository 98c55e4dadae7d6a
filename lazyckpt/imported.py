"""torch.distributed classes, looked up only where something already imported them.

``import torch.distributed.tensor`` takes about half a second (it pulls in sympy and torch's
operator registry): longer than loading a small model, and paid by every ``load_into`` of a
plain model that merely asked "is this a DTensor?". An object can only be an instance of a class
whose module was imported, so the question is answered without importing anything: a class
nobody imported has no instances.
"""

from __future__ import annotations

import sys

__all__ = ["fsdp_module_class", "is_device_mesh", "is_dtensor", "require_dtensor"]


def _imported(module: str, name: str) -> type | None:
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def is_dtensor(obj: object) -> bool:
    cls = _imported("torch.distributed.tensor", "DTensor")
    if cls is not None:
        return isinstance(obj, cls)
    old = _imported("torch.distributed._tensor", "DTensor")
    if old is not None and isinstance(obj, old):
        require_dtensor()
    return False


def require_dtensor() -> None:
    """DTensor targets use ``torch.distributed.tensor``, public from torch 2.5: on torch 2.4
    (its DTensor in ``torch.distributed._tensor``) a DTensor model failed deep in a copy with
    "invalid python storage"; say what is missing instead."""
    import torch.distributed.tensor as public

    if not isinstance(getattr(public, "DTensor", None), type):
        import torch

        raise RuntimeError(
            "DTensor parameters and device meshes need torch 2.5 or later "
            f"(torch.distributed.tensor); this is torch {torch.__version__}: upgrade torch"
        )


def is_device_mesh(obj: object) -> bool:
    cls = _imported("torch.distributed.device_mesh", "DeviceMesh")
    return cls is not None and isinstance(obj, cls)


def fsdp_module_class() -> type | None:
    """``FSDPModule`` (what ``fully_shard`` makes a module), or None if nothing made one (torch
    2.4 and 2.5 keep it in ``torch.distributed._composable.fsdp`` only)."""
    return _imported("torch.distributed.fsdp", "FSDPModule") or _imported(
        "torch.distributed._composable.fsdp", "FSDPModule"
    )
