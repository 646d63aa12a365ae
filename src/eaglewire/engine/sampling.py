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

``logit_bias`` and the frequency / presence penalties change the target's
logits before temperature, as OpenAI defines them. Penalties count the tokens
generated so far, so inside a draft tree each row counts the drafted tokens on
its own path too (``tree_row_probs``): row r is then exactly the distribution
plain decoding would sample from after that path, and acceptance stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import EaglewireError
from .draft_tree import DraftTree

MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # OpenAI's range for frequency_penalty and presence_penalty: [-2, 2]
MAX_BIAS = 100.0  # and for logit_bias values: [-100, 100]


class SamplingError(EaglewireError):
    """Sampling settings out of range; ``field`` names the setting."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    frequency_penalty: float = 0.0  # subtracted from a token's logit once per time it was generated
    presence_penalty: float = 0.0  # subtracted once if it was generated at all

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingError("temperature", f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"top_k must be >= 0 (0 = no limit), got {self.top_k}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise SamplingError(name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_BIAS <= bias <= MAX_BIAS:
                raise SamplingError("logit_bias", f"logit_bias maps token ids >= 0 to values in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                    f"got {token}: {bias}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise SamplingError("seed", f"seed must be an integer in [-2**63, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """The distribution depends on the tokens generated so far."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def generator(self) -> torch.Generator:
        generator = torch.Generator()
        if self.seed is not None:
            generator.manual_seed(self.seed)
        else:
            generator.seed()
        return generator


def adjust_logits(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None) -> torch.Tensor:
    """[R, V] logits with ``params``' logit_bias and penalties applied; ``counts`` [R, V] or [V]:
    how often each token was generated so far (needed only when ``params.penalized``)."""
    logits = logits.float()
    if params.logit_bias:
        ids = torch.tensor([token for token, _ in params.logit_bias])
        if int(ids.max()) >= logits.shape[-1]:
            raise SamplingError("logit_bias", f"logit_bias names token {int(ids.max())}; the vocabulary has {logits.shape[-1]}")
        logits = logits.index_add(-1, ids, torch.tensor([bias for _, bias in params.logit_bias]).expand(*logits.shape[:-1], -1))
    if params.penalized:
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return logits


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] logits -> [R, V] float32 probabilities the target samples from under ``params``
    (logit_bias and penalties are ``adjust_logits``' part, applied before this)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # In float64, from the row's maximum: a tiny temperature (down to 5e-324) drives every other
    # logit to -inf and leaves the argmax (ties shared) at 0, the greedy limit, instead of inf / inf;
    # a tiny top_p stays above 0 instead of rounding to it in float32.
    logits = logits.double()
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the top token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1).float()


def tree_row_probs(tree: DraftTree, row_logits: Callable[[int], torch.Tensor], params: SamplingParams,
                   counts: torch.Tensor | None) -> Callable[[int], torch.Tensor]:
    """The ``row_probs`` that ``accept`` walks for ``tree``: row r's target distribution [V] from the
    target's logits after row r (``row_logits(r)``, [V]), adjusted as plain decoding would adjust them
    after the same tokens. ``counts`` [V]: tokens generated before the tree (``params.penalized`` only);
    row r adds the drafted tokens on the path from the root down to node r-1."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()

    def probs(row: int) -> torch.Tensor:
        seen = None
        if params.penalized:
            seen = counts.clone()
            node = row - 1
            while node != -1:
                seen[tokens[node]] += 1
                node = parents[node]
        return target_probs(adjust_logits(row_logits(row)[None], params, seen), params)[0]

    return probs


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
            # All the mass on one token (always so when greedy) needs no draw, which over a 49k vocabulary costs
            # ~10x an argmax: 12% of a batch-32 `regenerate` step went to drawing the certain token.
            top = int(p.argmax())
            return Acceptance(path, top if float(p[top]) == 1.0 else int(torch.multinomial(p, 1, generator=generator)))
