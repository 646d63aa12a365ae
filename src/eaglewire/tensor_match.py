"""Which tensor of the target is this? Matching stored hidden states to every capture point.

The metric is the per-token relative error, averaged over tokens:

    error(s, c) = mean_t ||s_t - c_t|| / ||c_t||

Whole-tensor measures fail on real models. SmolLM2's residual stream carries a
few massive activations on the first token (norm ~25,000 against ~150 for the
others), so a flattened tensor is mostly that one token: whole-tensor relative
L2 between adjacent middle layers is only ~0.009-0.013 against ~0.0024 for a
bf16 round trip of the same tensor (a factor ~4), and whole-tensor cosine is
0.99995. Per token, every token counts once. Measured on SmolLM2-135M (fp32
recomputation against bf16-stored values, two chat inputs of 40 and 72 tokens,
every capture point from embed to final):

    same tensor, bf16 round trip    <= 0.0019
    closest adjacent pair           >= 0.22 (layer12.out / layer13.out)

``MATCH_TOLERANCE`` sits near the geometric middle, an order of magnitude from
both; ``tests/test_doctor.py`` checks the separation for every adjacent pair.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

MATCH_TOLERANCE = 0.02  # a stored tensor "is" a candidate when its error is below this
_EPS = 1e-12


def token_errors(stored: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Per-token relative error [T] of ``stored`` [T, H] against ``candidate`` [T, H], in float32."""
    if stored.shape != candidate.shape:
        raise ValueError(f"stored {tuple(stored.shape)} and candidate {tuple(candidate.shape)} differ in shape")
    s, c = stored.float(), candidate.float()
    return (s - c).norm(dim=-1) / c.norm(dim=-1).clamp(min=_EPS)


def relative_error(stored: torch.Tensor, candidate: torch.Tensor) -> float:
    """The matching metric: mean over tokens of the per-token relative error."""
    return float(token_errors(stored, candidate).mean())


class ErrorTable:
    """Per-token errors of every stored tensor against every candidate, summed over samples."""

    def __init__(self, stored: list[str], candidates: list[str]):
        self.stored, self.candidates = list(stored), list(candidates)
        self.sums = torch.zeros(len(self.stored), len(self.candidates), dtype=torch.float64)
        self.tokens = 0

    def add(self, stored: Mapping[str, torch.Tensor], candidates: Mapping[str, torch.Tensor]) -> None:
        """One sample: ``stored`` and ``candidates`` map names to [T, H] tensors over the same tokens."""
        lengths = {t.shape[0] for t in (*stored.values(), *candidates.values())}
        if len(lengths) != 1:
            raise ValueError(f"one sample's tensors cover different token counts: {sorted(lengths)}")
        for i, name in enumerate(self.stored):
            s = stored[name]
            for j, cand in enumerate(self.candidates):
                self.sums[i, j] += float(token_errors(s, candidates[cand]).double().sum())
        self.tokens += lengths.pop()

    def errors(self) -> torch.Tensor:
        """[stored, candidates] mean per-token relative error."""
        if self.tokens == 0:
            raise ValueError("no tokens were compared")
        return (self.sums / self.tokens).float()

    def matches(self, tolerance: float = MATCH_TOLERANCE) -> list["Match"]:
        errors = self.errors()
        out = []
        for i, name in enumerate(self.stored):
            order = errors[i].argsort().tolist()
            best, second = order[0], order[1] if len(order) > 1 else order[0]
            out.append(Match(name, self.candidates[best], float(errors[i, best]), self.candidates[second],
                             float(errors[i, second]), tolerance))
        return out


@dataclass(frozen=True)
class Match:
    """The candidate a stored tensor equals (if any) and the runner-up, with their errors."""

    stored: str
    best: str
    error: float
    runner_up: str
    runner_up_error: float
    tolerance: float

    @property
    def found(self) -> bool:
        """The best candidate is within tolerance (and so unambiguous: no two candidates are that close)."""
        return self.error <= self.tolerance

    def describe(self, label: str) -> str:
        """'stored aux[0] = layer1.out, rel. error 0.0017; next best layer2.out, rel. error 0.31'."""
        head = f"stored {label} = {self.best}" if self.found else f"stored {label} matches no tensor (closest {self.best})"
        return f"{head}, rel. error {self.error:.4f}; next best {self.runner_up}, rel. error {self.runner_up_error:.4f}"
