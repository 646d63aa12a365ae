"""The tokens a request returns, where it stops, and how much text is safe to stream so far.

Tokens arrive in blocks (every verify step accepts several); ``push`` takes them
one at a time so a stop that lands in the middle of a block ends the output
exactly there. Streamed text holds back what could still turn into a stop
string, and an incomplete UTF-8 sequence, so nothing streamed is ever retracted.

Text is decoded incrementally: each push decodes only the tokens since the last
point where the text was complete (plus the one block before it, so a tokenizer
that drops a leading space at the start of a decode keeps it), not the whole
output again, which made a long answer quadratic in its length.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import EaglewireError

FINISH_STOP = "stop"  # EOS or a stop string
FINISH_LENGTH = "length"  # max_new_tokens or the context limit


class StopError(EaglewireError):
    """Stop settings out of range."""


class OutputTracker:
    def __init__(self, tokenizer, eos_ids: Iterable[int], stop: Iterable[str], max_new_tokens: int):
        stop = tuple(stop)
        if any(not s for s in stop):
            raise StopError("stop strings must not be empty")
        if max_new_tokens < 1:
            raise StopError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.tokenizer, self.eos_ids, self.stop, self.max_new_tokens = tokenizer, frozenset(eos_ids), stop, max_new_tokens
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._text = ""
        self._settled = ""  # the text of token_ids[:_read], which no later token changes
        self._prefix, self._read = 0, 0  # token_ids[_prefix:_read] decode to _prefix_text, the end of _settled
        self._prefix_text = ""
        self._streamed = 0
        self._holdback = max((len(s) for s in stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._text

    def push(self, token: int) -> bool:
        """Add one token; True when the output is finished (the token is kept either way)."""
        if self.finished:
            raise RuntimeError("push after the output finished")
        self.token_ids.append(token)
        previous = len(self._text)
        window = self.tokenizer.decode(self.token_ids[self._prefix:], skip_special_tokens=True)
        tail = window[len(self._prefix_text):]
        self._text = self._settled + tail
        if tail and not tail.endswith("\ufffd"):  # complete: later tokens only append
            self._settled = self._text
            self._prefix, self._read = self._read, len(self.token_ids)
            self._prefix_text = self.tokenizer.decode(self.token_ids[self._prefix:self._read], skip_special_tokens=True)
        if token in self.eos_ids:
            self.finish_reason = FINISH_STOP
        elif self.stop:
            start = max(0, previous - self._holdback)
            hits = [i for i in (self._text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self._text = self._text[: min(hits)]
                self.finish_reason = FINISH_STOP
        if not self.finished and len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = FINISH_LENGTH
        return self.finished

    def end_for_context(self) -> None:
        """The context is full: finish as OpenAI reports it ('length')."""
        if not self.finished:
            self.finish_reason = FINISH_LENGTH

    def stream(self) -> str:
        """Text not streamed yet that no later token can change."""
        end = len(self._text)
        if not self.finished:
            end -= self._holdback
            while end > self._streamed and self._text[end - 1] == "\ufffd":  # an unfinished UTF-8 sequence
                end -= 1
        if end <= self._streamed:
            return ""
        chunk = self._text[self._streamed: end]
        self._streamed = end
        return chunk
