"""OpenAI-style request parsing and response bodies, independent of the web framework.

Every invalid request becomes an ``ApiError`` with the status and the error body
OpenAI clients expect: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.sampling import SamplingError, SamplingParams
from ..engine.speculative import TokenLogprob

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}  # -> template role
API_MAX_TEMPERATURE = 2.0  # OpenAI's documented range; the engine itself accepts up to sampling.MAX_TEMPERATURE
MAX_TOP_LOGPROBS = {True: 20, False: 5}  # chat's top_logprobs, completions' logprobs (OpenAI's limits)

# Every field each endpoint reads; any other is refused as the official API refuses it
# ("Unrecognized request argument supplied"), so that a misspelt or unsupported option never passes silently.
COMMON = ("model", "max_tokens", "n", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
          "logprobs", "logit_bias", "frequency_penalty", "presence_penalty", "user")
FIELDS = {
    True: COMMON + ("messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
                    "parallel_tool_calls", "functions", "function_call"),
    False: COMMON + ("prompt", "echo", "best_of", "suffix"),
}
# OpenAI fields this server knows and cannot honour: refused (with this reason) unless absent, null or the default.
UNSUPPORTED = {
    "tools": "tool calling", "functions": "function calling", "function_call": "function calling",
    "tool_choice": "tool calling", "parallel_tool_calls": "tool calling", "response_format": "structured output",
    "echo": "echoing the prompt", "best_of": "best_of > 1 (server-side candidates)", "suffix": "suffix (insertion)",
}
DEFAULTS = {"tools": ([],), "functions": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
            "echo": (False,), "best_of": (1,), "suffix": ("",)}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ApiRequest:
    chat: bool
    messages: list[dict] | None  # chat: {role, content: str} with the template's roles
    prompt: str | None  # completions
    max_tokens: int | None  # None: up to the context limit
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # alternatives reported per token; None: no logprobs


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, and integers of over 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _number(body: dict, name: str, default, low: float, high: float, kind=(int, float)):
    """``body[name]`` (null or absent: ``default``), a number in [low, high]."""
    value = body.get(name)
    if value is None:
        return default
    noun = "an integer" if kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be {noun} in [{low:g}, {high:g}], got {value!r}", param=name)
    return value


def _text(value, param: str) -> str:
    """A string a tokenizer can take: JSON may carry lone surrogates (\\ud800), which UTF-8 cannot encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{param} is not valid Unicode: {exc.reason} at character {exc.start}", param=param) from None
    return value


def _content(message: dict, i: int) -> str:
    """A message's text: a string, or an array of text parts (joined with newlines)."""
    content, param = message.get("content"), f"messages[{i}].content"
    if isinstance(content, str):
        return _text(content, param)
    if not isinstance(content, list) or not content:
        raise ApiError(400, f"{param} must be a string or a non-empty array of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{param}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}, got type "
                                f"{kind!r}: this server reads text only", param=f"{param}[{j}].type")
        texts.append(_text(part["text"], f"{param}[{j}].text"))
    return "\n".join(texts)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required: a non-empty list of {role, content} objects", param="messages")
    parsed = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}] has role {role!r}; expected one of {', '.join(ROLES)} "
                                "(tool messages need tool calling, which this server does not support)",
                           param=f"messages[{i}].role")
        for key in message:
            if key not in ("role", "content"):
                raise ApiError(400, f"messages[{i}].{key} is not supported by this server (a message is role and "
                                    "content)", param=f"messages[{i}].{key}")
        parsed.append({"role": ROLES[role], "content": _content(message, i)})
    return parsed


def _refuse_unsupported(body: dict, chat: bool) -> None:
    for name in body:
        if name not in FIELDS[chat]:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name)
    for name, what in UNSUPPORTED.items():
        value = body.get(name)
        if name in FIELDS[chat] and value is not None and value not in DEFAULTS.get(name, ()):
            raise ApiError(400, f"'{name}' is not supported: this server does not support {what} "
                                f"(got {json.dumps(value)[:80]})", param=name)


def _logprobs(body: dict, chat: bool) -> int | None:
    if not chat:  # completions: logprobs is the number of alternatives (0: the chosen token's only)
        return _number(body, "logprobs", None, 0, MAX_TOP_LOGPROBS[False], int)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, f"'logprobs' must be true or false, got {wanted!r}", param="logprobs")
    top = _number(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS[True], int)
    if top is not None and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or not all(
            isinstance(k, str) and k.isascii() and k.isdigit() and not isinstance(v, bool) and isinstance(v, (int, float))
            for k, v in bias.items()):
        raise ApiError(400, "'logit_bias' must map token ids (as strings) to numbers in [-100, 100]", param="logit_bias")
    return tuple(sorted((int(k), float(v)) for k, v in bias.items()))


def parse_request(body: dict, chat: bool, model_names: tuple[str, ...]) -> ApiRequest:
    _refuse_unsupported(body, chat)
    model = body.get("model")
    if model is not None and model not in model_names:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {', '.join(model_names)}",
                       param="model", code="model_not_found")
    messages = prompt = None
    if chat:
        messages = _messages(body)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' is required: a non-empty string (lists of prompts or of token ids are not "
                                "supported)", param="prompt")
        _text(prompt, "prompt")
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, max_name, None, 1, float("inf"), int)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise ApiError(400, f"'n' must be 1: this server returns one choice per request, got {n!r}", param="n")
    user = body.get("user")
    if user is not None and not isinstance(user, str):  # an end-user id for the caller's own records; not used
        raise ApiError(400, f"'user' must be a string, got {user!r}", param="user")
    try:
        sampling = SamplingParams(
            temperature=float(_number(body, "temperature", 1.0, 0, API_MAX_TEMPERATURE)),  # OpenAI's default; 0 stays 0
            top_p=float(_number(body, "top_p", 1.0, 0, 1)), seed=_number(body, "seed", None, -(2**63), 2**64 - 1, int),
            logit_bias=_logit_bias(body), frequency_penalty=float(_number(body, "frequency_penalty", 0.0, -2, 2)),
            presence_penalty=float(_number(body, "presence_penalty", 0.0, -2, 2)))
    except SamplingError as exc:
        raise ApiError(400, str(exc), param=exc.field) from exc
    stop = body.get("stop")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or not s for s in stops) or len(stops) > 4:
        raise ApiError(400, "'stop' must be a non-empty string or a list of at most 4 non-empty strings", param="stop")
    for s in stops:
        _text(s, "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}", param="stream_options")
    include_usage = options.get("include_usage", False)
    return ApiRequest(chat, messages, prompt, max_tokens, sampling, tuple(stops), stream, include_usage,
                      _logprobs(body, chat))


class ResponseBuilder:
    """Response and stream-chunk bodies for one request; ``token_text`` decodes one token id (for logprobs)."""

    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str] = str):
        self.chat, self.model, self.token_text = chat, model, token_text
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offset = 0  # completions' text_offset: characters of the tokens reported so far

    def _base(self, stream: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """The ``logprobs`` object of a choice for these tokens (None when not asked for): chat's
        ``content`` list, or the legacy completions lists."""
        if entries is None:
            return None
        if self.chat:
            def item(token_id: int, logprob: float) -> dict:
                text = self.token_text(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                                for e in entries], "refusal": None}
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def full(self, text: str, finish_reason: str, usage: dict, logprobs: list[TokenLogprob] | None = None) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}} if self.chat else {"index": 0, "text": text}
        choice.update(logprobs=self.logprobs(logprobs), finish_reason=finish_reason)
        return {**self._base(False), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False,
              logprobs: list[TokenLogprob] | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=self.logprobs(logprobs), finish_reason=finish_reason)
        return {**self._base(True), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._base(True), "choices": [], "usage": usage}
