"""``eaglewire serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

The server only adapts: it parses requests (``openai_api.py``), queues them
for the engine's worker thread (``scheduler.py``), and turns engine events
into responses or server-sent events. Prometheus metrics are on ``/metrics``.

Under faults it stays bounded: a request body must arrive within
``body_timeout`` (else 408 and the connection closes), idle keep-alive
connections close after ``keep_alive``, at most ``max_connections`` are served
at once (the rest get 503), and every error, an unknown route included, has the
OpenAI error body. The first SIGTERM or SIGINT drains: the listener closes,
queued requests get 503, running ones may finish until ``shutdown_timeout``
nears and are then ended with a final event (finish_reason, an error, [DONE]
for a stream; 503 otherwise); a second signal ends them at once. The process
exits 0 within the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    generate_latest,
)
from starlette.exceptions import HTTPException

from ..engine.drafting_labels import drafting_labels
from ..engine.speculative import Chunk, Engine, Finished, GenerationConfig
from ..errors import ConfigError
from .openai_api import ApiError, ApiRequest, ResponseBuilder, parse_body, parse_request
from .scheduler import Job, QueueFull, Scheduler, ShuttingDown, Started

log = logging.getLogger("eaglewire.serve")
DISCONNECT_POLL_S = 0.25
RETRY_AFTER_S = 1  # what a 503 tells clients to wait
FORCE_EXIT_AFTER_S = 1.0  # after a second signal
ABORTED = "length"  # the finish_reason of a stream ended by shutdown: cut short, as by max_tokens (an error follows)


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
    draft_up_to: int | None = 1  # requests draft only while at most this many run; None: always (engine/batching.py)
    shutdown_timeout: float = 10.0  # seconds from the first SIGTERM / SIGINT to exit
    body_timeout: float = 30.0  # seconds a request body may take to arrive (then 408, connection closed)
    keep_alive: int = 5  # seconds an idle keep-alive connection stays open
    max_connections: int = 256  # connections served at once; requests on more get 503 (uvicorn's limit_concurrency)

    def __post_init__(self) -> None:
        for option, value in (("--max-queue", self.max_queue), ("--max-batch", self.max_batch),
                              ("max_body_bytes", self.max_body_bytes), ("--keep-alive", self.keep_alive),
                              ("--max-connections", self.max_connections)):
            if value < 1:
                raise ConfigError(f"{option} must be >= 1, got {value}")
        for option, value in (("--shutdown-timeout", self.shutdown_timeout), ("--body-timeout", self.body_timeout)):
            if not value > 0:
                raise ConfigError(f"{option} must be > 0 seconds, got {value}")
        if self.draft_up_to is not None and self.draft_up_to < 1:
            raise ConfigError(f"--draft-up-to must be >= 1 or 'all', got {self.draft_up_to}")
        if not self.log_interval > 0:
            raise ConfigError(f"--log-interval must be > 0, got {self.log_interval}")


class ServerMetrics:
    """The drafter's counters count its own drafts only: steps whose drafts were looked up in the context
    (``--lookup-min``) count in the ``eaglewire_lookup_*`` counters instead."""

    def __init__(self, registry: CollectorRegistry, drafting: GenerationConfig):
        Info("eaglewire_drafting", "How every request drafts", registry=registry).info(drafting_labels(drafting))
        self.drafts = Counter("eaglewire_drafts", "Verify steps that checked draft tokens", registry=registry)
        self.draft_tokens = Counter("eaglewire_draft_tokens", "Draft tokens sent to verification", registry=registry)
        self.accepted = Counter("eaglewire_accepted_tokens", "Draft tokens accepted", registry=registry)
        self.accepted_at = Counter("eaglewire_accepted_tokens_per_position", "Draft tokens accepted at each depth",
                                   ["position"], registry=registry)
        self.lookup_steps = Counter("eaglewire_lookup_steps", "Verify steps whose drafts were looked up in the "
                                    "context", registry=registry)
        self.lookup_draft_tokens = Counter("eaglewire_lookup_draft_tokens", "Looked-up draft tokens sent to "
                                           "verification", registry=registry)
        self.lookup_accepted = Counter("eaglewire_lookup_accepted_tokens", "Looked-up draft tokens accepted",
                                       registry=registry)
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
        self.lookup_steps.inc(m.lookup_steps)
        self.lookup_draft_tokens.inc(m.lookup_drafted)
        self.lookup_accepted.inc(m.lookup_accepted)
        for position, count in enumerate(m.accepted_at, start=1):
            self.accepted_at.labels(position=str(position)).inc(count)
        self.generated.inc(m.new_tokens)
        self.latency.observe(time.perf_counter() - job.submitted)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _busy(message: str, code: str) -> ApiError:
    return ApiError(503, message, kind="server_error", code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def _shutting_down(exc: ShuttingDown) -> ApiError:
    return _busy(f"{exc}; retry on another server or later", "server_shutting_down")


def create_app(engine: Engine, cfg: ServeConfig) -> tuple[FastAPI, Scheduler]:
    """The app, and the scheduler that runs its requests (``serve`` drains it on a signal)."""
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry, cfg.drafting)
    scheduler = Scheduler(engine, cfg.max_queue, metrics.finished, cfg.log_interval, cfg.max_batch, cfg.draft_up_to)
    tokenizer = engine.target.tokenizer
    vocab = engine.lean.config.vocab_size

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="eaglewire", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(HTTPException)  # the router's own: unknown route (404), wrong method (405)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path}): this server serves " \
                      "/v1/chat/completions, /v1/completions, /v1/models, /health and /metrics"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "another method")
            message = f"{request.method} is not allowed on {request.url.path}; use {allowed}"
        else:
            message = str(exc.detail)
        return _error(ApiError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "draining" if scheduler.draining else "ok", "queued": scheduler.queued,
                "target_dtype": engine.dtype}

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
        """The body, within ``body_timeout`` and ``max_body_bytes``; a failure also closes the connection,
        so that the unread rest of a body cannot keep it open."""
        close = {"Connection": "close"}
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cfg.max_body_bytes:
            raise ApiError(413, f"the request body has {declared} bytes; the limit is {cfg.max_body_bytes}",
                           headers=close)
        chunks: list[bytes] = []

        async def receive() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > cfg.max_body_bytes:
                    raise ApiError(413, f"the request body exceeds the limit of {cfg.max_body_bytes} bytes",
                                   headers=close)
                chunks.append(chunk)

        try:
            await asyncio.wait_for(receive(), cfg.body_timeout)
        except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11
            raise ApiError(408, f"the request body did not arrive within {cfg.body_timeout:g} s "
                                f"({sum(map(len, chunks))} bytes came)", code="request_timeout", headers=close) from None
        return b"".join(chunks)

    def _prompt_ids(req: ApiRequest) -> list[int]:
        if req.chat:
            return engine.chat_prompt(req.messages)
        return list(tokenizer(req.prompt)["input_ids"])

    async def _complete(request: Request, chat: bool):
        arrived = time.perf_counter()
        req = parse_request(parse_body(await _read_body(request)), chat, (cfg.model_name,))
        if req.sampling.logit_bias and req.sampling.logit_bias[-1][0] >= vocab:
            raise ApiError(400, f"logit_bias names token {req.sampling.logit_bias[-1][0]}; the vocabulary has {vocab}",
                           param="logit_bias")
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
                                     sampling=req.sampling, stop=req.stop, logprobs=req.logprobs)
        job = Job(prompt_ids, config, asyncio.get_running_loop(), submitted=arrived)
        try:
            scheduler.submit(job)
        except QueueFull:
            raise _busy(f"the server is busy: {cfg.max_queue} requests are queued; retry later",
                        "server_overloaded") from None
        except ShuttingDown as exc:
            raise _shutting_down(exc) from None
        streaming = False
        try:
            # Wait for a slot before answering, so that a request failed while queued (shutdown) still gets a status.
            started = await _next(request, job)
            if started is None:
                return Response(status_code=499)
            assert isinstance(started, Started), started
            builder = ResponseBuilder(chat, cfg.model_name, lambda token: tokenizer.decode([token]))
            if req.stream:
                streaming = True  # from here the stream owns the job
                return StreamingResponse(_stream(job, builder, req, len(prompt_ids)), media_type="text/event-stream")
            return await _collect(request, job, builder, req, len(prompt_ids))
        finally:
            if not streaming:
                job.cancelled.set()  # no-op once finished; frees the engine if the client left

    async def _next(request: Request | None, job: Job):
        """The job's next event; None when ``request``'s client went away first (not checked without one)."""
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    return None
                continue
            if isinstance(event, ShuttingDown):
                raise _shutting_down(event)
            if isinstance(event, Exception):
                raise ApiError(500, f"generation failed: {event}", kind="server_error")
            return event

    async def _collect(request: Request, job: Job, builder: ResponseBuilder, req: ApiRequest, prompt_tokens: int):
        first = True
        while True:
            event = await _next(request, job)
            if event is None:
                return Response(status_code=499)
            if first:
                metrics.ttft.observe(time.perf_counter() - job.submitted)
                first = False
            if isinstance(event, Finished):
                usage = builder.usage(prompt_tokens, len(event.token_ids))
                return builder.full(event.text, event.finish_reason, usage,
                                    event.logprobs if req.logprobs is not None else None)

    async def _stream(job: Job, builder: ResponseBuilder, req: ApiRequest, prompt_tokens: int):
        def sse(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        reported = 0  # tokens whose logprobs were sent

        def new_logprobs(event):
            nonlocal reported
            if req.logprobs is None:
                return None
            entries, reported = event.logprobs[reported:], len(event.logprobs)
            return entries

        try:
            if req.chat:
                yield sse(builder.chunk(first=True))
            first = True
            while True:
                event = await _next(None, job)  # a client that leaves ends this generator (finally below)
                if first:
                    metrics.ttft.observe(time.perf_counter() - job.submitted)
                    first = False
                if isinstance(event, Chunk):
                    yield sse(builder.chunk(event.text, logprobs=new_logprobs(event)))
                    continue
                yield sse(builder.chunk(finish_reason=event.finish_reason, logprobs=new_logprobs(event) or None))
                if req.include_usage:
                    yield sse(builder.usage_chunk(builder.usage(prompt_tokens, len(event.token_ids))))
                yield "data: [DONE]\n\n"
                return
        except ApiError as exc:
            if exc.code == "server_shutting_down":  # cut short: say so as a finish, then why
                yield sse(builder.chunk(finish_reason=ABORTED))
            yield sse(exc.body())
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # the client disconnected, or we are done: the worker stops or skips it

    return app, scheduler


class _Server(uvicorn.Server):
    """uvicorn's server with this server's signal policy (see the module docstring). uvicorn itself
    waits for streams without limit and re-raises the signal after its shutdown (exit status 143)."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, shutdown_timeout: float):
        super().__init__(config)
        self.scheduler, self.shutdown_timeout = scheduler, shutdown_timeout

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            # Streams end a little before the timeout, so that their final events go out before uvicorn gives up.
            grace = max(0.0, self.shutdown_timeout - min(1.0, self.shutdown_timeout / 4))
            log.info("%s: draining; running requests have %.1f s, then end", signal.Signals(sig).name, grace)
            self.scheduler.drain(grace)
            self.should_exit = True
        else:
            log.info("%s again: ending running requests now", signal.Signals(sig).name)
            self.scheduler.drain(0.0)
            # Their final events go out within a step; then uvicorn stops waiting, slow readers or not.
            # (call_soon_threadsafe takes no lock, unlike threading.Timer: safe in a signal handler.)
            loop = asyncio.get_running_loop()
            loop.call_soon_threadsafe(loop.call_later, FORCE_EXIT_AFTER_S, setattr, self, "force_exit", True)


def serve(engine: Engine, cfg: ServeConfig, host: str, port: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app, scheduler = create_app(engine, cfg)
    # uvicorn gives up on open connections a little before the timeout: the process is gone within it.
    uvicorn_grace = cfg.shutdown_timeout - min(0.5, cfg.shutdown_timeout / 8)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_keep_alive=cfg.keep_alive,
                            limit_concurrency=cfg.max_connections, timeout_graceful_shutdown=uvicorn_grace)
    _Server(config, scheduler, cfg.shutdown_timeout).run()
