"""OpenAI-style request parsing and response bodies, independent of the web framework.

Every invalid request becomes an ``ApiError`` with the status and the error body
OpenAI clients expect: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from .sampling import SamplingError, SamplingParams

ROLES = ("system", "user", "assistant")
MAX_TEMPERATURE = 2.0  # OpenAI's documented range


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ApiRequest:
    chat: bool
    messages: list[dict] | None  # chat
    prompt: str | None  # completions
    max_tokens: int | None  # None: up to the context limit
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _number(body: dict, name: str, default, kind=(int, float)):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}", param=name)
    return value


def parse_request(body: dict, chat: bool, model_names: tuple[str, ...]) -> ApiRequest:
    model = body.get("model")
    if model is not None and model not in model_names:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {', '.join(model_names)}",
                       param="model", code="model_not_found")
    messages = prompt = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' is required: a non-empty list of {role, content} objects", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                role = message.get("role") if isinstance(message, dict) else None
                raise ApiError(400, f"messages[{i}] has role {role!r}; expected one of {', '.join(ROLES)}",
                               param=f"messages[{i}].role")
            if not isinstance(message.get("content"), str):
                raise ApiError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' is required: a non-empty string", param="prompt")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ApiError(400, f"'max_tokens' must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
    n = _number(body, "n", 1, int)
    if n != 1:
        raise ApiError(400, f"'n' must be 1: this server returns one choice per request, got {n}", param="n")
    temperature = _number(body, "temperature", 1.0)  # OpenAI's default; 0 stays 0 (greedy)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise ApiError(400, f"'temperature' must be in [0, {MAX_TEMPERATURE:g}], got {temperature}", param="temperature")
    top_p = _number(body, "top_p", 1.0)
    seed = _number(body, "seed", None, int)
    try:
        sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p), seed=seed)
    except SamplingError as exc:
        raise ApiError(400, str(exc), param="top_p") from exc
    stop = body.get("stop")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or not s for s in stops) or len(stops) > 4:
        raise ApiError(400, "'stop' must be a non-empty string or a list of at most 4 non-empty strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}", param="stream_options")
    include_usage = options.get("include_usage", False)
    return ApiRequest(chat, messages, prompt, max_tokens, sampling, tuple(stops), stream, include_usage)


class ResponseBuilder:
    """Response and stream-chunk bodies for one request."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _base(self, stream: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def full(self, text: str, finish_reason: str, usage: dict) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
                  if self.chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason})
        return {**self._base(False), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._base(True), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._base(True), "choices": [], "usage": usage}
