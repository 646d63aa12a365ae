"""Hidden-state shards: one safetensors file per chunk of source records.

Chunk c holds the usable conversations among source records
[c * shard_records, (c + 1) * shard_records). Because the split depends only on
record indices, any number of processes can fill chunks in any order, an
interrupted run redoes only unfinished chunks, and the result is the same.

Tensors (samples packed back to back, T = total tokens, S = samples):
  input_ids     [T]    int32
  loss_mask     [T]    bool   token t belongs to an assistant turn (a training target)
  offsets       [S+1]  int64  sample s is tokens offsets[s]:offsets[s+1]
  record_index  [S]    int64  position of the sample in the source
  hidden.<point>[T, H]        one per captured point, e.g. hidden.layer14.out, hidden.final
The header metadata ``eaglewire`` holds the chunk's counts and skipped records.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..errors import EaglewireError
from ..files import atomic_write_bytes
from ..wiring import CapturePoint

HIDDEN_PREFIX = "hidden."


def hidden_key(point: CapturePoint | str) -> str:
    """The tensor name under which a shard stores the hidden states captured at ``point``."""
    return f"{HIDDEN_PREFIX}{point}"


class ShardError(EaglewireError):
    """A shard file is missing, corrupt, or from another run."""


def shard_name(chunk: int) -> str:
    return f"shard-{chunk:06d}.safetensors"


@dataclass
class Sample:
    record_index: int
    input_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T] bool
    hidden: dict[CapturePoint, torch.Tensor]  # point -> [T, H]


@dataclass
class ShardMeta:
    chunk: int
    first_record: int
    end_record: int  # exclusive
    samples: int
    tokens: int
    loss_tokens: int
    settings_sha256: str  # ties the shard to the run settings in the manifest
    skipped: int = 0
    first_skipped: str | None = None  # "item 17: unknown role 'bot'"
    skip_reasons: dict[str, int] = field(default_factory=dict)


def write_shard(path: Path, samples: list[Sample], points: tuple[CapturePoint, ...], meta: ShardMeta) -> int:
    """Pack ``samples`` and write them atomically. Returns the file size in bytes."""
    lengths = [len(s.input_ids) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32) if samples else torch.zeros(0, dtype=torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in samples]) if samples else torch.zeros(0, dtype=torch.bool),
        "offsets": offsets,
        "record_index": torch.tensor([s.record_index for s in samples], dtype=torch.int64),
    }
    for point in points:
        parts = [s.hidden[point] for s in samples]
        tensors[hidden_key(point)] = torch.cat(parts) if parts else torch.zeros(0, 0)
    data = save(tensors, metadata={"eaglewire": json.dumps(asdict(meta))})
    atomic_write_bytes(path, data)
    return len(data)


def read_shard_meta(path: Path) -> ShardMeta:
    try:
        with safe_open(str(path), framework="pt") as handle:
            raw = handle.metadata()["eaglewire"]
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ShardError(f"cannot read shard {path}: {exc}") from exc
    return ShardMeta(**json.loads(raw))
