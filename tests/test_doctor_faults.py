"""eaglewire doctor, a second fault suite: faults the first suite's doctor missed or misnamed.

Each fault is injected the way a real pipeline would produce it, and the doctor must name its
cause, not only fail: a swap in later samples only (a bad later shard, another rank), hidden
states shifted one position against their tokens (all of them, or the aux ones only), hidden
states computed under another system prompt than the stored input_ids, weights edited after
training, and foreign folders examined without --format. The good setup (a tiny random Llama
target, its own greedy data in two shards, a drafter trained on it) comes from test_doctor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import test_doctor as first_suite
import torch
from conftest import EAGLEWIRE
from safetensors import safe_open
from safetensors.torch import save_file
from test_doctor import (
    DEFAULT_SYSTEM,
    FAST,
    copy_checkpoint,
    doctor,
    edit_config,
    edit_weights,
)

from eaglewire.data.capture import capture
from eaglewire.data.samples import SampleRef
from eaglewire.data.shards import HIDDEN_PREFIX
from eaglewire.doctor.checks import (
    FAIL,
    PASS,
    SKIPPED,
    DoctorConfig,
    DoctorError,
    format_report,
    run_doctor_detected,
)
from eaglewire.doctor.evidence import (
    SharedPrefix,
    between_samples_variance,
    detectable_drop,
    matched_samples,
    positions_to_detect,
)
from eaglewire.doctor.state import (
    MATCH_MIN_TOKENS,
    OFFLINE_DETECT_DROP,
    OFFLINE_POWER_Z,
    OFFLINE_Z,
)
from eaglewire.files import sha256_file
from eaglewire.wiring import all_points

# The first suite's good setup (module-scoped fixtures, built once more for this module).
good, tiny, tiny_dir = first_suite.good, first_suite.tiny, first_suite.tiny_dir

AUX = ("layer1.out", "layer2.out", "layer4.out")
STORED = (*AUX, "final")


# ---- writing faulty data ---------------------------------------------------------------------


Change = Callable[[int, torch.Tensor, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def rewrite_samples(data: Path, tmp: Path, target, change: Change) -> Path:
    """A copy of ``data`` in which ``change(record, input_ids, truth)`` (truth: every capture point of the
    target on the sample's tokens) returns the tensors to store per label. Shards are re-hashed into the
    manifest and the probe is kept: the faulty tool hashed its own output and ran the probe correctly."""
    out = Path(shutil.copytree(data, tmp / "data"))
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["shards"]:
        path = out / entry["file"]
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        offsets, records = tensors["offsets"].tolist(), tensors["record_index"].tolist()
        for s, record in enumerate(records):
            a, b = offsets[s], offsets[s + 1]
            ids = tensors["input_ids"][a:b].long()
            truth = {str(p): t[0] for p, t in capture(target.layout, all_points(target.num_layers), ids[None]).items()}
            for label, value in change(record, ids, truth).items():
                key = HIDDEN_PREFIX + label
                tensors[key][a:b] = value.to(tensors[key].dtype)
        save_file(tensors, path, metadata=metadata)
        entry["sha256"], entry["bytes"] = sha256_file(path), path.stat().st_size
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def later_shard_records(data: Path) -> list[int]:
    """The record indices of every shard after the first."""
    manifest = json.loads((data / "manifest.json").read_text())
    records = []
    for entry in manifest["shards"][1:]:
        with safe_open(str(data / entry["file"]), framework="pt") as handle:
            records += handle.get_tensor("record_index").tolist()
    return records


def shifted(value: torch.Tensor, by: int = 1) -> torch.Tensor:
    """``value`` moved ``by`` positions later: token t gets what token t - by had (the first keep theirs),
    as a loader does that pairs states and ids after slicing only one of them."""
    out = value.clone()
    out[by:] = value[:-by]
    return out


def tensors_failure(report, causes: list[str]):
    """numbers.tensors failed with exactly ``causes``; returns its result."""
    result = report.result("numbers.tensors")
    assert result.status == FAIL, format_report(report)
    assert result.data["causes"] == causes, (result.data["causes"], result.detail)
    return result


# ---- 1. every sample is checked, and a swap in later samples is named a swap -------------------


def test_a_swap_in_later_samples_only_is_found_and_named_a_swap(good, tiny, tmp_path):
    later = later_shard_records(good.data)
    assert later, "the good data must span two shards"
    swap = {"layer1.out": "layer2.out", "layer2.out": "layer1.out"}
    data = rewrite_samples(good.data, tmp_path, tiny, lambda record, ids, truth: (
        {label: truth[actual] for label, actual in swap.items()} if record in later else {}))
    report = doctor(good.checkpoint, data, tiny)
    result = tensors_failure(report, ["relabelled"])
    checked = result.data["samples"]
    assert checked == result.data["dataset_samples"], result.data  # every sample, not the first 4
    span = f"records {min(later)}-{max(later)}"
    assert f"in {len(later)} of {checked} samples checked ({span}" in result.detail, result.detail
    assert "the aux order is swapped: the data stores layer2.out under the label layer1.out" in result.detail
    assert "the data stores layer1.out under the label layer2.out" in result.detail
    assert "aux order swapped" in result.fix and "noise" not in result.fix
    assert [g["records"] for g in result.data["groups"]] == [sorted(later)]
    rows = {r["label"]: r for r in result.data["rows"]}
    assert rows["layer1.out"]["samples_wrong"] == len(later) and not rows["layer1.out"]["ok"]
    assert rows["layer4.out"]["ok"] and rows["final"]["ok"]
    assert f"not layer1.out in {len(later)} of {checked} samples" in format_report(report)


# ---- 2. misalignment named as misalignment ---------------------------------------------------


@pytest.mark.parametrize("which", ["all", "aux"])
def test_states_shifted_one_position_against_their_tokens_are_named_misaligned(which, good, tiny, tmp_path):
    labels = STORED if which == "all" else AUX
    data = rewrite_samples(good.data, tmp_path, tiny,
                           lambda record, ids, truth: {label: shifted(truth[label]) for label in labels})
    report = doctor(good.checkpoint, data, tiny)
    result = tensors_failure(report, ["misaligned"])
    head = ("every stored tensor" if which == "all" else
            "layer1.out, layer2.out, layer4.out (while final is in place)")
    assert f"in all {result.data['samples']} samples checked: misaligned: {head} shifted 1 position against the " \
           "stored tokens: the value stored at token t is the target's layer1.out at token t-1" in result.detail, \
        result.detail
    assert "do not belong to the stored tokens" in result.fix
    assert "noise" not in result.detail + result.fix and "another model" not in result.detail + result.fix
    assert "matches no tensor" not in result.detail and "closest" not in result.detail
    assert report.result("numbers.probe").status == PASS  # the tool ran the probe right; only the pairing is off


def test_states_from_another_system_prompt_do_not_belong_to_their_tokens(good, tiny, tmp_path):
    tokenizer = tiny.tokenizer
    system = tokenizer(DEFAULT_SYSTEM, add_special_tokens=False)["input_ids"]
    other = tokenizer("You are a terse assistant who answers in as few words as you can, always and everywhere",
                      add_special_tokens=False)["input_ids"][: len(system)]
    assert len(other) == len(system) and other[:3] == system[:3] and other[3] != system[3]
    first_difference = []

    def other_prompt(record, ids, truth):
        start = next(i for i in range(len(ids)) if ids[i: i + len(system)].tolist() == system)
        rendered = ids.clone()
        rendered[start: start + len(system)] = torch.tensor(other)
        first_difference.append(start + 3)
        states = capture(tiny.layout, all_points(tiny.num_layers), rendered[None])
        return {str(p): t[0] for p, t in states.items() if str(p) in STORED}

    data = rewrite_samples(good.data, tmp_path, tiny, other_prompt)
    report = doctor(good.checkpoint, data, tiny)
    result = tensors_failure(report, ["misaligned"])
    at = first_difference[0]
    assert ("the tensors do not belong to these tokens: every stored tensor equals the target's on the first "
            f"{at} tokens") in result.detail, result.detail
    assert "all at once: they were computed on another text than the stored input_ids (another system prompt" \
        in result.detail
    assert f"{tokenizer.decode(system[3:4])!r}" in result.detail  # the first token that differs, decoded
    assert "closest" not in result.detail and "noise" not in result.fix


# ---- 3. weights edited after training --------------------------------------------------------


def test_a_weights_edit_after_training_is_named(good, tiny, tmp_path):
    assert doctor(good.checkpoint, None, tiny).result("checkpoint.weights_hash").status == PASS
    folder = edit_weights(copy_checkpoint(good, tmp_path),
                          lambda t: t.update({"norm.weight": torch.ones_like(t["norm.weight"])}))
    report = doctor(folder, None, tiny)
    result = report.result("checkpoint.weights_hash")
    assert result.status == FAIL, format_report(report)
    assert "norm.weight changed since the checkpoint was saved (now all ones, as a freshly initialised norm)" \
        in result.detail
    assert "edited after training" in result.fix
    assert report.result("checkpoint.load").status == PASS  # the file itself is a valid drafter


def test_a_checkpoint_saved_before_the_hash_is_skipped_not_failed(good, tiny, tmp_path):
    folder = edit_config(copy_checkpoint(good, tmp_path), lambda c: c["eaglewire"].pop("tensors_sha256"))
    report = doctor(folder, None, tiny)
    result = report.result("checkpoint.weights_hash")
    assert result.status == SKIPPED and "records no hash of its tensors" in result.detail, result
    assert report.result("checkpoint.load").status == PASS


def test_the_hash_ignores_the_file_layout(good, tiny, tmp_path):
    """Rewriting the same tensors (another header order, other metadata) is no edit."""
    folder = edit_weights(copy_checkpoint(good, tmp_path), lambda t: None)
    assert doctor(folder, None, tiny).result("checkpoint.weights_hash").status == PASS


# ---- 4. foreign folders without --format -----------------------------------------------------


def detected(folder, tiny, engine="eaglewire", data=None):
    cfg = DoctorConfig(checkpoint=str(folder), target=str(tiny.name), data=data, **{**FAST, "engine": engine})
    return run_doctor_detected(cfg)


def test_a_speculators_folder_is_recognised_without_format(good, tiny, tiny_dir, tmp_path):
    from eaglewire.interop.formats import export_checkpoint

    spec = export_checkpoint(good.checkpoint, "speculators", tmp_path / "spec", verifier=str(tiny_dir),
                             target=tiny).out
    report = detected(spec, tiny, engine="vllm", data=good.data)
    assert report.exit_code == 0, format_report(report)
    fmt = report.result("checkpoint.format")
    assert fmt.status == PASS and "read as a speculators folder, from a speculators config" in fmt.detail, fmt
    assert report.result("checkpoint.serving").status == PASS
    assert report.result("numbers.tensors").status == PASS


def test_an_eagle3_folder_is_read_as_the_named_engine_serves_it(good, tiny, tmp_path):
    from eaglewire.interop.formats import export_checkpoint

    vllm = export_checkpoint(good.checkpoint, "vllm", tmp_path / "vllm").out
    report = detected(vllm, tiny)  # no --engine: only vLLM finds ids where it reads them (top level)
    fmt = report.result("checkpoint.format")
    assert fmt.status == PASS and "read as a vllm folder" in fmt.detail and "only vllm finds" in fmt.detail, fmt
    assert report.result("checkpoint.load").status == PASS, format_report(report)
    served = detected(vllm, tiny, engine="sglang")  # SGLang reads eagle_config only, where vLLM's export has none
    assert "read as a sglang folder, from an EAGLE-3 Llama config, read as --engine sglang" in \
        served.result("checkpoint.format").detail
    assert served.result("checkpoint.load").status == FAIL, format_report(served)


def test_speculators_key_confusion_reaches_the_weights_check(good, tiny, tiny_dir, tmp_path):
    """A speculators config without speculators_model_type, over weights named midlayer.*: the config
    error is reported, and so is the key problem behind it."""
    from eaglewire.interop.formats import export_checkpoint

    spec = export_checkpoint(good.checkpoint, "speculators", tmp_path / "spec", verifier=str(tiny_dir),
                             target=tiny).out
    edit_config(spec, lambda c: c.pop("speculators_model_type"))
    edit_weights(spec, lambda t: t.update({"midlayer." + k.removeprefix("layers.0."): t.pop(k)
                                           for k in [k for k in t if k.startswith("layers.0.")]}))
    report = detected(spec, tiny, engine="vllm")
    assert report.exit_code == 1
    assert "a speculators config (architectures Eagle3Speculator, speculators_config, transformer_layer_config)" \
        in report.result("checkpoint.format").detail
    assert report.result("checkpoint.load").status == FAIL
    keys = report.result("checkpoint.keys")
    assert keys.status == FAIL, format_report(report)
    assert "names the decoder layer midlayer.* (EAGLE, SpecForge, SGLang and vLLM naming), but speculators 0.9.0 " \
           "loads the decoder layer as layers.0.*" in keys.detail, keys.detail
    assert "random initialisation" in keys.detail and "rename the decoder layer's weights to layers.0.*" in keys.fix


# ---- 5. vLLM's lookup order comes from stacks.py ----------------------------------------------


def test_vllm_reads_the_top_level_ids_before_eagle_config(good, tiny, tmp_path):
    """Top-level ids right, eagle_config's wrong: vLLM (both runners) captures the trained wiring, SGLang
    does not; the doctor says which ids each engine reads."""
    folder = edit_config(copy_checkpoint(good, tmp_path),
                         lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}))
    vllm = doctor(folder, None, tiny, engine="vllm").result("checkpoint.engine_config")
    assert "vllm reads ids [2, 3, 5]: under vllm they capture layer1.out,layer2.out,layer4.out" in vllm.detail, vllm
    assert "disagrees with eagle_config's [0, 1, 3]" in vllm.detail
    sglang = doctor(folder, None, tiny, engine="sglang", engine_version="pre-25454").result("checkpoint.engine_config")
    assert sglang.status == FAIL and "sglang reads ids [0, 1, 3]" in sglang.detail, sglang
    assert f"but the drafter was trained on {','.join(AUX)}" in sglang.detail


# ---- 6. offline acceptance with power --------------------------------------------------------


def test_the_offline_check_is_sized_to_detect_a_005_drop():
    assert 690 <= positions_to_detect(0.35) <= 700  # binomial, two-sided 5%, 80% power
    assert max(positions_to_detect(p / 100) for p in range(5, 100)) <= 785
    assert detectable_drop(0.35, positions_to_detect(0.35)) == pytest.approx(0.05, abs=0.002)
    assert detectable_drop(0.35, 405) > 0.06  # the one held-out conversation the issue measured on


def test_the_spread_between_conversations_widens_the_offline_margin():
    """Positions of one conversation are not independent draws. The shipped drafter on four held-out third-turn
    conversations of its own answers (correctly wired) scored 0.759 / 0.862 / 0.853 / 0.766 against 0.830
    recorded: pooled 0.804, a drop of 0.026 that the binomial margin over 2,436 positions (~0.017) failed."""
    counted = [601.0, 465.0, 593.0, 777.0]
    hits = [round(a * n) for a, n in zip([0.759, 0.862, 0.853, 0.766], counted)]
    p, positions = 0.830, sum(counted)
    binomial = p * (1 - p) / positions
    between = between_samples_variance(hits, counted)
    assert p - sum(hits) / positions > OFFLINE_Z * binomial**0.5  # the old margin: a false failure
    assert between > 2 * binomial and p - sum(hits) / positions < OFFLINE_Z * between**0.5
    assert (OFFLINE_Z + OFFLINE_POWER_Z) * between**0.5 > OFFLINE_DETECT_DROP  # four such samples are too few


def test_the_spread_between_conversations_is_that_of_the_pooled_ratio():
    assert between_samples_variance([30.0], [100.0]) == 0.0  # one sample cannot show its spread
    assert between_samples_variance([30.0, 60.0, 15.0], [100.0, 200.0, 50.0]) == 0.0  # equal accuracies
    # k/(k-1) * sum((h_i - a n_i)^2) / N^2 with a = 0.5: 2 * (10^2 + 10^2) / 200^2
    assert between_samples_variance([60.0, 40.0], [100.0, 100.0]) == pytest.approx(0.01)


def test_offline_states_its_power(good, tiny):
    offline = doctor(good.checkpoint, good.data, tiny).result("acceptance.offline")
    assert offline.status == PASS, offline
    data = offline.data
    assert data["positions_needed"] == positions_to_detect(data["recorded"][0])
    assert data["samples"] == data["held_out_samples"] == len(data["per_sample_accuracy"]) == 1  # of 12 records
    assert data["powered"] is (data["positions"] >= data["positions_needed"])  # one sample shows no spread
    if not data["powered"]:  # 12 records hold one held-out sample
        assert "UNDERPOWERED" in offline.detail and f"needs {data['positions_needed']} positions" in offline.detail


# ---- the sample selection --------------------------------------------------------------------


def test_samples_are_spread_over_every_shard_within_the_budget():
    refs = [SampleRef(i, torch.zeros(500, dtype=torch.long), torch.ones(500, dtype=torch.bool), f"s{i // 100}", 0)
            for i in range(1000)]
    chosen, per = matched_samples(refs, budget=8192, max_tokens=512)
    assert len(chosen) * per <= 8192 + 10 * MATCH_MIN_TOKENS and per >= MATCH_MIN_TOKENS
    assert {r.shard for r in chosen} == {f"s{i}" for i in range(10)}
    for shard in range(10):
        mine = [r.record_index for r in chosen if r.shard == f"s{shard}"]
        assert min(mine) == shard * 100 and max(mine) == shard * 100 + 99
    small, per = matched_samples(refs[:30], budget=8192, max_tokens=512)
    assert len(small) == 30 and per == 8192 // 30


def test_a_shared_prefix_runs_once_and_changes_no_value(tiny):
    prefix = torch.arange(1000, 1012)
    sequences = [torch.cat([prefix, torch.randint(2000, 3000, (n,))]) for n in (5, 9, 7)]
    shared = SharedPrefix(tiny, all_points(tiny.num_layers), sequences)
    assert shared.length == 12
    for ids in sequences:
        full = capture(tiny.layout, all_points(tiny.num_layers), ids[None])
        cached = shared.capture(ids)
        for point, value in full.items():
            torch.testing.assert_close(cached[str(point)], value[0], rtol=1e-4, atol=1e-4)


def test_the_cli_recognises_a_foreign_folder_without_format(good, tiny, tiny_dir, tmp_path):
    from eaglewire.interop.formats import export_checkpoint

    spec = export_checkpoint(good.checkpoint, "speculators", tmp_path / "spec", verifier=str(tiny_dir),
                             target=tiny).out
    run = subprocess.run([EAGLEWIRE, "doctor", str(spec), "--target", str(tiny_dir), "--engine", "vllm",
                          "--live-prompts", "1", "--live-tokens", "8", "--json"], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    results = {r["name"]: r for r in json.loads(run.stdout)["results"]}
    assert results["checkpoint.format"]["status"] == "pass" and results["checkpoint.format"]["data"]["format"] == \
        "speculators"
    assert results["checkpoint.serving"]["status"] == "pass"


def test_samples_wrong_the_same_way_are_one_group_whatever_their_closest_candidate():
    from types import SimpleNamespace

    from eaglewire.doctor.evidence import _describe_group, _group_verdicts
    from eaglewire.doctor.tensor_match import SampleVerdict

    labels = [("aux[0] layer1.out", "layer1.out"), ("teacher final", "final")]
    refs = [SampleRef(i, torch.arange(10), torch.ones(10, dtype=torch.bool), "s0", 0) for i in range(6)]
    verdicts = [(r, {"aux[0] layer1.out": SampleVerdict("unmatched", f"layer{r.record_index % 3}.out", 0.5),
                     "teacher final": SampleVerdict("ok" if r.record_index < 4 else "relabelled", "layer5.out", 0.001)})
                for r in refs]
    groups = _group_verdicts(verdicts, labels)
    assert [[r.record_index for r in group] for _, group in groups] == [[0, 1, 2, 3], [4, 5]]
    text, causes = _describe_group(*groups[1], 6, labels, SimpleNamespace())
    assert text.startswith("in 2 of 6 samples checked (records 4-5; shards s0): the data stores layer5.out under the "
                           "label final") and causes == ["relabelled", "unmatched"], text


# ---- a served acceptance figure explained -----------------------------------------------------


def test_an_observed_accept_length_is_explained_by_the_wiring_that_predicts_it(good, tiny):
    """The declared wiring's own prediction passes; a figure of 1.0 (nothing accepted) is explained by
    miswirings, not by the declared wiring, and the fix names the best one."""
    report = doctor(good.checkpoint, None, tiny, observed_accept_len=1.0)
    observed = report.result("acceptance.observed")
    assert observed.status == FAIL, format_report(report)
    rows = observed.data["rows"]
    declared = next(r for r in rows if r["description"] == "declared")
    assert declared["predicted_accept_len"] > 1.5 and declared["interval"][0] > 1.0, declared
    assert rows[0]["description"] != "declared" and abs(rows[0]["z"]) <= abs(declared["z"])
    assert "which does not explain it. Best explanations:" in observed.detail
    assert "the serving engine most likely feeds the drafter" in observed.fix
    again = doctor(good.checkpoint, None, tiny, observed_accept_len=round(declared["predicted_accept_len"], 2))
    assert again.result("acceptance.observed").status == PASS, format_report(again)
    assert "the declared wiring explains it" in again.result("acceptance.observed").detail
    higher = doctor(good.checkpoint, None, tiny, observed_accept_len=4.0).result("acceptance.observed")
    if declared["interval"][1] < 4.0:
        assert higher.status == PASS and "above the declared wiring's prediction" in higher.detail, higher
    assert "acceptance.observed" not in {r.name for r in doctor(good.checkpoint, None, tiny).results}
    with pytest.raises(DoctorError, match="--observed-accept-len must lie in"):
        DoctorConfig(checkpoint=str(good.checkpoint), observed_accept_len=5.0)
