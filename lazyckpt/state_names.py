"""A model's state-dict keys: what its tensors are called in a checkpoint of it.

``load_into`` and ``get_shard_dims`` walk the module tree (``module._parameters``, persistent
``module._buffers``), which names each tensor by its path: cheap, and no hook runs. A module's
state-dict post-hook may rename those keys, and the checkpoint then holds the new names.
``checkpoint_wrapper`` (activation checkpointing, as FSDP2 training recipes apply it) drops its
``_checkpoint_wrapped_module.`` so that a wrapped model saves and loads under the plain names.
Where such a hook (or an override of ``state_dict``/``_save_to_state_dict``) is present, the
names come from ``model.state_dict(keep_vars=True)``, whose values are the model's own tensors:
the i-th key holding a tensor is matched to the i-th path holding it (the two walks visit
modules in the same order).

A module that overrides ``get_extra_state`` saves its return value as ``<prefix>_extra_state``
(:func:`extra_states`); ``load_into`` hands the checkpoint's tensor there to ``set_extra_state``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["extra_states", "state_dict_renames", "tree_tensors"]

EXTRA = "_extra_state"
"""The key suffix of a module's extra state (``torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX``)."""


def tree_tensors(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor, bool]]:
    """``(path, module, attribute, tensor, is_parameter)`` for every parameter and persistent
    buffer, each place it is held (a shared module's under each of its paths)."""
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for attr, p in module._parameters.items():
            if p is not None:
                yield prefix + attr, module, attr, p, True
        for attr, b in module._buffers.items():
            if b is not None and attr not in module._non_persistent_buffers_set:
                yield prefix + attr, module, attr, b, False


def extra_states(model: nn.Module) -> dict[str, nn.Module]:
    """``{path of its _extra_state key: module}`` for the modules whose extra state a state
    dict holds (those overriding ``get_extra_state``), by path, each module once per path."""
    out: dict[str, nn.Module] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            out[f"{module_name}.{EXTRA}" if module_name else EXTRA] = module
    return out


def _renames(model: nn.Module) -> bool:
    """Whether some module may save its keys under other names than its paths."""
    for module in model.modules():
        cls = type(module)
        if (
            module._state_dict_hooks
            or cls.state_dict is not nn.Module.state_dict
            or cls._save_to_state_dict is not nn.Module._save_to_state_dict
        ):
            return True
    return False


def state_dict_renames(model: nn.Module) -> dict[str, str | None] | None:
    """``{path: state-dict key}`` for every tensor path and extra-state path (:func:`extra_states`),
    ``None`` for a path the state dict leaves out; ``None`` where no module can rename (the paths
    are the keys). Raises ``ValueError`` for a state-dict key holding a tensor that is none of the
    model's parameters and buffers: a hook made it, and ``load_into`` fills tensors in place."""
    if not _renames(model):
        return None
    paths: dict[int, collections.deque[str]] = {}
    for path, _, _, t, _ in tree_tensors(model):
        paths.setdefault(id(t), collections.deque()).append(path)
    extras = collections.deque(extra_states(model))
    out: dict[str, str | None] = dict.fromkeys([p for q in paths.values() for p in q])
    out.update(dict.fromkeys(extras))
    for key, value in model.state_dict(keep_vars=True).items():
        held = paths.get(id(value)) if isinstance(value, torch.Tensor) else None
        if held:
            out[held.popleft()] = key
        elif key.rsplit(".", 1)[-1] == EXTRA and extras:
            out[extras.popleft()] = key
        elif isinstance(value, torch.Tensor):
            raise ValueError(
                f"model.state_dict() holds {key!r}, a tensor that is none of the model's "
                "parameters and buffers (a state-dict hook made it): load_into fills the "
                "model's tensors in place; load this model with load_state_dict"
            )
    return out
