"""Capturing named residual-stream tensors from a target forward pass.

Forward hooks sit on exactly the modules that produce each requested capture
point (the embedding, a decoder layer, the final norm). After the forward every
hook must have fired exactly once with a tensor of the expected shape; anything
else is an error, never a fallback to some other tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import EaglewireError
from ..target import TargetLayout
from ..wiring import CapturePoint, WiringError


class CaptureError(EaglewireError):
    """A requested tensor was not produced by the forward pass."""


def module_for(layout: TargetLayout, point: CapturePoint) -> nn.Module:
    point.check_reachable(len(layout.layers))
    if point.is_embed:
        return layout.embed
    if point.is_final:
        return layout.norm
    return layout.layers[point.layer]


class CaptureHooks:
    """Context manager that records the requested points during one forward.

    ``dtype`` converts inside the hook, so a full-precision copy of each
    captured tensor is never kept.
    """

    def __init__(self, layout: TargetLayout, points: Sequence[CapturePoint], dtype: torch.dtype | None = None):
        self.points = tuple(dict.fromkeys(points))  # unique, order kept
        self.dtype = dtype
        self.hidden_size = layout.embed.embedding_dim
        self._modules = {point: module_for(layout, point) for point in self.points}
        self._captured: dict[CapturePoint, torch.Tensor] = {}
        self._handles: list = []

    def _hook_for(self, point: CapturePoint):
        def hook(module, args, output):
            if not isinstance(output, torch.Tensor):
                raise CaptureError(
                    f"{type(module).__name__} producing {point} returned {type(output).__name__}, not a tensor; "
                    "this transformers version lays out its decoder differently from what eaglewire supports"
                )
            if point in self._captured:
                raise CaptureError(f"the module producing {point} ran twice in one forward")
            self._captured[point] = output.detach() if self.dtype is None else output.detach().to(self.dtype)

        return hook

    def __enter__(self) -> "CaptureHooks":
        self._captured = {}
        self._handles = [module.register_forward_hook(self._hook_for(p)) for p, module in self._modules.items()]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def result(self, expected_tokens: int) -> dict[CapturePoint, torch.Tensor]:
        """The captured tensors; raises unless every hook fired with [..., expected_tokens, H]."""
        missing = [str(p) for p in self.points if p not in self._captured]
        if missing:
            raise CaptureError(f"capture hooks did not fire for {', '.join(missing)}: the forward never ran those modules")
        for point, tensor in self._captured.items():
            if tensor.shape[-2:] != (expected_tokens, self.hidden_size):
                raise CaptureError(
                    f"captured {point} has shape {tuple(tensor.shape)}, expected [..., {expected_tokens}, {self.hidden_size}]"
                )
        return dict(self._captured)


@torch.inference_mode()
def capture(
    layout: TargetLayout,
    points: Sequence[CapturePoint],
    input_ids: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> dict[CapturePoint, torch.Tensor]:
    """Run the target's decoder stack (no lm_head) on ``input_ids`` [B, T] and return the named tensors."""
    if input_ids.dim() != 2:
        raise WiringError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
    with CaptureHooks(layout, points, dtype) as hooks:
        layout.base(input_ids=input_ids, use_cache=False)
    return hooks.result(input_ids.shape[1])
