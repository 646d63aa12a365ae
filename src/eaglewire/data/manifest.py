"""The dataset manifest: what a folder of hidden-state shards is, and proof of where it came from.

``manifest.json`` is written when an extraction starts (``complete: false``,
holding the run settings) and rewritten when it ends with the shard list,
counts and sha256 of every shard. The settings are what a resumed run must
match exactly; their hash is also stamped into every shard.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import EaglewireError
from ..files import atomic_write_json, sha256_file
from ..wiring import Wiring
from .shards import ShardError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Settings added after datasets had been written, with their defaults: at its default such a setting stays out of
# the hash, so an older dataset keeps the hash its manifest and shards recorded (and still opens and resumes).
SETTINGS_ADDED_LATER = {"held_out_only": False}


class ManifestError(EaglewireError):
    """A dataset folder is missing its manifest, incomplete, or not what was asked for."""


@dataclass(frozen=True)
class RunSettings:
    """Everything that determines the bytes of the shards."""

    target: dict  # fingerprint
    wiring: dict  # Wiring.to_json()
    dtype: str
    max_length: int
    shard_records: int
    max_samples: int | None
    source: dict  # conversations.Source.identity()
    chat_template: str
    held_out_only: bool = False  # only the records training holds out (`extract --held-out-only`)

    def sha256(self) -> str:
        hashed = {key: value for key, value in asdict(self).items()
                  if not (key in SETTINGS_ADDED_LATER and value == SETTINGS_ADDED_LATER[key])}
        return hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()

    def differences(self, other: "RunSettings") -> list[str]:
        """What differs, phrased for an error message."""
        mine, theirs = asdict(self), asdict(other)
        out = []
        for key in mine:
            if mine[key] == theirs[key]:
                continue
            if key == "target":
                diff = [k for k in mine[key] if mine[key].get(k) != theirs[key].get(k)]
                out.append(f"target ({', '.join(diff)}): {theirs[key].get('name')!r} vs {mine[key].get('name')!r}")
            elif key == "wiring":
                out.append(f"wiring: {Wiring.from_json(theirs[key])} vs {Wiring.from_json(mine[key])}")
            elif key == "chat_template":
                out.append("chat template")
            else:
                out.append(f"{key}: {theirs[key]!r} vs {mine[key]!r}")
        return out


@dataclass
class ShardEntry:
    file: str
    chunk: int
    first_record: int
    end_record: int
    samples: int
    tokens: int
    loss_tokens: int
    skipped: int
    bytes: int
    sha256: str


@dataclass
class Manifest:
    settings: RunSettings
    probe: dict
    complete: bool = False
    shards: list[ShardEntry] = field(default_factory=list)
    totals: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)  # reason -> count, plus "first"
    format_version: int = FORMAT_VERSION

    @property
    def wiring(self) -> Wiring:
        return Wiring.from_json(self.settings.wiring)

    def to_json(self) -> dict:
        data = asdict(self)
        data["settings_sha256"] = self.settings.sha256()
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Manifest":
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ManifestError(f"dataset format version {version!r} is not supported (this eaglewire reads {FORMAT_VERSION})")
        manifest = cls(
            settings=RunSettings(**data["settings"]),
            probe=data["probe"],
            complete=data["complete"],
            shards=[ShardEntry(**s) for s in data["shards"]],
            totals=data["totals"],
            skipped=data["skipped"],
        )
        if data.get("settings_sha256") != manifest.settings.sha256():
            raise ManifestError("manifest settings do not match their recorded hash: the file was edited or corrupted")
        return manifest

    def save(self, folder: Path) -> None:
        atomic_write_json(Path(folder) / MANIFEST, self.to_json())


def load_manifest(folder: Path) -> Manifest:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{folder} has no {MANIFEST}: it is not an eaglewire dataset (run `eaglewire extract` first)")
    try:
        return Manifest.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ManifestError(f"{path} is not a valid eaglewire manifest: {exc}") from exc


def open_dataset(folder: Path, verify: bool = True) -> Manifest:
    """Load a finished dataset; with ``verify`` every shard's sha256 is checked."""
    manifest = load_manifest(folder)
    if not manifest.complete:
        raise ManifestError(
            f"dataset {folder} is incomplete (extraction was interrupted); rerun the same `eaglewire extract` command to finish it"
        )
    for entry in manifest.shards:
        path = Path(folder) / entry.file
        if not path.is_file():
            raise ShardError(f"shard {path} listed in the manifest is missing")
        if verify and sha256_file(path) != entry.sha256:
            raise ShardError(f"shard {path} does not match its sha256 in the manifest: it is corrupt or was replaced")
    return manifest
