"""Every declared family and wrapper (target.py), on tiny random models built offline.

- capture (the hooks extraction uses) equals HF's ``output_hidden_states`` of the model's
  own forward (a wrapper's whole forward, so the inner language model's stream is proven
  to be the wrapper's); ``final`` is the final norm of ``layer{n-1}.out``;
- T=0 speculative decoding (chain, tree) equals the model's own HF greedy decode;
- a wrapper whose language model is renamed, missing or of another kind is refused,
  and so is a model whose decoder stack is not where its family declares it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from eaglewire.data.capture import CaptureError, capture
from eaglewire.drafter.model import Drafter, DrafterConfig
from eaglewire.engine.drafting import TreeShape
from eaglewire.engine.hf_forward import HFForward, HFForwardError
from eaglewire.engine.lean import LeanError, LeanModel
from eaglewire.engine.speculative import Engine, GenerationConfig
from eaglewire.target import (
    FAMILIES,
    SUPPORTED_FAMILIES,
    WRAPPERS,
    TargetError,
    layout_of,
    load_target,
)
from eaglewire.wiring import CapturePoint, Wiring

LAYERS = 4
VOCAB = 49152  # SmolLM2's tokenizer (with its chat template) needs its own vocabulary
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, vocab_size=VOCAB,
            tie_word_embeddings=False)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
# Extra config per family: small MoE blocks, DeepSeek's dense first layer and MLA, Gemma's window above max_len.
FAMILY_CONFIGS = {
    "qwen3": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16, sliding_window=512),
    "qwen3_moe": dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[0]),
    "deepseek_v3": dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4),
}
WRAPPER_CONFIGS = {
    "llava": dict(text_config=dict(model_type="llama", **TEXT),
                  vision_config=dict(model_type="clip_vision_model", image_size=28, patch_size=14, projection_dim=32,
                                     **_VISION), image_token_index=VOCAB - 1),
    "qwen2_5_vl": dict(text_config=dict(**TEXT, rope_parameters=_MROPE),
                       vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                          fullatt_block_indexes=[0]),
                       image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3),
    "qwen3_vl": dict(text_config=dict(**TEXT, head_dim=16, rope_parameters={**_MROPE, "mrope_interleaved": True}),
                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                        deepstack_visual_indexes=[0]),
                     image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3),
    "gemma3": dict(text_config=dict(**TEXT, head_dim=16, sliding_window=512),
                   vision_config=dict(image_size=28, patch_size=14, **_VISION), mm_tokens_per_image=4,
                   image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2),
}
ALL = list(FAMILY_CONFIGS) + list(WRAPPER_CONFIGS)


def build_model(kind: str, seed: int = 0):
    """A tiny random model of ``kind`` (a family or a wrapper), its lm_head sharpened so decoding is not flat."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
    )

    torch.manual_seed(seed)
    if kind in WRAPPER_CONFIGS:
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(kind, **WRAPPER_CONFIGS[kind]))
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **{**TEXT, **FAMILY_CONFIGS[kind]}))
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.eval()


@pytest.fixture(scope="module")
def family_target(tmp_path_factory, tokenizer_dir):
    made = {}

    def make(kind: str):
        if kind not in made:
            out = tmp_path_factory.mktemp(f"tiny-{kind}")
            build_model(kind).save_pretrained(out)
            for item in Path(tokenizer_dir).iterdir():
                shutil.copy(item, out / item.name)
            made[kind] = load_target(str(out))
        return made[kind]

    return make


def all_points(num_layers: int) -> list[CapturePoint]:
    return [CapturePoint.parse("embed")] + [CapturePoint.layer_out(i) for i in range(num_layers)] + \
        [CapturePoint.parse("final")]


def test_every_declared_family_and_wrapper_is_tested():
    standalone = [name for name, f in FAMILIES.items() if f.standalone and name not in ("llama", "qwen2", "mistral")]
    assert sorted(standalone) == sorted(FAMILY_CONFIGS)  # llama, qwen2, mistral: tests/test_lean.py, test_engine.py
    assert sorted(WRAPPERS) == sorted(WRAPPER_CONFIGS)
    assert set(ALL) <= set(SUPPORTED_FAMILIES)


@pytest.mark.parametrize("kind", ALL)
def test_capture_equals_output_hidden_states(family_target, kind):
    """embed = hidden_states[0], layer{i}.out = hidden_states[i+1] (i < n-1), final = hidden_states[n]
    = norm(layer{n-1}.out), where hidden_states come from the loaded model's own forward (a wrapper's whole)."""
    target = family_target(kind)
    assert target.num_layers == LAYERS and target.hidden_size == TEXT["hidden_size"]
    ids = torch.tensor([target.tokenizer("The residual stream of a tiny model.")["input_ids"]])
    points = all_points(LAYERS)
    captured = capture(target.layout, points, ids)
    with torch.no_grad():
        states = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(states) == LAYERS + 1
    torch.testing.assert_close(captured[points[0]], states[0], rtol=0, atol=0)
    for i in range(LAYERS - 1):
        torch.testing.assert_close(captured[CapturePoint.layer_out(i)], states[i + 1], rtol=0, atol=0)
    torch.testing.assert_close(captured[points[-1]], states[LAYERS], rtol=0, atol=0)
    last = captured[CapturePoint.layer_out(LAYERS - 1)]
    torch.testing.assert_close(captured[points[-1]], target.layout.norm(last), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ALL)
def test_hf_forward_is_chosen_and_captures_what_extraction_does(family_target, kind):
    target = family_target(kind)
    with pytest.raises(LeanError, match="lean forward supports"):
        LeanModel.from_hf(target.model, 64)  # never the Llama re-implementation for these
    forward = HFForward(target.layout, 64)
    ids = torch.tensor([target.tokenizer("Capture in the engine.")["input_ids"]])
    points = all_points(LAYERS)
    reference = capture(target.layout, points, ids)
    cache = forward.new_cache()
    cut = ids.shape[1] - 3  # a prefill and a continuation over the cache capture the same stream
    _, first = forward(cache, ids[:, :cut], torch.arange(cut), capture=points)
    _, rest = forward(cache, ids[:, cut:], torch.arange(cut, ids.shape[1]), capture=points)
    for point in points:
        torch.testing.assert_close(torch.cat([first[point], rest[point]], dim=1), reference[point],
                                   rtol=1e-5, atol=1e-5)


def _random_drafter(target, wiring):
    torch.manual_seed(1)
    config = DrafterConfig.from_target(target.text_config, wiring, 512)
    assert config.hidden_size == target.hidden_size  # the drafter's width follows the target
    return Drafter(config, target.layout.embed, torch.randperm(target.fingerprint["vocab_size"])[:512])


SMALL_TREE = TreeShape(depth=4, top_k=4, total_tokens=12)


@pytest.mark.parametrize("kind", ALL)
def test_greedy_speculative_output_is_the_models_own(family_target, kind):
    """T=0 chain, tree and plain decoding through the engine equal the model's own HF greedy generate."""
    target = family_target(kind)
    wiring = Wiring.parse("layer0.out,layer1.out,layer3.out")
    engine = Engine(target, _random_drafter(target, wiring), wiring, max_len=128)
    assert engine.forward_reason.startswith("HF forward")
    ids = engine.chat_prompt("Hello there")
    with torch.no_grad():
        ref = target.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    for strategy in ("chain", "tree"):  # min_confidence 0: the random drafter drafts whole chains
        config = GenerationConfig(max_new_tokens=8, strategy=strategy, tree=SMALL_TREE, min_confidence=0.0)
        events = list(engine.generate_ids(ids, config))
        assert events[-1].token_ids == ref, (kind, strategy)


# ---- refusals -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llava():
    return build_model("llava")


def test_wrapper_with_its_language_model_renamed_is_refused(llava):
    inner = llava.model.language_model
    del llava.model.language_model
    llava.model.text_model = inner
    try:
        with pytest.raises(TargetError, match=r"'llava' model keeps its language model \(llama or qwen2 or mistral\) "
                                              r"at model\.model\.language_model.*has no 'language_model'.*text_model"):
            layout_of(llava)
    finally:
        del llava.model.text_model
        llava.model.language_model = inner


def test_wrapper_with_its_language_model_missing_or_foreign_is_refused(llava):
    inner = llava.model.language_model
    try:
        llava.model.language_model = torch.nn.Identity()
        with pytest.raises(TargetError, match=r"model\.model\.language_model is a Identity, not a transformers model"):
            layout_of(llava)
        llava.model.language_model = build_model("qwen3").model  # a language model, not one llava may hold
        with pytest.raises(TargetError, match=r"is a Qwen3Model \('qwen3'\), not a llama or qwen2 or mistral"):
            layout_of(llava)
    finally:
        llava.model.language_model = inner
    assert layout_of(llava).base is inner


def test_decoder_stack_not_where_declared_is_an_error_naming_the_model_type():
    model = build_model("qwen3_moe")
    layers = model.model.layers
    del model.model.layers
    with pytest.raises(TargetError, match=r"decoder stack of this 'qwen3_moe' model: model\.model\.layers should be a "
                                          r"ModuleList, found NoneType"):
        layout_of(model)
    model.model.layers = layers
    model.model.embed_tokens = None
    with pytest.raises(TargetError, match=r"'qwen3_moe'.*model\.model\.embed_tokens should be a Embedding"):
        layout_of(model)


def test_wrapper_fault_from_the_story_is_refused(family_target, tmp_path):
    """The inner language model's layers bypassed, so its capture never fires: extraction and the engine refuse
    instead of falling back to the final hidden state, and the doctor names the failed capture."""
    from conftest import conversation, write_jsonl

    from eaglewire.data.extract import ExtractConfig, run_extract
    from eaglewire.doctor.checks import DoctorConfig, run_doctor
    from eaglewire.doctor.state import FAIL
    from eaglewire.train.loop import TrainConfig, run_train

    target = family_target("gemma3")
    wiring = Wiring.parse("layer0.out,layer1.out,layer3.out")
    data = write_jsonl(tmp_path / "d.jsonl", [conversation(f"Say {i}.", f"{i}.") for i in range(2)])
    run_extract(ExtractConfig(data=str(data), out=tmp_path / "ds", target=target.name, wiring=str(wiring),
                              dtype="fp32", progress=False), target=target)
    run_train(TrainConfig(out=tmp_path / "run", data=str(tmp_path / "ds"), target=target.name, draft_vocab=256,
                          steps=1, batch_tokens=200, warmup_steps=1, eval_every=1, save_every=1, ttt_steps=1,
                          progress=False), target=target)
    engine = Engine(target, _random_drafter(target, wiring), wiring, max_len=64)
    ids = torch.tensor([engine.chat_prompt("hi")])
    inner = target.layout.base
    layers, real = inner.layers, inner.config.num_hidden_layers
    inner.layers, inner.config.num_hidden_layers = torch.nn.ModuleList(), 0  # the language model runs no layer
    try:
        with pytest.raises(CaptureError, match="did not fire for layer0.out, layer1.out, layer3.out"):
            capture(target.layout, wiring.points, ids)
        with pytest.raises(CaptureError, match="did not fire"):
            run_extract(ExtractConfig(data=str(data), out=tmp_path / "again", target=target.name,
                                      wiring=str(wiring), dtype="fp32", progress=False), target=target)
        with pytest.raises(CaptureError, match="did not fire"):
            list(engine.generate_ids(ids[0].tolist(), GenerationConfig(max_new_tokens=4, strategy="chain")))
        report = run_doctor(DoctorConfig(checkpoint=str(tmp_path / "run" / "checkpoint"), data=tmp_path / "ds",
                                         engine="vllm", live_prompts=1, live_tokens=4), target=target)
        failed = [r for r in report.results if r.status == FAIL and "capture failed" in r.detail]
        assert failed and "did not fire for layer0.out" in failed[0].detail, [(r.name, r.detail) for r in report.results]
    finally:
        inner.layers, inner.config.num_hidden_layers = layers, real


def test_sliding_window_shorter_than_max_len_is_refused(family_target):
    target = family_target("gemma3_text")
    with pytest.raises(HFForwardError, match="sliding-window layers"):
        HFForward(target.layout, 1024)


# ---- every stage on every family ------------------------------------------------------------

@pytest.mark.parametrize("kind", ALL)
def test_extract_train_doctor_export_import(family_target, kind, tmp_path):
    from conftest import conversation, write_jsonl

    from eaglewire.data.extract import ExtractConfig, run_extract
    from eaglewire.data.manifest import load_manifest
    from eaglewire.doctor.checks import DoctorConfig, run_doctor
    from eaglewire.doctor.state import FAIL, PASS
    from eaglewire.interop.formats import (
        FormatError,
        export_checkpoint,
        import_checkpoint,
    )
    from eaglewire.train.loop import TrainConfig, run_train

    target = family_target(kind)
    wiring = "layer0.out,layer1.out,layer2.out"
    data = write_jsonl(tmp_path / "d.jsonl", [conversation(f"Say {i} twice.", f"{i} {i}.") for i in range(4)])
    run_extract(ExtractConfig(data=str(data), out=tmp_path / "ds", target=target.name, wiring=wiring,
                              shard_records=4, dtype="fp32", progress=False), target=target)
    manifest = load_manifest(tmp_path / "ds")
    assert manifest.complete and manifest.totals["samples"] == 4
    run_train(TrainConfig(out=tmp_path / "run", data=str(tmp_path / "ds"), target=target.name, draft_vocab=256,
                          steps=2, batch_tokens=200, warmup_steps=1, eval_every=2, save_every=2, ttt_steps=2,
                          progress=False), target=target)
    checkpoint = tmp_path / "run" / "checkpoint"
    report = run_doctor(DoctorConfig(checkpoint=str(checkpoint), data=tmp_path / "ds", engine="vllm",
                                     live_prompts=1, live_tokens=8), target=target)
    statuses = {r.name: r.status for r in report.results}
    assert statuses["numbers.tensors"] == PASS and statuses["target"] == PASS, statuses
    assert not [n for n, s in statuses.items() if s == FAIL and not n.startswith("acceptance")], statuses
    vllm = export_checkpoint(checkpoint, "vllm", tmp_path / "vllm")
    back = import_checkpoint(vllm.out, "vllm", tmp_path / "back", target)
    assert str(back.wiring) == wiring
    if kind == "llava":  # SGLang's llava.py captures no aux states
        with pytest.raises(FormatError, match="llava.py has no set_eagle3_layers_to_capture"):
            export_checkpoint(checkpoint, "sglang", tmp_path / "sglang")
    elif kind == "deepseek_v3":  # on 4 layers no 3 ids survive "+1 only when ids[0] == 1" (see the test below)
        with pytest.raises(FormatError, match="adds \\+1 only when the first id is 1"):
            export_checkpoint(checkpoint, "sglang", tmp_path / "sglang")
    else:
        sglang = export_checkpoint(checkpoint, "sglang", tmp_path / "sglang")
        assert sglang.ids == [0, 1, 2] and str(sglang.wiring) == wiring  # +1: id j = layer{j}.out


@pytest.mark.parametrize(("family", "wiring", "ids"), [
    ("qwen3", "layer2.out,layer4.out,layer6.out", [2, 4, 6]),  # qwen3.py: +1 always
    ("gemma3", "layer2.out,layer4.out,layer6.out", [2, 4, 6]),  # gemma3_mm.py -> gemma3_causal.py: +1 always
    ("deepseek_v3", "layer1.out,layer3.out,layer5.out", [1, 3, 5]),  # first id 1: +1
    ("deepseek_v3", "layer2.out,layer4.out,layer6.out", [3, 5, 7]),  # else verbatim: the stream entering layer j
])
def test_sglang_ids_follow_the_targets_own_model_file(family, wiring, ids):
    """sglang 0.5.23: deepseek_v2.py adds 1 only when ids[0] == 1; qwen3.py, gemma3_causal.py always add 1."""
    from eaglewire.engine_ids import convention
    from eaglewire.stacks import sglang_rules

    (rule,) = sglang_rules(family)
    assert convention(rule).to_ids(Wiring.parse(wiring), 8) == ids
    assert convention(rule).from_ids(ids, 8) == Wiring.parse(wiring)


def test_train_refuses_what_would_copy_or_teach_another_model(family_target, tmp_path):
    """Gemma's (1 + w) norm and logit softcap, a non-Llama layer: refused, never copied or taught silently."""
    from eaglewire.train.loop import TrainConfig, TrainingError, _check_family_applies

    def cfg(**kw):
        return TrainConfig(out=tmp_path / "run", data=str(tmp_path), **kw)

    gemma = family_target("gemma3_text")
    with pytest.raises(TrainingError, match=r"scales by \(1 \+ weight\)"):
        _check_family_applies(cfg(init_head="target"), gemma.layout)
    gemma.text_config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(TrainingError, match="final_logit_softcapping 30.0"):
            _check_family_applies(cfg(), gemma.layout)
    finally:
        gemma.text_config.final_logit_softcapping = None
    with pytest.raises(TrainingError, match="copies a Llama decoder layer; this target's layers are qwen3_moe's"):
        _check_family_applies(cfg(init_midlayer="target-last"), family_target("qwen3_moe").layout)
    _check_family_applies(cfg(init_head="target"), family_target("qwen3_moe").layout)  # same RMSNorm: allowed
    # A native checkpoint's ids for SGLang follow the target's own model file: deepseek_v2.py's rule for DeepSeek.
    deepseek = family_target("deepseek_v3").layout
    with pytest.raises(TrainingError, match=r"sglang-pre-25454 is not how SGLang reads ids for a 'deepseek_v3'.*"
                                            r"use sglang-post-25454"):
        _check_family_applies(cfg(convention="sglang-pre-25454"), deepseek)
    _check_family_applies(cfg(convention="sglang-post-25454"), deepseek)
    with pytest.raises(TrainingError, match="llava.py has no set_eagle3_layers_to_capture"):
        _check_family_applies(cfg(convention="sglang-pre-25454"), family_target("llava").layout)
