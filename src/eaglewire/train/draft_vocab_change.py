"""Continuing a drafter on a new draft vocabulary.

A drafter can only ever propose tokens of its draft vocabulary, so the share of the
target's tokens outside it caps acceptance at every position. The vocabulary is chosen
once, from the first run's data; a lineage that later trains on other text (the
target's own answers instead of human ones) keeps a vocabulary that covers that text
worse than one chosen from it would (SmolLM2's shipped drafter: 90.0% of the target's
MT-bench tokens, against 92.7% for the 8,192 most frequent in its own answers).

Rebuilding the vocabulary keeps everything the drafter learned: every weight but
``lm_head`` carries over, as do the rows of tokens in both vocabularies. A new token's
row starts from the target's own lm_head row for it, mapped into the drafter's head by
the linear map that best takes the target's rows to the drafter's on the tokens both
vocabularies share (least squares). Both heads read a normed final hidden state, so a
linear map between them absorbs the two norms' weights and whatever else differs; its
fit is reported so a poor start is visible.
"""

from __future__ import annotations

import dataclasses

import torch

from ..drafter.model import Drafter, draft_ids_of, reshaped_copy
from ..errors import ConfigError

REPLACED = ("lm_head.weight", "d2t", "t2d")  # what depends on the vocabulary; every other tensor carries over


@torch.no_grad()
def with_draft_vocabulary(drafter: Drafter, draft_ids: torch.Tensor, target_head: torch.Tensor,
                          embed: torch.nn.Embedding) -> tuple[Drafter, dict]:
    """A copy of ``drafter`` over the target ids ``draft_ids``, and a record of the change.

    ``target_head``: the target's lm_head weight [vocab, hidden]; ``embed``: the target's embedding.
    """
    old_ids = draft_ids_of(drafter.d2t).cpu()
    new_ids = torch.as_tensor(draft_ids, dtype=torch.int64).reshape(-1).sort().values
    config = dataclasses.replace(drafter.config, draft_vocab_size=new_ids.numel())
    rebuilt = reshaped_copy(drafter, config, embed, new_ids, REPLACED)

    old_row = torch.full((config.vocab_size,), -1, dtype=torch.int64)
    old_row[old_ids] = torch.arange(old_ids.numel())
    rows_in_old = old_row[new_ids]
    kept = rows_in_old >= 0
    if int(kept.sum()) < config.hidden_size:
        raise ConfigError(f"the new draft vocabulary shares {int(kept.sum())} tokens with the drafter's; at least "
                          f"{config.hidden_size} (its hidden size) are needed to map the target's head onto the "
                          "drafter's. Start a new drafter instead")
    head = drafter.lm_head.weight.detach().float().cpu()
    target = target_head.detach().float().cpu()
    shared_target, shared_drafter = target[new_ids[kept]], head[rows_in_old[kept]]
    mapping = torch.linalg.lstsq(shared_target, shared_drafter).solution  # [hidden, hidden]
    residual = (shared_target @ mapping - shared_drafter).norm() / shared_drafter.norm()
    rows = target[new_ids] @ mapping
    rows[kept] = shared_drafter
    rebuilt.lm_head.weight.copy_(rows.to(rebuilt.lm_head.weight.dtype))
    record = {"tokens": int(new_ids.numel()), "kept": int(kept.sum()), "new": int((~kept).sum()),
              "dropped": int(old_ids.numel() - kept.sum()), "new_rows": "target rows, least-squares mapped",
              "map_relative_residual": round(float(residual), 4)}
    return rebuilt.to(drafter.lm_head.weight.device), record
