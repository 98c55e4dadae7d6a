"""A model's state-dict keys: what its tensors are called in a checkpoint of it.

``load_into`` and ``get_shard_dims`` walk the module tree (``module._parameters``, persistent
``module._buffers``), which names each tensor by its path: cheap, and no hook runs. A module's
state-dict post-hook may rename those keys, and the checkpoint then holds the new names.
``checkpoint_wrapper`` (activation checkpointing, as FSDP2 training recipes apply it) drops its
``_checkpoint_wrapped_module.`` so that a wrapped model saves and loads under the plain names.
Where such a hook (or an override of ``state_dict``/``_save_to_state_dict``) is present, the
names come from ``model.state_dict(keep_vars=True)``, whose values are the model's own tensors:
the i-th key holding a tensor is matched to the i-th path holding it (the two walks visit
modules in the same order). Names are only ever changed, never dropped: ``load_state_dict``
expects every path (under its name), whatever a hook leaves out of the state dict.

A module that overrides ``get_extra_state`` saves its return value as ``<prefix>_extra_state``;
one that overrides ``set_extra_state`` expects it (:attr:`ModelKeys.extras`), and ``load_into``
hands it the checkpoint's tensor there.
"""

from __future__ import annotations

import bisect
import collections
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["ModelKeys", "model_keys"]

EXTRA = "_extra_state"
"""The key suffix of a module's extra state (``torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX``)."""


class ModelKeys(NamedTuple):
    """One walk of the module tree (:func:`model_keys`)."""

    tensors: list[tuple[str, nn.Module, str, torch.Tensor, bool]]
    """``(path, module, attribute, tensor, is_parameter)`` for every parameter and persistent
    buffer, each place it is held (a shared module's under each of its paths)."""
    extras: dict[str, nn.Module]
    """``{path of its _extra_state key: module}`` for the modules that take an extra state
    (those overriding ``set_extra_state``, as ``load_state_dict`` tells them)."""
    renames: dict[str, str] | None
    """``{path: state-dict key}`` for every path above; ``None`` where no module can rename
    (the paths are the keys)."""

    def key(self, path: str) -> str:
        return path if self.renames is None else self.renames[path]


def model_keys(model: nn.Module) -> ModelKeys:
    """The model's tensors and extra states by path, and their state-dict names where a module
    may rename them: one walk of the tree, and ``state_dict()`` only where a module has a
    state-dict post-hook or overrides ``state_dict``/``_save_to_state_dict``."""
    tensors: list[tuple[str, nn.Module, str, torch.Tensor, bool]] = []
    extras: dict[str, nn.Module] = {}
    renames = False
    base_state_dict, base_save = nn.Module.state_dict, nn.Module._save_to_state_dict
    base_extra = nn.Module.set_extra_state
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
        if cls.set_extra_state is not base_extra:  # what load_state_dict asks for
            extras[prefix + EXTRA] = module
        if not renames and (
            module._state_dict_hooks
            or cls.state_dict is not base_state_dict
            or cls._save_to_state_dict is not base_save
        ):
            renames = True
    names = _renames(model, tensors, extras) if renames else None
    return ModelKeys(tensors, extras, names)


def _renames(
    model: nn.Module,
    tensors: list[tuple[str, nn.Module, str, torch.Tensor, bool]],
    extras: dict[str, nn.Module],
) -> dict[str, str] | None:
    """Each path's name in ``model.state_dict(keep_vars=True)``, where that holds the path's
    own tensor; a path it leaves out, or holds another tensor under (a hook that casts, or
    saves only adapters), keeps its path, as ``load_state_dict`` expects its key there. Extra
    states are matched by path first, then the rest in order. None where ``state_dict`` cannot
    be called so (an override without ``keep_vars``)."""
    try:
        state = model.state_dict(keep_vars=True)
    except Exception:  # its own business: the paths are the names then
        return None
    paths: dict[int, collections.deque[str]] = {}
    for path, _, _, t, _ in tensors:
        paths.setdefault(id(t), collections.deque()).append(path)
    out = {path: path for path, *_ in tensors}
    out.update((path, path) for path in extras)
    extra_keys = []
    for key, value in state.items():
        held = paths.get(id(value)) if isinstance(value, torch.Tensor) else None
        if held:
            out[held.popleft()] = key
        elif key.rsplit(".", 1)[-1] == EXTRA:
            extra_keys.append(key)
    # An extra state goes where its module's own tensors went (a wrapper's inner module), else
    # to the one name left, in order, where the counts agree.
    ordered = sorted(path for path, *_ in tensors)  # those under one prefix lie together
    renamed = [key for key in extra_keys if key not in extras]
    unmatched = []
    for path in extras:
        if path in extra_keys:
            continue
        prefix = path[: len(path) - len(EXTRA)]
        at = bisect.bisect_left(ordered, prefix)
        if at < len(ordered) and ordered[at].startswith(prefix):
            # A tensor of the module or below it: where its prefix went, its extra state goes.
            some = ordered[at]
            attr, key = some[len(prefix) :], out[some]
            moved = key[: len(key) - len(attr)] + EXTRA if key.endswith(attr) else None
            if moved in renamed:
                out[path] = moved
                renamed.remove(moved)
                continue
        unmatched.append(path)
    if len(unmatched) == len(renamed):
        out.update(zip(unmatched, renamed))
    return out
