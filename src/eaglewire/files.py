"""Atomic writes of files and folders: a reader sees the old one or the whole new one, never a part."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, fsync, then rename over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (the directory entry, not only the file, must reach the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, data) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode())


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete leftovers of writes interrupted by a kill; returns what was removed."""
    stale = [p for p in Path(folder).glob(".*.tmp-*") if p.is_file()]
    for path in stale:
        path.unlink()
    return stale


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def previous_of(folder: Path) -> Path:
    """Where replace_folder keeps the old folder while it swaps the new one in."""
    return folder.with_name(f".{folder.name}.previous")


def recover_folder_swap(folder: Path) -> str | None:
    """Finish what an interrupted replace_folder left beside ``folder``; returns what was done, or None."""
    folder = Path(folder)
    previous = previous_of(folder)
    if folder.parent.is_dir():
        for name in os.listdir(folder.parent):
            if name.startswith(f".{folder.name}.tmp-"):
                shutil.rmtree(folder.parent / name)
    if not previous.is_dir():
        return None
    if folder.exists():  # the swap completed; only removing the old copy was cut short
        shutil.rmtree(previous)
        return f"removed the leftover previous copy {previous}"
    os.replace(previous, folder)  # cut between the two renames: put the old folder back
    return f"restored the previous copy from {previous}"


def replace_folder(folder: Path, build: Callable[[Path], None]) -> Path:
    """Build a new ``folder`` with ``build(tmp)`` in a temporary sibling, then swap it in with two renames.

    A failure in ``build`` or a kill leaves the old folder (recover_folder_swap, which every call runs
    first, puts it back after a kill between the renames)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    recover_folder_swap(folder)
    tmp, previous = folder.with_name(f".{folder.name}.tmp-{os.getpid()}"), previous_of(folder)
    tmp.mkdir()
    try:
        build(tmp)
        if folder.exists():
            os.replace(folder, previous)
        os.replace(tmp, folder)
        fsync_dir(folder.parent)
    except BaseException:
        recover_folder_swap(folder)  # drops the temporary, puts the old folder back if it was moved
        raise
    if previous.exists():
        shutil.rmtree(previous)
    return folder
