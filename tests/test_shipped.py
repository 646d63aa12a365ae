"""The drafter shipped for the embedded target: strict load, fingerprint, size, and live agreement."""

from __future__ import annotations

import json

import pytest
import torch

from eaglewire.data.capture import capture
from eaglewire.drafter.checkpoint import load_checkpoint
from eaglewire.drafter.shipped import MAX_BYTES, ShippedDrafterError, shipped_drafter
from eaglewire.train.ttt import teacher_targets, unroll
from eaglewire.wiring import CapturePoint, Wiring


@pytest.fixture(scope="module")
def shipped(smollm2):
    return load_checkpoint(shipped_drafter("smollm2-135m"), smollm2.layout.embed)


def test_shipped_checkpoint_is_small_strict_and_for_this_target(smollm2, shipped):
    folder = shipped_drafter("smollm2-135m")
    assert sum(f.stat().st_size for f in folder.iterdir() if f.name in ("config.json", "model.safetensors")) <= MAX_BYTES
    assert shipped.drafter.fc.weight.dtype == torch.float16
    shipped.meta.check_target(smollm2.fingerprint)
    assert shipped.meta.wiring == Wiring.default(smollm2.num_layers)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM convention
    report = (folder / "REPORT.md").read_text()
    assert "Held-out top-1 agreement" in report and (folder / "curves.png").stat().st_size > 1000
    with pytest.raises(ShippedDrafterError, match="no drafter is shipped for target 'other'"):
        shipped_drafter("other")


def _agreement(smollm2, drafter, ids, mask, points) -> list[float]:
    """Per draft position, how often the drafter's top-1 equals the target's on the masked tokens."""
    captured = capture(smollm2.layout, (*points, CapturePoint.parse("final")), ids[None])
    aux = torch.cat([captured[p][0] for p in points], dim=-1)
    teacher = teacher_targets(captured[CapturePoint.parse("final")][0], smollm2.layout.lm_head.weight, drafter.t2d)
    with torch.no_grad():
        logits = unroll(drafter, ids, aux, 3)
    out = []
    for k, step in enumerate(logits, start=1):
        valid = len(ids) - 1 - k
        drafted = drafter.draft_to_target(step[:valid].argmax(-1))
        m = mask[k + 1: k + 1 + valid]
        out.append(float(((drafted == teacher.top1[k: k + valid]) & m).sum() / m.sum()))
    return out


def test_shipped_drafter_agrees_with_the_live_target_only_under_its_wiring(smollm2, shipped):
    """Values, not shapes, prove the wiring: on the target's own greedy answer the drafter predicts the
    target's next token more often when fed its trained wiring than when fed a plausible miswiring."""
    messages = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]
    prompt = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)["input_ids"]
    with torch.inference_mode():
        ids = smollm2.model.generate(prompt, max_new_tokens=64, do_sample=False)[0]
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[prompt.shape[1]:] = True
    wiring = shipped.meta.wiring
    drafter = load_checkpoint(shipped_drafter("smollm2-135m"), smollm2.layout.embed).drafter.float()
    good = _agreement(smollm2, drafter, ids, mask, wiring.aux)
    shifted = _agreement(smollm2, drafter, ids, mask, tuple(CapturePoint(p.depth + 1) for p in wiring.aux))
    final_only = _agreement(smollm2, drafter, ids, mask, (CapturePoint.parse("final"),) * 3)
    # Measured with the shipped drafter: trained 0.25 / shifted 0.17 / final-only 0.05 at position 1 (64 tokens).
    # Adjacent layers are near-identical tensors, so a one-layer shift costs less than a wrong kind of state.
    assert good[0] >= 0.2, good
    assert good[0] > shifted[0], (good, shifted)
    assert good[0] >= final_only[0] + 0.15, (good, final_only)
