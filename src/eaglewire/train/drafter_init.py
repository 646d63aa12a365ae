"""Starting a drafter from the target's own weights instead of random ones.

The drafter's last two modules do what the target's last two already do: ``norm``
then ``lm_head`` turn a final-like hidden state into next-token logits. Starting
them from the target's final norm and its lm_head rows of the draft vocabulary
leaves the drafter only one job, producing a hidden state the target's head
already reads (speculators 0.9 does this and keeps that lm_head frozen).

Two cheaper-still starts are offered for measurement:
  fc "last-aux"          g = the last aux state (the deepest captured layer), the
                         other aux states weighted zero
  midlayer "target-last" the target's last decoder layer: its MLP, o_proj and
                         norms; q/k/v read the hidden half of the 2H input with
                         the target's weights and start blind to the embedding half

Each choice is a named option so a run records exactly how it began.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..drafter.model import Drafter, draft_ids_of
from ..errors import ConfigError

HEAD_INITS = ("random", "target")
FC_INITS = ("random", "last-aux")
MIDLAYER_INITS = ("random", "target-last")


@dataclass(frozen=True)
class DrafterInit:
    head: str = "random"  # lm_head + norm: random, or the target's rows and final norm
    freeze_lm_head: bool = False  # keep lm_head as initialised (it must start from something worth keeping)
    fc: str = "random"
    midlayer: str = "random"

    def __post_init__(self) -> None:
        for name, choices in (("head", HEAD_INITS), ("fc", FC_INITS), ("midlayer", MIDLAYER_INITS)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"--init-{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")

    @property
    def is_random(self) -> bool:
        return (self.head, self.fc, self.midlayer) == ("random", "random", "random")

    def to_json(self) -> dict:
        return asdict(self)


@torch.no_grad()
def initialize(drafter: Drafter, init: DrafterInit, lm_head: nn.Linear, norm: nn.Module, last_layer: nn.Module) -> None:
    """Apply ``init`` to a drafter in place (and freeze its lm_head if asked). The target modules are only read."""
    if init.head == "target":
        draft_ids = draft_ids_of(drafter.d2t).to(lm_head.weight.device)
        drafter.lm_head.weight.copy_(lm_head.weight[draft_ids])
        drafter.norm.weight.copy_(norm.weight)
    if init.fc == "last-aux":
        hidden = drafter.config.hidden_size
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -hidden:].copy_(torch.eye(hidden))
    if init.midlayer == "target-last":
        _copy_decoder_layer(drafter, last_layer)
    drafter.lm_head.weight.requires_grad_(not init.freeze_lm_head)


def _copy_decoder_layer(drafter: Drafter, layer: nn.Module) -> None:
    hidden = drafter.config.hidden_size
    mid = drafter.midlayer
    for name in ("q_proj", "k_proj", "v_proj"):
        ours, theirs = getattr(mid.self_attn, name).weight, getattr(layer.self_attn, name).weight
        if ours.shape != (theirs.shape[0], 2 * theirs.shape[1]):
            raise ConfigError(f"--init-midlayer target-last: the target's {name} is {tuple(theirs.shape)}, the drafter's "
                              f"{tuple(ours.shape)}; the drafter must be sized like the target's layers")
        ours[:, :hidden].zero_()  # the embedding half: the target layer never saw a separate token embedding
        ours[:, hidden:].copy_(theirs)
    mid.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mid.mlp, name).weight.copy_(getattr(layer.mlp, name).weight)
    mid.hidden_norm.weight.copy_(layer.input_layernorm.weight)
    mid.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)


def trainable_parameters(drafter: Drafter) -> list[nn.Parameter]:
    return [p for p in drafter.parameters() if p.requires_grad]
