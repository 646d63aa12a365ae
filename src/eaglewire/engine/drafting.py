"""Running an EAGLE-3 drafter at serving time: its KV cache, step-1 extension, chain and tree drafts.

Slots and positions follow training (``train/ttt.py``). With n committed tokens, the
drafter's cache holds one step-1 entry per base position t < n-1 (token x[t+1],
fused aux[t]) at slot t, and ``root`` is its output at t = n-2, which predicts
x[n]. A draft step at depth d below the root runs at RoPE position n-2+d; chain
steps sit at slot = position, tree expansions at fresh slots after the prefix,
each attending to the prefix, its expanded ancestors and itself. After
verification, ``extend`` writes the accepted tokens' step-1 entries at their
own slots, overwriting whatever the draft left there; nothing reads a slot
before this step writes it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..drafter.model import Drafter, apply_rope, rope_cos_sin
from ..errors import ConfigError
from . import rowwise_kernel
from .draft_tree import DraftTree
from .kv_cache import KVCache
from .projection import Projection, native_bf16, packing_available

MAX_TREE_DRAFT_SLOTS = 512  # drafter cache rows reserved past the context for one tree's expansions
ROW_KERNEL_TOKENS = 64  # a step over more tokens (a prompt's step-1 entries) attends with SDPA at once


def default_matmul_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the drafter's matrices multiply in when serving.

    Drafts need not be exact (verification keeps the output the target's). A draft
    step is bound by reading the drafter's ~9 M weights. Where the rowwise kernel is the
    CPU's fp32 product it reads a drafter saved in fp16 as its fp16 codes (``block_codes.py``)
    and stays fp32: on an AVX-512 AMD EPYC a chain of 6 drafts took 3.5 ms so, with the row
    kernels, against 4.8 in oneDNN bf16 (``benchmarks/results/draft_step.json``). Elsewhere, on a
    CPU that multiplies bf16 in hardware, its packed matrices are bf16 (half the bytes);
    activations, norms, attention and the cache stay in the drafter's own dtype."""
    if (weight.dtype == torch.float32 and weight.device.type == "cpu" and native_bf16()
            and not rowwise_kernel.multiplies_by_default()):
        return torch.bfloat16
    return weight.dtype


@dataclass(frozen=True)
class TreeShape:
    """An EAGLE-2 dynamic tree: ``depth`` draft steps expanding the ``top_k`` best nodes each,
    then the ``total_tokens`` best nodes (by cumulative draft log-probability) are verified."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 32

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "total_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"tree {name} must be >= 1, got {getattr(self, name)}")
        if self.draft_slots > MAX_TREE_DRAFT_SLOTS:
            raise ConfigError(f"tree depth x top-k = {self.draft_slots} exceeds {MAX_TREE_DRAFT_SLOTS} draft steps")

    @property
    def draft_slots(self) -> int:
        """Drafter cache slots one tree draft may use beyond the prefix."""
        return self.depth * self.top_k


class LayerProjections(NamedTuple):
    """One decoder layer's matrices as projections."""

    q: Projection
    k: Projection
    v: Projection
    o: Projection
    gate: Projection
    up: Projection
    down: Projection


class DrafterProjections(NamedTuple):
    """The drafter's matrices as projections (``projection.py``): a draft step multiplies them by 1-8 rows."""

    fc: Projection
    layers: tuple[LayerProjections, ...]  # the midlayer's first, then each later layer's
    lm_head: Projection

    @classmethod
    def of(cls, drafter: Drafter, packed: bool, dtype: torch.dtype) -> DrafterProjections:
        def projection(linear) -> Projection:
            return Projection(linear.weight, linear.bias, packed, transposed_for_one_row=linear is drafter.lm_head,
                              dtype=dtype)

        layers = tuple(LayerProjections(*(projection(linear) for linear in (
            layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
            layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj))) for layer in drafter.decoder_layers())
        return cls(projection(drafter.fc), layers, projection(drafter.lm_head))

    def all(self) -> list[Projection]:
        return [self.fc, *(p for layer in self.layers for p in layer), self.lm_head]


def row_kernels_apply(drafter: Drafter) -> bool:
    """The row kernels (``row_attention.cpp``) can run a draft step's norms, RoPE and attention: an fp32 drafter
    on a CPU where the kernels compile, with widths they take. Drafts need not be exact, so unlike the target's
    forward this does not wait for the rowwise kernel to be the CPU's default product."""
    c, weight = drafter.config, drafter.fc.weight
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and c.head_dim % 16 == 0
            and c.hidden_size % 8 == 0 and rowwise_kernel.available())


class DraftRunner:
    def __init__(self, drafter: Drafter, context: int, packed: bool | None = None,
                 matmul_dtype: torch.dtype | None = None, row_kernels: bool | None = None):
        """``context``: the target's context; the cache adds room for one tree's expansions.

        ``packed``: run the drafter's matrices through oneDNN-packed copies, as the lean
        forward does (None: wherever it applies, i.e. fp32 on CPU), multiplying in
        ``matmul_dtype`` (None: ``default_matmul_dtype``; unpacked, the weights' own).
        ``row_kernels``: run the norms, RoPE, cache writes and attention of steps over up to
        ``ROW_KERNEL_TOKENS`` tokens in the row kernels, as one call each instead of ~40 torch
        ops a step (None: where ``row_kernels_apply``).
        The runner is for serving: it snapshots the weights, so build it after training."""
        self.drafter = drafter
        max_len = context + MAX_TREE_DRAFT_SLOTS
        c = drafter.config
        weight = drafter.fc.weight
        packed = packing_available(weight.dtype, weight.device) if packed is None else packed
        if matmul_dtype is None:
            matmul_dtype = default_matmul_dtype(weight) if packed else weight.dtype
        if row_kernels is None:
            row_kernels = row_kernels_apply(drafter)
        elif row_kernels and not row_kernels_apply(drafter):
            raise ConfigError("the row kernels run an fp32 CPU drafter with head_dim % 16 == 0 and hidden_size % 8 "
                              f"== 0 where they compile; this drafter is {weight.dtype} on {weight.device}, head_dim "
                              f"{c.head_dim}, hidden {c.hidden_size}, kernels available: {rowwise_kernel.available()}")
        self.row_kernels = row_kernels
        self.projections = DrafterProjections.of(drafter, packed, matmul_dtype)
        self.cache = KVCache(c.num_layers, c.num_key_value_heads, max_len, c.head_dim, weight.dtype, weight.device)
        self._keys = torch.arange(max_len, device=weight.device)
        # RoPE rows for every slot, once: a step looks its positions up instead of recomputing them
        cos, sin = rope_cos_sin(self._keys[None], c.head_dim, c.rope_theta, weight.dtype)
        self._cos, self._sin = cos[0, 0], sin[0, 0]  # [max_len, head_dim]
        self._sin_signed = rowwise_kernel.signed_sin(self._sin)
        self._scale = c.head_dim ** -0.5

    def with_own_cache(self) -> DraftRunner:
        """A runner for another sequence in flight: the same drafter and packed weights, a fresh cache."""
        twin = copy.copy(self)
        twin.cache = self.cache.empty_like()
        return twin

    # -- one drafter step over T tokens ------------------------------------------------

    @torch.inference_mode()
    def _step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """tokens [T], hidden [1, T, H] -> the last layer's output [1, T, H]; mask [T, S] or None (causal by slot)."""
        if self.row_kernels and tokens.numel() <= ROW_KERNEL_TOKENS:
            return self._step_in_row_kernels(tokens, hidden, positions, slots, mask)
        d = self.drafter
        cos, sin = self._cos[positions][None, None], self._sin[positions][None, None]
        if mask is None:
            keys = int(slots.max()) + 1
            mask = None if tokens.numel() == 1 else self._keys[:keys] <= slots[:, None]
        else:
            keys = mask.shape[-1]
        for index, (layer, p) in enumerate(zip(d.decoder_layers(), self.projections.layers)):
            if index == 0:  # the midlayer reads the token's embedding beside the hidden state
                x = torch.cat([layer.input_layernorm(d.embed(tokens)[None]), layer.hidden_norm(hidden)], dim=-1)
            else:
                x = layer.input_layernorm(hidden)
            hidden = self._layer(index, p, x, hidden, cos, sin, slots, mask, keys)
            y = layer.post_attention_layernorm(hidden)
            hidden = hidden + p.down(F.silu(p.gate(y)) * p.up(y))
        return hidden

    def _layer(self, index: int, p: LayerProjections, x: torch.Tensor, residual: torch.Tensor, cos, sin,
               slots: torch.Tensor, mask: torch.Tensor | None, keys: int) -> torch.Tensor:
        """Layer ``index``'s attention over its cache, added to ``residual`` [1, T, H]."""
        c, count = self.drafter.config, x.shape[1]
        q = apply_rope(p.q(x).view(1, count, c.num_attention_heads, c.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(p.k(x).view(1, count, c.num_key_value_heads, c.head_dim).transpose(1, 2), cos, sin)
        v = p.v(x).view(1, count, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        k_all, v_all = self.cache.write(index, slots, k, v)
        out = F.scaled_dot_product_attention(q, k_all[:, :, :keys], v_all[:, :, :keys], attn_mask=mask,
                                             enable_gqa=True)
        return residual + p.o(out.transpose(1, 2).reshape(1, count, -1))

    def _step_in_row_kernels(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                             slots: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``_step`` with its norms, RoPE, cache writes and attention in the row kernels, rows [T, heads, D]."""
        d = self.drafter
        c, count, eps = d.config, tokens.numel(), d.config.rms_norm_eps
        hidden = hidden[0].contiguous()
        slots = slots.contiguous()
        cos, sin = self._cos[positions], self._sin_signed[positions]
        if mask is None:  # causal by slot: row t reads slots 0..slots[t]
            lengths, index = slots + 1, slots.new_empty(0)
        else:  # each row's visible slots, in slot order
            lengths, index = mask.sum(-1), mask.nonzero()[:, 1].contiguous()
        for number, (layer, p) in enumerate(zip(d.decoder_layers(), self.projections.layers)):
            if number == 0:  # the midlayer reads the token's embedding beside the hidden state
                x = torch.cat([rowwise_kernel.rms_norm_rows(d.embed(tokens), layer.input_layernorm.weight, eps),
                               rowwise_kernel.rms_norm_rows(hidden, layer.hidden_norm.weight, eps)], dim=-1)
            else:
                x = rowwise_kernel.rms_norm_rows(hidden, layer.input_layernorm.weight, eps)
            q = p.q(x).view(count, c.num_attention_heads, c.head_dim)
            k = p.k(x).view(count, c.num_key_value_heads, c.head_dim)
            v = p.v(x).view(count, c.num_key_value_heads, c.head_dim)
            k_cache, v_cache = (tensor[0] for tensor in self.cache.layers[number])
            rowwise_kernel.rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots)
            out = rowwise_kernel.attend_rows(q, k_cache, v_cache, lengths, index, self._scale)
            hidden = hidden + p.o(out.view(count, -1))
            y = rowwise_kernel.rms_norm_rows(hidden, layer.post_attention_layernorm.weight, eps)
            hidden = hidden + p.down(F.silu(p.gate(y)) * p.up(y))
        return hidden[None]

    def _log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.projections.lm_head(self.drafter.norm(hidden)).float().log_softmax(-1)

    # -- the committed prefix ----------------------------------------------------------

    @torch.inference_mode()
    def extend(self, next_tokens: torch.Tensor, aux: torch.Tensor, start: int) -> torch.Tensor:
        """Step-1 entries for base positions start.. (token x[t+1], aux [T, num_aux*H] of x[t]).

        Returns the output at the last one: the root of the next draft [H]."""
        positions = torch.arange(start, start + next_tokens.numel(), device=self._keys.device)
        self.drafter.check_fc_input(aux)
        fused = self.projections.fc(aux.to(self.drafter.fc.weight.dtype))[None]
        return self._step(next_tokens, fused, positions, positions, None)[0, -1]

    # -- drafts ------------------------------------------------------------------------

    @torch.inference_mode()
    def chain(self, root: torch.Tensor, base: int, length: int, min_confidence: float = 0.0) -> DraftTree:
        """Up to ``length`` greedy drafts; ``base`` = n-2, the base position of ``root``.

        The chain stops early once the drafter gives its own latest token less than
        ``min_confidence``: a token it doubts is rarely followed by accepted ones, and
        each further draft costs a drafter step and a wider verify."""
        hidden = root[None, None]
        tokens, scores, total = [], [], 0.0
        for step in range(1, length + 1):
            log_probs = self._log_probs(hidden)[0, 0]
            best = int(log_probs.argmax())
            token = self.drafter.draft_to_target(torch.tensor(best, device=self._keys.device))
            tokens.append(int(token))
            total += float(log_probs[best])
            scores.append(total)
            if float(log_probs[best].exp()) < min_confidence:
                break
            if step < length:
                at = torch.tensor([base + step], device=self._keys.device)
                hidden = self._step(token.reshape(1), hidden, at, at, None)
        return DraftTree.chain(torch.tensor(tokens, dtype=torch.long), torch.tensor(scores))

    @torch.inference_mode()
    def tree(self, root: torch.Tensor, base: int, shape: TreeShape) -> DraftTree:
        """EAGLE-2 dynamic tree below ``root``; at most ``shape.total_tokens`` nodes."""
        device = self._keys.device
        k = shape.top_k
        # All candidate nodes: token, parent, depth, cumulative score, and the hidden that predicted them.
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        scores: list[float] = []
        source: list[torch.Tensor] = []
        slot_of: dict[int, int] = {}

        def add_children(parent: int, depth: int, parent_score: float, hidden: torch.Tensor,
                         log_probs: torch.Tensor) -> list[int]:
            top = log_probs.topk(min(k, log_probs.numel()))
            ids = self.drafter.draft_to_target(top.indices).tolist()
            added = []
            for token, lp in zip(ids, top.values.tolist()):
                added.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
                depths.append(depth)
                scores.append(parent_score + min(lp, 0.0))  # rounding must not rank a child above its parent
                source.append(hidden)
            return added

        frontier = add_children(-1, 1, 0.0, root, self._log_probs(root))
        next_slot = base + 1
        prefix = base + 1  # slots 0..base hold the committed step-1 entries
        for depth in range(1, shape.depth):
            frontier = sorted(frontier, key=lambda i: -scores[i])[:k]
            count = len(frontier)
            slots = torch.arange(next_slot, next_slot + count, device=device)
            mask = torch.zeros(count, next_slot + count, dtype=torch.bool, device=device)
            mask[:, :prefix] = True
            for row, node in enumerate(frontier):
                slot_of[node] = next_slot + row
                ancestor = node
                while ancestor != -1:
                    if ancestor in slot_of:
                        mask[row, slot_of[ancestor]] = True
                    ancestor = parents[ancestor]
            positions = torch.full((count,), base + depth, device=device)
            hidden = torch.stack([source[node] for node in frontier])[None]
            token_ids = torch.tensor([tokens[node] for node in frontier], device=device)
            out = self._step(token_ids, hidden, positions, slots, mask)[0]
            # one lm_head call for the whole frontier: rows are invariant to how many share it (projection.py);
            # a packed head (bf16 drafters) multiplies 8 rows in ~1.5x one (fp32, 8,192 rows: 2.7 vs 1.8 ms)
            log_probs = self._log_probs(out)
            next_slot += count
            frontier = [child for row, node in enumerate(frontier)
                        for child in add_children(node, depth + 1, scores[node], out[row], log_probs[row])]
        return _select(tokens, parents, depths, scores, shape.total_tokens)


def _select(tokens, parents, depths, scores, budget: int) -> DraftTree:
    """The ``budget`` best nodes, parents first. Ties go to the shallower node, so a node's
    parent (whose score is never lower) is always kept with it."""
    ranked = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[:budget]
    order = sorted(ranked, key=lambda i: (depths[i], -scores[i], i))
    index = {node: new for new, node in enumerate(order)}
    return DraftTree(
        tokens=torch.tensor([tokens[i] for i in order], dtype=torch.long),
        parents=torch.tensor([index[parents[i]] if parents[i] != -1 else -1 for i in order], dtype=torch.long),
        depths=torch.tensor([depths[i] for i in order], dtype=torch.long),
        scores=torch.tensor([scores[i] for i in order]),
    )
