"""Training-time test: unroll the drafter K steps on its own outputs, as it runs when serving.

Alignment for one sample of T tokens x[0..T-1] (all tensors indexed by base position t):

  step 1: hidden fc(aux[t]),       token x[t+1], RoPE position t,       predicts x[t+2]
  step k: hidden h_{k-1}[t],       token x[t+k], RoPE position t+k-1,   predicts x[t+k+1]

The teacher for step k at t is the target's next-token distribution at t+k,
softmax(lm_head(final[t+k])) restricted to the draft vocabulary. Attention
follows serving: step 1 is causal over base positions; a step-k query at t sees
step-1 keys at s <= t plus its own chain's keys from steps 2..k at t (the
tokens it drafted before). Loss and accuracy count position t of step k only
when the predicted token x[t+k+1] exists and is an assistant token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..drafter.model import Attention, Drafter, rope_cos_sin

STEP_DECAY = 0.8  # weight of step k is STEP_DECAY**(k-1): later steps matter less (EAGLE-3's choice)
_TEACHER_CHUNK = 512  # tokens per chunk of the full-vocabulary teacher matmul (bounds memory)


@dataclass
class TeacherTargets:
    draft_log_probs: torch.Tensor  # [(B,) T, Vd] log-softmax of the target logits over the draft vocabulary
    top1: torch.Tensor  # [(B,) T] the target's argmax (target ids) over its full vocabulary, or within the draft vocabulary


@torch.no_grad()
def teacher_targets(final: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor,
                    full_vocab: bool = True, temperature: float = 1.0) -> TeacherTargets:
    """The target's next-token distribution at every position, from its post-norm states.

    The loss reads only the draft vocabulary's logits. ``full_vocab=False`` computes only those rows
    (a sixth of the product for an 8k draft vocabulary of 49k) and takes ``top1`` within them, which
    overstates agreement where the target's top-1 lies outside the draft vocabulary; evaluation keeps
    the full product so its accuracy is exact.

    ``temperature`` sharpens (< 1) the distribution the drafter is trained towards: greedy
    verification accepts only the target's top-1, which a drafter fitting the whole distribution
    spends capacity beyond. 0 is the limit, a one-hot label on the draft vocabulary's argmax.
    """
    weight = lm_head_weight.float()
    draft_ids = t2d.nonzero().squeeze(-1)  # ascending target ids = draft order
    if not full_vocab:
        weight = weight[draft_ids]
    log_probs, top1 = [], []
    leading = final.shape[:-1]  # [T], or [B, T] for a padded batch
    for chunk in final.float().reshape(-1, final.shape[-1]).split(_TEACHER_CHUNK):
        logits = chunk @ weight.T
        if full_vocab:
            top1.append(logits.argmax(-1))
            logits = logits[:, t2d]
        else:
            top1.append(draft_ids[logits.argmax(-1)])
        log_probs.append(_sharpened_log_probs(logits, temperature))
    return TeacherTargets(torch.cat(log_probs).reshape(*leading, -1), torch.cat(top1).reshape(leading))


def _sharpened_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature == 0:  # log of a one-hot: 0 at the argmax, -inf elsewhere (weight exp(-inf) = 0 in the loss)
        return torch.full_like(logits, -math.inf).scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
    return (logits / temperature).log_softmax(-1)


def _ttt_attention(attn: Attention, x, cos, sin, history: list[tuple[torch.Tensor, torch.Tensor]]):
    """Attention for one unrolled step; appends this step's keys/values to ``history``."""
    length = x.shape[1]
    q, k, v = attn.project(x, cos, sin)
    groups = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    history.append((k, v))
    if len(history) == 1:
        return attn.merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True))
    scale = 1.0 / math.sqrt(attn.head_dim)
    k1, v1 = history[0]
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    scores = (q @ k1.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, h, T, T]
    diagonal = torch.stack([(q * kj).sum(-1) * scale for kj, _ in history[1:]], dim=-1)  # [B, h, T, k-1]
    weights = torch.cat([scores, diagonal], dim=-1).softmax(-1)
    out = weights[..., :length] @ v1
    for j, (_, vj) in enumerate(history[1:]):
        out = out + weights[..., length + j, None] * vj
    return attn.merge_heads(out)


def unroll(drafter: Drafter, input_ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft logits [T-1, Vd] for each of ``steps`` unrolled steps (base positions 0..T-2).

    A batch is input_ids [B, T] and aux [B, T, A], its samples right-padded to one length (logits
    [B, T-1, Vd]): attention is causal, so no real position sees a pad, and pads carry no loss.
    """
    length = input_ids.shape[-1] - 1
    fused = drafter.fuse(aux[..., :length, :].to(drafter.fc.weight.dtype))
    return unroll_fused(drafter, input_ids, fused, steps)


def unroll_fused(drafter: Drafter, input_ids: torch.Tensor, fused: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """``unroll`` from step 1's hidden input [(B,) T-1, H] as given (``fuse(aux)`` in training; the doctor
    also feeds what a broken engine would, e.g. the final state with the fc bypassed)."""
    batched = input_ids.dim() == 2
    ids = input_ids if batched else input_ids[None]
    length = ids.shape[1] - 1
    if fused.shape != (*input_ids.shape[:-1], length, drafter.config.hidden_size):
        raise ValueError(f"fused must be [{'B, ' if batched else ''}T-1={length}, {drafter.config.hidden_size}], "
                         f"got {tuple(fused.shape)}")
    tokens = torch.cat([ids, ids.new_zeros(ids.shape[0], steps)], dim=1)  # past the end: never trained on
    hidden = fused.to(drafter.fc.weight.dtype)
    hidden = hidden if batched else hidden[None]
    layer = drafter.midlayer
    histories: list[list] = [[] for _ in range(drafter.config.num_layers)]  # each layer attends to its own keys
    logits = []
    for step in range(1, steps + 1):
        embeds = drafter.embed(tokens[:, step: step + length])
        positions = torch.arange(step - 1, step - 1 + length, device=input_ids.device)[None]
        cos, sin = rope_cos_sin(positions, drafter.config.head_dim, drafter.config.rope_theta, hidden.dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        h = hidden + _ttt_attention(layer.self_attn, x, cos, sin, histories[0])
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        for later, history in zip(drafter.decoder_layers()[1:], histories[1:]):
            h = hidden + _ttt_attention(later.self_attn, later.input_layernorm(hidden), cos, sin, history)
            hidden = h + later.mlp(later.post_attention_layernorm(h))
        step_logits = drafter.logits(hidden)
        logits.append(step_logits if batched else step_logits[0])
    return logits


def step_sums(drafter: Drafter, logits: list[torch.Tensor], loss_mask: torch.Tensor, teacher: TeacherTargets):
    """Per unrolled step k: (soft cross-entropy summed over trained positions, with grad;
    positions where the drafter's top-1 equals the target's; trained positions).

    Sums, not means, so samples and ranks add up exactly before normalising.
    """
    T = loss_mask.shape[-1]  # loss_mask [T], or [B, T] for a padded batch (pads are False)
    losses, correct, count = [], [], []
    for k, step_logits in enumerate(logits, start=1):
        valid = max(T - 1 - k, 0)  # base positions whose predicted token x[t+k+1] exists
        mask = loss_mask[..., k + 1: k + 1 + valid]
        log_q = step_logits[..., :valid, :].float().log_softmax(-1)
        ce = -(teacher.draft_log_probs[..., k: k + valid, :].exp() * log_q).sum(-1)
        losses.append((ce * mask).sum())
        drafted = drafter.draft_to_target(step_logits[..., :valid, :].detach().argmax(-1))
        correct.append(float(((drafted == teacher.top1[..., k: k + valid]) & mask).sum()))
        count.append(float(mask.sum()))
    return losses, correct, count


def step_weights(steps: int) -> list[float]:
    return [STEP_DECAY ** (k - 1) for k in range(1, steps + 1)]
