"""Lock-step batching: generations in flight advance together, one target forward per step.

Each generation is the engine's own step generator (``Engine.start``), the same
code that serves a single request, so batching cannot change an answer: a
generation runs on its own caches (a ``SequenceSlot``) and, whenever it needs the
target, yields a ``SequenceCall``. ``step`` sends all pending calls through one
``LeanModel.forward_batch`` and hands each generation its output; each then
accepts, drafts its next step and yields its next call.

Why it pays on CPU: every matrix of the target is read once per forward, and with
packed weights 4-20 rows cost little more than one (``projection.py``). A new
request's prefill joins the next forward with the others' verify steps.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from ..errors import ConfigError
from .lean import SequenceCall
from .speculative import (
    Chunk,
    Engine,
    Finished,
    Generation,
    GenerationConfig,
    SequenceSlot,
)

Event = Chunk | Finished | Exception  # an exception ends that request only


@dataclass
class _InFlight:
    key: Hashable
    generation: Generation
    slot: SequenceSlot
    call: SequenceCall | None = None  # what it waits on


class Batch:
    def __init__(self, engine: Engine, max_batch: int, draft_up_to: int | None = None):
        """Up to ``max_batch`` generations at once; each needs its own caches (one is the engine's own).

        ``draft_up_to``: generations draft only while at most this many run (None: always). Once
        several share a step, the forward is already wide, and drafts add their own cost and widen
        it further; with a weak drafter, plain batched steps are faster (``benchmarks/serve.py``).
        Greedy answers do not change: a step without drafts is an ordinary decode step. A seeded
        sample keeps its distribution but not its exact tokens, since acceptance draws per draft."""
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        if draft_up_to is not None and draft_up_to < 1:
            raise ConfigError(f"draft_up_to must be >= 1 or None, got {draft_up_to}")
        self.engine, self.draft_up_to = engine, draft_up_to
        self._free = [SequenceSlot(engine.cache, engine.runner)] + [engine.new_slot() for _ in range(max_batch - 1)]
        self._in_flight: list[_InFlight] = []

    @property
    def running(self) -> int:
        return len(self._in_flight)

    @property
    def has_room(self) -> bool:
        return bool(self._free)

    def keys(self) -> list[Hashable]:
        return [entry.key for entry in self._in_flight]

    def add(self, key: Hashable, prompt_ids: list[int], config: GenerationConfig) -> list[tuple[Hashable, Event]]:
        """Start a generation (its prefill runs with the next ``step``); returns events it emitted already.

        An invalid request raises ``EngineError`` here and takes no slot."""
        if not self._free:
            raise RuntimeError("the batch is full; check has_room first")
        slot = self._free[-1]
        entry = _InFlight(key, self.engine.start(prompt_ids, config, slot, self._may_draft), slot)
        self._free.pop()
        self._in_flight.append(entry)
        return self._advance(entry, lambda: next(entry.generation))

    def _may_draft(self) -> bool:
        return self.draft_up_to is None or self.running <= self.draft_up_to

    def cancel(self, key: Hashable) -> None:
        """Stop a generation between two steps and free its caches."""
        for entry in self._in_flight:
            if entry.key == key:
                entry.generation.close()
                self._release(entry)
                return

    def step(self) -> list[tuple[Hashable, Event]]:
        """One target forward for every generation in flight; the events they emit after it."""
        batch = list(self._in_flight)
        if not batch:
            return []
        try:
            outputs = self.engine.lean.forward_batch([entry.call for entry in batch], self.engine.capture)
        except Exception as exc:  # a forward that fails fails the whole batch, never silently
            for entry in batch:
                entry.generation.close()
                self._release(entry)
            return [(entry.key, exc) for entry in batch]
        events = []
        for entry, output in zip(batch, outputs):
            events += self._advance(entry, lambda e=entry, o=output: e.generation.send(o))
        return events

    def _advance(self, entry: _InFlight, resume: Callable) -> list[tuple[Hashable, Event]]:
        """Run a generation until it needs the target again, or ends."""
        events: list[tuple[Hashable, Event]] = []
        try:
            item = resume()
            while not isinstance(item, SequenceCall):
                events.append((entry.key, item))
                if isinstance(item, Finished):
                    self._release(entry)
                    return events
                item = next(entry.generation)
        except Exception as exc:  # this request fails; the others go on
            self._release(entry)
            events.append((entry.key, exc))
            return events
        entry.call = item
        return events

    def _release(self, entry: _InFlight) -> None:
        self._in_flight.remove(entry)
        self._free.append(entry.slot)
