"""Continuing a drafter with a wider MLP.

A drafter sized like one of the target's layers may be too small to take more from
more data: SmolLM2's stopped gaining held-out agreement from new answers and from
more passes alike. Widening its MLP (the SwiGLU's intermediate size) is the cheapest
way to give it room: engines build the drafter's layer from ``intermediate_size`` in
its config.json, so the export is unchanged in kind, and a draft step costs more
only by the added rows.

The wider drafter starts as exactly the narrower one: the old ``gate_proj``/``up_proj``
rows and ``down_proj`` columns carry over, new gate/up rows start random (as a new
drafter's do) and the new ``down_proj`` columns start at zero, so the new units add
nothing until training moves them. (With those columns at zero the new gate/up rows
get no gradient in the first step; the columns do, and the rows follow from the next.)
"""

from __future__ import annotations

import dataclasses

import torch

from ..drafter.model import Drafter, draft_ids_of, reshaped_copy
from ..errors import ConfigError

WIDENED = ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight")


@torch.no_grad()
def with_mlp_width(drafter: Drafter, width: int, embed: torch.nn.Embedding) -> tuple[Drafter, dict]:
    """A copy of ``drafter`` whose MLP has ``width`` units, computing the same function, and a record of the
    change. New gate/up rows are drawn from torch's global generator (seed it first for a reproducible run)."""
    old = drafter.config.intermediate_size
    if width < old:
        raise ConfigError(f"the drafter's MLP has {old} units; narrowing it to {width} would drop what they learned. "
                          f"Give a width of at least {old}, or start a new drafter")
    config = dataclasses.replace(drafter.config, intermediate_size=width)
    widened = reshaped_copy(drafter, config, embed, draft_ids_of(drafter.d2t).cpu(), WIDENED)
    theirs = drafter.state_dict()
    mlp = widened.midlayer.mlp
    mlp.gate_proj.weight[:old].copy_(theirs["midlayer.mlp.gate_proj.weight"])
    mlp.up_proj.weight[:old].copy_(theirs["midlayer.mlp.up_proj.weight"])
    mlp.down_proj.weight.zero_()
    mlp.down_proj.weight[:, :old].copy_(theirs["midlayer.mlp.down_proj.weight"])
    record = {"from": old, "to": width, "new_units": "random gate/up rows, zero down_proj columns (same function)"}
    return widened.to(drafter.lm_head.weight.device), record
