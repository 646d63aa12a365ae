"""One worker thread that owns the engine and runs queued requests, up to ``max_batch`` at once.

Requests are admitted in arrival order from a bounded queue into a lock-step
``Batch`` (``engine/batching.py``): the running ones share one target forward per step.
A full queue is refused at once (the server answers 503) instead of growing
without bound. Each request's events travel to its asyncio consumer through
``call_soon_threadsafe``: ``Started`` when it enters the batch, then the engine's
events. A request whose client went away is cancelled: skipped if still queued,
stopped between two steps (its caches freed) if running.

``drain`` begins a shutdown: new requests are refused, queued ones fail at once
with ``ShuttingDown``, running ones go on until a deadline and are then ended
with ``ShuttingDown`` too (the server turns both into proper final responses).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.batching import Batch
from ..engine.speculative import Engine, Finished, GenerationConfig

log = logging.getLogger("eaglewire.serve")
COUNTED = ("verify_steps", "step_tokens", "drafted", "accepted")  # GenerationMetrics counters the log line reads


class QueueFull(Exception):
    """The request queue is at capacity."""


class ShuttingDown(Exception):
    """The server is shutting down: the request was refused, failed while queued, or ended while running."""

    def __init__(self, tokens: int | None = None):
        what = "it was not started" if tokens is None else f"the answer was cut after {tokens} tokens"
        super().__init__(f"the server is shutting down: {what}")
        self.tokens = tokens  # tokens it had generated; None: it never ran


@dataclass(frozen=True)
class Started:
    """The job entered the batch (its prefill runs with the next step)."""


@dataclass(eq=False)  # identity: a job is a dict key while it runs
class Job:
    prompt_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Started, Chunks, then Finished; or an Exception
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int, on_finished: Callable[[Job, Finished], None],
                 log_interval: float = 10.0, max_batch: int = 1, draft_up_to: int | None = None):
        self.engine, self.on_finished, self.log_interval = engine, on_finished, log_interval
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._batch = Batch(engine, max_batch, draft_up_to)
        self._running: list[Job] = []  # a snapshot for stop() and the log, replaced (not mutated) by the worker
        self._counted = (0,) * len(COUNTED)  # COUNTED over every step so far, running requests' included
        self._streamed = 0  # tokens sent so far, running requests included (for throughput)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._end_running_at: float | None = None  # set by drain: the shutdown deadline (time.monotonic)
        self._threads = [threading.Thread(target=self._work, name="eaglewire-engine", daemon=True),
                         threading.Thread(target=self._report, name="eaglewire-log", daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for job in self._running:
            job.cancelled.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass

    def drain(self, grace: float) -> None:
        """Refuse new requests, fail queued ones, and end running ones ``grace`` seconds from now (0: at the
        next step). Called again, the earlier deadline holds. Safe in a signal handler: it only assigns a
        deadline, which ``submit`` and the worker read (a lock here could deadlock with the interrupted code)."""
        deadline = time.monotonic() + grace
        if self._end_running_at is None or deadline < self._end_running_at:
            self._end_running_at = deadline

    @property
    def draining(self) -> bool:
        return self._end_running_at is not None

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        if self.draining:
            raise ShuttingDown()
        try:
            self._queue.put_nowait(job)
        except queue.Full as exc:
            raise QueueFull from exc

    def _emit(self, job: Job, event) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, event)

    def _work(self) -> None:
        seen: dict[Job, tuple[int, tuple]] = {}  # per running job: tokens streamed, COUNTED as last delivered
        while not self._stop.is_set():
            if not self._admit(seen):
                return
            if self.draining:
                self._shut_down(seen)
            for job in list(self._batch.keys()):
                if job.cancelled.is_set():
                    self._batch.cancel(job)
                    del seen[job]
            self._running = self._batch.keys()
            self._deliver(self._batch.step(), seen)
            self._running = self._batch.keys()

    def _admit(self, seen: dict[Job, tuple[int, tuple]]) -> bool:
        """Move queued jobs into the batch while it has room; wait for one only when nothing runs.
        False when the scheduler is stopping."""
        while self._batch.has_room:
            try:
                job = self._queue.get(block=self._batch.running == 0)
            except queue.Empty:
                return True
            if job is None:
                return False
            if job.cancelled.is_set():
                continue
            if self.draining:
                self._emit(job, ShuttingDown())
                continue
            seen[job] = (0, (0,) * len(COUNTED))
            self._emit(job, Started())
            try:
                events = self._batch.add(job, job.prompt_ids, job.config)
            except Exception as exc:  # an invalid request fails alone
                log.exception("request refused")
                events = [(job, exc)]
            self._deliver(events, seen)
        return True

    def _shut_down(self, seen: dict[Job, tuple[int, tuple]]) -> None:
        """Fail every queued job; past the deadline, end every running one."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:  # stop() came first: keep its sentinel for _admit
                self._queue.put_nowait(None)
                break
            self._emit(job, ShuttingDown())
        if time.monotonic() < self._end_running_at:
            return
        for job in list(self._batch.keys()):
            self._batch.cancel(job)
            tokens, _ = seen.pop(job)
            log.warning("shutdown deadline: ending a request after %d tokens", tokens)
            self._emit(job, ShuttingDown(tokens))

    def _deliver(self, events: list, seen: dict[Job, tuple[int, tuple]]) -> None:
        for job, event in events:
            if isinstance(event, Exception):
                log.error("request failed: %r", event)
                seen.pop(job, None)
                self._emit(job, event)
                continue
            tokens, counted = len(event.token_ids), tuple(getattr(event.metrics, name) for name in COUNTED)
            before_tokens, before = seen[job]
            with self._lock:  # verify steps count as they happen, not when their request ends
                self._streamed += tokens - before_tokens
                self._counted = tuple(total + now - then for total, now, then in zip(self._counted, counted, before))
            seen[job] = (tokens, counted)
            if isinstance(event, Finished):
                del seen[job]
                self.on_finished(job, event)
            self._emit(job, event)

    def _report(self) -> None:
        last, last_streamed = self._counted, 0
        while not self._stop.wait(self.log_interval):
            with self._lock:
                now, streamed = self._counted, self._streamed
            steps, step_tokens, drafted, accepted = (n - b for n, b in zip(now, last))
            tau = step_tokens / steps if steps else 0.0
            acceptance = accepted / drafted if drafted else 0.0
            throughput = (streamed - last_streamed) / self.log_interval
            log.info("running %d, queued %d, tau %.2f, acceptance %.2f, %.1f tok/s",
                     len(self._running), self.queued, tau, acceptance, throughput)
            last, last_streamed = now, streamed
