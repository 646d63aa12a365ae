"""export and import: round trips, folders laid out the way each stack writes them, ids per convention, strict keys.

The stack layouts below are written by hand from each project's documented layout
(sources and commits in formats.py's docstring), not produced by the exporter, so
import is tested against what the stacks write rather than against itself.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_target
from safetensors.torch import load_file, save_file
from test_drafter import step_inputs

from eaglewire.cli import main
from eaglewire.drafter.checkpoint import (
    CheckpointMeta,
    load_checkpoint,
    read_checkpoint_state,
    save_checkpoint,
)
from eaglewire.drafter.model import Drafter, DrafterConfig
from eaglewire.drafter.shipped import shipped_drafter
from eaglewire.engine.speculative import Engine, GenerationConfig
from eaglewire.engine_ids import CONVENTIONS, convention
from eaglewire.interop.formats import (
    FORMATS,
    FormatError,
    export_checkpoint,
    import_checkpoint,
)
from eaglewire.stacks import STACKS
from eaglewire.target import load_target
from eaglewire.wiring import Wiring

TINY_LAYERS = 8
TINY_WIRING = Wiring.default(TINY_LAYERS)  # layer1.out,layer3.out,layer4.out
# (format, --engine-version on export, --ids-convention on import)
ROUND_TRIPS = [
    ("sglang", "pre-25454", "sglang-pre-25454"),
    ("sglang", "post-25454", "sglang-post-25454"),
    ("sglang", None, "sglang-post-25454"),
    ("vllm", None, None),
    ("speculators", None, None),
    ("specforge", None, None),
    ("eagle", None, None),
]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer_dir):
    """A tiny 8-layer target and a random bf16 drafter for it, saved natively."""
    folder = build_tiny_target(tmp_path_factory.mktemp("tiny8"), "llama", tokenizer_dir, num_hidden_layers=TINY_LAYERS)
    target = load_target(str(folder))
    torch.manual_seed(0)
    config = DrafterConfig.from_target(target.model.config, TINY_WIRING, draft_vocab_size=64)
    drafter = Drafter(config, target.layout.embed, torch.randperm(config.vocab_size)[:64])
    with torch.no_grad():
        for name, param in drafter.named_parameters():  # norms away from 1, so a norm mix-up shows
            param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
    meta = CheckpointMeta(TINY_WIRING, target.fingerprint, metrics={"step": 1})
    native = save_checkpoint(tmp_path_factory.mktemp("native") / "ckpt", drafter, meta, dtype=torch.bfloat16)
    return target, folder, native


@pytest.fixture(scope="module")
def shipped_state():
    """The shipped SmolLM2 drafter's config, metadata and fp16 tensors: the weights every stack layout below holds."""
    return read_checkpoint_state(shipped_drafter("smollm2-135m"))


# speculators resolves the verifier by hub id offline in no test: the shipped drafter's exports name SmolLM2's
# hub id (not checked offline), the tiny target's exports name its Hugging Face folder.
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def to_stack(fmt, tiny) -> dict:
    """What export needs beyond the format for the tiny target (speculators: the verifier and the target)."""
    target, folder, _ = tiny
    return {"verifier": str(folder), "target": target} if fmt == "speculators" else {}


def logits_of(drafter):
    torch.manual_seed(1)
    ids, aux, positions = step_inputs(drafter)
    with torch.no_grad():
        return drafter.logits(drafter(drafter.embed(ids), drafter.fuse(aux.to(drafter.fc.weight.dtype)), positions))


def assert_same_drafter(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


# ---------------------------------------------------------------- round trips: native -> X -> native


@pytest.mark.parametrize("fmt, version, ids_convention", ROUND_TRIPS)
def test_round_trip_is_bit_identical(tiny, tmp_path, fmt, version, ids_convention):
    target, _, native = tiny
    exported = export_checkpoint(native, fmt, tmp_path / fmt, engine_version=version, **to_stack(fmt, tiny))
    assert exported.wiring == TINY_WIRING
    back = import_checkpoint(tmp_path / fmt, fmt, tmp_path / "back", target, ids_convention)
    before, after = load_checkpoint(native, target.layout.embed), load_checkpoint(back.out, target.layout.embed)
    assert after.meta.wiring == before.meta.wiring == TINY_WIRING
    assert after.meta.target == before.meta.target
    assert_same_drafter(before.drafter, after.drafter)
    assert before.drafter.fc.weight.dtype == torch.bfloat16
    assert torch.equal(logits_of(before.drafter), logits_of(after.drafter))


def test_every_format_has_a_round_trip():
    assert {fmt for fmt, _, _ in ROUND_TRIPS} == set(FORMATS)


# ---------------------------------------------------------------- ids read back by each engine's rule

SMOLLM2_LAYERS = 30
# Where each stack reads its ids (and by which rule), written from the sources, not from formats.py.
READ_BY_ENGINE = {
    "eagle": ("eagle", None, lambda c: [2, SMOLLM2_LAYERS // 2, SMOLLM2_LAYERS - 3]),  # hard-coded, config unread
    "vllm": ("vllm", None, lambda c: c["eagle_aux_hidden_state_layer_ids"]),
    "speculators": ("speculators", None, lambda c: c["eagle_aux_hidden_state_layer_ids"]),
    "specforge": ("specforge", None, lambda c: c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
    "sglang-pre-25454": ("sglang", "pre-25454", lambda c: c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
    "sglang-post-25454": ("sglang", "post-25454", lambda c: c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
}


def test_every_convention_is_checked():
    assert set(READ_BY_ENGINE) == set(CONVENTIONS)


@pytest.mark.parametrize("name", sorted(READ_BY_ENGINE))
def test_exported_ids_capture_the_training_wiring(shipped_state, smollm2, tmp_path, name):
    _, meta, _ = shipped_state
    fmt, version, read_ids = READ_BY_ENGINE[name]
    extra = {"verifier": SMOLLM2_HUB_ID, "target": smollm2} if fmt == "speculators" else {}
    export_checkpoint(shipped_drafter("smollm2-135m"), fmt, tmp_path / "out", engine_version=version, **extra)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert convention(name).from_ids(read_ids(config), SMOLLM2_LAYERS) == meta.wiring
    # The ids stand only where this engine reads them: no other engine picks them up in its own convention.
    if fmt in ("sglang", "specforge", "eagle"):
        assert "eagle_aux_hidden_state_layer_ids" not in config
    if fmt in ("vllm", "speculators", "eagle"):
        assert "eagle_aux_hidden_state_layer_ids" not in config.get("eagle_config", {})


def test_forward_flags_are_written_explicitly(smollm2, tmp_path):
    export_checkpoint(shipped_drafter("smollm2-135m"), "speculators", tmp_path / "s", verifier=SMOLLM2_HUB_ID,
                      target=smollm2)
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    # vLLM reads a speculators config without norm_before_residual as True.
    assert {k: spec[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")} == dict.fromkeys(
        ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), False)
    export_checkpoint(shipped_drafter("smollm2-135m"), "eagle", tmp_path / "e")
    eagle = json.loads((tmp_path / "e" / "config.json").read_text())
    assert "target_hidden_size" not in eagle  # with it, EAGLE would not load the target's embedding
    assert eagle["rope_theta"] == 100000.0 and eagle["rope_scaling"] is None and eagle["bias"] is False
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == ["config.json", "pytorch_model.bin"]


# ---------------------------------------------------------------- folders as each stack writes them


def layer_fields(config: DrafterConfig) -> dict:
    return {
        "model_type": "llama", "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size, "tie_word_embeddings": False, "initializer_range": 0.02,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "use_cache": True, "torch_dtype": "float16",
        "transformers_version": "4.57.1",
    }


def speculators_layout(config, tensors, embed):
    """speculators' Eagle3SpeculatorConfig and Eagle3DraftModel.save_pretrained: layers.0.*, with embed_tokens."""
    weights = {k.replace("midlayer.", "layers.0."): t for k, t in tensors.items()}
    weights["embed_tokens.weight"] = embed.to(torch.float16)
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.4.0",
        "transformer_layer_config": layer_fields(config), "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": [2, 15, 27], "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "architectures": ["LlamaForCausalLM"]},
        },
    }, weights, "model.safetensors"


def specforge_layout(config, tensors, embed):
    """SpecForge's draft config (configs/*-eagle3.json) and export/to_hf.py: midlayer.*, with embed_tokens."""
    weights = dict(tensors) | {"embed_tokens.weight": embed.to(torch.float16)}
    return {
        "architectures": ["LlamaForCausalLMEagle3"], **layer_fields(config), "draft_vocab_size": config.draft_vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
    }, weights, "model.safetensors"


def sglang_layout(config, tensors, embed):
    """A LlamaForCausalLMEagle3 folder as SGLang loads it: ids in eagle_config only."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"], **layer_fields(config), "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "use_aux_hidden_state": True},
    }, dict(tensors), "model.safetensors"


def vllm_layout(config, tensors, embed):
    """A LlamaForCausalLMEagle3 folder as vLLM loads it: ids at the top level."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"], **layer_fields(config), "draft_vocab_size": config.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": [2, 15, 27], "norm_before_residual": False,
    }, dict(tensors), "model.safetensors"


def eagle_layout(config, tensors, embed):
    """EAGLE-3's traineagle3/config.json and its pytorch_model.bin (frozen embedding excluded)."""
    fields = layer_fields(config)
    del fields["head_dim"]  # EAGLE derives it
    return {"architectures": ["LlamaForCausalLM"], **fields, "draft_vocab_size": config.draft_vocab_size}, \
        dict(tensors), "pytorch_model.bin"


LAYOUTS = {
    "speculators": (speculators_layout, None),
    "specforge": (specforge_layout, None),
    "sglang": (sglang_layout, "sglang-pre-25454"),
    "vllm": (vllm_layout, None),
    "eagle": (eagle_layout, None),
}


def write_layout(folder, layout):
    config, weights, weights_file = layout
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if weights_file.endswith(".bin"):
        torch.save(weights, folder / weights_file)
    else:
        save_file(weights, folder / weights_file)
    return folder


@pytest.fixture(scope="module")
def native_engine(smollm2):
    checkpoint = load_checkpoint(shipped_drafter("smollm2-135m"), smollm2.layout.embed)
    return Engine(smollm2, checkpoint.drafter.float(), checkpoint.meta.wiring, max_len=256)


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


def greedy(engine):
    config = GenerationConfig(max_new_tokens=24, chain_length=4)
    runs = []
    for prompt in PROMPTS:
        finished = list(engine.generate(prompt, config))[-1]
        m = finished.metrics
        runs.append((finished.token_ids, m.accepted, m.drafted, m.attempted_at, m.accepted_at))
    return runs


@pytest.fixture(scope="module")
def native_runs(native_engine):
    return greedy(native_engine)


def test_every_format_has_a_stack_layout():
    assert set(LAYOUTS) == set(FORMATS)


@pytest.mark.parametrize("fmt", sorted(LAYOUTS))
def test_a_stack_layout_imports_and_generates_like_the_native_drafter(
        fmt, smollm2, shipped_state, native_engine, native_runs, tmp_path):
    config, meta, tensors = shipped_state
    make, ids_convention = LAYOUTS[fmt]
    source = write_layout(tmp_path / fmt, make(config, tensors, smollm2.layout.embed.weight.detach()))
    done = import_checkpoint(source, fmt, tmp_path / "native", smollm2, ids_convention)
    assert done.wiring == meta.wiring
    imported = load_checkpoint(done.out, smollm2.layout.embed)
    imported.meta.check_target(smollm2.fingerprint)
    state = imported.drafter.state_dict()
    assert state.keys() == tensors.keys()
    assert all(state[k].dtype == tensors[k].dtype and torch.equal(state[k], tensors[k]) for k in tensors)
    engine = Engine(smollm2, imported.drafter.float(), imported.meta.wiring, max_len=256)
    runs = greedy(engine)
    assert [r[0] for r in runs] == [r[0] for r in native_runs]  # the same tokens
    assert runs == native_runs  # and the same drafts accepted at every depth: the same drafter, wired the same
    assert sum(r[1] for r in runs) > 0


# ---------------------------------------------------------------- strictness


@pytest.fixture
def vllm_folder(tiny, tmp_path):
    _, _, native = tiny
    return export_checkpoint(native, "vllm", tmp_path / "vllm").out


def edit_weights(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def edit_config(folder, edit):
    path = folder / "config.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def rename_prefix(old, new):
    def edit(tensors):
        for key in [k for k in tensors if k.startswith(old)]:
            tensors[new + key.removeprefix(old)] = tensors.pop(key)
    return edit


def test_speculators_naming_in_a_vllm_folder_names_keys_and_cause(tiny, vllm_folder, tmp_path):
    edit_weights(vllm_folder, rename_prefix("midlayer.", "layers.0."))
    with pytest.raises(ValueError) as err:
        import_checkpoint(vllm_folder, "vllm", tmp_path / "o", tiny[0])
    message = str(err.value)
    assert "missing keys: midlayer." in message and "unexpected keys: layers.0." in message
    assert "speculators naming of the decoder layer (`layers.0.*` instead of `midlayer.*`)" in message
    assert "--from speculators" in message
    assert not (tmp_path / "o").exists()


def test_midlayer_naming_in_a_speculators_folder_names_keys_and_cause(tiny, tmp_path):
    target, _, native = tiny
    folder = export_checkpoint(native, "speculators", tmp_path / "s", **to_stack("speculators", tiny)).out
    edit_weights(folder, rename_prefix("layers.0.", "midlayer."))
    with pytest.raises(ValueError, match=r"missing keys: layers\.0\..*unexpected keys: midlayer\..*"
                                         r"`midlayer\.\*` instead of `layers\.0\.\*`.*--from sglang, vllm"):
        import_checkpoint(folder, "speculators", tmp_path / "o", target)


def test_a_missing_key_is_named(tiny, vllm_folder, tmp_path):
    edit_weights(vllm_folder, lambda t: t.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(ValueError, match="missing keys: midlayer.hidden_norm.weight"):
        import_checkpoint(vllm_folder, "vllm", tmp_path / "o", tiny[0])


def test_an_unexpected_key_is_named_with_its_cause(tiny, vllm_folder, tmp_path):
    edit_weights(vllm_folder, lambda t: t.update({"fc_norm.0.weight": torch.ones(64, dtype=torch.bfloat16)}))
    with pytest.raises(ValueError, match=r"unexpected keys: fc_norm\.0\.weight.*norms of the aux states before fc"):
        import_checkpoint(vllm_folder, "vllm", tmp_path / "o", tiny[0])


def test_a_foreign_embedding_is_refused(tiny, vllm_folder, tmp_path):
    target = tiny[0]
    edit_weights(vllm_folder, lambda t: t.update({"embed_tokens.weight": torch.zeros_like(target.layout.embed.weight)}))
    with pytest.raises(FormatError, match="not the target's embedding"):
        import_checkpoint(vllm_folder, "vllm", tmp_path / "o", target)


def test_a_second_weights_file_is_refused(tiny, vllm_folder, tmp_path):
    save_file({"x": torch.zeros(1)}, vllm_folder / "model-00002-of-00002.safetensors")
    with pytest.raises(FormatError, match="exactly one weights file"):
        import_checkpoint(vllm_folder, "vllm", tmp_path / "o", tiny[0])


def test_flags_the_drafter_cannot_reproduce_are_refused(tiny, tmp_path):
    target, _, native = tiny
    folder = export_checkpoint(native, "speculators", tmp_path / "s", **to_stack("speculators", tiny)).out
    edit_config(folder, lambda c: c.pop("norm_before_residual"))
    with pytest.raises(FormatError, match="has no 'norm_before_residual'"):
        import_checkpoint(folder, "speculators", tmp_path / "o", target)
    edit_config(folder, lambda c: c.update({"norm_before_residual": True}))
    with pytest.raises(FormatError, match="norm_before_residual is True.*un-normed fused hidden"):
        import_checkpoint(folder, "speculators", tmp_path / "o", target)


def test_sglang_ids_need_a_convention_only_where_the_rules_disagree(tiny, tmp_path):
    target, _, native = tiny
    folder = export_checkpoint(native, "sglang", tmp_path / "g").out
    # [1, 3, 4] starts with 1: both rules of PR #25454 add 1, so no --ids-convention is needed.
    done = import_checkpoint(folder, "sglang", tmp_path / "agreed", target)
    assert done.wiring == TINY_WIRING and done.rules == ("sglang-pre-25454", "sglang-post-25454")
    edit_config(folder, lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}))
    with pytest.raises(FormatError) as err:
        import_checkpoint(folder, "sglang", tmp_path / "o", target)
    message = str(err.value)
    assert "PR #25454" in message and "--ids-convention sglang-pre-25454 or sglang-post-25454" in message
    assert "Its ids [2, 4, 5] mean layer2.out,layer4.out,layer5.out under sglang-pre-25454" in message
    assert "layer1.out,layer3.out,layer4.out under sglang-post-25454" in message
    with pytest.raises(FormatError, match="--ids-convention vllm would name other tensors"):
        import_checkpoint(folder, "sglang", tmp_path / "o", target, ids_convention="vllm")


def test_absent_ids_need_wiring(tiny, vllm_folder, tmp_path):
    target = tiny[0]
    edit_config(vllm_folder, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    with pytest.raises(FormatError, match="names no aux layer ids.*pass --wiring"):
        import_checkpoint(vllm_folder, "vllm", tmp_path / "o", target)
    done = import_checkpoint(vllm_folder, "vllm", tmp_path / "o", target, wiring=str(TINY_WIRING))
    assert done.wiring == TINY_WIRING and done.ids is None
    with_ids = export_checkpoint(tiny[2], "vllm", tmp_path / "with-ids").out
    with pytest.raises(FormatError, match="--wiring layer1.out,layer2.out,layer4.out disagrees"):
        import_checkpoint(with_ids, "vllm", tmp_path / "o2", target, wiring="layer1.out,layer2.out,layer4.out")


def test_ids_in_two_places_must_agree(tiny, vllm_folder, tmp_path):
    edit_config(vllm_folder, lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}))
    with pytest.raises(FormatError, match=r"\[2, 4, 5\] disagrees with eagle_config's \[1, 3, 4\]: vLLM reads the top"):
        import_checkpoint(vllm_folder, "vllm", tmp_path / "o", tiny[0])


def test_exports_that_a_stack_cannot_load_are_refused(tiny, tmp_path):
    target, _, native = tiny
    drafter = load_checkpoint(native, target.layout.embed).drafter

    def rewired(wiring: str):
        meta = CheckpointMeta(Wiring.parse(wiring), target.fingerprint, convention="specforge")
        return save_checkpoint(tmp_path / wiring, drafter, meta)

    with pytest.raises(FormatError, match=r"hard-coded ids \[2, 4, 5\] = layer1.out,layer3.out,layer4.out, but this "
                                          r"drafter was trained on layer1.out,layer3.out,layer5.out"):
        export_checkpoint(rewired("layer1.out,layer3.out,layer5.out"), "eagle", tmp_path / "e")
    # SGLang before #25454 never reaches the last layer's output
    with pytest.raises(FormatError, match=r"sglang cannot capture.*sglang-pre-25454 cannot capture ids \[7\]"):
        export_checkpoint(rewired("layer1.out,layer3.out,layer7.out"), "sglang", tmp_path / "g", "pre-25454")
    with pytest.raises(FormatError, match="applies only to --to sglang"):
        export_checkpoint(native, "vllm", tmp_path / "v", engine_version="pre-25454")
    with pytest.raises(FormatError, match="not an empty folder"):
        export_checkpoint(native, "vllm", native)
    assert not (tmp_path / "e").exists() and not (tmp_path / "g").exists()


# ---------------------------------------------------------------- what each stack needs (issue 13)


def test_speculators_export_carries_the_verifier_and_the_target_embedding(tiny, tmp_path):
    # speculators 0.9.0 from_pretrained resolves verifier.name_or_path, and keeps the folder's embed_tokens.weight:
    # its NaN placeholder does not survive from_pretrained, so without one it drafts on a zero embedding.
    target, folder, native = tiny
    done = export_checkpoint(native, "speculators", tmp_path / "s", verifier=str(folder), target=target)
    config = json.loads((done.out / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(folder),
                                                        "architectures": ["LlamaForCausalLM"]}
    weights = load_file(done.out / "model.safetensors")
    assert torch.equal(weights["embed_tokens.weight"], target.layout.embed.weight.detach().to(torch.bfloat16))
    assert weights["embed_tokens.weight"].dtype == weights["fc.weight"].dtype == torch.bfloat16
    assert done.warnings == ()


def test_speculators_export_refuses_a_verifier_speculators_cannot_resolve(tiny, tmp_path, tokenizer_dir):
    target, folder, native = tiny
    with pytest.raises(FormatError, match="--to speculators needs --verifier"):
        export_checkpoint(native, "speculators", tmp_path / "a", target=target)
    with pytest.raises(FormatError, match=r"--verifier 'smollm2-135m' is neither a local folder nor a hub id.*"
                                          r"ask the hub for a repo named 'smollm2-135m'.*save_pretrained"):
        export_checkpoint(native, "speculators", tmp_path / "b", verifier="smollm2-135m", target=target)
    other = build_tiny_target(tmp_path / "other", "llama", tokenizer_dir, seed=1, num_hidden_layers=TINY_LAYERS)
    with pytest.raises(FormatError, match="holds another token embedding than the target this drafter was trained on"):
        export_checkpoint(native, "speculators", tmp_path / "c", verifier=str(other), target=target)
    with pytest.raises(FormatError, match="--verifier and --target apply only to --to speculators"):
        export_checkpoint(native, "vllm", tmp_path / "d", verifier=str(folder))
    with pytest.raises(FormatError, match="--verifier and --target apply only to --to speculators"):
        export_checkpoint(native, "sglang", tmp_path / "d", target=target)
    assert not any((tmp_path / name).exists() for name in "abcd")
    hub = export_checkpoint(native, "speculators", tmp_path / "e", verifier="owner/some-model", target=target)
    assert len(hub.warnings) == 1 and "was not checked offline" in hub.warnings[0]


def test_vllm_runners_disagree_on_ids_named_only_in_eagle_config(tiny, vllm_folder, tmp_path):
    # vllm 0.33.0: the V1 runner falls back to eagle_config's ids, the V2 runner (the default) does not.
    def nested_only(config):
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = config.pop("eagle_aux_hidden_state_layer_ids")

    edit_config(vllm_folder, nested_only)
    with pytest.raises(FormatError, match=r"vllm 0.33.0 reads this folder's ids differently per code path \(its V1 "
                                          r"runner reads eagle_config.eagle_aux_hidden_state_layer_ids = \[2, 4, 5\]; "
                                          r"its V2 runner finds none and captures its default\)"):
        import_checkpoint(vllm_folder, "vllm", tmp_path / "o", tiny[0], wiring=str(TINY_WIRING))


def test_an_sglang_folder_says_vllm_would_read_it_otherwise(tiny, tmp_path):
    _, _, native = tiny
    done = export_checkpoint(native, "sglang", tmp_path / "g")
    assert len(done.warnings) == 1
    assert done.warnings[0].startswith("do not serve this folder with vllm: vllm 0.33.0 V1 runner reads "
                                       "eagle_config.eagle_aux_hidden_state_layer_ids = [1, 3, 4], which captures "
                                       "layer0.out,layer2.out,layer3.out, not the trained layer1.out,layer3.out,layer4.out")
    assert export_checkpoint(native, "vllm", tmp_path / "v").warnings == ()  # SGLang's default is this wiring


def test_vllm_captures_the_embedding_and_the_last_layer(tiny, tmp_path):
    # vllm 0.33.0 offers slot 0 (the embedding) and slot n (layer{n-1}.out); so does speculators 0.9.0.
    target, _, native = tiny
    drafter = load_checkpoint(native, target.layout.embed).drafter
    wiring = Wiring.parse(f"embed,layer3.out,layer{TINY_LAYERS - 1}.out")
    edge = save_checkpoint(tmp_path / "edge", drafter, CheckpointMeta(wiring, target.fingerprint))
    for fmt in ("vllm", "speculators"):
        done = export_checkpoint(edge, fmt, tmp_path / fmt, **to_stack(fmt, tiny))
        config = json.loads((done.out / "config.json").read_text())
        assert config["eagle_aux_hidden_state_layer_ids"] == [0, 4, TINY_LAYERS]
        assert import_checkpoint(done.out, fmt, tmp_path / f"{fmt}-back", target).wiring == wiring


def test_a_specforge_folder_says_sglang_and_vllm_read_norm_output_otherwise(tiny, tmp_path):
    # SpecForge's norm_output: true = logits from the normed hidden; SGLang's and vLLM's = the next step reads it.
    _, _, native = tiny
    done = export_checkpoint(native, "specforge", tmp_path / "f")
    assert json.loads((done.out / "config.json").read_text())["norm_output"] is True
    flagged = {note.split(":")[0]: note for note in done.warnings if "norm_output is True" in note}
    assert set(flagged) == {"do not serve this folder with vllm", "do not serve this folder with sglang"}
    assert "the next draft step reads the normed hidden instead of the pre-norm one" in flagged[
        "do not serve this folder with sglang"]


# ---------------------------------------------------------------- command line


def test_cli_export_then_import(tiny, tmp_path, capsys):
    _, target_dir, native = tiny
    assert main(["export", str(native), "--to", "speculators", "--out", str(tmp_path / "s"),
                 "--verifier", str(target_dir), "--target", str(target_dir)]) == 0
    assert "ids [2, 4, 5] at eagle_aux_hidden_state_layer_ids (top level)" in capsys.readouterr().out
    argv = ["import", str(tmp_path / "s"), "--from", "speculators", "--out", str(tmp_path / "n"), "--target", str(target_dir)]
    assert main(argv) == 0
    assert "wiring layer1.out,layer3.out,layer4.out" in capsys.readouterr().out
    assert main(["import", str(tmp_path / "s"), "--from", "vllm", "--out", str(tmp_path / "x"),
                 "--target", str(target_dir)]) == 2
    assert "declares architectures ['Eagle3Speculator']" in capsys.readouterr().err
    assert main(["export", str(native), "--to", "speculators", "--out", str(tmp_path / "alias"),
                 "--verifier", "smollm2-135m", "--target", str(target_dir)]) == 2
    err = capsys.readouterr().err
    assert "eaglewire export: error: --verifier 'smollm2-135m' is neither" in err and "Traceback" not in err


# ---------------------------------------------------------------- drafters of more than one decoder layer


@pytest.fixture(scope="module")
def deep(tiny, tmp_path_factory):
    """The tiny drafter with a second decoder layer (non-zero, norms away from 1), saved natively."""
    target, _, native = tiny
    drafter = load_checkpoint(native, target.layout.embed).drafter.float()
    config = DrafterConfig(**{**drafter.config.__dict__, "num_layers": 2})
    deeper = Drafter(config, target.layout.embed, drafter.draft_to_target(torch.arange(64)))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in deeper.named_parameters():
            param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
    meta = CheckpointMeta(TINY_WIRING, target.fingerprint)
    return save_checkpoint(tmp_path_factory.mktemp("deep") / "ckpt", deeper, meta, dtype=torch.bfloat16)


@pytest.mark.parametrize("fmt, norm", [("vllm", "input_layernorm"), ("sglang", "hidden_norm"),
                                       ("speculators", "input_layernorm")])
def test_a_two_layer_drafter_exports_the_norm_each_stack_reads_and_imports_back(tiny, deep, tmp_path, fmt, norm):
    # vLLM 0.33.0 and speculators 0.9.0 normalise a later layer's input with its input_layernorm, SGLang 0.5.23
    # with its hidden_norm (llama_eagle3.py in each wheel); a file naming the other would serve ones there.
    target = tiny[0]
    done = export_checkpoint(deep, fmt, tmp_path / fmt, **to_stack(fmt, tiny))
    config = json.loads((done.out / "config.json").read_text())
    layers = config["transformer_layer_config" if fmt == "speculators" else "num_hidden_layers"]
    assert (layers["num_hidden_layers"] if fmt == "speculators" else layers) == 2
    names = set(load_file(done.out / "model.safetensors"))
    other = {"input_layernorm", "hidden_norm"} - {norm}
    assert f"layers.1.{norm}.weight" in names and f"layers.1.{other.pop()}.weight" not in names
    assert "layers.1.self_attn.q_proj.weight" in names
    back = import_checkpoint(done.out, fmt, tmp_path / "back", target)
    assert_same_drafter(load_checkpoint(deep, target.layout.embed).drafter,
                        load_checkpoint(back.out, target.layout.embed).drafter)


def test_two_layer_exports_say_which_stacks_would_serve_them_otherwise(deep, tmp_path):
    vllm = export_checkpoint(deep, "vllm", tmp_path / "v")
    assert [note for note in vllm.warnings if "hidden_norm" in note] == [
        "do not serve this folder with sglang: sglang 0.5.23 normalises each layer after the first with its "
        "hidden_norm, which the folder lacks (layers.1.hidden_norm.weight; " + STACKS["sglang"].layers_source
        + ") (export --to sglang for that)"]
    sglang = export_checkpoint(deep, "sglang", tmp_path / "g")
    assert any("vllm 0.33.0 normalises each layer after the first with its input_layernorm, which the folder lacks"
               in note for note in sglang.warnings)
    for fmt in ("specforge", "eagle"):
        with pytest.raises(FormatError, match=f"{fmt} builds one decoder layer .*this drafter has 2"):
            export_checkpoint(deep, fmt, tmp_path / fmt)


def test_a_later_layer_norm_the_stack_never_reads_is_refused_on_import(tiny, deep, tmp_path):
    done = export_checkpoint(deep, "sglang", tmp_path / "g")
    tensors = load_file(done.out / "model.safetensors")
    tensors["layers.1.input_layernorm.weight"] = tensors["layers.1.hidden_norm.weight"].clone()
    save_file(tensors, done.out / "model.safetensors")
    with pytest.raises(FormatError, match="sglang never reads layers.1.input_layernorm.weight"):
        import_checkpoint(done.out, "sglang", tmp_path / "back", tiny[0])
