"""Drafts looked up in the context: where its last tokens occurred before, the tokens that followed them.

A small target's greedy answers repeat themselves: in SmolLM2-135M's answers to the 80 MT-bench questions
(256 tokens), the 8 tokens before 35% of all positions had occurred earlier in the prompt or the answer, and
of the 16 tokens that had followed them, the first 9.6 on average were the answer's next ones. Such drafts
cost no drafter step.
Acceptance treats every draft as a point mass whatever proposed it (``sampling.py``), so looked-up drafts
keep the output exact like the drafter's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class LookupShape:
    # MT-bench questions 1-20, 256 tokens, the shipped drafter's chain elsewhere, median speedup over plain
    # decoding (benchmarks/results/draft_shape_lookup_zen4.json; an earlier run of the same in brackets):
    # 5 and 6 1.09x (1.11x), 3/6 1.09x (1.10x), 3/4 1.13x (1.09x), 2/3 1.11x (1.08x), 8/8 1.06x, the chain alone
    # 1.03x (1.01x): within noise of each other; 5/6 ran all 80 questions (1.08x, the chain alone 1.02x).
    min_match: int = 5  # the context's last tokens that must have occurred before (the shortest match used)
    max_drafts: int = 6  # drafts looked up per step, at most
    longest_match: int = 16  # matches are compared up to this many tokens (the longest wins)

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.longest_match:
            raise ConfigError(f"lookup: min_match must be in 1..{self.longest_match}, got {self.min_match}")
        if self.max_drafts < 1:
            raise ConfigError(f"lookup: max_drafts must be >= 1, got {self.max_drafts}")


def lookup_drafts(context: list[int], shape: LookupShape, limit: int) -> list[int]:
    """Up to ``min(shape.max_drafts, limit)`` tokens that followed the latest of the longest earlier occurrences
    of the context's last tokens (at least ``min_match`` of them); [] when they never occurred before.

    The followers continue periodically: when they run up to the context's end (a loop shorter than the
    drafts), what follows is what followed them."""
    count = min(shape.max_drafts, limit)
    length = len(context)
    if count < 1 or length <= shape.min_match:
        return []
    tokens = torch.tensor(context)
    # Earlier windows of min_match tokens (each with at least one token after it) equal to the last ones.
    windows = tokens[:-1].unfold(0, shape.min_match, 1)
    starts = (windows == tokens[length - shape.min_match:]).all(dim=1).nonzero()[:, 0]
    if starts.numel() == 0:
        return []
    ends = starts + shape.min_match  # the followers start here
    # Lengthen the match one token back at a time while some occurrence still agrees; keep the longest.
    for matched in range(shape.min_match + 1, min(shape.longest_match, length) + 1):
        before = ends - matched
        agree = (before >= 0) & (tokens[before.clamp(min=0)] == tokens[length - matched])
        if not bool(agree.any()):
            break
        ends = ends[agree]
    start = int(ends.max())  # the latest occurrence
    period = length - start
    followers = tokens[start:].tolist()
    return [followers[i % period] for i in range(count)]
