"""Capture returns exactly the named tensors: checked against HF output_hidden_states."""

from __future__ import annotations

import pytest
import torch

from eaglewire.data.capture import CaptureError, CaptureHooks, capture
from eaglewire.target import TargetError, TargetLayout, load_target
from eaglewire.wiring import CapturePoint, Wiring, WiringError, all_points


def hf_reference(target, ids) -> dict[str, torch.Tensor]:
    """HF's own hidden states, named by docs/ARCHITECTURE.md's vocabulary table: index 0 = embed,
    index i = layer{i-1}.out, and the last entry is post-norm (final)."""
    with torch.inference_mode():
        states = target.model(ids, output_hidden_states=True).hidden_states
    n = target.num_layers
    named = {"embed": states[0], "final": states[n]}
    named.update({f"layer{i}.out": states[i + 1] for i in range(n - 1)})
    return named


def check_against_hf(target, ids) -> None:
    points = all_points(target.num_layers)
    got = capture(target.layout, points, ids)
    ref = hf_reference(target, ids)
    for name, tensor in ref.items():
        assert torch.equal(got[CapturePoint.parse(name)], tensor), name
    # HF does not return layer{n-1}.out; the final norm applied to it must give 'final'.
    last = got[CapturePoint.layer_out(target.num_layers - 1)]
    with torch.inference_mode():
        assert torch.allclose(target.layout.norm(last), ref["final"], atol=1e-6)
    # adjacent points really are different tensors
    assert not torch.allclose(got[CapturePoint.layer_out(1)], got[CapturePoint.layer_out(2)])


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_capture_equals_hf_hidden_states_tiny(tiny_target_dir, family):
    target = load_target(str(tiny_target_dir(family)))
    assert target.fingerprint["model_type"] == family
    torch.manual_seed(1)
    check_against_hf(target, torch.randint(0, 49152, (2, 17)))


def test_capture_equals_hf_hidden_states_smollm2(smollm2):
    ids = smollm2.tokenizer("The wiring must be exact, or acceptance drops.", return_tensors="pt").input_ids
    check_against_hf(smollm2, ids)
    wiring = Wiring.default(smollm2.num_layers)
    assert str(wiring) == "layer1.out,layer14.out,layer26.out"
    got = capture(smollm2.layout, wiring.points, ids, dtype=torch.bfloat16)
    assert list(got) == list(wiring.points)
    assert all(t.dtype == torch.bfloat16 for t in got.values())


def test_unreachable_point_is_an_error(tiny_target_dir):
    target = load_target(str(tiny_target_dir("llama")))
    with pytest.raises(WiringError, match="layer0.out to layer5.out"):
        capture(target.layout, [CapturePoint.layer_out(6)], torch.zeros(1, 3, dtype=torch.long))


def test_hook_that_never_fires_is_an_error(tiny_target_dir):
    """A module that the forward does not run (e.g. a wrapper that skips capture) must not pass silently."""
    target = load_target(str(tiny_target_dir("llama")))
    stray = torch.nn.ModuleList([torch.nn.Identity() for _ in target.layout.layers])
    layout = TargetLayout(target.layout.embed, stray, target.layout.norm, target.layout.lm_head, target.layout.base)
    with pytest.raises(CaptureError, match="did not fire for layer2.out"):
        capture(layout, [CapturePoint.layer_out(2), CapturePoint.parse("final")], torch.zeros(1, 3, dtype=torch.long))


def test_hook_firing_twice_is_an_error(tiny_target_dir):
    target = load_target(str(tiny_target_dir("llama")))
    hooks = CaptureHooks(target.layout, [CapturePoint.parse("embed")])
    with hooks, torch.inference_mode():
        target.layout.embed(torch.zeros(1, 2, dtype=torch.long))
        with pytest.raises(CaptureError, match="ran twice"):
            target.layout.embed(torch.zeros(1, 2, dtype=torch.long))


def test_unsupported_family_and_bad_paths(tmp_path, tokenizer_dir):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(TargetError, match="supported families: llama, qwen2, mistral"):
        load_target(str(tmp_path / "gpt2"))
    with pytest.raises(TargetError, match="does not exist"):
        load_target(str(tmp_path / "missing.gguf"))
    with pytest.raises(TargetError, match="no config.json"):
        load_target(str(tmp_path))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(TargetError, match="cannot read the config"):
        load_target(str(tmp_path / "broken"))


def test_fingerprint_tells_weights_apart(tmp_path, tokenizer_dir):
    from conftest import build_tiny_target

    a = load_target(str(build_tiny_target(tmp_path / "a", "llama", tokenizer_dir, seed=0)))
    b = load_target(str(build_tiny_target(tmp_path / "b", "llama", tokenizer_dir, seed=1)))
    assert a.fingerprint["config_sha256"] == b.fingerprint["config_sha256"]
    assert a.fingerprint["tokenizer_sha256"] == b.fingerprint["tokenizer_sha256"]
    assert a.fingerprint["weights_sha256"] != b.fingerprint["weights_sha256"]


def test_a_gguf_path_is_the_same_target_as_the_embedded_name(smollm2):
    from eaglewire.target import fingerprint_mismatches, smollm2_gguf_path

    by_path = load_target(str(smollm2_gguf_path()))
    assert by_path.name.endswith(".gguf")
    assert fingerprint_mismatches(by_path.fingerprint, smollm2.fingerprint) == []


def test_tokenizer_fingerprint_follows_behaviour_not_serialization(tokenizer_dir):
    """Library versions re-serialize one tokenizer differently; the hash must not move, but a
    tokenizer that maps text to other ids must."""
    from transformers import AutoTokenizer

    from eaglewire.target import tokenizer_sha256

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    reference = tokenizer_sha256(tok)
    tok.backend_tokenizer.decoder = None  # a serialization change that leaves text -> ids alone
    assert tokenizer_sha256(tok) == reference
    tok.add_tokens(["<extra_marker>"])
    assert tokenizer_sha256(tok) != reference
