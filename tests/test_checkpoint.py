"""The native drafter checkpoint: round trip, strict loading, atomic saves."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_drafter import DRAFT_VOCAB, VOCAB, H, step_inputs, tiny_drafter

from eaglewire.drafter import checkpoint as ckpt
from eaglewire.drafter.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    load_checkpoint,
    read_checkpoint_config,
    save_checkpoint,
)
from eaglewire.wiring import Wiring

NUM_LAYERS = 8
WIRING = Wiring.parse("layer1.out,layer3.out,layer4.out")
FINGERPRINT = {
    "name": "tiny", "model_type": "llama", "num_layers": NUM_LAYERS, "hidden_size": H, "vocab_size": VOCAB,
    "config_sha256": "c" * 64, "tokenizer_sha256": "t" * 64, "weights_sha256": "w" * 64,
}


def meta(**changes) -> CheckpointMeta:
    fields = dict(wiring=WIRING, target=dict(FINGERPRINT), data_manifest_sha256="d" * 64,
                  metrics={"step": 10, "acc": [0.5, 0.3]})
    return CheckpointMeta(**(fields | changes))


@pytest.fixture
def saved(tmp_path):
    drafter = tiny_drafter()
    folder = save_checkpoint(tmp_path / "ckpt", drafter, meta())
    return drafter, folder


def logits_of(drafter, seed=1):
    torch.manual_seed(seed)
    ids, aux, positions = step_inputs(drafter)
    with torch.no_grad():
        return drafter.logits(drafter(drafter.embed(ids), drafter.fuse(aux), positions))


def edit_weights(folder, edit):
    path = folder / ckpt.WEIGHTS_FILE
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def edit_config(folder, edit):
    path = folder / ckpt.CONFIG_FILE
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_round_trip_is_bit_identical(saved):
    drafter, folder = saved
    loaded = load_checkpoint(folder, drafter.embed_tokens.table)
    original, restored = drafter.state_dict(), loaded.drafter.state_dict()
    assert original.keys() == restored.keys()
    for key in original:
        assert original[key].dtype == restored[key].dtype and torch.equal(original[key], restored[key]), key
    assert torch.equal(logits_of(drafter), logits_of(loaded.drafter))
    assert loaded.meta == meta()


def test_files_are_what_the_engines_expect(saved):
    drafter, folder = saved
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(folder.parent)) == ["ckpt"]  # no temporaries or backups left behind
    tensors = load_file(folder / ckpt.WEIGHTS_FILE)
    assert set(tensors) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        k for k in tensors if k.startswith("midlayer.")
    }
    assert not any("embed" in k for k in tensors)
    config = json.loads((folder / ckpt.CONFIG_FILE).read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert (config["draft_vocab_size"], config["vocab_size"], config["target_hidden_size"]) == (DRAFT_VOCAB, VOCAB, H)
    # vLLM ids name the stream entering layer j: layer1.out -> 2
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "use_aux_hidden_state": True}
    assert config["eaglewire"]["engine_convention"] == "vllm"
    assert config["eaglewire"]["wiring"] == WIRING.to_json()
    assert config["eaglewire"]["target"] == FINGERPRINT


def test_another_convention_writes_other_ids_for_the_same_wiring(tmp_path):
    drafter = tiny_drafter()
    folder = save_checkpoint(tmp_path / "ckpt", drafter, meta(convention="specforge"))
    config = json.loads((folder / ckpt.CONFIG_FILE).read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert load_checkpoint(folder, drafter.embed_tokens.table).meta.wiring == WIRING


def test_half_precision_save(tmp_path):
    drafter = tiny_drafter()
    folder = save_checkpoint(tmp_path / "ckpt", drafter, meta(), dtype=torch.bfloat16)
    loaded = load_checkpoint(folder, drafter.embed_tokens.table).drafter
    assert loaded.fc.weight.dtype == torch.bfloat16 and drafter.fc.weight.dtype == torch.float32
    assert torch.equal(loaded.lm_head.weight, drafter.lm_head.weight.to(torch.bfloat16))
    assert torch.equal(loaded.d2t, drafter.d2t) and loaded.d2t.dtype == torch.int64
    assert json.loads((folder / ckpt.CONFIG_FILE).read_text())["torch_dtype"] == "bfloat16"


def test_speculators_naming_is_an_error_that_names_it(saved):
    drafter, folder = saved

    def rename(tensors):
        for key in [k for k in tensors if k.startswith("midlayer.")]:
            tensors["layers.0." + key.removeprefix("midlayer.")] = tensors.pop(key)

    edit_weights(folder, rename)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder, drafter.embed_tokens.table)
    message = str(err.value)
    assert "layers.0.self_attn.q_proj.weight" in message and "midlayer.self_attn.q_proj.weight" in message
    assert "speculators" in message and "eaglewire import --from speculators" in message


def test_vllm_internal_naming_is_named(saved):
    drafter, folder = saved
    edit_weights(folder, lambda t: t.update({"model.fc.weight": t.pop("fc.weight")}))
    with pytest.raises(CheckpointError, match="missing keys: fc.weight.*unexpected keys: model.fc.weight.*vLLM-internal"):
        load_checkpoint(folder, drafter.embed_tokens.table)


def test_an_extra_key_is_an_error(saved):
    drafter, folder = saved
    edit_weights(folder, lambda t: t.update({"embed_tokens.weight": torch.zeros(VOCAB, H)}))
    with pytest.raises(CheckpointError, match="unexpected keys: embed_tokens.weight.*frozen embedding"):
        load_checkpoint(folder, drafter.embed_tokens.table)


def test_a_missing_key_is_an_error(saved):
    drafter, folder = saved
    edit_weights(folder, lambda t: t.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(CheckpointError, match="missing keys: midlayer.hidden_norm.weight"):
        load_checkpoint(folder, drafter.embed_tokens.table)


def test_a_wrong_shape_names_the_key_and_both_shapes(saved):
    drafter, folder = saved
    edit_weights(folder, lambda t: t.update({"fc.weight": torch.zeros(H, H)}))
    with pytest.raises(CheckpointError, match=r"fc.weight: file \(64, 64\) vs config \(64, 192\)"):
        load_checkpoint(folder, drafter.embed_tokens.table)


def test_d2t_out_of_order_or_disagreeing_with_t2d_is_an_error(saved):
    drafter, folder = saved
    edit_weights(folder, lambda t: t.update({"t2d": torch.roll(t["t2d"], 1)}))
    with pytest.raises(CheckpointError, match="d2t and t2d disagree"):
        load_checkpoint(folder, drafter.embed_tokens.table)


def test_ids_that_disagree_with_the_wiring_are_an_error(saved):
    drafter, folder = saved

    def shift(config):  # SpecForge-style ids under a vLLM label: every capture one layer early
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
        config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]

    edit_config(folder, shift)
    expected = r"\[1, 3, 4\] mean layer0.out,layer2.out,layer3.out.*wiring is layer1.out,layer3.out,layer4.out"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(folder, drafter.embed_tokens.table)


def test_top_level_ids_must_agree_with_eagle_config(saved):
    drafter, folder = saved
    edit_config(folder, lambda c: c.update({"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}))
    with pytest.raises(CheckpointError, match="disagrees with eagle_config"):
        read_checkpoint_config(folder)


def test_ids_only_in_eagle_config_are_refused_because_vllm_v2_reads_the_top_level(saved):
    # vllm 0.33.0's V2 runner (its default) reads only the top-level key: without it vLLM captures its default.
    drafter, folder = saved
    edit_config(folder, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    with pytest.raises(CheckpointError, match=r"vllm 0.33.0 \(V2 runner\) finds no layer ids.*add "
                                              r"\"eagle_aux_hidden_state_layer_ids\": \[2, 4, 5\] at the top level"):
        read_checkpoint_config(folder)


def test_a_foreign_checkpoint_without_the_eaglewire_section_is_refused(saved):
    drafter, folder = saved
    edit_config(folder, lambda c: c.pop("eaglewire"))
    with pytest.raises(CheckpointError, match="no 'eaglewire' section.*eaglewire import"):
        load_checkpoint(folder, drafter.embed_tokens.table)


def test_the_embedding_must_fit(saved):
    drafter, folder = saved
    with pytest.raises(CheckpointError, match="target embedding"):
        load_checkpoint(folder, torch.nn.Embedding(VOCAB + 1, H))


def test_a_save_failing_midway_keeps_the_previous_checkpoint(saved, monkeypatch):
    drafter, folder = saved
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}

    def broken(path, data):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "atomic_write_json", broken)  # weights written, config not
    other = tiny_drafter(seed=1)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(folder, other, meta())
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    assert sorted(os.listdir(folder.parent)) == ["ckpt"]
    assert torch.equal(logits_of(load_checkpoint(folder, drafter.embed_tokens.table).drafter), logits_of(drafter))


def test_a_save_killed_between_the_renames_is_recovered(saved):
    drafter, folder = saved
    backup = folder.with_name(f".{folder.name}.previous")
    os.replace(folder, backup)  # the state a kill between the two renames leaves
    with pytest.raises(CheckpointError, match="save was interrupted; the previous checkpoint is intact"):
        load_checkpoint(folder, drafter.embed_tokens.table)
    other = tiny_drafter(seed=1)
    save_checkpoint(folder, other, meta())
    assert sorted(os.listdir(folder.parent)) == ["ckpt"]
    assert torch.equal(logits_of(load_checkpoint(folder, other.embed_tokens.table).drafter), logits_of(other))


def test_a_folder_with_other_files_is_not_replaced(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"will not replace .*notes.txt"):
        save_checkpoint(folder, tiny_drafter(), meta())
    assert (folder / "notes.txt").read_text() == "keep me"


def test_meta_must_fit_the_drafter(tmp_path):
    with pytest.raises(CheckpointError, match="2 aux points, the drafter's fc takes 3"):
        save_checkpoint(tmp_path / "a", tiny_drafter(), meta(wiring=Wiring.parse("layer1.out,layer3.out")))
    with pytest.raises(CheckpointError, match="hidden_size 32"):
        save_checkpoint(tmp_path / "b", tiny_drafter(), meta(target=FINGERPRINT | {"hidden_size": 32}))
    # SGLang before #25454 cannot capture layer{n-1}.out: refused before anything is written
    with pytest.raises(CheckpointError, match="sglang-pre-25454"):
        save_checkpoint(tmp_path / "c", tiny_drafter(), meta(wiring=Wiring.parse("layer1.out,layer3.out,layer7.out"),
                                                           convention="sglang-pre-25454"))
    assert not os.listdir(tmp_path)


def test_meta_names_a_different_target_and_bad_settings(saved):
    drafter, folder = saved
    loaded = load_checkpoint(folder, drafter.embed_tokens.table)
    loaded.meta.check_target(FINGERPRINT | {"name": "renamed"})  # the display name does not matter
    with pytest.raises(CheckpointError, match="weights_sha256"):
        loaded.meta.check_target(FINGERPRINT | {"weights_sha256": "x" * 64})
    with pytest.raises(CheckpointError, match="unknown engine convention 'tgi'"):
        meta(convention="tgi")
    with pytest.raises(CheckpointError, match="lacks num_layers"):
        meta(target={"hidden_size": H, "vocab_size": VOCAB})
    edit_config(folder, lambda c: c["eaglewire"].update({"format_version": 99}))
    with pytest.raises(CheckpointError, match="format version 99"):
        read_checkpoint_config(folder)
