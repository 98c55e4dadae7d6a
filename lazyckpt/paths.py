"""Safe file lookup inside a checkpoint folder.

Index files and folder listings name files; a hostile or damaged one can name ``../../etc``, an
absolute path, or a symlink leading elsewhere (or in a loop). Every member a loader opens goes
through :func:`member_path`. The one outside target allowed is a Hugging Face cache blob: hub
snapshots are folders of symlinks into ``../../blobs``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath

from lazyckpt.errors import CorruptModelCheckpointError

__all__ = ["list_files", "member_path", "names_ending"]


def member_path(folder: Path, name: object, *, cited_by: Path) -> Path:
    """``folder / name`` after checking it is a regular file that stays inside ``folder``.

    ``cited_by`` is the file (index) or folder that named it, for the error message.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise CorruptModelCheckpointError(
            cited_by, f"names the file {name!r}, which is not a file name"
        )
    # A plain name (no separator, drive or dot entry) cannot leave the folder by its
    # spelling: it skips the parsing below, which cost 16 us a file (a set of 8 rank files).
    plain = not ("/" in name or "\\" in name or ":" in name or name in (".", ".."))
    if not plain:
        posix, windows = PurePosixPath(name), PureWindowsPath(name)
        if (
            posix.is_absolute()
            or windows.is_absolute()
            or windows.drive
            or ".." in posix.parts
            or (".." in windows.parts)
        ):
            raise CorruptModelCheckpointError(
                cited_by,
                f"names the file {name!r}, which lies outside the checkpoint folder; "
                "an index may only name files inside its own folder",
            )
    full = folder / name
    if plain:
        # A plain name that is a regular file, not a symlink, is inside the folder as it
        # stands: one lstat instead of resolving every component of the path.
        try:
            if stat.S_ISREG(os.lstat(full).st_mode):
                return full
        except OSError:
            pass  # missing or unreadable: the slow path below says which
    try:
        resolved = full.resolve(strict=True)
    except FileNotFoundError:
        raise CorruptModelCheckpointError(
            cited_by,
            f"names the file {name!r}, which is missing from {folder}; the download "
            "or copy is incomplete",
        ) from None
    except (RuntimeError, OSError) as exc:  # a symlink loop: RuntimeError up to 3.12, OSError after
        raise CorruptModelCheckpointError(
            full, f"cannot be resolved ({exc}): a symlink loop?"
        ) from None
    root = folder.resolve()
    if not (resolved.is_relative_to(root) or _is_hub_blob(root, resolved)):
        raise CorruptModelCheckpointError(
            full,
            f"is a symlink to {resolved}, outside the checkpoint folder {root}; copy the file "
            "into the folder",
        )
    if not resolved.is_file():
        raise CorruptModelCheckpointError(full, "is not a regular file")
    return full


def _is_hub_blob(root: Path, resolved: Path) -> bool:
    """True for ``<repo>/blobs/<hash>`` when ``root`` is ``<repo>/snapshots/<revision>`` or a
    folder inside it (a diffusers repo keeps each model in one: ``transformer/``, ``unet/``)."""
    for snapshot in (root, *root.parents):
        if snapshot.parent.name == "snapshots":
            return resolved.parent == snapshot.parent.parent / "blobs"
    return False


def names_ending(folder: Path, suffixes: str | tuple[str, ...]) -> list[str]:
    """The names in ``folder`` (not recursive) ending in ``suffixes``, hidden ones skipped, in
    listing order: names, not ``Path`` objects, as this runs before every load of a folder."""
    return [n for n in os.listdir(folder) if n.endswith(suffixes) and not n.startswith(".")]


def list_files(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files of ``folder`` (not recursive) ending in one of ``suffixes``, sorted by name, each
    checked by :func:`member_path`. Hidden files are skipped."""
    try:
        names = sorted(names_ending(folder, suffixes))
    except OSError as exc:
        raise CorruptModelCheckpointError(
            folder, f"cannot be listed: {exc.strerror or exc}"
        ) from None
    return [member_path(folder, n, cited_by=folder) for n in names]
