"""What one generation (or many, merged) did: tokens, verify steps, acceptance per draft position, time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

PHASES = ("prefill_s", "draft_s", "verify_s")  # the timed parts of a generation


@dataclass
class GenerationMetrics:
    prompt_tokens: int = 0
    new_tokens: int = 0  # tokens returned to the caller
    verify_steps: int = 0  # target forwards after the prefill
    step_tokens: int = 0  # tokens those steps produced: accepted drafts + one bonus each
    # The drafter's drafts: steps whose drafts were looked up in the context (context_lookup.py) count apart,
    # so these figures are the drafter's own.
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0
    attempted_at: list[int] = field(default_factory=list)  # [d-1]: steps that drafted at depth d
    accepted_at: list[int] = field(default_factory=list)  # [d-1]: steps that accepted a token at depth d
    lookup_steps: int = 0  # verify steps whose drafts were looked up in the context
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    requests: int = 1
    target_dtype: str = "fp32"  # what the target's matrix products multiplied in (--dtype)

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to ``phase`` (one of PHASES)."""
        if phase not in PHASES:
            raise KeyError(f"no phase {phase!r}; phases are {', '.join(PHASES)}")
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - start)

    def record_step(self, depth_reached: int, accepted: int, drafted: int, looked_up: bool = False) -> None:
        """One verify step: the draft reached ``depth_reached`` and ``accepted`` tokens were kept;
        ``looked_up``: its drafts came from the context, not the drafter."""
        self.verify_steps += 1
        self.step_tokens += accepted + 1
        if looked_up:
            self.lookup_steps += 1
            self.lookup_drafted += drafted
            self.lookup_accepted += accepted
            return
        self.drafted += drafted
        self.accepted += accepted
        for depth in range(depth_reached):
            self._bump(self.attempted_at, depth)
        for depth in range(accepted):
            self._bump(self.accepted_at, depth)

    @staticmethod
    def _bump(counts: list[int], index: int) -> None:
        while len(counts) <= index:
            counts.append(0)
        counts[index] += 1

    @property
    def tau(self) -> float:
        """Mean tokens per verify step, the bonus token included (1.0 without speculation)."""
        return self.step_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def drafter_tau(self) -> float:
        """``tau`` over the steps the drafter drafted for (or that had no drafts): the drafter's own figure."""
        steps = self.verify_steps - self.lookup_steps
        return (self.step_tokens - self.lookup_steps - self.lookup_accepted) / steps if steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """The drafter's: accepted / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_at(self) -> list[float]:
        """Per draft depth d: P(accepted at d | the drafter drafted at depth d)."""
        return [a / t if t else 0.0 for a, t in zip(self.accepted_at + [0] * len(self.attempted_at), self.attempted_at)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    def merge(self, other: GenerationMetrics) -> GenerationMetrics:
        out = GenerationMetrics(**{**asdict(self), "attempted_at": [], "accepted_at": []})
        for name in ("prompt_tokens", "new_tokens", "verify_steps", "step_tokens", "drafted", "accepted",
                     "lookup_steps", "lookup_drafted", "lookup_accepted", "prefill_s", "draft_s", "verify_s",
                     "total_s", "requests"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("attempted_at", "accepted_at"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(out, name, [(mine[i] if i < len(mine) else 0) + (theirs[i] if i < len(theirs) else 0)
                                for i in range(max(len(mine), len(theirs)))])
        return out

    def to_json(self) -> dict:
        return {**asdict(self), "tau": self.tau, "drafter_tau": self.drafter_tau,
                "acceptance_rate": self.acceptance_rate, "acceptance_at": self.acceptance_at,
                "tokens_per_s": self.tokens_per_s}

    def summary(self) -> str:
        per_position = " ".join(f"{a:.2f}" for a in self.acceptance_at[:8])
        lookup = (f" (drafter {self.drafter_tau:.2f}; {self.lookup_steps}/{self.verify_steps} steps looked up, "
                  f"{self.lookup_accepted}/{self.lookup_drafted} kept)" if self.lookup_steps else "")
        return (f"{self.new_tokens} tokens in {self.total_s:.2f} s ({self.tokens_per_s:.1f} tok/s)  "
                f"tau {self.tau:.2f}{lookup}  accepted {self.accepted}/{self.drafted}  per position [{per_position}]  "
                f"prefill {self.prefill_s:.2f} s, draft {self.draft_s:.2f} s, verify {self.verify_s:.2f} s  "
                f"target {self.target_dtype}")
