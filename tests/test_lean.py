"""The lean forward equals HF and the extraction capture path; the KV cache keeps nothing stale.

Every cache in these tests starts filled with NaN, and the free slots are
re-poisoned after each ``keep``: SDPA turns any read of such a slot (even a
masked one) into NaN logits, so a passing test proves no forward read a slot
it had not written.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import TINY

from eaglewire.data.capture import capture
from eaglewire.engine import rowwise_kernel
from eaglewire.engine.kv_cache import KVCache, KVCacheError
from eaglewire.engine.lean import LeanError, LeanModel, SequenceCall
from eaglewire.wiring import CapturePoint, WiringError, all_points

# fp32 logits, HF vs lean. Measured on SmolLM2 (logits up to ~45): HF's own token-by-token
# decode differs from its full-sequence forward by up to 1.04e-4 (a 1-row matmul sums in another
# order), and the lean step reproduces HF's step bit for bit; hence atol plus a small rtol.
ATOL, RTOL = 1e-4, 1e-5
SAME = 1e-5  # relative L2 error between two computations of one tensor
ADJACENT = 0.005  # relative L2 error adjacent layers must exceed (docs/ARCHITECTURE.md: ~0.012 on SmolLM2)
VOCAB = 256
P = CapturePoint.parse


def tiny_hf(family: str, seed: int = 0, **overrides):
    """An in-memory random HF model. A wide init (0.2) and random biases make every
    term (attention, RoPE, biases) move the logits far beyond the tolerance."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, vocab_size=VOCAB, tie_word_embeddings=False, initializer_range=0.2,
                                  **{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.2)
    return model


FAMILIES = {
    "llama": {"family": "llama"},
    "llama-biases": {"family": "llama", "attention_bias": True, "mlp_bias": True},
    "llama3-rope": {"family": "llama", "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "qwen2": {"family": "qwen2"},
    "mistral": {"family": "mistral"},
}


def nan_cache(lean: LeanModel) -> KVCache:
    cache = lean.new_cache()
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    return cache


def poison_from(cache: KVCache, start: int) -> None:
    cache.k[:, :, :, start:] = float("nan")
    cache.v[:, :, :, start:] = float("nan")


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def at(*positions: int) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long)


def decode_each(lean: LeanModel, cache: KVCache, ids: torch.Tensor, start: int, points=()):
    """Feed ids [1, T] one token at a time from position ``start``; logits and captures per step, concatenated."""
    logits, captured = [], []
    for i in range(ids.shape[1]):
        out, got = lean.forward(cache, ids[:, i:i + 1], at(start + i), capture=points)
        logits.append(out)
        captured.append(got)
    return torch.cat(logits, 1), {p: torch.cat([c[p] for c in captured], 1) for p in points}


def check_parity(model, lean: LeanModel, ids: torch.Tensor) -> None:
    """Prefill, token-by-token decoding, and chunked prefill all equal HF's full-sequence logits."""
    ref = hf_logits(model, ids)
    num_tokens = ids.shape[1]
    prefill, _ = lean.forward(nan_cache(lean), ids, torch.arange(num_tokens))
    torch.testing.assert_close(prefill, ref, atol=ATOL, rtol=RTOL)

    stepped, _ = decode_each(lean, nan_cache(lean), ids, 0)
    torch.testing.assert_close(stepped, ref, atol=ATOL, rtol=RTOL)

    cache, cut = nan_cache(lean), num_tokens // 2  # a prompt prefix, then a chunk after it (default mask, T > 1)
    head, _ = lean.forward(cache, ids[:, :cut], torch.arange(cut))
    tail, _ = lean.forward(cache, ids[:, cut:], torch.arange(cut, num_tokens))
    torch.testing.assert_close(torch.cat([head, tail], 1), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("packed", [False, True], ids=["shared", "packed"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_equal_hf_tiny(name, packed):
    spec = dict(FAMILIES[name])
    model = tiny_hf(spec.pop("family"), **spec)
    lean = LeanModel.from_hf(model, max_len=64, packed=packed)
    assert lean.packed is packed
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, 23))
    check_parity(model, lean, ids)
    # The test has teeth: token order alone (attention + RoPE) moves the logits far beyond ATOL.
    swapped = ids.clone()
    swapped[0, :2] = ids[0, :2].flip(0)
    assert (hf_logits(model, swapped)[0, -1] - hf_logits(model, ids)[0, -1]).abs().max() > 100 * ATOL


def test_logits_equal_hf_smollm2(smollm2):
    from transformers import DynamicCache

    ids = smollm2.tokenizer("Speculative decoding keeps the target's output exactly.", return_tensors="pt").input_ids
    shared = LeanModel.from_hf(smollm2.model, max_len=64, packed=False)
    packed = LeanModel.from_hf(smollm2.model, max_len=64)
    assert packed.packed, "fp32 on CPU packs by default"
    check_parity(smollm2.model, shared, ids)
    check_parity(smollm2.model, packed, ids)
    # Step for step, the shared-weight decode matches HF's own decode through its DynamicCache
    # (same kernels); the packed one sums in another order, within the parity tolerance.
    hf_cache = DynamicCache(config=smollm2.model.config)
    with torch.inference_mode():
        hf_steps = torch.cat([smollm2.model(ids[:, i:i + 1], cache=hf_cache, use_cache=True).logits
                              for i in range(ids.shape[1])], 1)
    torch.testing.assert_close(decode_each(shared, nan_cache(shared), ids, 0)[0], hf_steps, atol=1e-5, rtol=0)
    torch.testing.assert_close(decode_each(packed, nan_cache(packed), ids, 0)[0], hf_steps, atol=ATOL, rtol=RTOL)


def test_batched_lm_head_matches_hf_and_is_row_invariant_smollm2(smollm2):
    """The lm_head kernel regenerate uses (packed, many rows a call) keeps HF parity, and a row's logits
    do not depend on how many rows share the call, so batched greedy decoding is plain greedy decoding."""
    ids = smollm2.tokenizer("Regenerated answers come from batches of conversations.", return_tensors="pt").input_ids
    lean = LeanModel.from_hf(smollm2.model, max_len=64, batched_lm_head=True)
    hidden, _ = lean.forward(nan_cache(lean), ids, torch.arange(ids.shape[1]), logits_rows=None)
    rows = hidden[0]
    assert rows.shape[0] >= 8
    together = lean.logits(rows)
    # oneDNN's blocked lm_head sums the 576 products in its own order: up to 1.4e-4 from HF on logits ~20
    ref = hf_logits(smollm2.model, ids)[0]
    torch.testing.assert_close(together, ref, atol=4 * ATOL, rtol=RTOL)
    assert torch.equal(together.argmax(-1), ref.argmax(-1))
    assert torch.equal(together, torch.cat([lean.logits(rows[i:i + 1]) for i in range(rows.shape[0])]))


@pytest.mark.skipif(not rowwise_kernel.multiplies_by_default(), reason="the row kernels are this CPU's default only on x86 with AVX2")
def test_batched_lm_head_runs_the_row_steps_in_the_kernel_smollm2(smollm2):
    """regenerate's model keeps oneDNN's matrices but runs norms, RoPE and decode attention in row_attention.cpp:
    HF parity and greedy tokens hold, and a row's decode logits do not depend on the rows beside it."""
    ids = smollm2.tokenizer("Regenerated answers come from batches of conversations.", return_tensors="pt").input_ids
    kernels = LeanModel.from_hf(smollm2.model, max_len=64, batched_lm_head=True)
    ops = LeanModel.from_hf(smollm2.model, max_len=64, batched_lm_head=True, row_kernels=False)
    assert kernels.row_kernels and not ops.row_kernels and kernels.kernel == ops.kernel == "onednn"
    ref = hf_logits(smollm2.model, ids)
    steps = {name: decode_each(lean, nan_cache(lean), ids, 0)[0] for name, lean in (("kernels", kernels), ("ops", ops))}
    for got in steps.values():
        torch.testing.assert_close(got, ref, atol=4 * ATOL, rtol=RTOL)
    assert torch.equal(steps["kernels"].argmax(-1), steps["ops"].argmax(-1))
    # two sequences decoding together give each the logits it has alone
    caches = [nan_cache(kernels), nan_cache(kernels)]
    prompts = (ids[0, :5], ids[0, :7])
    for cache, prompt in zip(caches, prompts):  # each prompt but its last token, which the step decodes
        kernels.forward(cache, prompt[None, :-1], torch.arange(len(prompt) - 1))
    last = [(prompt[-1:], torch.tensor([len(prompt) - 1])) for prompt in prompts]
    together = kernels.forward_batch([SequenceCall(cache, token, position, logits_rows=(0,))
                                      for cache, (token, position) in zip(caches, last)])
    for cache, (token, position), out in zip(caches, last, together):
        alone = kernels.forward(cache, token[None], position)[0][0]
        assert out.logits.shape == alone.shape and torch.equal(out.logits, alone)


def test_row_kernels_are_refused_where_they_cannot_run():
    with pytest.raises(LeanError, match="row kernels need fp32 weights"):
        LeanModel.from_hf(tiny_hf("llama").to(torch.bfloat16), max_len=16, row_kernels=True)


def test_unpacked_weights_are_shared_not_copied():
    model = tiny_hf("qwen2")
    lean = LeanModel.from_hf(model, max_len=32, packed=False)
    attn = model.model.layers[3].self_attn
    assert lean.layers[3].q.weight is attn.q_proj.weight and lean.layers[3].q.bias is attn.q_proj.bias
    assert lean.layers[3].o.bias is None  # qwen2's o_proj has no bias
    assert lean.embed is model.model.embed_tokens.weight and lean.lm_head.weight is model.lm_head.weight
    with torch.no_grad():  # the HF model stays the source of truth: edit it, the lean forward follows
        attn.v_proj.weight.mul_(1.5)
    ids = torch.randint(0, VOCAB, (1, 9))
    torch.testing.assert_close(lean.forward(lean.new_cache(), ids, torch.arange(9))[0], hf_logits(model, ids),
                               atol=ATOL, rtol=RTOL)


def test_selected_logit_rows_and_final_hidden():
    model = tiny_hf("llama")
    lean = LeanModel.from_hf(model, max_len=32)
    ids = torch.randint(0, VOCAB, (1, 7))
    full = hf_logits(model, ids)
    last, _ = lean.forward(nan_cache(lean), ids, torch.arange(7), logits_rows=slice(-1, None))
    torch.testing.assert_close(last, full[:, -1:], atol=ATOL, rtol=RTOL)
    some, _ = lean.forward(nan_cache(lean), ids, torch.arange(7), logits_rows=at(0, 4))
    torch.testing.assert_close(some, full[:, [0, 4]], atol=ATOL, rtol=RTOL)
    hidden, got = lean.forward(nan_cache(lean), ids, torch.arange(7), capture=(P("final"),), logits_rows=None)
    assert hidden.shape == (1, 7, TINY["hidden_size"]) and torch.equal(hidden, got[P("final")])
    torch.testing.assert_close(lean.logits(hidden), full, atol=ATOL, rtol=RTOL)


# -- capture parity with the extraction path ----------------------------------------------


def check_capture_parity(target, ids: torch.Tensor) -> dict[CapturePoint, torch.Tensor]:
    """Every canonical point from the lean forward equals ``capture.capture``; returns the lean tensors."""
    points = all_points(target.num_layers)
    reference = capture(target.layout, points, ids)
    lean = LeanModel.from_hf(target.model, max_len=64)
    _, got = lean.forward(nan_cache(lean), ids, torch.arange(ids.shape[1]), capture=points, logits_rows=None)
    assert list(got) == points
    for point in points:
        assert got[point].shape == reference[point].shape
        assert rel_l2(got[point], reference[point]) <= SAME, point
    return got


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_capture_equals_extraction_path_tiny(tiny_target_dir, family):
    from eaglewire.target import load_target

    target = load_target(str(tiny_target_dir(family)))
    torch.manual_seed(2)
    check_capture_parity(target, torch.randint(0, 49152, (1, 15)))


def test_capture_equals_extraction_path_smollm2(smollm2):
    # Chat-formatted, as extraction sees it: on a bare 10-token input the first token's massive
    # activations dominate the norm and adjacent layers differ by only ~0.0045.
    text = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "The wiring must be exact."}],
                                                 tokenize=False, add_generation_prompt=True)
    ids = smollm2.tokenizer(text, return_tensors="pt").input_ids
    got = check_capture_parity(smollm2, ids)
    reference = capture(smollm2.layout, [P("layer14.out"), P("layer15.out")], ids)
    # Adjacent middle layers differ by ~0.012 (docs/ARCHITECTURE.md); the same layer by float noise.
    assert rel_l2(got[P("layer14.out")], reference[P("layer15.out")]) >= ADJACENT
    assert rel_l2(got[P("layer15.out")], reference[P("layer14.out")]) >= ADJACENT
    assert rel_l2(got[P("layer14.out")], reference[P("layer14.out")]) <= SAME
    points = list(got)
    for shallow, deep in itertools.pairwise(points):
        assert rel_l2(got[shallow], got[deep]) >= ADJACENT, (shallow, deep)

    # Decoding one token at a time captures the same rows (what every verify step relies on).
    lean = LeanModel.from_hf(smollm2.model, max_len=64)
    wiring_points = (P("layer1.out"), P("layer14.out"), P("layer26.out"), P("final"))
    _, stepped = decode_each(lean, nan_cache(lean), ids, 0, wiring_points)
    for point in wiring_points:
        assert rel_l2(stepped[point], got[point]) <= SAME, point


def test_capture_returns_exactly_the_requested_points():
    model = tiny_hf("llama")
    lean = LeanModel.from_hf(model, max_len=16)
    ids = torch.randint(0, VOCAB, (1, 4))
    request = (P("layer3.out"), P("embed"), P("final"), P("layer3.out"))
    _, got = lean.forward(lean.new_cache(), ids, torch.arange(4), capture=request)
    assert list(got) == [P("layer3.out"), P("embed"), P("final")]
    _, none = lean.forward(lean.new_cache(), ids, torch.arange(4))
    assert none == {}
    with pytest.raises(WiringError, match="layer0.out to layer5.out"):
        lean.forward(lean.new_cache(), ids, torch.arange(4), capture=(P("layer6.out"),))
    with pytest.raises(LeanError, match="CapturePoint"):
        lean.forward(lean.new_cache(), ids, torch.arange(4), capture=("layer1.out",))


# -- tree attention and compaction ------------------------------------------------------------

# Two sibling branches after the prefix: A = tree rows 0-1, B = tree rows 2-4.
BRANCHES = ((0, 1), (2, 3, 4))
DEPTHS = (0, 1, 0, 1, 2)


def tree_mask(prefix: int) -> torch.Tensor:
    """Tree rows see the whole prefix, their ancestors and themselves, never the sibling branch."""
    size = len(DEPTHS)
    mask = torch.zeros(size, prefix + size, dtype=torch.bool)
    mask[:, :prefix] = True
    for branch in BRANCHES:
        for i, row in enumerate(branch):
            for ancestor in branch[:i + 1]:
                mask[row, prefix + ancestor] = True
    return mask


def check_tree(lean: LeanModel, prefix: torch.Tensor, tree: torch.Tensor, after: torch.Tensor) -> None:
    points = (P("layer1.out"), P("final"))
    plen = prefix.shape[1]
    positions = plen + torch.tensor(DEPTHS)
    slots = plen + torch.arange(len(DEPTHS))

    def verified_cache():
        cache = nan_cache(lean)
        lean.forward(cache, prefix, torch.arange(plen))
        logits, got = lean.forward(cache, tree, positions, slots=slots, attention_mask=tree_mask(plen), capture=points)
        return cache, logits, got

    _, tree_logits, tree_got = verified_cache()
    for branch in BRANCHES:
        cache = nan_cache(lean)
        lean.forward(cache, prefix, torch.arange(plen))
        alone, alone_got = decode_each(lean, cache, tree[:, list(branch)], plen, points)
        torch.testing.assert_close(tree_logits[:, list(branch)], alone, atol=ATOL, rtol=RTOL)
        for point in points:
            assert rel_l2(tree_got[point][:, list(branch)], alone_got[point]) <= SAME

    # Accept a whole branch or a path prefix of one; compact it; keep decoding.
    for accepted in ((0, 1), (0,), (2, 3, 4), (2, 3), (2,)):
        cache, _, _ = verified_cache()
        length = cache.keep(slots[list(accepted)], plen)
        assert length == plen + len(accepted)
        poison_from(cache, length)  # rejected entries must never be read again
        continued, _ = decode_each(lean, cache, after, length)

        sequence = torch.cat([prefix, tree[:, list(accepted)]], 1)
        cache = nan_cache(lean)
        lean.forward(cache, sequence, torch.arange(sequence.shape[1]))
        plain, _ = decode_each(lean, cache, after, sequence.shape[1])
        torch.testing.assert_close(continued, plain, atol=ATOL, rtol=RTOL, msg=f"accepted {accepted}")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tree_mask_and_keep_tiny(family):
    lean = LeanModel.from_hf(tiny_hf(family), max_len=48)
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, 19))
    check_tree(lean, ids[:, :11], ids[:, 11:16], ids[:, 16:])


def test_tree_mask_and_keep_smollm2(smollm2):
    ids = smollm2.tokenizer("The capital of France is Paris, and the capital of Italy is Rome.",
                            return_tensors="pt").input_ids
    assert ids.shape[1] >= 14
    lean = LeanModel.from_hf(smollm2.model, max_len=64)
    check_tree(lean, ids[:, :6], ids[:, 6:11], ids[:, 11:14])


def test_keep_moves_entries_in_order():
    cache = KVCache(num_layers=2, kv_heads=1, max_len=8, head_dim=1, dtype=torch.float32)
    cache.k[..., 0] = torch.arange(8.0)
    cache.v[..., 0] = -torch.arange(8.0)
    assert cache.keep([3, 5, 6], 2) == 5
    assert cache.k[1, 0, 0, :, 0].tolist() == [0, 1, 3, 5, 6, 5, 6, 7]
    assert cache.v[0, 0, 0, :5, 0].tolist() == [0, -1, -3, -5, -6]
    assert cache.keep(at(1, 2), 1) == 3  # already in place
    assert cache.keep([], 4) == 4
    with pytest.raises(KVCacheError, match="repeat"):
        cache.keep([3, 3], 2)
    with pytest.raises(KVCacheError, match="outside"):
        cache.keep([8], 2)
    with pytest.raises(KVCacheError, match="has 8"):
        cache.keep([1, 2], 7)


# -- refusals ---------------------------------------------------------------------------------


def test_refuses_what_it_does_not_implement():
    with pytest.raises(LeanError, match="sliding-window.*max_len <= 32"):
        LeanModel.from_hf(tiny_hf("mistral", sliding_window=32), max_len=64)
    LeanModel.from_hf(tiny_hf("mistral", sliding_window=32), max_len=32)  # the window never bites
    with pytest.raises(LeanError, match="sliding-window"):
        LeanModel.from_hf(tiny_hf("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2), max_len=64)
    with pytest.raises(LeanError, match="gelu"):
        LeanModel.from_hf(tiny_hf("llama", hidden_act="gelu"), max_len=16)
    with pytest.raises(LeanError, match="dynamic"):
        LeanModel.from_hf(tiny_hf("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                            "factor": 2.0}), max_len=16)


def test_malformed_forward_calls_are_errors():
    lean = LeanModel.from_hf(tiny_hf("llama"), max_len=16)
    cache = lean.new_cache()
    ids = torch.randint(0, VOCAB, (1, 3))
    with pytest.raises(LeanError, match=r"\[1, T\]"):
        lean.forward(cache, ids.repeat(2, 1), torch.arange(3))
    with pytest.raises(LeanError, match="positions must be"):
        lean.forward(cache, ids, torch.arange(4))
    with pytest.raises(LeanError, match="max_len 16"):
        lean.forward(cache, ids, torch.arange(14, 17))
    with pytest.raises(LeanError, match="slots run -1"):
        lean.forward(cache, ids, torch.arange(3), slots=at(-1, 0, 1))
    with pytest.raises(LeanError, match="bool"):
        lean.forward(cache, ids, torch.arange(3), attention_mask=torch.ones(3, 3))
    with pytest.raises(LeanError, match="new_cache"):
        lean.forward(LeanModel.from_hf(tiny_hf("llama"), max_len=8).new_cache(), ids, torch.arange(3))
    with pytest.raises(LeanError, match="must cover slot 2"):
        lean.forward(cache, ids, torch.arange(3), attention_mask=torch.ones(3, 2, dtype=torch.bool))


@pytest.mark.parametrize("packed", [False, True], ids=["shared", "packed"])
def test_forward_batch_equals_each_sequence_alone(packed):
    """Sequences batched into one forward (a prefill, a decode step, a tree verify) give what
    each gives alone, write only their own caches, and read nothing stale (NaN caches)."""
    model = tiny_hf("llama")
    lean = LeanModel.from_hf(model, max_len=48, packed=packed)
    torch.manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (7, 12, 9)]
    alone, batched = [nan_cache(lean) for _ in prompts], [nan_cache(lean) for _ in prompts]
    for cache, ids in zip(alone, prompts[:2]):  # sequences 0 and 1 already hold their prompts
        lean.forward(cache, ids[None], torch.arange(len(ids)))
    for cache, ids in zip(batched, prompts[:2]):
        lean.forward(cache, ids[None], torch.arange(len(ids)))
    tree_parents = torch.tensor([-1, 0, 0, 1])  # root, two children, a grandchild
    tree_depths = torch.tensor([0, 1, 1, 2])
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert (ancestors.sum(1) == tree_depths + 1).all() and tree_parents[3] == 1
    calls = [
        SequenceCall(batched[0], torch.tensor([5]), torch.tensor([7]), logits_rows=(0,)),
        SequenceCall(batched[1], torch.tensor([1, 2, 3, 4]), 12 + tree_depths, slots=torch.arange(12, 16),
                     attention_mask=torch.cat([torch.ones(4, 12, dtype=torch.bool), ancestors], 1), logits_rows=(0, 3)),
        SequenceCall(batched[2], prompts[2], torch.arange(9), logits_rows=(8,)),
    ]
    points = [P("layer1.out"), P("final")]
    outs = lean.forward_batch(calls, capture=points)
    for i, (call, out) in enumerate(zip(calls, outs)):
        cache = alone[i] if i < 2 else nan_cache(lean)
        hidden, captured = lean.forward(cache, call.input_ids[None], call.positions, slots=call.slots,
                                        attention_mask=call.attention_mask, capture=points, logits_rows=None)
        torch.testing.assert_close(out.hidden, hidden[0], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(out.logits, lean.logits(hidden[0, list(call.logits_rows)]), atol=ATOL, rtol=RTOL)
        assert list(out.captured) == points
        for point in points:
            torch.testing.assert_close(out.captured[point], captured[point][0], atol=ATOL, rtol=RTOL)
        assert not out.logits.isnan().any()
    # the batch wrote each sequence's keys into its own cache, at its own slots only
    torch.testing.assert_close(batched[0].k[:, :, :, :8], alone[0].k[:, :, :, :8], atol=ATOL, rtol=RTOL)
    assert batched[0].k[:, :, :, 8:].isnan().all() and batched[2].k[:, :, :, 9:].isnan().all()
    with pytest.raises(LeanError, match="at least one"):
        lean.forward_batch([])
    with pytest.raises(LeanError, match="share a cache"):
        lean.forward_batch([calls[0], SequenceCall(batched[0], torch.tensor([6]), torch.tensor([8]))])
    for rows in ((1,), (-1,)):  # row 1 of a one-token sequence would be the next sequence's first token
        with pytest.raises(LeanError, match="outside the sequence's 1 tokens"):
            lean.forward_batch([SequenceCall(batched[0], torch.tensor([5]), torch.tensor([7]), logits_rows=rows), calls[2]])


def _product_dtypes():
    from eaglewire.engine.projection import native_bf16

    return [torch.float32] + ([torch.bfloat16] if native_bf16() else [])


@pytest.mark.parametrize("dtype", _product_dtypes(), ids=lambda d: str(d).removeprefix("torch."))
def test_a_verify_forward_is_plain_decoding_bit_for_bit_smollm2(smollm2, dtype):
    """Each token of a verify forward (a chain under the default mask, and every path of a tree) gets
    bit for bit the hidden state a one-token decode step gives it after the same prefix: the
    exactness of speculative decoding at any product dtype, near-ties included."""
    lean = LeanModel.from_hf(smollm2.model, max_len=32, product_dtype=dtype)
    assert lean.product_dtype == dtype
    torch.manual_seed(0)
    prompt, drafts = torch.randint(0, 49152, (1, 24)), torch.randint(0, 49152, (1, 6))
    n = prompt.shape[1]
    base = lean.new_cache()
    lean.forward(base, prompt, torch.arange(n), logits_rows=None)

    def prefilled() -> KVCache:
        cache = base.empty_like()
        cache.k.copy_(base.k)
        cache.v.copy_(base.v)
        return cache

    def plain(tokens: torch.Tensor) -> torch.Tensor:
        cache = prefilled()
        return torch.cat([lean.forward(cache, tokens[:, i: i + 1], at(n + i), logits_rows=None)[0]
                          for i in range(tokens.shape[1])], 1)

    chain, _ = lean.forward(prefilled(), drafts, torch.arange(n, n + 6), logits_rows=None)
    assert torch.equal(chain, plain(drafts))

    # tree: node 0 is the root (the last committed token); 1 and 2 its children; 3 under 1; 4 and 5 under 2
    parents = [-1, 0, 0, 1, 2, 2]
    depths = torch.tensor([0, 1, 1, 2, 2, 2])
    ancestors = torch.eye(6, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            ancestors[node] |= ancestors[parent]
    mask = torch.cat([torch.ones(6, n, dtype=torch.bool), ancestors], 1)
    tree, _ = lean.forward(prefilled(), drafts, n + depths, slots=torch.arange(n, n + 6), attention_mask=mask,
                           logits_rows=None)
    for leaf in (3, 4, 5):
        path = ancestors[leaf].nonzero().flatten()
        assert torch.equal(tree[:, path], plain(drafts[:, path])), f"the path to node {leaf}"
