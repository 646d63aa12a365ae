"""Sampling settings, the target distribution they define, and lossless acceptance of drafts.

Acceptance treats every drafted token as a point-mass proposal: at a node whose
target distribution is p, its children c1, c2, ... (in the drafter's rank
order) are tried in turn; c is accepted with probability p(c), and on
rejection p becomes p with c removed, renormalised. When no child is accepted
the bonus token is sampled from what is left. Each round is exact rejection
sampling (a point mass q = δ_c gives min(1, p/q) = p(c) and residual
norm(max(p - q, 0)) = p without c), so the emitted tokens are distributed
exactly as the target's own sampling, for chains and trees alike.

At temperature 0, p is one-hot on the target's argmax, and the same walk
accepts a child exactly when it is the greedy token: one code path for both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .draft_tree import DraftTree

MAX_TEMPERATURE = 100.0


class SamplingError(ValueError):
    """Sampling settings out of range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        generator = torch.Generator()
        if self.seed is not None:
            generator.manual_seed(self.seed)
        else:
            generator.seed()
        return generator


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] logits -> [R, V] float32 probabilities the target samples from under ``params``."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the top token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted tree nodes, root's child first
    bonus: int  # the token sampled (or the greedy token) after the last accepted node


def accept(tree: DraftTree, row_probs: Callable[[int], torch.Tensor], generator: torch.Generator) -> Acceptance:
    """Walk ``tree``; ``row_probs(r)`` is the target distribution [V] after row r (0: the root, i+1: node i).

    Rows are asked for lazily, along the walk only: a verify step then pays for the
    target's lm_head on the rows acceptance reaches, not on every drafted token."""
    children = tree.children()
    tokens = tree.tokens.tolist()
    path: list[int] = []
    row = 0
    while True:
        p = row_probs(row)
        for child in children[row]:
            mass = float(p[tokens[child]])
            if mass > 0.0 and float(torch.rand((), generator=generator)) < mass:
                path.append(child)
                row = child + 1
                break
            if mass > 0.0:
                p = p.clone()
                p[tokens[child]] = 0.0
                p = p / p.sum()
        else:
            return Acceptance(path, int(torch.multinomial(p, 1, generator=generator)))
