"""Options of a load, validated when built so a typo fails before any file is touched."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lazyckpt.imported import is_device_mesh
from lazyckpt.layout import DP_DIM_NAMES, TP_DIM_NAMES, Layout, named_mesh_dims, unnamed_cut
from lazyckpt.stats import LoadStats

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["KeyMap", "ModelCheckpointLoadOptions", "apply_key_map", "castable", "convertible"]

_CPU = torch.device("cpu")
"""Made once: a fresh fork's first ``torch.device`` costs 80-110 us (copy-on-write faults on
torch's pages), and every load asks."""

MiB = 1 << 20


def castable(dtype: torch.dtype) -> bool:
    """Floating-point dtypes torch converts to and from: not the packed ``float4_e2m1fn_x2``
    (two values a byte), which ``copy_`` refuses either way."""
    return dtype.is_floating_point and dtype not in _PACKED


_PACKED = frozenset(d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if d is not None)


@functools.cache
def convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether ``copy_`` fills a ``dst`` tensor from a ``src`` one (``load_into`` casts each key
    to its parameter's dtype, as ``load_state_dict`` does). Asked of torch with one element:
    it has no kernel between the packed float4, ``bits*``, the sub-byte integers or the
    quantized dtypes and another dtype, and which it lacks changes with its versions."""
    if src == dst:
        return True
    try:
        # Its warnings go out (complex to real: the load drops the imaginary parts): torch
        # says each once a process, and a filter put up to hide them would show others again.
        torch.empty(1, dtype=dst, device="cpu").copy_(torch.zeros(1, dtype=src, device="cpu"))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


KeyMap = Mapping[str, str | None] | Callable[[str], str | None]
"""Renames checkpoint keys: a mapping (keys not in it stay as they are) or a function; a
``None`` result drops the key."""


@dataclass(kw_only=True, frozen=True)
class ModelCheckpointLoadOptions:
    """How to load: for which rank, into what dtype and device, and how careful to be."""

    layout: Layout | None = None
    """The target rank; ``None`` loads whole tensors."""
    mmap: bool = True
    """Map files and copy from the mapping, or yield zero-copy views of it where the box lies in
    one chunk or in chunks whose ranges lie back to back (stitched, :mod:`lazyckpt.stitch`).
    ``False`` reads with ``pread`` straight into the destination, which suits network
    filesystems."""
    restrict: bool = True
    """Unpickle torch files with an allow-list (tensors, containers, dtypes only). ``False``
    allows any global, which runs code from the file: only for files you trust."""
    key_map: KeyMap | None = None
    """Renames or drops keys before any tensor data is read; ``shard_dims`` uses the new names."""
    device: torch.device | str | None = None
    """Where yielded tensors live; ``None`` is the CPU. A CUDA device stages through a small pool
    of pinned buffers."""
    dtype: torch.dtype | None = None
    """Cast floating-point tensors to this dtype while copying; integer and bool tensors keep
    theirs. ``None`` keeps the checkpoint's dtypes."""
    contiguous: bool = False
    """Yield contiguous tensors only. By default a box that lies in one chunk is yielded as a
    zero-copy view of the mapped file even when it is strided there (a dim-1 shard of a row-major
    matrix), as ``torch.chunk`` would give it; ``True`` copies such boxes instead."""
    prefetch_bytes: int = 32 * MiB
    """Budget of a background thread that builds the next tensors while the caller works on the
    current one. A built tensor counts until the caller frees it, and one tensor is always built
    ahead when none is waiting, so the loader holds at most the largest tensor plus this budget.
    Within that same bound, the memory of tensors the caller has freed is kept and reused for
    the next ones (the kernel then need not zero new pages). Zero-copy views cost nothing and
    are not prefetched, nor are copies of less than 256 KiB (building one is Python more than
    copying, which on the thread would take the GIL from the caller). 0 turns prefetching off."""
    verify_replicas: bool = True
    """For model-parallel sources, compare the copies of a replicated key (up to
    ``verify_replicas_max_bytes``) among the files this rank reads anyway."""
    verify_replicas_max_bytes: int = 16 * MiB
    """Largest replicated tensor whose copies are compared byte for byte."""
    stats: LoadStats | None = None
    """Filled in place with bytes read per file, bytes delivered and time."""
    progress: bool = False
    """Show a tqdm progress bar (bytes delivered) on stderr."""
    mesh: DeviceMesh | None = None
    """When set, yield DTensors on this mesh: ``Shard(dim)`` on its TP dim for keys in
    ``shard_dims``, ``Shard(0)`` on its DP dim. The layout is then taken from the mesh."""

    def __post_init__(self) -> None:
        if self.layout is not None and not isinstance(self.layout, Layout):
            raise ValueError(f"options.layout must be a lazyckpt.Layout, got {self.layout!r}")
        for name in ("mmap", "restrict", "contiguous", "verify_replicas", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"options.{name} must be a bool, got {getattr(self, name)!r}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"options.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.dtype is not None and not castable(self.dtype):
            raise ValueError(
                f"options.dtype is {self.dtype}, but only floating-point tensors are cast, to a "
                "dtype torch converts to: give another (integer and bool tensors keep theirs), or "
                "None"
            )
        if self.mesh is not None and not is_device_mesh(self.mesh):
            raise ValueError(
                f"options.mesh must be a torch.distributed DeviceMesh, got {self.mesh!r}"
            )
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"options.device {self.device!r} is not a device: {exc}") from exc
        for name in ("prefetch_bytes", "verify_replicas_max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"options.{name} must be an int >= 0, got {value!r}")
        if self.key_map is not None and not (
            isinstance(self.key_map, Mapping) or callable(self.key_map)
        ):
            raise ValueError(
                f"options.key_map must be a mapping or a function, got {self.key_map!r}"
            )
        # None first: isinstance against an ABC walks its subclasses the first time a type is
        # asked about (0.1 ms of a fresh process's first load).
        if self.key_map is not None and isinstance(self.key_map, Mapping):
            for key, new in self.key_map.items():
                if new is not None and not isinstance(new, str):
                    raise ValueError(
                        f"options.key_map maps {key!r} to {new!r}; each key must map to a str "
                        "or None"
                    )
        if self.stats is not None and not isinstance(self.stats, LoadStats):
            raise ValueError(f"options.stats must be a lazyckpt.LoadStats, got {self.stats!r}")

    @property
    def target_device(self) -> torch.device:
        return _CPU if self.device is None else torch.device(self.device)

    def usable_device(self) -> torch.device:
        """:attr:`target_device`, refused with a ``ValueError`` where it cannot be used."""
        device = self.target_device
        if device.type == "cpu":
            return device
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"options.device is {device} but CUDA is not available here")
        if device.type == "meta":
            raise ValueError(
                "options.device is meta, which holds no data: nothing would be read into it. "
                "For keys, shapes and dtypes without reading, see `lazyckpt inspect` or "
                "loader.plan()"
            )
        try:  # a backend torch lacks here, or a device index past the last
            torch.empty(0, device=device)
        except Exception as exc:
            raise ValueError(
                f"options.device is {device}, which torch cannot use here: {exc}"
            ) from None
        return device

    def target_layout(self) -> Layout:
        if self.mesh is not None:
            names = tuple(self.mesh.mesh_dim_names or ())
            if named_mesh_dims(names) == (None, None):
                # Layout.from_mesh's own fix (tp_dim=/dp_dim=) cannot be passed through options,
                # and the DTensors yielded need the names too.
                raise ValueError(
                    f"options.mesh has dim names {names or 'None'}, none of which says TP or "
                    "FSDP: name them when making the mesh (init_device_mesh(..., "
                    f"mesh_dim_names=('dp', 'tp'))); TP names: {', '.join(TP_DIM_NAMES)}; "
                    f"FSDP names: {', '.join(DP_DIM_NAMES)}"
                )
            odd = unnamed_cut(self.mesh)
            if odd is not None:
                raise ValueError(f"options.mesh: {odd}")
            layout = Layout.from_mesh(self.mesh)
            if self.layout is not None and self.layout != layout:
                raise ValueError(
                    f"options.layout ({self.layout}) disagrees with options.mesh ({layout}); "
                    "give one of them"
                )
            return layout
        return self.layout if self.layout is not None else Layout()


def options_or_default(options: object) -> ModelCheckpointLoadOptions:
    """``options``, or the defaults for None. Anything else is refused by name: a dict of fields
    failed deep inside with ``AttributeError: 'dict' object has no attribute ...``."""
    if options is None:
        return ModelCheckpointLoadOptions()
    if not isinstance(options, ModelCheckpointLoadOptions):
        hint = (
            "; write ModelCheckpointLoadOptions(**options)" if isinstance(options, Mapping) else ""
        )
        raise TypeError(
            "options must be a lazyckpt.ModelCheckpointLoadOptions or None, got a "
            f"{type(options).__name__}{hint}"
        )
    return options


def apply_key_map(key_map: KeyMap | None, key: str) -> str | None:
    """The new name of ``key`` (``None``: dropped)."""
    if key_map is None:
        return key
    if isinstance(key_map, Mapping):
        return key_map.get(key, key)
    new = key_map(key)
    if new is not None and not isinstance(new, str):
        raise ValueError(
            f"options.key_map returned {new!r} for {key!r}; it must return a str or None"
        )
    return new
