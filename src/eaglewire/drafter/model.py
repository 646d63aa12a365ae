"""The EAGLE-3 drafter: Llama-style decoder layers over fused target hidden states.

Step 1 of a draft fuses the target's aux states, ``g = fc(cat(aux))``; every
later step feeds back the drafter's own pre-norm output instead (no fc)::

    x = cat([input_layernorm(embed(tok)), hidden_norm(g)])   # width 2H, embedding first
    h = g + self_attn(x)                                     # residual is the un-normed g
    h = h + mlp(post_attention_layernorm(h))                 # the first layer, ``midlayer``
    h = h + self_attn(input_layernorm(h)); h = h + mlp(...)  # each later layer (``layers.N``), if any
    logits = lm_head(norm(h))                                # over the draft vocabulary; h is next step's g

EAGLE-3 drafters have one layer; a deeper one (``num_layers`` > 1) adds plain Llama
decoder layers over the hidden state alone (``LaterLayer``).

Draft index i is target token ``i + d2t[i]``; ``t2d`` marks the target tokens
that have a draft index. Draft ids are kept in ascending target-id order, so
``target_logits[..., t2d]`` lines up with the draft logits.

The token embedding is the target's: the drafter borrows it read-only through
``TargetEmbedding``, which is not a module, so it is neither a drafter
parameter nor part of the drafter's checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..target import TargetError
from ..wiring import Wiring


@dataclass
class DrafterConfig:
    hidden_size: int  # the target's H: the embedding, every aux state and the drafter share it
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    num_aux: int  # aux states concatenated into fc = len(wiring.aux)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    num_layers: int = 1  # decoder layers: the EAGLE-3 midlayer, then plain Llama layers over H

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ConfigError(f"a drafter has at least one decoder layer, got num_layers={self.num_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(f"draft_vocab_size must be in 1..{self.vocab_size} (the target vocab), got {self.draft_vocab_size}")
        if self.num_aux < 1:
            raise ConfigError(f"num_aux must be >= 1, got {self.num_aux}")

    @property
    def fc_in_features(self) -> int:
        return self.num_aux * self.hidden_size

    @classmethod
    def from_target(cls, hf_config, wiring: Wiring, draft_vocab_size: int) -> "DrafterConfig":
        """Size the drafter like one decoder layer of the target (its language model's transformers config:
        ``Target.text_config``). Its width is the target's hidden size; its layer is Llama's in every family."""
        rope = hf_config.rope_parameters
        if hf_config.model_type == "gemma3_text":  # RoPE per layer type; the drafter's one layer is a global one
            rope = rope["full_attention"]
        if rope["rope_type"] != "default":
            # Engines rebuild RoPE from the drafter's config.json; only plain RoPE is written there.
            raise TargetError(f"the target uses {rope['rope_type']!r} RoPE scaling; eaglewire drafters support only default RoPE")
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        head_dim = hf_config.to_dict().get("head_dim")
        # Configs without the field (qwen2) use hidden // heads, as transformers does; so does DeepSeek's MLA,
        # whose head_dim is its RoPE part only (the drafter's layer is Llama attention whatever the target's).
        if head_dim is None or hf_config.model_type == "deepseek_v3":
            head_dim = hidden // heads
        return cls(
            hidden_size=hidden,
            intermediate_size=hf_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=hf_config.num_key_value_heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            num_aux=len(wiring.aux),
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope["rope_theta"]),
            max_position_embeddings=hf_config.max_position_embeddings,
        )


def expected_state_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a drafter's state dict (= its checkpoint), with its shape."""
    c = config
    h, q_out, kv_out = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim

    def layer(prefix: str, width: int) -> dict[str, tuple[int, ...]]:  # width: what q/k/v read
        norms = {f"{prefix}hidden_norm.weight": (h,)} if width == 2 * h else {}
        return {
            f"{prefix}input_layernorm.weight": (h,),
            **norms,
            f"{prefix}self_attn.q_proj.weight": (q_out, width),
            f"{prefix}self_attn.k_proj.weight": (kv_out, width),
            f"{prefix}self_attn.v_proj.weight": (kv_out, width),
            f"{prefix}self_attn.o_proj.weight": (h, q_out),
            f"{prefix}post_attention_layernorm.weight": (h,),
            f"{prefix}mlp.gate_proj.weight": (c.intermediate_size, h),
            f"{prefix}mlp.up_proj.weight": (c.intermediate_size, h),
            f"{prefix}mlp.down_proj.weight": (h, c.intermediate_size),
        }

    later = [layer(later_layer_prefix(i), h) for i in range(1, c.num_layers)]
    return {
        "fc.weight": (h, c.fc_in_features),
        **layer("midlayer.", 2 * h),
        **{key: shape for shapes in later for key, shape in shapes.items()},
        "norm.weight": (h,),
        "lm_head.weight": (c.draft_vocab_size, h),
        "d2t": (c.draft_vocab_size,),
        "t2d": (c.vocab_size,),
    }


# ---- draft vocabulary ----------------------------------------------------------------


def vocab_maps(draft_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the selected target ids, which are sorted ascending first.

    d2t: int64 [draft_vocab], target id = i + d2t[i]; t2d: bool [vocab_size].
    """
    ids = torch.as_tensor(draft_ids, dtype=torch.int64).reshape(-1)
    if ids.numel() == 0:
        raise ConfigError("the draft vocabulary is empty")
    ids = ids.sort().values
    if ids[0] < 0 or ids[-1] >= vocab_size:
        raise ConfigError(f"draft vocabulary ids must lie in 0..{vocab_size - 1} (the target vocab), got {ids[0]}..{ids[-1]}")
    repeated = ids[1:][ids[1:] == ids[:-1]]
    if repeated.numel():
        raise ConfigError(f"draft vocabulary repeats target ids {repeated.unique().tolist()[:10]}")
    d2t = ids - torch.arange(ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def draft_ids_of(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids a d2t offset table selects, in draft order."""
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t


# ---- building blocks -----------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (as Llama does) so half-precision drafters keep the statistics exact enough.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, 1, T, head_dim] for rotate-half (NeoX-style) RoPE, as Llama and the engines use.

    The frequencies are computed here in float32 rather than kept as a buffer, so
    casting the drafter to half precision cannot round them.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, head_dim/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query attention; the midlayer's q/k/v read the 2H-wide [embedding, hidden] input, a later
    layer's the hidden state alone."""

    def __init__(self, c: DrafterConfig, width: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(width, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(width, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(width, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, heads, T, d] and k, v [B, kv_heads, T, d], with RoPE applied to q and k."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """[B, heads, T, d] attention output -> o_proj -> [B, T, H]."""
        batch, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=attention_mask,
            is_causal=attention_mask is None,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.merge_heads(out)


class MLP(nn.Module):
    """SwiGLU feed-forward, as in Llama."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The drafter's single decoder layer (SGLang/vLLM name it ``midlayer``)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # normalises the token embedding
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # normalises the fused hidden g
        self.self_attn = Attention(c, 2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, embeds, fused, cos, sin, attention_mask):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(fused)], dim=-1)
        # Residual is the un-normed g (norm_before_residual=False), as EAGLE-3 and the engines do.
        h = fused + self.self_attn(x, cos, sin, attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LaterLayer(nn.Module):
    """A decoder layer after the midlayer: Llama's, reading the hidden state alone (no embedding)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, hidden, cos, sin, attention_mask):
        h = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def later_layer_prefix(index: int) -> str:
    """The state-dict prefix of decoder layer ``index`` >= 1 (the first is ``midlayer.``)."""
    return f"layers.{index}."


@dataclass(frozen=True)
class TargetEmbedding:
    """The target's token embedding, borrowed read-only.

    A plain dataclass, not a module: assigning it to the drafter registers
    nothing, so the table is not a drafter parameter, is not in the drafter's
    state dict or checkpoint, and is not moved by ``drafter.to(...)``.
    """

    table: nn.Embedding

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        # detach: no gradient reaches the target, even if its weight has requires_grad set.
        return F.embedding(input_ids, self.table.weight.detach())


# ---- the drafter ---------------------------------------------------------------------


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig, embed: nn.Embedding, draft_ids: Sequence[int] | torch.Tensor):
        """``embed``: the target's embedding; ``draft_ids``: the target ids of the draft vocabulary."""
        super().__init__()
        c = config
        if tuple(embed.weight.shape) != (c.vocab_size, c.hidden_size):
            raise ConfigError(
                f"the target embedding is {tuple(embed.weight.shape)}, the drafter expects "
                f"[vocab_size={c.vocab_size}, hidden_size={c.hidden_size}]"
            )
        ids = torch.as_tensor(draft_ids).reshape(-1)
        if ids.numel() != c.draft_vocab_size:
            raise ConfigError(f"got {ids.numel()} draft vocabulary ids, the config says draft_vocab_size={c.draft_vocab_size}")
        self.config = config
        self.embed_tokens = TargetEmbedding(embed)
        self.fc = nn.Linear(c.fc_in_features, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        # Keyed "1", "2", ...: layer i's tensors are "layers.i.*" (later_layer_prefix), counting the midlayer as 0.
        self.layers = nn.ModuleDict({str(i): LaterLayer(c) for i in range(1, c.num_layers)})
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        d2t, t2d = vocab_maps(ids, c.vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers in order: the midlayer, then the later ones (the order of their caches)."""
        return [self.midlayer, *self.layers.values()]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Target embedding of ``input_ids``, in the drafter's dtype."""
        return self.embed_tokens(input_ids).to(self.fc.weight.dtype)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """g = fc(cat(aux)): [..., num_aux*H] -> [..., H]. Always applied; a wrong width is an error."""
        self.check_fc_input(aux)
        return self.fc(aux)

    def check_fc_input(self, aux: torch.Tensor) -> None:
        """fc takes the wiring's aux states concatenated; anything narrower or wider is refused."""
        c = self.config
        if aux.shape[-1] != c.fc_in_features:
            raise ValueError(
                f"fc expects the {c.num_aux} aux states concatenated, width {c.num_aux}*{c.hidden_size} = "
                f"{c.fc_in_features}, but got width {aux.shape[-1]}; the aux input must be the wiring's "
                "captured states in order, never a single hidden state"
            )

    def forward(
        self,
        embeds: torch.Tensor,
        fused: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One draft step over a sequence; returns the pre-norm hidden [B, T, H].

        embeds: ``embed(input_ids)`` [B, T, H]; fused: ``fuse(aux)`` on step 1, the
        previous step's output afterwards [B, T, H]; position_ids: [B or 1, T];
        attention_mask: None for causal over the T positions, else a bool tensor
        broadcastable to [B, heads, T, T] where True means "may attend".
        """
        if embeds.shape != fused.shape or embeds.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"embeds {tuple(embeds.shape)} and fused {tuple(fused.shape)} must both be [B, T, {self.config.hidden_size}]"
            )
        if position_ids.dim() != 2 or position_ids.shape[-1] != embeds.shape[1]:
            raise ValueError(f"position_ids must be [B or 1, T={embeds.shape[1]}], got {tuple(position_ids.shape)}")
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            # A float 0/1 mask would be added to the scores as a bias and mask nothing.
            raise ValueError(f"attention_mask must be bool (True = may attend), got {attention_mask.dtype}")
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, fused.dtype)
        hidden = self.midlayer(embeds, fused, cos, sin, attention_mask)
        for layer in self.decoder_layers()[1:]:
            hidden = layer(hidden, cos, sin, attention_mask)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft_vocab] of a pre-norm hidden from ``forward``."""
        return self.lm_head(self.norm(hidden))

    # ---- draft <-> target vocabulary ----

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft ids."""
        return draft_ids + self.d2t[draft_ids]


@torch.no_grad()
def reshaped_copy(drafter: Drafter, config: DrafterConfig, embed: nn.Embedding, draft_ids: torch.Tensor,
                  replaced: Sequence[str]) -> Drafter:
    """A new drafter of ``config`` over ``draft_ids`` (in ``drafter``'s dtype, on the CPU) holding every tensor of
    ``drafter`` except ``replaced``, which keep a new drafter's values for the caller to fill. Anything else that
    does not carry over is refused, so a resize can never silently drop a learned tensor."""
    resized = Drafter(config, embed, draft_ids).to(drafter.lm_head.weight.dtype)
    carried = {k: v for k, v in drafter.state_dict().items() if k not in replaced}
    result = resized.load_state_dict(carried, strict=False)
    if sorted(result.missing_keys) != sorted(replaced) or result.unexpected_keys:
        raise ConfigError(f"the drafter's state does not match a drafter's (missing {result.missing_keys}, "
                          f"unexpected {result.unexpected_keys})")
    return resized
