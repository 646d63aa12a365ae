"""``eaglewire serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

The server only adapts: it parses requests (``openai_api.py``), queues them
for the engine's worker thread (``scheduler.py``), and turns engine events
into responses or server-sent events. Prometheus metrics are on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from .engine import Chunk, Engine, Finished, GenerationConfig
from .openai_api import ApiError, ApiRequest, ResponseBuilder, parse_body, parse_request
from .scheduler import Job, QueueFull, Scheduler

DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class ServeConfig:
    model_name: str
    # How every request drafts (strategy, chain, tree); each request sets its own length, sampling and stops.
    # A GenerationConfig, so bad draft settings fail at start-up, not on every request.
    drafting: GenerationConfig = field(default_factory=GenerationConfig)
    max_queue: int = 64
    max_body_bytes: int = 1 << 20
    log_interval: float = 10.0
    max_batch: int = 4  # requests decoded together, each with its own KV cache (see benchmarks/serve.py)
    draft_up_to: int | None = 1  # requests draft only while at most this many run; None: always (batching.py)

    def __post_init__(self) -> None:
        for option, value in (("--max-queue", self.max_queue), ("--max-batch", self.max_batch),
                              ("max_body_bytes", self.max_body_bytes)):
            if value < 1:
                raise ValueError(f"{option} must be >= 1, got {value}")
        if self.draft_up_to is not None and self.draft_up_to < 1:
            raise ValueError(f"--draft-up-to must be >= 1 or 'all', got {self.draft_up_to}")
        if not self.log_interval > 0:
            raise ValueError(f"--log-interval must be > 0, got {self.log_interval}")


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.drafts = Counter("eaglewire_drafts", "Verify steps that checked draft tokens", registry=registry)
        self.draft_tokens = Counter("eaglewire_draft_tokens", "Draft tokens sent to verification", registry=registry)
        self.accepted = Counter("eaglewire_accepted_tokens", "Draft tokens accepted", registry=registry)
        self.accepted_at = Counter("eaglewire_accepted_tokens_per_position", "Draft tokens accepted at each depth",
                                   ["position"], registry=registry)
        self.generated = Counter("eaglewire_generated_tokens", "Tokens returned to clients", registry=registry)
        self.latency = Histogram("eaglewire_request_latency_seconds", "Request arrival to last token",
                                 registry=registry, buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160))
        self.ttft = Histogram("eaglewire_time_to_first_token_seconds", "Request arrival to first token",
                              registry=registry, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40))

    def finished(self, job: Job, event: Finished) -> None:
        m = event.metrics
        self.drafts.inc(m.attempted_at[0] if m.attempted_at else 0)
        self.draft_tokens.inc(m.drafted)
        self.accepted.inc(m.accepted)
        for position, count in enumerate(m.accepted_at, start=1):
            self.accepted_at.labels(position=str(position)).inc(count)
        self.generated.inc(m.new_tokens)
        self.latency.observe(time.perf_counter() - job.submitted)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def create_app(engine: Engine, cfg: ServeConfig) -> FastAPI:
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    scheduler = Scheduler(engine, cfg.max_queue, metrics.finished, cfg.log_interval, cfg.max_batch, cfg.draft_up_to)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="eaglewire", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "queued": scheduler.queued}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "eaglewire"}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, chat=False)

    async def _read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cfg.max_body_bytes:
            raise ApiError(413, f"the request body has {declared} bytes; the limit is {cfg.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cfg.max_body_bytes:
                raise ApiError(413, f"the request body exceeds the limit of {cfg.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _prompt_ids(req: ApiRequest) -> list[int]:
        if req.chat:
            return engine.chat_prompt(req.messages)
        return list(engine.target.tokenizer(req.prompt)["input_ids"])

    async def _complete(request: Request, chat: bool):
        arrived = time.perf_counter()
        req = parse_request(parse_body(await _read_body(request)), chat, (cfg.model_name,))
        prompt_ids = _prompt_ids(req)
        room = engine.max_len - len(prompt_ids)
        param = "messages" if chat else "prompt"
        if room < 1:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the context holds {engine.max_len} "
                                "(prompt plus at least one new token)", param=param, code="context_length_exceeded")
        if req.max_tokens is not None and req.max_tokens > room:
            raise ApiError(400, f"max_tokens {req.max_tokens} does not fit: the prompt has {len(prompt_ids)} tokens "
                                f"and the context holds {engine.max_len}; ask for at most {room}",
                           param="max_tokens", code="context_length_exceeded")
        config = dataclasses.replace(cfg.drafting, max_new_tokens=req.max_tokens if req.max_tokens is not None else room,
                                     sampling=req.sampling, stop=req.stop)
        job = Job(prompt_ids, config, asyncio.get_running_loop(), submitted=arrived)
        try:
            scheduler.submit(job)
        except QueueFull:
            raise ApiError(503, f"the server is busy: {cfg.max_queue} requests are queued; retry later",
                           kind="server_error", code="server_overloaded") from None
        builder = ResponseBuilder(chat, cfg.model_name)
        if req.stream:
            return StreamingResponse(_stream(job, builder, req, len(prompt_ids)), media_type="text/event-stream")
        return await _collect(request, job, builder, len(prompt_ids))

    async def _next(job: Job):
        event = await job.events.get()
        if isinstance(event, Exception):
            raise ApiError(500, f"generation failed: {event}", kind="server_error")
        return event

    async def _collect(request: Request, job: Job, builder: ResponseBuilder, prompt_tokens: int):
        first = True
        try:
            while True:
                try:
                    event = await asyncio.wait_for(_next(job), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                if first:
                    metrics.ttft.observe(time.perf_counter() - job.submitted)
                    first = False
                if isinstance(event, Finished):
                    usage = builder.usage(prompt_tokens, len(event.token_ids))
                    return builder.full(event.text, event.finish_reason, usage)
        finally:
            job.cancelled.set()  # no-op once finished; frees the engine if the client left

    async def _stream(job: Job, builder: ResponseBuilder, req: ApiRequest, prompt_tokens: int):
        def sse(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        try:
            if req.chat:
                yield sse(builder.chunk(first=True))
            first = True
            while True:
                event = await _next(job)
                if first:
                    metrics.ttft.observe(time.perf_counter() - job.submitted)
                    first = False
                if isinstance(event, Chunk):
                    yield sse(builder.chunk(event.text))
                    continue
                yield sse(builder.chunk(finish_reason=event.finish_reason))
                if req.include_usage:
                    yield sse(builder.usage_chunk(builder.usage(prompt_tokens, len(event.token_ids))))
                yield "data: [DONE]\n\n"
                return
        except ApiError as exc:
            yield sse(exc.body())
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # the client disconnected, or we are done: the worker stops or skips it

    return app


def serve(engine: Engine, cfg: ServeConfig, host: str, port: int) -> None:
    import logging

    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(create_app(engine, cfg), host=host, port=port, log_level="info")
