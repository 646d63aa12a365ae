"""A lean forward for Llama-family targets (llama, qwen2, mistral) over a static KV cache.

Built from a loaded HF model. On CPU in fp32 its matrices are oneDNN-packed
copies, which make a verify step over several tokens cost about one decode step
(``projection.py``); with ``packed=False`` it holds references to the HF
parameters, copying nothing. What it drops is Python: no modules, no per-layer config reads, no cache
objects that grow. Per step the hot loop runs a fixed list of tensor ops.

Positions and slots are separate on purpose. ``positions`` are RoPE positions
(a token's depth in its sequence); ``slots`` are the cache rows its keys and
values go to. They coincide for ordinary decoding; in a verify step over a
tree, siblings share a position but need distinct slots. See ``kv_cache.py``
for the cache contract, including ``keep`` after verification.

Capture uses the canonical vocabulary of ``wiring.py`` (``embed``,
``layer{i}.out``, ``final``) and happens explicitly in the loop: the forward
returns exactly the requested points, and ``tests/test_lean.py`` proves each
equals what ``capture.capture`` (the extraction path) records.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import EaglewireError
from ..target import LEAN_FAMILIES, layout_of
from ..wiring import CapturePoint
from . import rowwise_kernel
from .kv_cache import KVCache
from .projection import Projection, check_product_dtype, packing_available

ALL_ROWS = slice(None)
# A forward of at most this many tokens (a decode step, or a verify step: the last token plus its drafts)
# attends one row at a time, each row over exactly the keys plain decoding would give it, in the same order
# and contiguous: SDPA's result for a query row depends on how many rows share the call (measured on SmolLM2:
# every row of a 17-token forward differs from its one-token step, by up to 2.5e-5 in fp32). Longer forwards
# (prefills) attend at once. Where the row kernels run (``LeanModel.row_kernels``), their row attention
# (row_attention.cpp) attends the rows, all in one call per layer; elsewhere one SDPA call per row (at 300
# tokens of context, SmolLM2, one thread, busy machine: a 5-token verify +6%, a 33-token tree +30%).
ROW_BY_ROW_ATTENTION = 64
# RoPE variants whose frequencies depend on the current sequence length; a table
# precomputed for max_len would not match what HF computes for shorter inputs.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class LeanError(EaglewireError):
    """The target cannot run through the lean forward, or a forward call is malformed."""


@dataclass(frozen=True)
class LeanConfig:
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_len: int  # RoPE table and KV cache length: the longest sequence this instance can hold

    @classmethod
    def from_hf(cls, model: nn.Module, max_len: int) -> LeanConfig:
        """Derive the config from an HF model; refuse what the lean forward does not implement."""
        config = model.config
        family = config.model_type
        if family not in LEAN_FAMILIES:  # each other family (and every wrapper) runs the HF forward (hf_forward.py)
            raise LeanError(f"the lean forward supports {', '.join(LEAN_FAMILIES)}, not {family!r}")
        if config.hidden_act != "silu":
            raise LeanError(f"the lean forward implements a SiLU-gated MLP; this {family} model uses {config.hidden_act!r}")
        rope_type = config.rope_parameters["rope_type"]
        if any(kind in rope_type for kind in _LENGTH_DEPENDENT_ROPE):
            raise LeanError(
                f"RoPE type {rope_type!r} recomputes its frequencies from the sequence length; the lean forward "
                "precomputes one table and does not support it"
            )
        window = _sliding_window(config)
        if window is not None and window < max_len:
            raise LeanError(
                f"this {family} model uses sliding-window attention (window {window}) and the lean forward does "
                f"not implement it; use max_len <= {window}, where the window never takes effect"
            )
        if max_len < 1:
            raise LeanError(f"max_len must be at least 1, got {max_len}")
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        if num_heads % num_kv_heads:
            raise LeanError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} key/value heads")
        # Qwen2's config has no head_dim field; the query projection's shape is the truth for every family.
        q_rows = model.model.layers[0].self_attn.q_proj.weight.shape[0]
        if q_rows % num_heads:
            raise LeanError(f"q_proj has {q_rows} rows, not a multiple of {num_heads} heads")
        return cls(
            family=family, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=q_rows // num_heads,
            vocab_size=config.vocab_size, rms_norm_eps=float(config.rms_norm_eps), max_len=max_len,
        )


def _sliding_window(config) -> int | None:
    """The attention window HF applies to this model, or None when attention is global."""
    if config.model_type == "mistral":
        return config.sliding_window
    if config.model_type == "qwen2":  # only layers typed 'sliding_attention' use the window
        return config.sliding_window if "sliding_attention" in config.layer_types else None
    return None  # llama


class LayerWeights(NamedTuple):
    """One decoder layer's parameters: the norms' weights and the projections over the HF parameters."""

    attn_norm: torch.Tensor
    q: Projection
    k: Projection
    v: Projection
    o: Projection
    mlp_norm: torch.Tensor
    gate: Projection
    up: Projection
    down: Projection

    @classmethod
    def of(cls, layer: nn.Module, packed: bool, dtype: torch.dtype | None = None,
           rowwise: bool | None = None, exact_codes: bool = True) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp

        def projection(linear: nn.Linear) -> Projection:
            return Projection(linear.weight, linear.bias, packed, dtype=dtype, rowwise=rowwise, exact_codes=exact_codes)

        return cls(
            layer.input_layernorm.weight,
            projection(attn.q_proj), projection(attn.k_proj), projection(attn.v_proj), projection(attn.o_proj),
            layer.post_attention_layernorm.weight,
            projection(mlp.gate_proj), projection(mlp.up_proj), projection(mlp.down_proj),
        )


@dataclass(frozen=True)
class CapturePlan:
    """Where each requested point is taken, resolved once per distinct request."""

    points: tuple[CapturePoint, ...]  # as requested, duplicates dropped
    embed: CapturePoint | None
    at_layer: tuple[CapturePoint | None, ...]  # index i: the point taken after layer i, if any
    final: CapturePoint | None

    @classmethod
    def build(cls, points: Sequence[CapturePoint], num_layers: int) -> CapturePlan:
        unique = tuple(dict.fromkeys(points))
        at_layer: list[CapturePoint | None] = [None] * num_layers
        embed = final = None
        for point in unique:
            if not isinstance(point, CapturePoint):
                raise LeanError(f"capture points must be CapturePoint objects (CapturePoint.parse('layer14.out')), got {point!r}")
            point.check_reachable(num_layers)  # WiringError names the valid range
            if point.is_embed:
                embed = point
            elif point.is_final:
                final = point
            else:
                at_layer[point.layer] = point
        return cls(unique, embed, tuple(at_layer), final)


@dataclass(frozen=True)
class SequenceCall:
    """One sequence's part of ``LeanModel.forward_batch``; the fields mean what ``forward``'s do."""

    cache: KVCache
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    logits_rows: tuple[int, ...] = ()  # rows (of this sequence) whose logits come with the forward


class SequenceOutput(NamedTuple):
    hidden: torch.Tensor  # [T, H] final (post-norm) hidden states
    logits: torch.Tensor | None  # [len(logits_rows), vocab], None when no rows were asked for
    captured: dict[CapturePoint, torch.Tensor]  # {point: [T, H]} in the requested order


class _Segment(NamedTuple):
    """A sequence's tokens within one forward: where their keys go and what they may attend to."""

    cache: KVCache
    slots: torch.Tensor
    keys: int  # cache slots attended over: 0..keys-1
    mask: torch.Tensor | None
    length: int
    # Row by row attention in the form of the path that runs it, the other None: per row the keys 0..end-1 or
    # these slots (torch ops), or the row attention kernel's (key counts, slots) where it runs. Both None: all
    # rows at once.
    rows: tuple[int | torch.Tensor, ...] | None
    kernel_rows: tuple[torch.Tensor, torch.Tensor] | None


class LeanModel:
    """Forward over a static KV cache, over an HF Llama-family model's weights (``projection.py``)."""

    def __init__(self, config: LeanConfig, embed: torch.Tensor, layers: Sequence[LayerWeights],
                 norm: torch.Tensor, lm_head: Projection, cos: torch.Tensor, sin: torch.Tensor,
                 row_kernels: bool | None = None):
        if len(layers) != config.num_layers:
            raise LeanError(f"got {len(layers)} layers for a config of {config.num_layers}")
        if cos.shape != (config.max_len, config.head_dim) or sin.shape != cos.shape:
            raise LeanError(f"RoPE tables must be [{config.max_len}, {config.head_dim}], got {tuple(cos.shape)}")
        self.config = config
        self.embed = embed
        self.layers = tuple(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.packed = lm_head.packed  # whether the matrices run through a row-invariant kernel
        self.kernel = lm_head.kernel  # which one (reported by bench)
        projections = [p for w in self.layers for p in (w.q, w.k, w.v, w.o, w.gate, w.up, w.down)] + [lm_head]
        # how many matrices the rowwise kernel reads as block codes of each width, and from fp32 (reported by bench)
        self.weight_formats = dict(sorted(Counter(
            "fp32" if p.codes is None else f"{p.codes.bits}-bit codes" for p in projections if p.kernel == "rowwise").items()))
        self.product_dtype = lm_head.dtype  # the dtype every matrix product multiplies in (reported with outputs)
        self.cos = cos
        # rotate_half(x) * sin == roll(x, half) * sin_signed: one op instead of slice, negate, cat.
        half = config.head_dim // 2
        self.sin_signed = rowwise_kernel.signed_sin(sin)
        self._key_index = torch.arange(config.max_len, device=embed.device)
        self._plans: dict[tuple, CapturePlan] = {}
        # Hot-loop constants, read once here instead of through the config each layer.
        self._q_shape = (config.num_heads, config.head_dim)
        self._kv_shape = (config.num_kv_heads, config.head_dim)
        self._norm_shape = (config.hidden_size,)
        self._eps = config.rms_norm_eps
        self._half = half
        self._scale = config.head_dim ** -0.5
        # Wherever the rowwise kernel multiplies the matrices, the row-wise steps between them run in it too
        # (row_attention.cpp): every RMSNorm, and the RoPE, cache write and attention of short forwards
        # (ROW_BY_ROW_ATTENTION). Each computes a row from that row alone, so a verify row keeps its decode bits.
        # row_kernels=True asks for them beside another matrix kernel (``from_hf``, ``batched_lm_head``).
        fit = _row_kernels_fit(config, embed.dtype)
        if row_kernels is None:
            row_kernels = self.kernel == "rowwise" and fit
        elif row_kernels and not (fit and rowwise_kernel.available()):
            raise LeanError(f"the row kernels need fp32 weights, head_dim a multiple of 16 and hidden_size of 8 and an "
                            f"x86 CPU where rowwise_kernel.py compiles; got {embed.dtype}, head_dim {config.head_dim}, "
                            f"hidden_size {config.hidden_size}, compiled: {rowwise_kernel.available()}")
        self.row_kernels = row_kernels

    @classmethod
    def from_hf(cls, model: nn.Module, max_len: int, packed: bool | None = None,
                product_dtype: torch.dtype | None = None, batched_lm_head: bool = False,
                rowwise: bool | None = None, exact_codes: bool = True, row_kernels: bool | None = None) -> LeanModel:
        """Wrap a loaded HF causal LM (e.g. ``Target.model``).

        ``packed``: multiply with oneDNN-packed copies of the matrices (``projection.py``);
        None chooses it wherever it applies (fp32 on CPU). False shares every HF parameter,
        copying nothing. Build it after choosing the model's dtype and device: the RoPE
        tables (and packed copies) are made here.

        ``product_dtype``: the dtype the matrix products multiply in (default: the model's). bf16
        on an fp32 model packs bf16 copies of the matrices and rounds each product's input to
        bf16 (fp32 accumulation, output rounded to bf16); the residual stream, norms, attention
        and KV cache stay in the model's dtype. It is a different model from the fp32 one: its
        exact reference is its own plain decoding, which verification matches bit for bit
        because every product is row-invariant (``projection.py``).

        ``batched_lm_head``: multiply the lm_head packed, like the other matrices, instead of through its
        one-row path (fp32 only). Packed is the faster kernel for many rows per call (a batch of sequences
        decoding together: 32 rows 32 ms against 186 ms one at a time) and the slower for one (9.3 against
        5.4 ms: a single stream's decode step), measured in ``benchmarks/lm_head_rows.py``. Either kernel is
        row-invariant, so within one model a row's logits do not depend on the rows beside it. The rowwise
        kernel (an x86 CPU's default: ``rowwise_kernel.py``) was measured up to 16 rows, so a model with a
        batched lm_head multiplies every matrix with oneDNN.

        ``rowwise``: packed fp32 matrices multiply with the rowwise kernel (True) or oneDNN (False); None: the
        rowwise kernel where it is this CPU's default (``Projection``), oneDNN with ``batched_lm_head``.

        ``row_kernels``: run the norms, and the RoPE, cache writes and attention of forwards of up to
        ROW_BY_ROW_ATTENTION tokens, in ``row_attention.cpp`` (True) or as torch ops (False). None: where the
        rowwise kernel multiplies the matrices, and with ``batched_lm_head`` wherever the kernel is this CPU's
        default: a batch's decode rows otherwise attend in one SDPA call each, which cost a 32-row decode step of
        SmolLM2 at ~675 tokens of context 565 ms against 358 in the kernel, the same 32 greedy answers
        (``benchmarks/regenerate_rows.py``).

        ``exact_codes``: the rowwise kernel reads the matrices of a model de-quantized from a GGUF (the embedded
        SmolLM2) as their exact block codes (``block_codes.py``): the same products bit for bit, from 5.3x
        fewer bytes (4-bit codes). False: from fp32 (to measure the difference).
        """
        config = LeanConfig.from_hf(model, max_len)
        layout = layout_of(model)
        weight = layout.embed.weight
        if product_dtype is not None and product_dtype != weight.dtype:
            check_product_dtype(product_dtype)
            packed = True  # another product dtype exists only as a packed copy
        if packed is None:
            packed = packing_available(weight.dtype, weight.device)
        if rowwise is None and batched_lm_head:
            rowwise = False
        if row_kernels is None and batched_lm_head:
            row_kernels = rowwise_kernel.multiplies_by_default() and _row_kernels_fit(config, weight.dtype)
        positions = torch.arange(max_len, device=weight.device)[None]
        with torch.inference_mode():
            # HF's own rotary module, so every static RoPE variant (llama3, yarn, linear) matches it exactly.
            cos, sin = model.model.rotary_emb(weight[:1], position_ids=positions)
        return cls(
            config, weight, [LayerWeights.of(layer, packed, product_dtype, rowwise, exact_codes) for layer in layout.layers],
            layout.norm.weight,
            Projection(layout.lm_head.weight, None, packed, transposed_for_one_row=not batched_lm_head,
                       dtype=product_dtype, rowwise=rowwise, exact_codes=exact_codes),
            cos[0].clone(), sin[0].clone(), row_kernels,
        )

    def new_cache(self) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.max_len, c.head_dim, self.embed.dtype, self.embed.device)

    def plan(self, capture: Sequence[CapturePoint]) -> CapturePlan:
        key = tuple(capture)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = CapturePlan.build(key, self.config.num_layers)
        return plan

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over final (post-norm) hidden states [..., H] -> [..., vocab]."""
        return self.lm_head(hidden)

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        slots: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        capture: Sequence[CapturePoint] = (),
        logits_rows: slice | torch.Tensor | None = ALL_ROWS,
    ) -> tuple[torch.Tensor, dict[CapturePoint, torch.Tensor]]:
        """Run T tokens, writing their keys and values into ``cache`` at ``slots``.

        - ``input_ids`` [1, T]; ``positions`` [T] RoPE positions; ``slots`` [T] distinct cache
          rows (default: ``positions``).
        - ``attention_mask`` bool [T, S], True = may attend, over cache slots ``0..S-1``
          (``max(slots) < S <= max_len``). Default: causal, token i sees slots ``<= slots[i]``.
          Each token must be allowed to see its own slot.
        - ``capture``: canonical points, returned as ``{point: [1, T, H]}`` in the requested order;
          an unreachable point raises ``WiringError``.
        - ``logits_rows``: which rows get the lm_head (a slice or index tensor; default all),
          returning logits [1, R, vocab]. ``None`` skips the lm_head and returns the final
          (post-norm) hidden states [1, T, H]; ``logits`` applies it later.
        """
        plan = self.plan(capture)
        segment = self._segment(cache, input_ids, positions, slots, attention_mask)
        hidden, captured = self._run(input_ids, positions, (segment,), plan)
        if logits_rows is None:
            return hidden, captured
        return self.logits(hidden[:, logits_rows]), captured

    @torch.inference_mode()
    def forward_batch(self, calls: Sequence[SequenceCall], capture: Sequence[CapturePoint] = ()) -> list[SequenceOutput]:
        """Several sequences, each with its own cache, in one forward.

        Every projection and MLP multiplies all sequences' tokens at once (on CPU, 4 rows
        cost about what 1 does; ``projection.py``); attention runs per sequence over its
        own cache. Each call means what ``forward`` would with the same arguments, and its
        ``logits_rows`` share one lm_head product.
        """
        if not calls:
            raise LeanError("forward_batch needs at least one sequence")
        if len({id(c.cache) for c in calls}) != len(calls):
            raise LeanError("two sequences of one forward_batch share a cache; each needs its own (new_cache())")
        plan = self.plan(capture)
        segments = [self._segment(c.cache, c.input_ids[None], c.positions, c.slots, c.attention_mask) for c in calls]
        for call, segment in zip(calls, segments):  # a row past a sequence's end would read the next sequence's
            if any(not 0 <= row < segment.length for row in call.logits_rows):
                raise LeanError(f"logits_rows {list(call.logits_rows)} fall outside the sequence's {segment.length} tokens")
        input_ids = torch.cat([c.input_ids for c in calls])[None]
        hidden, captured = self._run(input_ids, torch.cat([c.positions for c in calls]), segments, plan)
        starts = [0]
        for segment in segments:
            starts.append(starts[-1] + segment.length)
        rows = [starts[i] + row for i, call in enumerate(calls) for row in call.logits_rows]
        logits = self.logits(hidden[0, rows]).split([len(c.logits_rows) for c in calls]) if rows else [None] * len(calls)
        return [SequenceOutput(hidden[0, a:b], logits[i], {p: t[0, a:b] for p, t in captured.items()})
                for i, (a, b) in enumerate(zip(starts, starts[1:]))]

    def _segment(self, cache: KVCache, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None,
                 attention_mask: torch.Tensor | None) -> _Segment:
        if cache.max_len != self.config.max_len or len(cache.layers) != self.config.num_layers:
            raise LeanError("this cache was not made for this model: create it with new_cache()")
        num_tokens = self._check_tokens(input_ids, positions)
        if slots is None:
            slots = positions
        else:
            self._check_tokens(input_ids, slots, name="slots")
        keys, mask = self._mask(attention_mask, slots, num_tokens)
        rows = _row_keys(slots, mask, num_tokens)
        kernel_rows = None
        if rows is not None and self.row_kernels:
            rows, kernel_rows = None, _kernel_rows(rows)
        slots = slots.contiguous()
        return _Segment(cache, slots, keys, mask, num_tokens, rows, kernel_rows)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: Sequence[_Segment],
             plan: CapturePlan) -> tuple[torch.Tensor, dict[CapturePoint, torch.Tensor]]:
        """The decoder stack over ``input_ids`` [1, T] (the segments' tokens, in order): final hidden and captures."""
        captured: dict[CapturePoint, torch.Tensor] = {}
        hidden = F.embedding(input_ids, self.embed)
        if plan.embed is not None:
            captured[plan.embed] = hidden
        cos, sin = self.cos[positions], self.sin_signed[positions]  # [T, D]
        for index, weights in enumerate(self.layers):
            hidden = hidden + self._attention(weights, self._norm(hidden, weights.attn_norm), index, segments, cos, sin)
            hidden = hidden + self._mlp(weights, self._norm(hidden, weights.mlp_norm))
            point = plan.at_layer[index]
            if point is not None:
                captured[point] = hidden
        hidden = self._norm(hidden, self.norm)
        if plan.final is not None:
            captured[plan.final] = hidden
        return hidden, {point: captured[point] for point in plan.points}

    __call__ = forward

    # -- checks, once per forward -------------------------------------------------

    def _check_tokens(self, input_ids: torch.Tensor, index: torch.Tensor, name: str = "positions") -> int:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise LeanError(f"input_ids must be [1, T] (one sequence), got shape {tuple(input_ids.shape)}")
        num_tokens = input_ids.shape[1]
        if index.shape != (num_tokens,):
            raise LeanError(f"{name} must be [T] = [{num_tokens}], got shape {tuple(index.shape)}")
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= self.config.max_len:
            raise LeanError(f"{name} run {low}..{high}, outside this instance's max_len {self.config.max_len}")
        return num_tokens

    def _mask(self, attention_mask: torch.Tensor | None, slots: torch.Tensor,
              num_tokens: int) -> tuple[int, torch.Tensor | None]:
        """(number of cache slots to attend over, boolean mask for SDPA or None for 'all of them')."""
        last = int(slots.max())
        if attention_mask is None:
            keys = last + 1
            if num_tokens == 1:  # one token at the end of the sequence sees every slot up to its own
                return keys, None
            return keys, self._key_index[:keys] <= slots[:, None]
        keys = attention_mask.shape[-1]
        if attention_mask.dtype != torch.bool or attention_mask.shape != (num_tokens, keys):
            raise LeanError(
                f"attention_mask must be a bool tensor [T, S] = [{num_tokens}, S], got "
                f"{attention_mask.dtype} {tuple(attention_mask.shape)}"
            )
        if not last < keys <= self.config.max_len:
            raise LeanError(f"attention_mask covers {keys} slots; it must cover slot {last} and at most {self.config.max_len}")
        return keys, attention_mask

    # -- the layer ------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.row_kernels:
            return rowwise_kernel.rms_norm_rows(x, weight, self._eps)
        return F.rms_norm(x, self._norm_shape, weight, self._eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by each token's cos and signed sin rows [T, D]."""
        return x * cos[:, None] + x.roll(self._half, dims=-1) * sin_signed[:, None]

    def _attention(self, w: LayerWeights, x: torch.Tensor, layer: int, segments: Sequence[_Segment],
                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[1]
        q = w.q(x).view(num_tokens, *self._q_shape)  # [T, heads, D]
        k = w.k(x).view(num_tokens, *self._kv_shape)
        v = w.v(x).view(num_tokens, *self._kv_shape)
        outs, start = [], 0
        for seg in segments:  # each sequence attends over its own cache only
            end = start + seg.length
            outs.append(self._attend(seg, layer, q[start:end], k[start:end], v[start:end], cos[start:end], sin[start:end]))
            start = end
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return w.o(out.reshape(1, num_tokens, -1))

    def _attend(self, seg: _Segment, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One sequence's queries [t, heads, D] after storing its keys and values: -> [t, heads, D]."""
        if seg.kernel_rows is not None:
            k_cache, v_cache = (tensor[0] for tensor in seg.cache.layers[layer])
            rowwise_kernel.rope_and_store(q, k, v, cos, sin, k_cache, v_cache, seg.slots)
            return rowwise_kernel.attend_rows(q, k_cache, v_cache, *seg.kernel_rows, self._scale)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        k_all, v_all = seg.cache.write(layer, seg.slots, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        if seg.rows is not None:
            return torch.stack([_attend_one(q[i], k_all, v_all, keys) for i, keys in enumerate(seg.rows)])
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_all[:, :, :seg.keys], v_all[:, :, :seg.keys],
                                              attn_mask=seg.mask, enable_gqa=True)[0].transpose(0, 1)

    def _mlp(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        return w.down(F.silu(w.gate(x)) * w.up(x))


def _row_kernels_fit(config: LeanConfig, dtype: torch.dtype) -> bool:
    """The model's shapes and dtype are those ``row_attention.cpp`` computes: fp32, head_dim % 16, hidden % 8."""
    return dtype == torch.float32 and config.head_dim % 16 == 0 and config.hidden_size % 8 == 0


def _row_keys(slots: torch.Tensor, mask: torch.Tensor | None, num_tokens: int) -> tuple[int | torch.Tensor, ...] | None:
    """Each row's keys, as plain decoding would hold them, for a forward short enough to attend row by row.

    Plain decoding gives a token the contiguous keys 0..slot: a row whose visible slots are such a prefix
    reads that slice of the cache; a tree row (ancestors between siblings) gathers its visible slots, in slot
    order, into the same contiguous layout (``keep`` moves an accepted path's entries there afterwards)."""
    if num_tokens > ROW_BY_ROW_ATTENTION:
        return None
    if mask is None:
        return tuple(int(slot) + 1 for slot in slots)
    rows = []
    for visible in mask:
        index = visible.nonzero().flatten()
        prefix = len(index) > 0 and len(index) == int(index[-1]) + 1  # slots 0..n-1, all of them
        rows.append(len(index) if prefix else index)
    return tuple(rows)


def _kernel_rows(rows: tuple[int | torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` as ``attend_rows`` takes them: each row's key count, and every row's slots in turn (empty when
    each row reads a prefix). A listed prefix is read in the same order as a prefix, so it gives the same bits."""
    lengths = torch.tensor([row if isinstance(row, int) else len(row) for row in rows], dtype=torch.long)
    if all(isinstance(row, int) for row in rows):
        return lengths, torch.empty(0, dtype=torch.long)
    return lengths, torch.cat([torch.arange(row) if isinstance(row, int) else row for row in rows])


def _attend_one(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, keys: int | torch.Tensor) -> torch.Tensor:
    """One query row [heads, D] over its keys, as SDPA's call for a one-token decode step: -> [heads, D]."""
    if isinstance(keys, int):
        k, v = k_all[:, :, :keys], v_all[:, :, :keys]
    else:
        k, v = k_all.index_select(2, keys), v_all.index_select(2, keys)
    return F.scaled_dot_product_attention(q[None, :, None], k, v, enable_gqa=True)[0, :, 0]
