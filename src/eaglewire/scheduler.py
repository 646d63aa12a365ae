"""One worker thread that owns the engine and runs queued requests, up to ``max_batch`` at once.

Requests are admitted in arrival order from a bounded queue into a lock-step
``Batch`` (``batching.py``): the running ones share one target forward per step.
A full queue is refused at once (the server answers 503) instead of growing
without bound. Each request's events travel to its asyncio consumer through
``call_soon_threadsafe``. A request whose client went away is cancelled: skipped
if still queued, stopped between two steps (its caches freed) if running.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .batching import Batch
from .engine import Engine, Finished, GenerationConfig
from .generation_metrics import GenerationMetrics

log = logging.getLogger("eaglewire.serve")


class QueueFull(Exception):
    """The request queue is at capacity."""


@dataclass(eq=False)  # identity: a job is a dict key while it runs
class Job:
    prompt_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunk, then Finished, or an Exception
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int, on_finished: Callable[[Job, Finished], None],
                 log_interval: float = 10.0, max_batch: int = 1, draft_up_to: int | None = None):
        self.engine, self.on_finished, self.log_interval = engine, on_finished, log_interval
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._batch = Batch(engine, max_batch, draft_up_to)
        self._running: list[Job] = []  # a snapshot for stop() and the log, replaced (not mutated) by the worker
        self._finished = GenerationMetrics(requests=0)  # merged metrics of finished requests
        self._streamed = 0  # tokens sent so far, running requests included (for throughput)
        self._lock = threading.Lock()
        self._stop = threading.Event()
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

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full as exc:
            raise QueueFull from exc

    def _emit(self, job: Job, event) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, event)

    def _work(self) -> None:
        emitted: dict[Job, int] = {}  # tokens each running job has streamed
        while not self._stop.is_set():
            if not self._admit(emitted):
                return
            for job in self._batch.keys():
                if job.cancelled.is_set():
                    self._batch.cancel(job)
                    del emitted[job]
            self._running = self._batch.keys()
            self._deliver(self._batch.step(), emitted)
            self._running = self._batch.keys()

    def _admit(self, emitted: dict[Job, int]) -> bool:
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
            emitted[job] = 0
            try:
                events = self._batch.add(job, job.prompt_ids, job.config)
            except Exception as exc:  # an invalid request fails alone
                log.exception("request refused")
                events = [(job, exc)]
            self._deliver(events, emitted)
        return True

    def _deliver(self, events: list, emitted: dict[Job, int]) -> None:
        for job, event in events:
            if isinstance(event, Exception):
                log.error("request failed: %r", event)
                emitted.pop(job, None)
                self._emit(job, event)
                continue
            with self._lock:
                self._streamed += len(event.token_ids) - emitted[job]
                if isinstance(event, Finished):
                    self._finished = self._finished.merge(event.metrics)
            emitted[job] = len(event.token_ids)
            if isinstance(event, Finished):
                del emitted[job]
                self.on_finished(job, event)
            self._emit(job, event)

    def _report(self) -> None:
        last, last_streamed = GenerationMetrics(requests=0), 0
        while not self._stop.wait(self.log_interval):
            with self._lock:
                now, streamed = self._finished, self._streamed
            steps = now.verify_steps - last.verify_steps
            drafted = now.drafted - last.drafted
            tau = (now.step_tokens - last.step_tokens) / steps if steps else 0.0
            acceptance = (now.accepted - last.accepted) / drafted if drafted else 0.0
            throughput = (streamed - last_streamed) / self.log_interval
            log.info("running %d, queued %d, tau %.2f, acceptance %.2f, %.1f tok/s",
                     len(self._running), self.queued, tau, acceptance, throughput)
            last, last_streamed = now, streamed
