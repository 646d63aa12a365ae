"""One worker thread that owns the engine and runs queued requests one at a time.

The engine decodes one sequence (its KV caches are per engine), so requests are
served in arrival order from a bounded queue; a full queue is refused at
once (the server answers 503) instead of growing without bound. Each request's
events travel to its asyncio consumer through ``call_soon_threadsafe``. A
request whose client went away is cancelled: skipped if still queued, stopped
between two verify steps if running.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .engine import Engine, Finished, GenerationConfig
from .generation_metrics import GenerationMetrics

log = logging.getLogger("eaglewire.serve")


class QueueFull(Exception):
    """The request queue is at capacity."""


@dataclass
class Job:
    prompt_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunk, then Finished, or an Exception
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int, on_finished: Callable[[Job, Finished], None],
                 log_interval: float = 10.0):
        self.engine, self.on_finished, self.log_interval = engine, on_finished, log_interval
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._running: Job | None = None
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
        if self._running is not None:
            self._running.cancelled.set()
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
        while not self._stop.is_set():
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            self._running = job
            emitted = 0
            try:
                for event in self.engine.generate_ids(job.prompt_ids, job.config):
                    if job.cancelled.is_set():
                        break
                    with self._lock:
                        self._streamed += len(event.token_ids) - emitted
                        if isinstance(event, Finished):
                            self._finished = self._finished.merge(event.metrics)
                    emitted = len(event.token_ids)
                    if isinstance(event, Finished):
                        self.on_finished(job, event)
                    self._emit(job, event)
            except Exception as exc:  # the request fails; the server and the worker go on
                log.exception("request failed")
                self._emit(job, exc)
            finally:
                self._running = None

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
                     int(self._running is not None), self.queued, tau, acceptance, throughput)
            last, last_streamed = now, streamed
