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
(:attr:`ModelKeys.extras`); ``load_into`` hands the checkpoint's tensor there to ``set_extra_state``.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["ModelKeys", "model_keys", "state_dict_renames"]

EXTRA = "_extra_state"
"""The key suffix of a module's extra state (``torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX``)."""


class ModelKeys(NamedTuple):
    """One walk of the module tree (:func:`model_keys`)."""

    tensors: list[tuple[str, nn.Module, str, torch.Tensor, bool]]
    """``(path, module, attribute, tensor, is_parameter)`` for every parameter and persistent
    buffer, each place it is held (a shared module's under each of its paths)."""
    extras: dict[str, nn.Module]
    """``{path of its _extra_state key: module}`` for the modules whose extra state a state
    dict holds (those overriding ``get_extra_state``)."""
    renames: dict[str, str | None] | None
    """``{path: state-dict key}`` for every path above, ``None`` for a path the state dict
    leaves out; ``None`` where no module can rename (the paths are the keys)."""

    def key(self, path: str) -> str | None:
        return path if self.renames is None else self.renames[path]


def model_keys(model: nn.Module) -> ModelKeys:
    """The model's tensors and extra states by path, and their state-dict names where a module
    may rename them: one walk of the tree, and ``state_dict()`` only where a module has a
    state-dict post-hook or overrides ``state_dict``/``_save_to_state_dict``. Raises
    ``ValueError`` for a state-dict key holding a tensor that is none of the model's parameters
    and buffers: a hook made it, and ``load_into`` fills tensors in place."""
    tensors: list[tuple[str, nn.Module, str, torch.Tensor, bool]] = []
    extras: dict[str, nn.Module] = {}
    renames = False
    base_state_dict, base_save = nn.Module.state_dict, nn.Module._save_to_state_dict
    base_extra = nn.Module.get_extra_state
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for attr, p in module._parameters.items():
            if p is not None:
                tensors.append((prefix + attr, module, attr, p, True))
        persistent_only = module._non_persistent_buffers_set
        for attr, b in module._buffers.items():
            if b is not None and attr not in persistent_only:
                tensors.append((prefix + attr, module, attr, b, False))
        cls = type(module)
        if cls.get_extra_state is not base_extra:
            extras[prefix + EXTRA] = module
        if not renames and (
            module._state_dict_hooks
            or cls.state_dict is not base_state_dict
            or cls._save_to_state_dict is not base_save
        ):
            renames = True
    names = _renames(model, tensors, extras) if renames else None
    return ModelKeys(tensors, extras, names)


def state_dict_renames(model: nn.Module) -> dict[str, str | None] | None:
    """:attr:`ModelKeys.renames` of ``model``."""
    return model_keys(model).renames


def _renames(
    model: nn.Module,
    tensors: list[tuple[str, nn.Module, str, torch.Tensor, bool]],
    extras: dict[str, nn.Module],
) -> dict[str, str | None]:
    paths: dict[int, collections.deque[str]] = {}
    for path, _, _, t, _ in tensors:
        paths.setdefault(id(t), collections.deque()).append(path)
    unnamed = collections.deque(extras)
    out: dict[str, str | None] = dict.fromkeys(path for path, *_ in tensors)
    out.update(dict.fromkeys(extras))
    for key, value in model.state_dict(keep_vars=True).items():
        held = paths.get(id(value)) if isinstance(value, torch.Tensor) else None
        if held:
            out[held.popleft()] = key
        elif key.rsplit(".", 1)[-1] == EXTRA and unnamed:
            out[unnamed.popleft()] = key
        elif isinstance(value, torch.Tensor):
            raise ValueError(
                f"model.state_dict() holds {key!r}, a tensor that is none of the model's "
                "parameters and buffers (a state-dict hook made it): load_into fills the "
                "model's tensors in place; load this model with load_state_dict"
            )
    return out
