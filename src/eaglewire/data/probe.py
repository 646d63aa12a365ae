"""The probe: a fixed short input whose captured values are recorded in the manifest.

Any later run (training, serving, the doctor) can rerun the probe and prove it
captures the same tensors from the same model, without reading a shard.
"""

from __future__ import annotations

import torch

from ..errors import EaglewireError
from ..target import Target, chat_template_of
from ..wiring import CapturePoint, Wiring
from .capture import capture

PROBE_MESSAGES = [{"role": "user", "content": "Name three primary colors and one use for each."}]
PROBE_FIRST_VALUES = 8


def probe_input_ids(target: Target) -> torch.Tensor:
    text = target.tokenizer.apply_chat_template(
        PROBE_MESSAGES, chat_template=chat_template_of(target.tokenizer), tokenize=False, add_generation_prompt=True
    )
    return torch.tensor(target.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def run_probe(target: Target, points: tuple[CapturePoint, ...]) -> dict:
    """Capture ``points`` on the probe input, in float32; record per-token norms and leading values."""
    ids = probe_input_ids(target)
    captured = capture(target.layout, points, ids[None])
    return {
        "input_ids": ids.tolist(),
        "tensors": {
            str(point): {
                "token_norms": [round(float(v), 5) for v in captured[point][0].norm(dim=-1)],
                "last_token_first_values": [round(float(v), 6) for v in captured[point][0, -1, :PROBE_FIRST_VALUES]],
            }
            for point in points
        },
    }


def probe_for(target: Target, wiring: Wiring) -> dict:
    return run_probe(target, wiring.points)


class ProbeMismatch(EaglewireError):
    """The target no longer produces the probe values recorded with the data."""


PROBE_RTOL = 1e-3  # fp32 recomputation differs by ~1e-6 relative; adjacent layers differ by ~1e-2 (docs/ARCHITECTURE.md)


def probe_error(recorded: dict, fresh: dict) -> float:
    """How far one tensor's ``fresh`` probe entry is from the ``recorded`` one: the largest per-token
    relative error of its norms, against the recorded norms. Above PROBE_RTOL they are other tensors."""
    got, want = torch.tensor(fresh["token_norms"]), torch.tensor(recorded["token_norms"])
    return float(((got - want).abs() / want.abs().clamp(min=1e-6)).max())


def check_probe(recorded: dict, fresh: dict, what: str) -> None:
    """Raise unless ``fresh`` (from run_probe now) reproduces ``recorded`` for every tensor it names."""
    if recorded["input_ids"] != fresh["input_ids"]:
        raise ProbeMismatch(f"{what}: the probe input tokenizes differently now; the tokenizer or chat template changed")
    for name, expected in recorded["tensors"].items():
        if name not in fresh["tensors"]:
            raise ProbeMismatch(f"{what}: the probe recorded {name}, which is not captured now")
        error = probe_error(expected, fresh["tensors"][name])
        if error > PROBE_RTOL:
            raise ProbeMismatch(
                f"{what}: captured {name} differs from the recorded probe (max relative norm error {error:.2e} > "
                f"{PROBE_RTOL:g}); the target's weights or the capture code changed since the data was made"
            )
