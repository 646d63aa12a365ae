"""Training samples: from an extracted dataset (offline) or by running the target (online).

Both sources list every sample cheaply up front (record index, token ids,
loss mask) so batching, splitting and the draft vocabulary never need hidden
states; ``load`` then returns one sample's aux states and ``final``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ConfigError
from ..target import Target, chat_template_of
from ..wiring import Wiring
from .capture import capture
from .chat import SkipRecord, prepare_record
from .conversations import iter_records, open_source
from .manifest import Manifest, open_dataset
from .shards import hidden_key

EVAL_EVERY_NTH_RECORD = 50  # records with index % 50 == 0 are held out (2%), stable as data grows


def is_held_out(record_index: int) -> bool:
    """Whether training keeps this source record out (it evaluates on it instead)."""
    return record_index % EVAL_EVERY_NTH_RECORD == 0


@dataclass(frozen=True)
class SampleRef:
    record_index: int
    input_ids: torch.Tensor  # [T] integer ids
    loss_mask: torch.Tensor  # [T] bool
    shard: str | None = None  # offline: shard file and token range
    start: int = 0
    folder: Path | None = None  # offline: the dataset folder the shard is in
    replayed: bool = False  # from a --replay dataset: trained on, never evaluated

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def held_out(self) -> bool:
        return is_held_out(self.record_index)


@dataclass
class Loaded:
    input_ids: torch.Tensor  # [T], or [B, T] from load_batch
    loss_mask: torch.Tensor  # [(B,) T]
    aux: torch.Tensor  # [(B,) T, num_aux * H], in wiring order
    final: torch.Tensor  # [(B,) T, H]

    def to(self, device: str) -> "Loaded":
        return Loaded(*(t.to(device) for t in (self.input_ids, self.loss_mask, self.aux, self.final)))


def first_answer_tokens(ref: SampleRef, limit: int) -> SampleRef:
    """``ref`` trained on the first ``limit`` tokens of each answer (each run of loss-masked positions) and
    cut after the last of them; what precedes a kept token, later answers' context included, is unchanged."""
    mask = ref.loss_mask.bool()
    position = torch.arange(len(mask))
    starts = mask & ~torch.cat([mask.new_zeros(1), mask[:-1]])  # each answer's first token
    offset = position - torch.cummax(torch.where(starts, position, 0), dim=0).values
    keep = mask & (offset < limit)
    end = int(position[keep].max()) + 1 if bool(keep.any()) else 0
    return replace(ref, input_ids=ref.input_ids[:end], loss_mask=keep[:end])


def stack_ids(samples: list[SampleRef] | list[Loaded], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples' ids and loss masks as [B, length], right-padded (pad id 0, never trained on)."""
    pads = [length - len(s.input_ids) for s in samples]
    ids = [torch.nn.functional.pad(s.input_ids.long(), (0, pad)) for s, pad in zip(samples, pads)]
    masks = [torch.nn.functional.pad(s.loss_mask, (0, pad), value=False) for s, pad in zip(samples, pads)]
    return torch.stack(ids), torch.stack(masks)


def stack_padded(loaded: list[Loaded]) -> Loaded:
    """Samples as one batch [B, T_max, ...], right-padded: causal attention keeps pads out of real positions."""
    length = max(len(s.input_ids) for s in loaded)
    states = [torch.stack([torch.nn.functional.pad(getattr(s, name), (0, 0, 0, length - len(s.input_ids)))
                           for s in loaded]) for name in ("aux", "final")]
    return Loaded(*stack_ids(loaded, length), *states)


class DatasetSamples:
    """Samples of an extracted dataset; every shard's sha256 is verified on open."""

    def __init__(self, folder: Path, max_samples: int | None = None, skip: int = 0):
        self.folder = Path(folder)
        self.manifest: Manifest = open_dataset(self.folder, verify=True)
        self.wiring: Wiring = self.manifest.wiring
        self.refs: list[SampleRef] = []
        for entry in self.manifest.shards:
            with safe_open(str(self.folder / entry.file), framework="pt") as handle:
                ids, mask = handle.get_tensor("input_ids").long(), handle.get_tensor("loss_mask")
                offsets, records = handle.get_tensor("offsets").tolist(), handle.get_tensor("record_index").tolist()
            for s, record in enumerate(records):
                if record < skip:
                    continue
                a, b = offsets[s], offsets[s + 1]
                self.refs.append(SampleRef(record, ids[a:b], mask[a:b], entry.file, a, self.folder))
        if max_samples is not None:
            self.refs = self.refs[:max_samples]

    def add_replay(self, other: "DatasetSamples") -> None:
        """Train on ``other``'s samples as well, after this dataset's own (held-out evaluation reads the first
        held-out samples, so it stays on this dataset; ``other``'s held-out records stay out of training)."""
        if other.wiring != self.wiring:
            raise ConfigError(f"dataset {other.folder} has wiring {other.wiring}, {self.folder} has {self.wiring}; "
                              "replay only datasets extracted with the same wiring")
        self.refs.extend(replace(ref, replayed=True) for ref in other.refs)

    def load(self, ref: SampleRef) -> Loaded:
        return load_stored(ref.folder, ref, self.wiring)

    def load_batch(self, refs: list[SampleRef]) -> Loaded:
        return stack_padded([self.load(ref) for ref in refs])


def load_stored(folder: Path, ref: SampleRef, wiring: Wiring) -> Loaded:
    """One offline sample's tensors stored under ``wiring``'s labels (the doctor reads a checkpoint's
    wiring this way, which need not be the data's)."""
    end = ref.start + ref.length
    with safe_open(str(Path(folder) / ref.shard), framework="pt") as handle:
        aux = [handle.get_slice(hidden_key(p))[ref.start:end] for p in wiring.aux]
        final = handle.get_slice(hidden_key(wiring.teacher))[ref.start:end]
    return Loaded(ref.input_ids, ref.loss_mask, torch.cat(aux, dim=-1).float(), final.float())


class OnlineSamples:
    """Conversations tokenized up front (int32 ids, 5 bytes a token); hidden states come from
    running the target per sample. Malformed records are skipped and counted, or refused with strict."""

    def __init__(self, target: Target, wiring: Wiring, data: str, max_samples: int | None, max_length: int,
                 strict: bool = False, skip: int = 0):
        """Records with index in [skip, max_samples) become samples."""
        self.target, self.wiring = target, wiring
        self.source = open_source(data)
        template = chat_template_of(target.tokenizer)
        self.refs: list[SampleRef] = []
        self.skipped: dict[str, int] = {}
        for record in iter_records(self.source):
            if max_samples is not None and record.index >= max_samples:
                break
            if record.index < skip:
                continue
            try:
                tokens = prepare_record(record, target.tokenizer, template, max_length)
            except SkipRecord as reason:
                reason.refuse_if_strict(record, strict)
                self.skipped[reason.reason] = self.skipped.get(reason.reason, 0) + 1
                self.skipped.setdefault("first", f"{record.where}: {reason}")
                continue
            self.refs.append(SampleRef(record.index, tokens.input_ids.to(torch.int32), tokens.loss_mask))

    def load(self, ref: SampleRef) -> Loaded:
        ids = ref.input_ids.long().to(self.target.layout.embed.weight.device)
        captured = capture(self.target.layout, self.wiring.points, ids[None])
        aux = torch.cat([captured[p][0] for p in self.wiring.aux], dim=-1)
        return Loaded(ids, ref.loss_mask, aux, captured[self.wiring.teacher][0])

    def load_batch(self, refs: list[SampleRef]) -> Loaded:
        """Several samples through one target forward, right-padded to the longest (a GPU runs this far
        faster than one forward per sample; causal attention keeps each sample's states its own)."""
        ids, masks = stack_ids(refs, max(ref.length for ref in refs))
        ids = ids.to(self.target.layout.embed.weight.device)
        captured = capture(self.target.layout, self.wiring.points, ids)
        aux = torch.cat([captured[p] for p in self.wiring.aux], dim=-1)
        return Loaded(ids, masks, aux, captured[self.wiring.teacher])


def draft_vocabulary(refs: list[SampleRef], vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` target ids most often trained on (loss-masked tokens), ties by overall count then id."""
    if not 0 < size <= vocab_size:
        raise ConfigError(f"--draft-vocab must be in 1..{vocab_size} (the target vocabulary), got {size}")
    masked = torch.zeros(vocab_size, dtype=torch.int64)
    overall = torch.zeros(vocab_size, dtype=torch.int64)
    for ref in refs:
        ids = ref.input_ids.long()
        masked += torch.bincount(ids[ref.loss_mask], minlength=vocab_size)
        overall += torch.bincount(ids, minlength=vocab_size)
    # lexicographic sort by (masked desc, overall desc, id asc) via a stable sort on each key in reverse
    order = torch.arange(vocab_size)
    order = order[torch.argsort(-overall[order], stable=True)]
    order = order[torch.argsort(-masked[order], stable=True)]
    return order[:size].sort().values
