"""Atomic file writes: a reader sees the old file or the whole new one, never a part."""

from __future__ import annotations

import hashlib
import json
import os
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
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
