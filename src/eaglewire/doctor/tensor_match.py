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

    def add(self, stored: Mapping[str, torch.Tensor],
            candidates: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """One sample: ``stored`` and ``candidates`` map names to [T, H] tensors over the same tokens.
        Returns the per-token errors [T] of every stored tensor against every candidate."""
        lengths = {t.shape[0] for t in (*stored.values(), *candidates.values())}
        if len(lengths) != 1:
            raise ValueError(f"one sample's tensors cover different token counts: {sorted(lengths)}")
        out: dict[str, dict[str, torch.Tensor]] = {}
        for i, name in enumerate(self.stored):
            s = stored[name].float()
            out[name] = {}
            for j, cand in enumerate(self.candidates):
                errors = token_errors(s, candidates[cand])
                out[name][cand] = errors
                self.sums[i, j] += float(errors.double().sum())
        self.tokens += lengths.pop()
        return out

    def errors(self) -> torch.Tensor:
        """[stored, candidates] mean per-token relative error."""
        if self.tokens == 0:
            raise ValueError("no tokens were compared")
        return (self.sums / self.tokens).float()

    def matches(self, tolerance: float = MATCH_TOLERANCE) -> list[Match]:
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


# ---- one sample: what each stored tensor is, position by position -----------------------------
#
# Errors averaged over a whole dataset say "no match" for data that is wrong in only some samples,
# and for tensors that are right but sit at the wrong tokens. Per sample and per token they tell:
#
#   ok          the labelled tensor, at (nearly) every token
#   relabelled  another capture point, at (nearly) every token: an index or order mix-up
#   shifted     the labelled tensor, but of the token `shift` positions away: tensors and input_ids
#               paired off by one (a loader slicing one of them for next-token prediction)
#   diverges    the labelled tensor on the first `at` tokens, then nothing: the tensors were computed
#               on another text than the stored input_ids, equal up to token `at` (a causal model's
#               state at t depends on tokens 0..t only, so every stored tensor diverges at that same token)
#   unmatched   no capture point at any alignment: noise, a lossy conversion, another model

MATCHING_SHARE = 0.9  # a stored tensor "is" a candidate on a sample when this share of its tokens is within tolerance
SHIFTS = (-1, 1, -2, 2)  # positions tried when the labelled tensor does not match in place


@dataclass(frozen=True)
class SampleVerdict:
    kind: str  # "ok", "relabelled", "shifted", "diverges" or "unmatched"
    best: str  # the candidate it equals (relabelled), its label (ok, shifted, diverges), the closest (unmatched)
    error: float  # mean per-token error against ``best`` in place
    shift: int = 0  # shifted: the value stored at token t is the candidate's at token t + shift
    at: int = 0  # diverges: the first token whose value differs


def _share(errors: torch.Tensor, tolerance: float) -> float:
    return float((errors <= tolerance).float().mean()) if errors.numel() else 0.0


def shifted_errors(stored: torch.Tensor, candidate: torch.Tensor, shift: int) -> torch.Tensor:
    """Per-token errors of ``stored[t]`` against ``candidate[t + shift]``, over the tokens where both exist."""
    length = stored.shape[0]
    if abs(shift) >= length:
        return torch.empty(0)
    if shift >= 0:
        return token_errors(stored[: length - shift], candidate[shift:])
    return token_errors(stored[-shift:], candidate[: length + shift])


def diagnose(label: str, stored: torch.Tensor, candidates: Mapping[str, torch.Tensor],
             errors: Mapping[str, torch.Tensor], tolerance: float = MATCH_TOLERANCE) -> SampleVerdict:
    """What ``stored`` [T, H] (labelled ``label``) is on one sample; ``errors``: its per-token errors
    against every candidate in place (from ``ErrorTable.add``)."""
    mean = {c: float(e.mean()) for c, e in errors.items()}
    if _share(errors[label], tolerance) >= MATCHING_SHARE:
        return SampleVerdict("ok", label, mean[label])
    shares = {c: _share(e, tolerance) for c, e in errors.items()}
    top = max(shares, key=lambda c: (shares[c], -mean[c]))
    if shares[top] >= MATCHING_SHARE:
        return SampleVerdict("relabelled", top, mean[top])
    closest = min(mean, key=mean.get)
    for point in dict.fromkeys((label, closest)):
        for shift in SHIFTS:
            if _share(shifted_errors(stored, candidates[point], shift), tolerance) >= MATCHING_SHARE:
                return SampleVerdict("shifted", point, mean[point], shift=shift)
    within = (errors[label] <= tolerance).tolist()
    leading = within.index(False) if False in within else len(within)
    if leading >= 1:
        return SampleVerdict("diverges", label, mean[label], at=leading)
    return SampleVerdict("unmatched", closest, mean[closest])
