"""Continuing a drafter with more room: a wider MLP, or more decoder layers.

A drafter sized like one of the target's layers may be too small to take more from
more data: SmolLM2's stopped gaining held-out agreement from new answers and from
more passes alike. Either growth starts as exactly the smaller drafter, so a
continued run loses nothing it had learned and the measurement shows what the room
alone buys:

- a wider MLP (the SwiGLU's intermediate size): the old ``gate_proj``/``up_proj`` rows
  and ``down_proj`` columns carry over, new gate/up rows start random (as a new
  drafter's do) and the new ``down_proj`` columns start at zero. Engines build the
  layer from ``intermediate_size`` in config.json, so the export is unchanged in kind.
- more layers (``LaterLayer``, after the midlayer): each new layer starts random except
  its two output matrices, ``o_proj`` and ``down_proj``, at zero, so both its residual
  branches add nothing and it passes the hidden state through unchanged.

Zeroed output weights get gradient in the first step; the matrices feeding them follow
from the next (their gradient passes through the zeroed weights).
"""

from __future__ import annotations

import dataclasses

import torch

from ..drafter.model import (
    Drafter,
    draft_ids_of,
    expected_state_shapes,
    later_layer_prefix,
    reshaped_copy,
)
from ..errors import ConfigError

WIDENED = ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight")


@torch.no_grad()
def with_mlp_width(drafter: Drafter, width: int, embed: torch.nn.Embedding) -> tuple[Drafter, dict]:
    """A copy of ``drafter`` whose MLP has ``width`` units, computing the same function, and a record of the
    change. New gate/up rows are drawn from torch's global generator (seed it first for a reproducible run)."""
    if drafter.config.num_layers != 1:
        raise ConfigError("--mlp-width widens a one-layer drafter's MLP; this drafter has "
                          f"{drafter.config.num_layers} layers: widen it before adding layers")
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


@torch.no_grad()
def with_num_layers(drafter: Drafter, layers: int, embed: torch.nn.Embedding) -> tuple[Drafter, dict]:
    """A copy of ``drafter`` with ``layers`` decoder layers, computing the same function, and a record of the
    change. New layers' other weights are drawn from torch's global generator (seed it first)."""
    old = drafter.config.num_layers
    if layers < old:
        raise ConfigError(f"the drafter has {old} decoder layers; dropping to {layers} would lose what the others "
                          f"learned. Give at least {old}, or start a new drafter")
    config = dataclasses.replace(drafter.config, num_layers=layers)
    added = [later_layer_prefix(i) for i in range(old, layers)]
    new_keys = [key for key in expected_state_shapes(config) if key.startswith(tuple(added))]
    deeper = reshaped_copy(drafter, config, embed, draft_ids_of(drafter.d2t).cpu(), new_keys)
    for index in range(old, layers):
        layer = deeper.layers[str(index)]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    record = {"from": old, "to": layers, "new_layers": "random, with o_proj and down_proj zero (same function)"}
    return deeper.to(drafter.lm_head.weight.device), record
