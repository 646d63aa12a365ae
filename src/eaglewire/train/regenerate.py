"""``eaglewire regenerate``: the target answers each conversation's user turns itself.

A drafter imitates the target, so training answers written by the target
itself show it the target's own continuations rather than another model's.
For every source conversation the system and user turns are kept and each
assistant turn is replaced, in order: the prompt for answer i is the chat
template over the conversation so far, with the target's own earlier answers.
Trailing user turns without an answer in the source are dropped. With
``keep_answers`` N, the first N answers of each source conversation are kept as
they are (e.g. the target's own, from an earlier regenerate over first turns),
so only the later turns cost target forwards; a conversation with no answer
after those is skipped.

Several conversations advance together, one target forward per step
(``batching.Batch``, the serving path: a batched answer equals the answer
alone). Each answer samples with its own seed (``seed``, the source index and
the turn), so neither batching nor a restart changes it.

Output: ``OUT`` (JSONL, one ``{"messages": [...], "source_index": i}`` per usable
source conversation, in source order; ``extract``, ``train --online`` and the
draft-vocabulary count read it as ``--data``) and ``OUT.meta.json`` (the target
fingerprint, sampling settings, source identity and counts). A conversation
finished early waits until every earlier one is written, so the file is always
a prefix of the finished result; after a kill the same command continues from
the last complete line and writes the identical file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..data.conversations import Record, iter_records, open_source
from ..engine.batching import Batch
from ..engine.sampling import SamplingParams
from ..engine.speculative import Engine, Finished, GenerationConfig
from ..errors import EaglewireError
from ..files import atomic_write_json
from ..target import DEFAULT_TARGET, load_target

META_SUFFIX = ".meta.json"


class RegenerateError(EaglewireError):
    """Bad regenerate settings, or an --out that belongs to another run."""


@dataclass
class RegenerateConfig:
    data: str  # 'sharegpt' or a .json/.jsonl conversation file
    out: Path  # the .jsonl to write
    target: str = DEFAULT_TARGET
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    max_samples: int | None = None  # source records to read (counting malformed ones, as extract does)
    batch: int = 8  # conversations in flight at once
    seed: int = 0
    max_len: int = 2048  # context per conversation: it ends at the first turn whose prompt no longer fits
    keep_answers: int = 0  # each source conversation's first N answers are copied, not regenerated
    progress: bool = True

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.out.suffix != ".jsonl":
            raise RegenerateError(f"--out {self.out} must end in .jsonl (one conversation per line)")
        if self.keep_answers < 0:
            raise RegenerateError(f"--keep-answers must be >= 0, got {self.keep_answers}")
        for name in ("max_new_tokens", "batch"):
            if getattr(self, name) < 1:
                raise RegenerateError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_samples is not None and self.max_samples < 1:
            raise RegenerateError(f"--max-samples must be >= 1, got {self.max_samples}")
        if self.max_len < 2:
            raise RegenerateError(f"--max-len must be >= 2, got {self.max_len}")
        SamplingParams(self.temperature, self.top_p)  # range checks, with their own messages

    def identity(self) -> dict:
        """What a resumed run must share with the one that wrote the file."""
        data = asdict(self)
        for key in ("out", "batch", "progress"):
            data.pop(key)
        if not self.keep_answers:  # files written before the option existed kept none, and still continue
            data.pop("keep_answers")
        return data


@dataclass
class _Conversation:
    index: int
    source: list[dict]  # the source messages
    keep_answers: int  # source answers copied as they are before the target answers
    messages: list[dict] = field(default_factory=list)  # what is written: source turns, the target's answers
    next_turn: int = 0  # index into ``source`` of the next message to copy or answer
    kept: int = 0  # source answers copied so far
    answered: int = 0  # answers the target wrote

    def next_prompt(self) -> list[dict] | None:
        """Copy source turns (and kept answers) up to the next answer to write; the messages to answer,
        or None when done."""
        while self.next_turn < len(self.source):
            message = self.source[self.next_turn]
            if message["role"] == "assistant":
                if self.kept == self.keep_answers:
                    return self.messages
                self.kept += 1
            self.messages.append(message)
            self.next_turn += 1
        return None

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.next_turn += 1
        self.answered += 1

    def finished_messages(self) -> list[dict] | None:
        """The conversation up to its last answer, or None if the target answered nothing."""
        if not self.answered:
            return None
        last = max(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        return self.messages[: last + 1]

    def skip_reason(self) -> str:
        """Why a conversation the target answered nothing in is left out."""
        return "prompt_too_long" if self.next_turn < len(self.source) else "no_turn_to_answer"


def read_meta(out: Path) -> dict:
    return json.loads(Path(str(out) + META_SUFFIX).read_text())


def run_regenerate(cfg: RegenerateConfig, engine: Engine | None = None) -> dict:
    """Regenerate as ``cfg`` says; returns the metadata written beside the output."""
    source = open_source(cfg.data)  # cheap checks first: fail before loading a model
    # Batches of conversations decode together, so the lm_head multiplies many rows a call (1.4x faster packed).
    engine = engine or Engine(load_target(cfg.target), None, None, cfg.max_len, batched_lm_head=True)
    if engine.max_len != cfg.max_len:
        raise RegenerateError(f"the engine's context is {engine.max_len} tokens, the config says {cfg.max_len}")
    meta_path = Path(str(cfg.out) + META_SUFFIX)
    meta = {"settings": cfg.identity(), "target": engine.target.fingerprint, "source": source.identity(),
            "complete": False}
    done_index = _resume_point(cfg.out, meta_path, meta)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(meta_path, meta)

    records = (r for r in iter_records(source) if r.index > done_index
               and (cfg.max_samples is None or r.index < cfg.max_samples))
    skipped: dict[str, int] = {}
    bar = tqdm(total=cfg.max_samples, initial=done_index + 1, unit="conv", desc="regenerate",
               disable=not cfg.progress, dynamic_ncols=True)
    with cfg.out.open("a", encoding="utf-8") as handle:
        writer = _OrderedWriter(handle, done_index + 1, bar)
        for index, messages, reason in _answers(engine, cfg, records):
            if reason is not None:
                skipped[reason] = skipped.get(reason, 0) + 1
            writer.finish(index, messages)
        writer.close()
    bar.close()
    counts = _count_lines(cfg.out)
    meta.update(complete=True, conversations=counts, skipped_this_run=skipped)
    atomic_write_json(meta_path, meta)
    return meta


def _answers(engine: Engine, cfg: RegenerateConfig, records: Iterator[Record]):
    """Yield (source index, messages or None, skip reason or None) as conversations finish, in any order."""
    batch = Batch(engine, cfg.batch, draft_up_to=None)
    live: dict[tuple[int, int], _Conversation] = {}  # (source index, turn) -> conversation

    def start(conversation: _Conversation):
        """Start the conversation's next answer; the finished conversation if there is none to start."""
        prompt = conversation.next_prompt()
        if prompt is None:
            return conversation
        ids = engine.chat_prompt(prompt)
        if len(ids) + 1 > engine.max_len:
            return conversation  # the context is full: the conversation ends with its last answer
        turn = conversation.next_turn
        sampling = SamplingParams(cfg.temperature, cfg.top_p, seed=_seed(cfg.seed, conversation.index, turn))
        config = GenerationConfig(max_new_tokens=min(cfg.max_new_tokens, engine.max_len - len(ids)),
                                  sampling=sampling, strategy="none")
        live[(conversation.index, turn)] = conversation
        events = batch.add((conversation.index, turn), ids, config)
        assert not any(isinstance(e, Finished) for _, e in events), "a generation cannot finish before its prefill"
        return None

    def ended(conversation: _Conversation):
        messages = conversation.finished_messages()
        return conversation.index, messages, (None if messages is not None else conversation.skip_reason())

    pending = iter(records)
    exhausted = False
    while True:
        while batch.has_room and not exhausted:
            record = next(pending, None)
            if record is None:
                exhausted = True
                break
            if record.messages is None:
                yield record.index, None, "malformed"
                continue
            done = start(_Conversation(record.index, record.messages, cfg.keep_answers))
            if done is not None:
                yield ended(done)
        if not batch.running:
            return
        for key, event in batch.step():
            if isinstance(event, Exception):
                raise event
            if isinstance(event, Finished):
                conversation = live.pop(key)
                conversation.answer(event.text)
                done = start(conversation)
                if done is not None:
                    yield ended(done)


def _seed(seed: int, index: int, turn: int) -> int:
    return (seed * 1_000_003 + index) * 1_009 + turn


class _OrderedWriter:
    """Writes finished conversations in source order; holds later ones until the earlier ones are done."""

    def __init__(self, handle, next_index: int, bar):
        self.handle, self.next_index, self.bar = handle, next_index, bar
        self.waiting: dict[int, list[dict] | None] = {}

    def finish(self, index: int, messages: list[dict] | None) -> None:
        self.waiting[index] = messages
        wrote = False
        # indices are contiguous in the source (malformed records count), so the next one always arrives
        while self.next_index in self.waiting:
            messages = self.waiting.pop(self.next_index)
            if messages is not None:
                self.handle.write(json.dumps({"messages": messages, "source_index": self.next_index},
                                             ensure_ascii=False) + "\n")
                wrote = True
            self.next_index += 1
            self.bar.update(1)
        if wrote:
            self.handle.flush()
            os.fsync(self.handle.fileno())

    def close(self) -> None:
        if self.waiting:
            raise RuntimeError(f"conversations {sorted(self.waiting)[:5]} finished but an earlier one never did")


def _resume_point(out: Path, meta_path: Path, meta: dict) -> int:
    """The last source index already written (-1 for a new file); refuses a file from other settings."""
    if not out.exists():
        return -1
    if not meta_path.is_file():
        raise RegenerateError(f"--out {out} exists but has no {meta_path.name}: it was not written by eaglewire "
                              "regenerate; choose a new --out (nothing was changed)")
    theirs = json.loads(meta_path.read_text())
    diffs = [key for key in ("settings", "target", "source") if theirs[key] != meta[key]]
    if diffs:
        detail = "; ".join(f"{k}: {v!r} vs {meta['settings'][k]!r}" for k, v in theirs["settings"].items()
                           if meta["settings"].get(k) != v) if "settings" in diffs else ", ".join(diffs)
        raise RegenerateError(f"--out {out} was regenerated with other settings, target or source ({detail}); "
                              "use another --out, or delete it to start over (nothing was changed)")
    text = out.read_bytes()
    complete = text[: text.rfind(b"\n") + 1]  # a line cut by a kill is dropped and redone
    if len(complete) != len(text):
        with out.open("r+b") as handle:
            handle.truncate(len(complete))
    lines = complete.decode("utf-8").splitlines()
    # With nothing written yet, the records before the first usable one are redone (they are cheap skips).
    return json.loads(lines[-1])["source_index"] if lines else -1


def _count_lines(out: Path) -> int:
    with out.open("rb") as handle:
        return sum(1 for _ in handle)

