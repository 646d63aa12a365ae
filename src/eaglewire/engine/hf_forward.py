"""The target's own HF forward behind the lean forward's interface: for every family lean.py does not implement.

``LeanModel`` (``lean.py``) is a re-implementation, exact for the Llama family. Every
other supported family (Qwen3's q/k norms, Gemma 3's scaled embedding and extra
norms, MoE blocks, DeepSeek's MLA) and every wrapper runs here through the
model's own decoder stack, so it is exact by construction; it is slower (Python
modules, one sequence at a time) but computes what HF computes.

Same contract as ``LeanModel``: explicit RoPE ``positions`` and cache ``slots``,
an optional boolean ``[T, S]`` attention mask for tree verification, capture
points in the canonical vocabulary taken by the same hooks extraction uses
(``capture.CaptureHooks``), and a cache whose ``keep`` moves accepted entries.

How it drives HF (transformers 5.x): the attention modules call
``cache.update(k, v, layer_idx)`` and use the keys and values it returns; a 4-D
mask passed as ``attention_mask`` is used as given (masking_utils returns a 4-D
mask as is), and ``position_ids`` set RoPE. ``SlotCache`` writes each update at
the forward's slots and returns the slots ``0..S-1`` the mask covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..data.capture import CaptureHooks
from ..errors import ConfigError
from ..target import LEAN_FAMILIES, Target, TargetLayout
from ..wiring import CapturePoint
from .lean import ALL_ROWS, LeanError, LeanModel, SequenceCall, SequenceOutput


class HFForwardError(LeanError):
    """The target cannot run exactly through its HF forward here, or a call is malformed."""


@dataclass(frozen=True)
class ForwardConfig:
    family: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_len: int


class SlotCache:
    """A static KV cache written at explicit slots, which HF's attention modules write through ``update``.

    Per layer ``[1, kv_heads, max_len, head_dim]`` for keys and values (their head dims may differ,
    as in DeepSeek's MLA), allocated at the layer's first write. Same contract as ``kv_cache.KVCache``.
    """

    def __init__(self, num_layers: int, max_len: int):
        self.max_len = max_len
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self._slots: torch.Tensor | None = None
        self._keys = 0

    def empty_like(self) -> SlotCache:
        return SlotCache(len(self.k), self.max_len)

    def bind(self, slots: torch.Tensor | None, keys: int) -> None:
        """Where the next forward's tokens go and how many slots it attends over (None: outside a forward)."""
        self._slots, self._keys = slots, keys

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._slots is None:
            raise HFForwardError("SlotCache.update called outside HFForward.forward: nothing says where to write")
        if self.k[layer_idx] is None:
            heads = key_states.shape[1]
            self.k[layer_idx] = key_states.new_zeros(1, heads, self.max_len, key_states.shape[-1])
            self.v[layer_idx] = value_states.new_zeros(1, value_states.shape[1], self.max_len, value_states.shape[-1])
        k, v = self.k[layer_idx], self.v[layer_idx]
        k.index_copy_(2, self._slots, key_states)
        v.index_copy_(2, self._slots, value_states)
        return k[:, :, :self._keys], v[:, :, :self._keys]

    @torch.inference_mode()
    def keep(self, src_slots: torch.Tensor | Sequence[int], dst_start: int) -> int:
        """Move the entries at ``src_slots`` (in order) to ``dst_start, ...`` in every layer (``KVCache.keep``)."""
        src = torch.as_tensor(src_slots, dtype=torch.long)
        end = dst_start + src.numel()
        if dst_start < 0 or end > self.max_len or (src.numel() and (int(src.min()) < 0 or int(src.max()) >= self.max_len)):
            raise HFForwardError(f"cannot keep slots {src.tolist()} at {dst_start}..{end - 1}: the cache has {self.max_len}")
        if int(src.unique().numel()) != src.numel():
            raise HFForwardError(f"src_slots {src.tolist()} repeat a slot; each kept entry must be a distinct token")
        for k, v in zip(self.k, self.v):
            if k is not None:
                k[:, :, dst_start:end] = k[:, :, src.to(k.device)]
                v[:, :, dst_start:end] = v[:, :, src.to(v.device)]
        return end


class HFForward:
    """``LeanModel``'s interface over the target's own decoder stack (``TargetLayout.base``)."""

    packed = False  # the HF modules' own kernels
    kernel = "hf"

    def __init__(self, layout: TargetLayout, max_len: int):
        text = layout.text_config
        if max_len < 1:
            raise HFForwardError(f"max_len must be at least 1, got {max_len}")
        # A 4-D mask replaces HF's sliding-window masks too: exact only while the window never takes effect.
        layer_types = text.to_dict().get("layer_types") or ()
        if "sliding_attention" in layer_types and text.sliding_window is not None and text.sliding_window < max_len:
            raise HFForwardError(
                f"this {layout.family} model has sliding-window layers (window {text.sliding_window}); the HF "
                f"forward here passes one explicit mask to every layer, exact only with max_len <= {text.sliding_window}"
            )
        self.layout = layout
        self.config = ForwardConfig(layout.family, len(layout.layers), layout.embed.embedding_dim,
                                    layout.lm_head.weight.shape[0], max_len)
        # Gemma 3 caps its final logits (tanh); its HF CausalLM applies the cap after lm_head, and so does logits().
        self._softcap = text.final_logit_softcapping if layout.family == "gemma3_text" else None
        self._float_mask = text._attn_implementation != "sdpa"  # eager attention adds the mask to the scores
        self._key_index = torch.arange(max_len, device=layout.embed.weight.device)

    def new_cache(self) -> SlotCache:
        return SlotCache(self.config.num_layers, self.config.max_len)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.layout.lm_head(hidden)
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    @torch.inference_mode()
    def forward(self, cache: SlotCache, input_ids: torch.Tensor, positions: torch.Tensor, *,
                slots: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                capture: Sequence[CapturePoint] = (), logits_rows: slice | torch.Tensor | None = ALL_ROWS,
                ) -> tuple[torch.Tensor, dict[CapturePoint, torch.Tensor]]:
        """What ``LeanModel.forward`` does with the same arguments."""
        if not isinstance(cache, SlotCache) or cache.max_len != self.config.max_len:
            raise HFForwardError("this cache was not made for this model: create it with new_cache()")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise HFForwardError(f"input_ids must be [1, T] (one sequence), got shape {tuple(input_ids.shape)}")
        num_tokens = input_ids.shape[1]
        slots = positions if slots is None else slots
        for name, index in (("positions", positions), ("slots", slots)):
            if index.shape != (num_tokens,) or int(index.min()) < 0 or int(index.max()) >= self.config.max_len:
                raise HFForwardError(f"{name} must be [T] = [{num_tokens}] within max_len {self.config.max_len}, "
                                     f"got {index.tolist()}")
        if attention_mask is None:
            keys = int(slots.max()) + 1
            mask = self._key_index[:keys] <= slots[:, None]
        else:
            keys = attention_mask.shape[-1]
            if attention_mask.dtype != torch.bool or attention_mask.shape != (num_tokens, keys) \
                    or not int(slots.max()) < keys <= self.config.max_len:
                raise HFForwardError(f"attention_mask must be a bool tensor [T, S] covering every slot, got "
                                     f"{attention_mask.dtype} {tuple(attention_mask.shape)}")
            mask = attention_mask
        mask = mask[None, None]
        if self._float_mask:
            dtype = self.layout.embed.weight.dtype
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
        cache.bind(slots, keys)
        try:
            with CaptureHooks(self.layout, capture) as hooks:
                out = self.layout.base(input_ids=input_ids, position_ids=positions[None], attention_mask=mask,
                                       cache=cache, use_cache=True)
        finally:
            cache.bind(None, 0)
        captured = hooks.result(num_tokens)
        captured = {point: captured[point] for point in dict.fromkeys(capture)}
        hidden = out.last_hidden_state
        if logits_rows is None:
            return hidden, captured
        return self.logits(hidden[:, logits_rows]), captured

    __call__ = forward

    @torch.inference_mode()
    def forward_batch(self, calls: Sequence[SequenceCall], capture: Sequence[CapturePoint] = ()) -> list[SequenceOutput]:
        """Each sequence through its own forward (what ``LeanModel.forward_batch`` computes, without batching)."""
        if not calls:
            raise HFForwardError("forward_batch needs at least one sequence")
        if len({id(c.cache) for c in calls}) != len(calls):
            raise HFForwardError("two sequences of one forward_batch share a cache; each needs its own (new_cache())")
        outputs = []
        for call in calls:
            if any(not 0 <= row < len(call.input_ids) for row in call.logits_rows):
                raise HFForwardError(f"logits_rows {list(call.logits_rows)} fall outside the sequence's "
                                     f"{len(call.input_ids)} tokens")
            hidden, captured = self.forward(call.cache, call.input_ids[None], call.positions, slots=call.slots,
                                            attention_mask=call.attention_mask, capture=capture, logits_rows=None)
            logits = self.logits(hidden[0, list(call.logits_rows)]) if call.logits_rows else None
            outputs.append(SequenceOutput(hidden[0], logits, {p: t[0] for p, t in captured.items()}))
        return outputs


def target_forward(target: Target, max_len: int, product_dtype: torch.dtype | None = None,
                   batched_lm_head: bool = False) -> tuple[LeanModel | HFForward, str]:
    """The forward generate/bench/serve run, with the reason it was chosen. ``product_dtype``: what the
    matrix products multiply in (lean forward only; None: the model's dtype). ``batched_lm_head``: the
    lm_head kernel for many rows per call (``LeanModel.from_hf``; the HF forward has one kernel)."""
    layout = target.layout
    if layout.wrapper is None and layout.family in LEAN_FAMILIES:
        return (LeanModel.from_hf(target.model, max_len, product_dtype=product_dtype,
                                  batched_lm_head=batched_lm_head),
                f"lean forward ({layout.family}, lean.py)")
    if product_dtype not in (None, target.model.dtype):
        raise ConfigError(f"--dtype {product_dtype} runs through the lean forward only; this {layout.family} target "
                          "runs the HF forward: use --dtype fp32")
    inside = f" inside a {layout.wrapper} wrapper" if layout.wrapper else ""
    return HFForward(layout, max_len), (f"HF forward ({layout.family}{inside}: lean.py implements only "
                                        f"{', '.join(LEAN_FAMILIES)}; exact, slower)")
