"""Chat-template rendering with a loss mask over assistant tokens.

The mask is found in character space, then mapped to tokens through the fast
tokenizer's offsets: for assistant turn i, the trained span runs from the end
of ``render(messages[:i], add_generation_prompt=True)`` (the assistant header)
to the end of ``render(messages[:i+1])`` (content and end-of-turn marker).
This works for any template whose renders of growing prefixes are prefixes of
each other; a template that is not is refused rather than guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import EaglewireError
from .conversations import DataError


class TemplateError(EaglewireError):
    """The chat template cannot render this conversation with a well-defined mask."""


@dataclass(frozen=True)
class Tokenized:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool: token t is part of an assistant turn (a training target)


def render(tokenizer, template: str, messages: list[dict], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as exc:  # jinja raises template-defined errors of arbitrary types
        raise TemplateError(f"the chat template refused the conversation: {exc}") from exc


def assistant_spans(tokenizer, template: str, messages: list[dict], text: str, limit: int) -> list[tuple[int, int]]:
    """[start, end) character spans of the assistant turns that begin before character ``limit``."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise TemplateError("the conversation starts with an assistant turn; it needs a user turn first")
        before = render(tokenizer, template, messages[:i], generation_prompt=True)
        if len(before) >= limit:
            break  # this turn and all later ones fall past the truncation point
        through = render(tokenizer, template, messages[: i + 1], generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise TemplateError(
                "the chat template's renders of growing prefixes of the conversation are not prefixes of each "
                "other, so assistant tokens cannot be located"
            )
        spans.append((len(before), len(through)))
    return spans


def tokenize_conversation(tokenizer, template: str, messages: list[dict], max_length: int) -> Tokenized:
    """Render, tokenize, truncate to ``max_length`` tokens and mask assistant tokens."""
    text = render(tokenizer, template, messages, generation_prompt=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"][:max_length]
    offsets = encoded["offset_mapping"][: len(ids)]
    limit = offsets[-1][1] if offsets else 0
    spans = assistant_spans(tokenizer, template, messages, text, limit)
    mask = [any(start <= begin < end for start, end in spans) for begin, _ in offsets]
    return Tokenized(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


class SkipRecord(ValueError):
    """A record that cannot be trained on; ``reason`` is a short key for counting."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason

    def refuse_if_strict(self, record, strict: bool) -> None:
        """Under --strict a malformed record stops the run; one merely truncated away is still skipped."""
        if strict and self.reason != "no_assistant_tokens":
            raise DataError(f"{record.where} of the conversation source: {self} (drop --strict to skip such records)") from self


def prepare_record(record, tokenizer, template: str, max_length: int) -> Tokenized:
    """Tokens and loss mask of a conversations.Record, or SkipRecord saying why not."""
    if record.messages is None:
        raise SkipRecord("malformed", record.error)
    try:
        tokens = tokenize_conversation(tokenizer, template, record.messages, max_length)
    except TemplateError as exc:
        raise SkipRecord("template", str(exc)) from exc
    if not tokens.loss_mask.any():
        raise SkipRecord("no_assistant_tokens", "no assistant tokens within --max-length")
    return tokens
