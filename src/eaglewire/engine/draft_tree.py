"""The candidate tokens one verify step checks: a tree rooted at the last committed token.

A chain of K drafts is the tree whose node i has parent i-1. Nodes are stored
parents-first (every parent index is smaller than its child's), and siblings in
the order the drafter ranked them, which is the order acceptance tries them.
Parent -1 is the root: the last committed token, which the target has not run yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [N] target token ids
    parents: torch.Tensor  # [N] parent node index, -1 for the root
    depths: torch.Tensor  # [N] 1 for the root's children
    scores: torch.Tensor  # [N] cumulative draft log-probability (ranking only)

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        if not (self.parents.shape == self.depths.shape == self.scores.shape == (n,)):
            raise ValueError("tokens, parents, depths and scores must all be [N]")
        if n and bool((self.parents >= torch.arange(n)).any()):
            raise ValueError("draft tree nodes must come after their parents")

    @classmethod
    def chain(cls, tokens: torch.Tensor, scores: torch.Tensor | None = None) -> DraftTree:
        n = tokens.numel()
        return cls(tokens, torch.arange(-1, n - 1), torch.arange(1, n + 1),
                   scores if scores is not None else torch.zeros(n))

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def is_chain(self) -> bool:
        return bool(torch.equal(self.parents, torch.arange(-1, self.size - 1)))

    def children(self) -> list[list[int]]:
        """children()[i + 1] lists node i's children in rank order; children()[0] the root's."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for node, parent in enumerate(self.parents.tolist()):
            out[parent + 1].append(node)
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """bool [N+1, N+1] over (root, nodes...): row i may attend to column j when j is i or an ancestor."""
        n = self.size
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[0, 0] = True
        for node, parent in enumerate(self.parents.tolist()):
            mask[node + 1] = mask[parent + 1]
            mask[node + 1, node + 1] = True
        return mask
