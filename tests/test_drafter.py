"""The EAGLE-3 drafter on a tiny random config (no downloads)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from eaglewire.drafter.model import (
    Drafter,
    DrafterConfig,
    draft_ids_of,
    expected_state_shapes,
    vocab_maps,
)
from eaglewire.wiring import Wiring

H, VOCAB, DRAFT_VOCAB = 64, 256, 64


def tiny_config(num_aux: int = 3) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=H, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, num_aux=num_aux, rms_norm_eps=1e-6, rope_theta=10000.0,
    )


def tiny_drafter(num_aux: int = 3, seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    embed = nn.Embedding(VOCAB, H)
    return Drafter(tiny_config(num_aux), embed, torch.randperm(VOCAB)[:DRAFT_VOCAB])


def step_inputs(drafter: Drafter, batch: int = 2, length: int = 5):
    ids = torch.randint(0, VOCAB, (batch, length))
    aux = torch.randn(batch, length, drafter.config.fc_in_features)
    positions = torch.arange(length)[None].expand(batch, length)
    return ids, aux, positions


def test_every_drafter_parameter_gets_gradient_and_the_embedding_none():
    drafter = tiny_drafter()
    embed = drafter.embed_tokens.table
    embed.weight.requires_grad_(True)  # even a trainable-looking target embedding must stay untouched
    ids, aux, positions = step_inputs(drafter)
    hidden = drafter(drafter.embed(ids), drafter.fuse(aux), positions)
    hidden2 = drafter(drafter.embed(ids), hidden, positions)  # a second step on its own output
    loss = drafter.logits(hidden).logsumexp(-1).mean() + drafter.logits(hidden2).logsumexp(-1).mean()
    loss.backward()
    names = [name for name, _ in drafter.named_parameters()]
    assert not any("embed" in name for name in names)
    for name, param in drafter.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert embed.weight.grad is None


def test_embedding_is_borrowed_not_owned():
    drafter = tiny_drafter()
    embed = drafter.embed_tokens.table
    assert all(p is not embed.weight for p in drafter.parameters())
    assert not any("embed" in key for key in drafter.state_dict())
    drafter.to(torch.float16)
    assert embed.weight.dtype == torch.float32  # the target's table is not the drafter's to cast
    assert drafter.embed(torch.tensor([[1, 2]])).dtype == torch.float16


def test_state_dict_is_exactly_the_documented_layout():
    drafter = tiny_drafter()
    actual = {key: tuple(t.shape) for key, t in drafter.state_dict().items()}
    assert actual == expected_state_shapes(drafter.config)


def test_embedding_shape_must_match_the_config():
    with pytest.raises(ValueError, match="target embedding"):
        Drafter(tiny_config(), nn.Embedding(VOCAB, H + 1), torch.arange(DRAFT_VOCAB))


def test_fc_refuses_a_single_hidden_state_even_of_width_h():
    drafter = tiny_drafter(num_aux=3)
    with pytest.raises(ValueError, match=r"3\*64 = 192.*width 64"):
        drafter.fuse(torch.randn(1, 4, H))
    with pytest.raises(ValueError, match="width 128"):
        drafter.fuse(torch.randn(1, 4, 2 * H))


def test_fc_is_applied_even_when_its_width_is_h():
    drafter = tiny_drafter(num_aux=1)
    aux = torch.randn(1, 4, H)
    fused = drafter.fuse(aux)
    torch.testing.assert_close(fused, aux @ drafter.fc.weight.T)
    assert not torch.allclose(fused, aux)


def test_vocab_maps_are_consistent():
    selected = torch.randperm(VOCAB)[:DRAFT_VOCAB]
    d2t, t2d = vocab_maps(selected, VOCAB)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert int(t2d.sum()) == DRAFT_VOCAB
    assert torch.equal(torch.arange(DRAFT_VOCAB) + d2t, selected.sort().values)
    assert torch.equal(draft_ids_of(d2t), torch.nonzero(t2d).flatten())


def test_vocab_maps_refuse_repeats_and_out_of_range_ids():
    with pytest.raises(ValueError, match="repeats target ids \\[7\\]"):
        vocab_maps([3, 7, 7], VOCAB)
    with pytest.raises(ValueError, match="must lie in 0..255"):
        vocab_maps([0, VOCAB], VOCAB)


def test_the_teachers_draft_order_is_the_one_serving_maps_back():
    """Training scores the target's logits in draft order (ttt.teacher_targets); serving maps a draft
    argmax to a target id with draft_to_target. Both orders must be the same, or every draft is wrong."""
    from eaglewire.train.ttt import teacher_targets

    drafter = tiny_drafter()
    selected = draft_ids_of(drafter.d2t)
    assert torch.equal(drafter.draft_to_target(torch.arange(DRAFT_VOCAB)), selected)
    final, lm_head = torch.randn(7, H), torch.randn(VOCAB, H)
    target_logits = final @ lm_head.T
    for full_vocab in (True, False):
        teacher = teacher_targets(final, lm_head, drafter.t2d, full_vocab=full_vocab)
        torch.testing.assert_close(teacher.draft_log_probs, target_logits[:, selected].log_softmax(-1))
        best_in_draft = drafter.draft_to_target(teacher.draft_log_probs.argmax(-1))
        assert torch.equal(best_in_draft, selected[target_logits[:, selected].argmax(-1)])
    assert torch.equal(teacher.top1, best_in_draft)  # full_vocab=False: top-1 within the draft vocabulary


def test_attention_is_causal_and_an_explicit_bool_mask_matches():
    drafter = tiny_drafter()
    ids, aux, positions = step_inputs(drafter, batch=1, length=6)
    embeds, fused = drafter.embed(ids), drafter.fuse(aux)
    full = drafter(embeds, fused, positions)
    prefix = drafter(embeds[:, :3], fused[:, :3], positions[:, :3])
    torch.testing.assert_close(full[:, :3], prefix)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(drafter(embeds, fused, positions, causal), full)
    with pytest.raises(ValueError, match="must be bool"):
        drafter(embeds, fused, positions, causal.float())


def test_midlayer_matches_a_transformers_llama_layer():
    """With the embedding half of q/k/v zeroed, the midlayer is a Llama layer on g (RoPE, GQA, mask, MLP)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRotaryEmbedding,
    )

    drafter = tiny_drafter()
    c = drafter.config
    hf_config = LlamaConfig(
        hidden_size=H, intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}, vocab_size=VOCAB,
    )
    hf_config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(hf_config, layer_idx=0).eval()
    mid = drafter.midlayer
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            ours = getattr(mid.self_attn, name).weight
            ours[:, :H] = 0  # embedding half
            ours[:, H:] = getattr(layer.self_attn, name).weight
        mid.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mid.mlp, name).weight.copy_(getattr(layer.mlp, name).weight)
        layer.input_layernorm.weight.normal_()
        layer.post_attention_layernorm.weight.normal_()
        mid.hidden_norm.weight.copy_(layer.input_layernorm.weight)
        mid.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)

    ids, aux, _ = step_inputs(drafter, batch=2, length=7)
    positions = torch.arange(5, 12)[None].expand(2, 7)  # not starting at 0: RoPE must use the given positions
    fused = drafter.fuse(aux).detach()
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected = layer(fused, attention_mask=mask, position_ids=positions,
                         position_embeddings=LlamaRotaryEmbedding(hf_config)(fused, positions))
        ours = drafter(drafter.embed(ids), fused, positions)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_config_from_a_target_config():
    from transformers import LlamaConfig, Qwen2Config

    wiring = Wiring.parse("layer1.out,layer3.out,layer4.out")
    llama = LlamaConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=VOCAB, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    c = DrafterConfig.from_target(llama, wiring, DRAFT_VOCAB)
    assert (c.hidden_size, c.intermediate_size, c.head_dim, c.num_aux, c.rope_theta) == (H, 96, 16, 3, 100000.0)
    qwen = Qwen2Config(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB)
    assert DrafterConfig.from_target(qwen, wiring, DRAFT_VOCAB).head_dim == 32  # qwen2 configs carry no head_dim
    scaled = LlamaConfig(hidden_size=H, num_attention_heads=2, vocab_size=VOCAB,
                         rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="'linear' RoPE"):
        DrafterConfig.from_target(scaled, wiring, DRAFT_VOCAB)


def test_config_checks_its_numbers():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        dataclasses.replace(tiny_config(), num_key_value_heads=3)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        dataclasses.replace(tiny_config(), draft_vocab_size=VOCAB + 1)
