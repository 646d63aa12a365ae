"""Training fc on aux states divided by their per-feature RMS, folded back into fc on save.

The aux states span very different scales: on SmolLM2, one feature of
``layer14.out`` has RMS ~845 where the median feature has ~3.6, and
``layer26.out``'s features are ~10x ``layer1.out``'s. Adam moves every weight
by about the learning rate, so a column of fc that reads a feature of RMS s
changes g = fc(aux) s times as fast as a column reading a unit feature: the
massive features get a step hundreds of times too large, the small ones one too
small.

Training therefore keeps ``fc.weight`` as W' over inputs ``aux / s`` (s: the
per-feature RMS of the training aux states, fixed at the start of the run) and
every checkpoint stores ``W = W' / s``, which reads the raw aux states: the
saved drafter is an ordinary EAGLE-3 drafter, the same function, and engines
load it unchanged. Only the optimizer sees the preconditioned parameters.
"""

from __future__ import annotations

import copy

import torch

from ..drafter.model import Drafter

SCALES = ("rms", "none")
_SCALE_TOKENS = 65_536  # tokens of training data the RMS is measured on (a few conversations' worth)
_FLOOR = 1e-3  # a dead feature keeps its column as it is instead of an enormous one


@torch.no_grad()
def feature_rms(samples, refs) -> torch.Tensor:
    """Per-feature RMS [num_aux * H] of the aux states over the first ~64k tokens of ``refs``."""
    total, count = None, 0
    for ref in refs:
        aux = samples.load(ref).aux.double()
        total = aux.pow(2).sum(0) if total is None else total + aux.pow(2).sum(0)
        count += aux.shape[0]
        if count >= _SCALE_TOKENS:
            break
    return (total / count).sqrt().clamp(min=_FLOOR).float()


@torch.no_grad()
def to_scaled_inputs(drafter: Drafter, scale: torch.Tensor) -> None:
    """Rewrite fc in place to read ``aux / scale`` with the same output: W' = W * scale."""
    drafter.fc.weight.mul_(scale.to(drafter.fc.weight)[None])


@torch.no_grad()
def raw_input_copy(drafter: Drafter, scale: torch.Tensor | None) -> Drafter:
    """The drafter as engines run it (fc reads raw aux states); ``drafter`` itself is untouched."""
    if scale is None:
        return drafter
    saved = copy.deepcopy(drafter, memo={id(drafter.embed_tokens): drafter.embed_tokens})  # share the target's table
    saved.fc.weight.div_(scale.to(saved.fc.weight)[None])
    return saved
