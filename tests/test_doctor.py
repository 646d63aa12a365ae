"""eaglewire doctor: fault injection. A good drafter and dataset pass; each failure mode of docs/ARCHITECTURE.md,
injected the way the real faulty tool would produce it, fails the check that should catch it, with a
detail that names the tensors involved.

The good setup is a tiny random Llama target with peaked next-token distributions, a dataset of its own
greedy continuations (as EAGLE data regeneration does; its tokens are the ones the target predicts, so a
512-token draft vocabulary covers them) and a drafter trained on it to ~0.94 held-out accuracy. The real
SmolLM2 target checks the matching metric on every adjacent layer pair, runs the doctor on the shipped
drafter, and shows the live check naming the wiring a drafter was really trained on.
"""

from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import EAGLEWIRE, build_tiny_target, conversation, write_jsonl
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eaglewire.data.capture import capture
from eaglewire.data.extract import ExtractConfig, run_extract
from eaglewire.data.probe import run_probe
from eaglewire.data.shards import HIDDEN_PREFIX
from eaglewire.doctor.checks import (
    FAIL,
    PASS,
    SKIPPED,
    DoctorConfig,
    DoctorError,
    format_report,
    run_doctor,
)
from eaglewire.doctor.evidence import miswirings
from eaglewire.doctor.tensor_match import MATCH_TOLERANCE, relative_error
from eaglewire.files import sha256_file
from eaglewire.target import load_target
from eaglewire.train.loop import TrainConfig, run_train
from eaglewire.wiring import Wiring, all_points

WIRING = "layer1.out,layer2.out,layer4.out"
TRAINED = WIRING  # what the good drafter was trained on
TOPICS = ["the sea", "a red fox", "winter rain", "old trains", "green tea", "city lights", "paper boats", "a quiet road"]
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
FAST = dict(engine="vllm", live_prompts=2, live_tokens=24)  # the live check is shown on SmolLM2 below


# ---- the good setup --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer_dir):
    return build_tiny_target(tmp_path_factory.mktemp("doctor-target"), "llama", tokenizer_dir, lm_head_scale=200.0)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_target(str(tiny_dir))


@dataclass
class Good:
    conversations: Path  # the jsonl the data was extracted from
    data: Path
    checkpoint: Path


@pytest.fixture(scope="module")
def good(tmp_path_factory, tiny) -> Good:
    root = tmp_path_factory.mktemp("doctor-good")
    tokenizer, records = tiny.tokenizer, []
    for i in range(12):  # record 0 is held out; its prompt recurs in training, as duplicates do in real data
        prompt = f"Tell me about {TOPICS[i % len(TOPICS)]}."
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=False)
        with torch.no_grad():
            out = tiny.model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        records.append(conversation(prompt, tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
    conversations = write_jsonl(root / "chat.jsonl", records)
    run_extract(ExtractConfig(data=str(conversations), out=root / "data", target=tiny.name, wiring=WIRING,
                              shard_records=8, dtype="bf16", progress=False), target=tiny)
    run_train(TrainConfig(out=root / "run", data=str(root / "data"), target=tiny.name, draft_vocab=512, steps=80,
                          batch_tokens=100_000, lr=3e-3, warmup_steps=5, ttt_steps=2, eval_every=80, save_every=80,
                          progress=False), target=tiny)
    return Good(conversations, root / "data", root / "run" / "checkpoint")


def doctor(checkpoint, data, target, **options):
    return run_doctor(DoctorConfig(checkpoint=str(checkpoint), data=data, **{**FAST, **options}), target=target)


def test_good_drafter_and_data_pass(good, tiny, tmp_path):
    report = doctor(good.checkpoint, good.data, tiny, out=tmp_path / "report")
    assert report.exit_code == 0, format_report(report)
    statuses = {r.name: r.status for r in report.results}
    ran = [name for name, status in statuses.items() if status != SKIPPED]
    assert set(statuses) - set(ran) <= {"acceptance.live"}, statuses  # live may be inconclusive on a tiny target
    offline = report.result("acceptance.offline").data
    assert offline["recorded"][0] > 0.8 and abs(offline["measured"][0] - offline["recorded"][0]) < 0.05, offline
    rows = report.result("numbers.tensors").data["rows"]
    assert [r["best"] for r in rows] == ["layer1.out", "layer2.out", "layer4.out", "final"]
    assert all(r["error"] < 0.005 < MATCH_TOLERANCE < r["next_error"] for r in rows), rows
    text = format_report(report)
    assert "ok    stored aux[0] layer1.out = layer1.out, rel. error 0.00" in text and "; next best layer" in text
    assert (tmp_path / "report" / "tensor_match.png").stat().st_size > 5000
    saved = json.loads((tmp_path / "report" / "doctor.json").read_text())
    assert saved["ok"] and saved["counts"]["fail"] == 0


# ---- injection helpers -----------------------------------------------------------------------


def copy_checkpoint(good: Good, tmp: Path) -> Path:
    return Path(shutil.copytree(good.checkpoint, tmp / "checkpoint"))


def edit_weights(folder: Path, edit: Callable[[dict], None]) -> Path:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def edit_config(folder: Path, edit: Callable[[dict], None]) -> Path:
    path = folder / "config.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))
    return folder


def rewrite_data(good: Good, tmp: Path, target, stores: dict[str, str] | None = None, noise: float = 0.0,
                 rehash: bool = True) -> Path:
    """A copy of the good data as a faulty assembly tool would write it: label -> the tensor it really stores
    (``stores``), or Gaussian noise of ``noise`` x each token's RMS added to the aux tensors. Shards are
    re-hashed into the manifest and, for relabelled tensors, the probe is recorded from the same wrong
    tensors, as the tool would (``rehash=False``: a tool that forgot the manifest)."""
    out = Path(shutil.copytree(good.data, tmp / "data"))
    manifest = json.loads((out / "manifest.json").read_text())
    aux = manifest["settings"]["wiring"]["aux"]
    generator = torch.Generator().manual_seed(0)
    for entry in manifest["shards"]:
        path = out / entry["file"]
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        offsets = tensors["offsets"].tolist()
        for a, b in zip(offsets[:-1], offsets[1:]):
            ids = tensors["input_ids"][a:b].long()[None]
            truth = {str(p): t[0] for p, t in capture(target.layout, all_points(target.num_layers), ids).items()}
            for label, actual in (stores or {}).items():
                key = HIDDEN_PREFIX + label
                tensors[key][a:b] = truth[actual].to(tensors[key].dtype)
            for label in aux if noise else ():
                key = HIDDEN_PREFIX + label
                x = tensors[key][a:b].float()
                rms = x.pow(2).mean(-1, keepdim=True).sqrt()
                tensors[key][a:b] = (x + noise * rms * torch.randn(x.shape, generator=generator)).to(x.dtype)
        save_file(tensors, path, metadata=metadata)
        if rehash:
            entry["sha256"], entry["bytes"] = sha256_file(path), path.stat().st_size
    if stores:
        fresh = run_probe(target, tuple(all_points(target.num_layers)))
        for label, actual in stores.items():
            manifest["probe"]["tensors"][label] = fresh["tensors"][actual]
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def extract_with(good: Good, tmp: Path, target_dir: Path) -> Path:
    other = load_target(str(target_dir))
    run_extract(ExtractConfig(data=str(good.conversations), out=tmp / "data", target=other.name, wiring=WIRING,
                              shard_records=8, dtype="bf16", progress=False), target=other)
    return tmp / "data"


def variant_target(tmp: Path, tiny_dir: Path, edit: Callable[[Path], None]) -> Path:
    folder = Path(shutil.copytree(tiny_dir, tmp / "variant-target"))
    edit(folder)
    return folder


def quantize_q4(folder: Path) -> None:
    """Symmetric 4-bit per-row round trip of every matrix (a Q4 build of the same model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                scale = param.abs().amax(dim=1, keepdim=True) / 7
                param.copy_((param / scale).round() * scale)
    model.save_pretrained(folder)


def other_chat_template(folder: Path) -> None:
    path = folder / "chat_template.jinja"
    path.write_text(path.read_text().replace(DEFAULT_SYSTEM, "You are a concise assistant"))


def other_vocabulary(tensors: dict, keep_t2d: bool) -> None:
    """d2t (and t2d unless ``keep_t2d``) of another draft vocabulary of the same size."""
    ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"]
    stale = (ids + 7919) % tensors["t2d"].numel()
    stale = stale.sort().values
    tensors["d2t"] = stale - torch.arange(stale.numel())
    if not keep_t2d:
        t2d = torch.zeros_like(tensors["t2d"])
        t2d[stale] = True
        tensors["t2d"] = t2d


# ---- the faults ------------------------------------------------------------------------------


@dataclass
class Setup:
    good: Good
    tmp: Path
    tiny: object  # the loaded tiny target
    tiny_dir: Path
    tokenizer_dir: Path


@dataclass
class Fault:
    """``inject(setup)`` -> (checkpoint, data, doctor options); ``check`` must fail, its detail contain
    every string of ``names`` and its fix ``fix``; ``also`` lists further checks that must fail."""

    inject: Callable
    check: str
    names: tuple[str, ...]
    also: tuple[str, ...] = ()
    fix: str = ""  # must appear in the failing check's fix


def _ckpt(edit_w=None, edit_c=None, **options):
    def inject(s: Setup):
        folder = copy_checkpoint(s.good, s.tmp)
        if edit_w:
            edit_weights(folder, edit_w)
        if edit_c:
            edit_config(folder, edit_c)
        return folder, s.good.data, options
    return inject


def _data(**rewrite):
    def inject(s: Setup):
        return s.good.checkpoint, rewrite_data(s.good, s.tmp, s.tiny, **rewrite), {}
    return inject


def _from_target(edit):
    def inject(s: Setup):
        return s.good.checkpoint, extract_with(s.good, s.tmp, variant_target(s.tmp, s.tiny_dir, edit)), {}
    return inject


def _other_seed(s: Setup):
    other = build_tiny_target(s.tmp / "seed1", "llama", s.tokenizer_dir, seed=1, lm_head_scale=200.0)
    return s.good.checkpoint, extract_with(s.good, s.tmp, other), {}


def _rename_midlayer(tensors):
    for key in [k for k in tensors if k.startswith("midlayer.")]:
        tensors["layers.0." + key.removeprefix("midlayer.")] = tensors.pop(key)


def _ids_minus_one(config):
    ids = [i - 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"] = ids


def _fc_single_state(tensors):
    tensors["fc.weight"] = tensors["fc.weight"][:, -64:].contiguous()


def _claims_other_wiring(config):
    config["eaglewire"]["wiring"]["aux"] = ["layer2.out", "layer3.out", "layer4.out"]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"] = [3, 4, 5]


FAULTS = {
    # 1. speculators key names
    "keys renamed midlayer.* -> layers.0.*": Fault(
        _ckpt(edit_w=_rename_midlayer), "checkpoint.load", ("layers.0.", "midlayer.", "speculators")),
    # 2. engine ids off by one in config.json
    "engine ids off by one": Fault(
        _ckpt(edit_c=_ids_minus_one), "checkpoint.engine_config",
        ("[1, 2, 4]", "layer0.out,layer1.out,layer3.out", TRAINED), also=("consistency.wiring",), fix="[2, 3, 5]"),
    # 2b. ids written for vLLM, served by SGLang: its +1 shift reads id 5 as layer5.out, which it cannot reach
    "vllm ids served by sglang (pre-25454)": Fault(
        _ckpt(engine="sglang", engine_version="pre-25454"), "checkpoint.engine_config",
        ("[2, 3, 5]", "sglang-pre-25454 cannot capture ids [5]", TRAINED), fix="[1, 2, 4]"),
    "vllm ids served by sglang (version unknown)": Fault(
        _ckpt(engine="sglang"), "checkpoint.engine_config",
        ("SGLang builds disagree", "only sglang-post-25454 reads them as the trained wiring"), fix="[1, 2, 4]"),
    # 2c. ids only in eagle_config: vLLM 0.33.0's V2 runner (its default) reads the top level only
    "ids only in eagle_config, served by vllm": Fault(
        _ckpt(edit_c=lambda c: c.pop("eagle_aux_hidden_state_layer_ids")), "checkpoint.engine_config",
        ("vllm 0.33.0 (V2 runner) finds no ids", "captures its default layers"), also=("checkpoint.load",)),
    # 3. data assembly: the embedding in place of a layer, or every index one off
    "embed stored as layer1.out": Fault(
        _data(stores={"layer1.out": "embed"}), "numbers.tensors", ("embed under the label layer1.out",),
        also=("numbers.probe",)),
    "hidden_states sliced one off": Fault(
        _data(stores={"layer1.out": "layer0.out", "layer2.out": "layer1.out", "layer4.out": "layer3.out"}),
        "numbers.tensors", ("layer0.out under the label layer1.out", "layer1.out under the label layer2.out",
                            "layer3.out under the label layer4.out")),
    # 4. capture silently fell back to the final state
    "capture fell back to final": Fault(
        _data(stores={"layer1.out": "final", "layer2.out": "final", "layer4.out": "final"}), "numbers.tensors",
        ("final under the label layer1.out", "final under the label layer4.out"), also=("acceptance.offline",)),
    # 5. fc bypassed on equal widths
    "fc is H x H (fusion bypassed)": Fault(
        _ckpt(edit_w=_fc_single_state), "checkpoint.fc_width", ("[64, 64]", "ONE hidden state", "3 aux states"),
        also=("checkpoint.load",)),
    # 6. a plausible answer with wrong values
    "stored aux perturbed by noise": Fault(
        _data(noise=0.1), "numbers.tensors", ("stored as layer1.out match no tensor of this target (closest layer1.out",
                                               "stored as layer4.out match no tensor of this target (closest layer4.out")),
    # more: aux order swapped, another target, a quantization, another chat template, stale d2t, ...
    "aux order swapped in the data": Fault(
        _data(stores={"layer1.out": "layer2.out", "layer2.out": "layer1.out"}), "numbers.tensors",
        ("layer2.out under the label layer1.out", "layer1.out under the label layer2.out")),
    "data from another target (other seed)": Fault(
        _other_seed, "consistency.target", ("the data's target", "differs from the target", "weights"),
        also=("numbers.tensors", "numbers.probe"), fix="extract the data again"),
    "data from a Q4 quantization of the target": Fault(
        _from_target(quantize_q4), "consistency.target", ("the data's target", "weights"), also=("numbers.tensors",)),
    "data made with another chat template": Fault(
        _from_target(other_chat_template), "consistency.target", ("the data's target", "chat template"),
        also=("numbers.probe",)),
    "stale d2t (t2d current)": Fault(
        _ckpt(edit_w=lambda t: other_vocabulary(t, keep_t2d=True)), "checkpoint.vocab_maps",
        ("d2t and t2d disagree",), also=("checkpoint.load",)),
    "stale d2t and t2d (consistent, wrong)": Fault(
        _ckpt(edit_w=lambda t: other_vocabulary(t, keep_t2d=False)), "acceptance.offline", ("dropped by",)),
    "checkpoint claims another wiring than its data": Fault(
        _ckpt(edit_c=_claims_other_wiring), "consistency.wiring",
        ("the data (manifest): " + TRAINED, "the checkpoint (eaglewire section): layer2.out,layer3.out,layer4.out")),
    "shards rewritten without re-hashing": Fault(
        _data(stores={"layer1.out": "embed"}, rehash=False), "data.integrity", ("does not match its sha256",)),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_is_diagnosed(name, good, tiny, tiny_dir, tokenizer_dir, tmp_path):
    fault = FAULTS[name]
    checkpoint, data, options = fault.inject(Setup(good, tmp_path, tiny, tiny_dir, tokenizer_dir))
    report = doctor(checkpoint, data, tiny, **options)
    text = format_report(report)
    assert report.exit_code == 1, text
    result = report.result(fault.check)
    assert result.status == FAIL, text
    for expected in fault.names:
        assert expected in result.detail, (expected, result.detail)
    assert result.fix and fault.fix in result.fix, result
    for other in fault.also:
        assert report.result(other).status == FAIL, (other, text)


@pytest.mark.parametrize("name, training_data", [("stale d2t and t2d (consistent, wrong)", True),
                                                  ("capture fell back to final", False)])
def test_an_offline_drop_says_whether_the_data_is_the_training_data(name, training_data, good, tiny, tiny_dir,
                                                                    tokenizer_dir, tmp_path):
    """On other data than the drafter trained on, a drop may be the data's: the failure says so and how to tell."""
    checkpoint, data, options = FAULTS[name].inject(Setup(good, tmp_path, tiny, tiny_dir, tokenizer_dir))
    offline = doctor(checkpoint, data, tiny, **options).result("acceptance.offline")
    assert offline.status == FAIL and offline.data["training_data"] is training_data, offline
    assert ("not its training dataset" in offline.detail) is not training_data, offline.detail
    assert ("rerun with --data the dataset it was trained on" in offline.fix) is not training_data, offline.fix


def test_the_order_of_the_checks_changes_no_verdict(good, tiny, tmp_path):
    """The checks only read the state loaded before them: reversed or shuffled, they say the same. The fault
    makes consistency.wiring read what checkpoint.engine_config's engine captures, and acceptance.observed
    the continuations acceptance.live compares on."""
    import random
    from dataclasses import FrozenInstanceError

    from eaglewire.doctor.checks import CHECKS, run_checks
    from eaglewire.doctor.loading import load_state

    folder = edit_config(copy_checkpoint(good, tmp_path), _ids_minus_one)
    cfg = DoctorConfig(checkpoint=str(folder), data=good.data, observed_accept_len=1.0, **FAST)
    st, _ = load_state(cfg, folder, tiny)
    with pytest.raises(FrozenInstanceError):
        st.live = None

    def verdicts(checks):
        return {r.name: (r.status, r.detail, r.fix) for r in run_checks(st, checks)}

    in_order = verdicts(CHECKS)
    assert len(in_order) == len(CHECKS)
    wiring = in_order["consistency.wiring"]
    assert wiring[0] == FAIL and "vllm reading config.json ids [1, 2, 4]: layer0.out,layer1.out,layer3.out" in wiring[1]
    assert in_order["acceptance.observed"][0] != SKIPPED
    shuffled = list(CHECKS)
    random.Random(0).shuffle(shuffled)
    for order in (CHECKS[::-1], shuffled):
        assert verdicts(order) == in_order


def test_the_good_checkpoint_passes_each_engines_id_check(good, tiny):
    for engine, version in (("eaglewire", None), ("vllm", None), ("sglang", "post-25454")):
        report = doctor(good.checkpoint, None, tiny, engine=engine, engine_version=version)
        assert report.result("checkpoint.engine_config").status == PASS, format_report(report)
    with pytest.raises(DoctorError, match="pre-25454, post-25454"):
        DoctorConfig(checkpoint=str(good.checkpoint), engine="sglang", engine_version="0.5.13")


def test_a_two_layer_checkpoint_is_as_vllm_builds_it_but_not_as_sglang_does(good, tiny, tmp_path):
    """vLLM normalises a later layer's input with the input_layernorm the native file holds; SGLang with a
    hidden_norm it lacks, which it would load as ones without a word: the doctor says so and how to fix it."""
    from eaglewire.drafter.checkpoint import load_checkpoint, save_checkpoint
    from eaglewire.train.drafter_growth import with_num_layers

    loaded = load_checkpoint(good.checkpoint, tiny.layout.embed)
    deeper, _ = with_num_layers(loaded.drafter.float(), 2, tiny.layout.embed)
    folder = save_checkpoint(tmp_path / "deep", deeper, loaded.meta)
    for engine in ("eaglewire", "vllm"):
        result = doctor(folder, None, tiny, engine=engine).result("checkpoint.engine_config")
        assert result.status == PASS, result.detail
    sglang = doctor(folder, None, tiny, engine="sglang", engine_version="post-25454").result("checkpoint.engine_config")
    assert sglang.status == FAIL and "with its hidden_norm, which the folder lacks (layers.1.hidden_norm.weight" in \
        sglang.detail and "`eaglewire export --to sglang` writes it" in sglang.detail, sglang.detail


def test_sglang_ids_of_a_non_llama_target_are_judged_by_its_model_files_rule(tiny_target_dir, tmp_path):
    """Only SGLang's llama-family files differ between PR #25454 builds: a qwen3 target's ids written under
    qwen3.py's one rule pass without --engine-version, though a post-25454 build would read them otherwise."""
    from dataclasses import replace

    from test_doctor_server import random_drafter

    from eaglewire.drafter.checkpoint import load_checkpoint, save_checkpoint

    target = load_target(str(tiny_target_dir("qwen3")))
    folder = random_drafter(target, tmp_path / "random", wiring="layer2.out,layer3.out,layer4.out")
    loaded = load_checkpoint(folder, target.layout.embed)
    written = save_checkpoint(tmp_path / "sglang", loaded.drafter, replace(loaded.meta, convention="sglang-pre-25454"))
    result = doctor(written, None, target, engine="sglang").result("checkpoint.engine_config")
    assert result.status == PASS, result.detail
    assert "builds disagree" not in result.detail
    post = doctor(written, None, target, engine="sglang", engine_version="post-25454").result("checkpoint.engine_config")
    assert post.status == FAIL, post.detail  # the rule that does not apply to qwen3 would misread them


def test_sglang_on_a_family_it_cannot_capture_on_is_said_not_judged_by_some_rule(good, tiny, tmp_path):
    """A target family whose SGLang model file captures no aux states (llava), or whose rule eaglewire has
    not recorded, fails checkpoint.engine_config with that reason instead of being read by a rule that
    is not its own; --engine-version names the rule when the user knows it."""
    for family, reason in (("llava", "SGLang cannot capture aux states of a 'llava' target"),
                           ("mystery", "no SGLang id rule is recorded for 'mystery' targets")):
        folder = edit_config(copy_checkpoint(good, tmp_path / family),
                             lambda c: c["eaglewire"]["target"].update(model_type=family))
        result = doctor(folder, None, tiny, engine="sglang").result("checkpoint.engine_config")
        assert result.status == FAIL and reason in result.detail, result.detail
        assert "--engine-version" in result.fix and result.data["readings"] == {}
        told = doctor(folder, None, tiny, engine="sglang", engine_version="post-25454").result("checkpoint.engine_config")
        assert reason not in told.detail and told.data["readings"], told.detail


def test_miswirings_are_distinct_reachable_and_named():
    declared = Wiring.parse("layer1.out,layer2.out,layer4.out")
    alternatives = miswirings(declared, 6)
    wirings = [str(a.wiring) for a in alternatives if a.wiring is not None]
    assert len(wirings) == len(set(wirings)) and str(declared) not in wirings
    assert {"layer2.out,layer3.out,layer5.out", "layer0.out,layer1.out,layer3.out", "embed,layer2.out,layer4.out",
            "layer2.out,layer1.out,layer4.out"} <= set(wirings)
    assert alternatives[-1].wiring is None and "final" in alternatives[-1].description
    # layer5.out + 1 would be final, which no engine feeds the fc: left out
    assert all("final" not in w for w in wirings)


def test_cli_exit_codes_and_json(good, tiny_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [EAGLEWIRE, "doctor", "--target", str(tiny_dir), "--engine", "vllm", "--live-prompts", "1",
            "--live-tokens", "8"]
    ok = subprocess.run([*base, str(good.checkpoint), "--data", str(good.data), "--json"], capture_output=True,
                        text=True, env=env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    report = json.loads(ok.stdout)
    assert report["ok"] and {r["name"] for r in report["results"]} >= {"numbers.tensors", "acceptance.offline"}
    broken = edit_config(copy_checkpoint(good, tmp_path), _ids_minus_one)
    bad = subprocess.run([*base, str(broken), "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env)
    assert bad.returncode == 1, bad.stderr[-2000:]
    assert "FAIL  checkpoint.engine_config" in bad.stdout and "-> write eagle_aux_hidden_state_layer_ids [2, 3, 5]" in bad.stdout
    assert json.loads((tmp_path / "o" / "doctor.json").read_text())["ok"] is False
    usage = subprocess.run([*base, str(tmp_path / "nope")], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "is not a folder" in usage.stderr and "Traceback" not in usage.stderr



def test_foreign_folders_are_imported_strictly_first(good, tiny_dir, tmp_path):
    from eaglewire.interop.formats import export_checkpoint

    export_checkpoint(good.checkpoint, "speculators", tmp_path / "spec", verifier=str(tiny_dir),
                      target=load_target(str(tiny_dir)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [EAGLEWIRE, "doctor", "--target", str(tiny_dir), "--live-prompts", "1", "--live-tokens", "8", "--json"]
    ok = subprocess.run([*base, str(tmp_path / "spec"), "--format", "speculators", "--data", str(good.data)],
                        capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    report = json.loads(ok.stdout)
    assert report["ok"] and "imported strictly" in report["checkpoint"]
    # the same folder read as vLLM's layout: its layers.0.* names are the speculators rename of midlayer.*
    wrong = subprocess.run([*base, str(tmp_path / "spec"), "--format", "vllm"], capture_output=True, text=True, env=env)
    assert wrong.returncode == 1, wrong.stderr[-2000:]
    load = json.loads(wrong.stdout)["results"][0]
    assert load["name"] == "checkpoint.load" and load["status"] == "fail"
    assert "Eagle3Speculator" in load["detail"] or "layers.0" in load["detail"]

def test_load_reports_the_dtype_the_weights_are_stored_in(good, tiny, tmp_path):
    from eaglewire.drafter.checkpoint import load_checkpoint, save_checkpoint

    checkpoint = load_checkpoint(good.checkpoint, tiny.layout.embed)
    half = save_checkpoint(tmp_path / "f16", checkpoint.drafter, checkpoint.meta, dtype=torch.float16)
    report = doctor(half, None, tiny)
    assert ", float16, wiring" in report.result("checkpoint.load").detail, format_report(report)


def test_a_foreign_folder_is_judged_as_the_stack_that_runs_it_reads_it(good, tiny, tmp_path):
    from eaglewire.doctor.checks import run_doctor_on_foreign
    from eaglewire.interop.formats import export_checkpoint

    def judged(folder, fmt, engine, **kw):
        cfg = DoctorConfig(checkpoint=str(folder), target=str(tiny.name), **{**FAST, "engine": engine})
        return run_doctor_on_foreign(cfg, fmt, **kw).result("checkpoint.serving")

    specforge = export_checkpoint(good.checkpoint, "specforge", tmp_path / "specforge").out
    served = judged(specforge, "specforge", "sglang")
    assert served.status == FAIL and "norm_output is True: in sglang 0.5.23" in served.detail, served
    assert judged(specforge, "specforge", "eaglewire").status == SKIPPED
    sglang = export_checkpoint(good.checkpoint, "sglang", tmp_path / "sglang").out
    served = judged(sglang, "sglang", "vllm", ids_convention="sglang-pre-25454")
    assert served.status == FAIL and "V1 runner reads eagle_config.eagle_aux_hidden_state_layer_ids" in served.detail
    assert judged(sglang, "sglang", "sglang", ids_convention="sglang-pre-25454").status == PASS
    spec = export_checkpoint(good.checkpoint, "speculators", tmp_path / "spec", verifier=str(tiny.name), target=tiny).out
    assert judged(spec, "speculators", "vllm").status == PASS
    edit_weights(spec, lambda t: t.pop("embed_tokens.weight"))
    served = judged(spec, "speculators", "vllm")
    assert served.status == FAIL and "the folder has no embed_tokens.weight" in served.detail, served


# ---- the real SmolLM2 target -----------------------------------------------------------------


def test_metric_separates_every_adjacent_smollm2_layer(smollm2):
    """bf16-stored values match their own layer and no neighbour, for every adjacent pair from embed to
    final; whole-tensor cosine cannot tell the middle layers apart (massive activations)."""
    template = smollm2.tokenizer.chat_template
    texts = [
        [{"role": "user", "content": "Name three primary colors and one use for each."}],
        [{"role": "user", "content": "Write five sentences about a robot who learns to paint."},
         {"role": "assistant", "content": "Once upon a time there was a robot named Pixel. It loved sunsets."}],
    ]
    points = all_points(smollm2.num_layers)
    own, adjacent = [], []
    for messages in texts:
        ids = smollm2.tokenizer.apply_chat_template(messages, chat_template=template, return_tensors="pt",
                                                    return_dict=False)
        captured = [t[0] for t in capture(smollm2.layout, points, ids).values()]
        stored = [t.bfloat16() for t in captured]
        for i, value in enumerate(stored):
            own.append(relative_error(value, captured[i]))
            for j in (i - 1, i + 1):
                if 0 <= j < len(points):
                    adjacent.append((relative_error(value, captured[j]), str(points[i]), str(points[j])))
        flat = torch.nn.functional.cosine_similarity(captured[15].flatten(), captured[16].flatten(), dim=0)
        assert flat > 0.9999  # layer14.out vs layer15.out: whole-tensor cosine sees no difference
    closest = min(adjacent)
    print(f"\nper-token relative error: own layer (bf16) max {max(own):.4f}; closest adjacent pair "
          f"{closest[1]} vs {closest[2]}: {closest[0]:.4f}; tolerance {MATCH_TOLERANCE}")
    assert max(own) < MATCH_TOLERANCE / 5, max(own)
    assert closest[0] > MATCH_TOLERANCE * 5, closest


# The target's own answers the shipped lineage trained on at row 7 (rows 8-9: answers_c-f); record 0 was held out.
REGENERATED = Path(__file__).parents[1] / "data" / "regenerated" / "smollm2-135m" / "answers_a.jsonl.xz"


def test_shipped_drafter_passes_on_real_data(smollm2, tmp_path):
    """On records like those it was trained on, never trained on. A ShareGPT record is not such data for a
    drafter trained on the target's own answers: the row-7 drafter agreed 0.408 on ShareGPT record 0 against
    0.476 recorded, a drop past the offline check's margin though the wiring is right."""
    # Records 0, 50 and 100, held out as they were at row 7 (every 50th), and only they are extracted; one record
    # alone (85 positions) put row 13 at 0.506 against 0.625 recorded, past the margin: its positions are not
    # independent.
    with lzma.open(REGENERATED, "rt") as answers:
        (tmp_path / "answers.jsonl").write_text("".join(next(answers) for _ in range(101)))
    run_extract(ExtractConfig(data=str(tmp_path / "answers.jsonl"), out=tmp_path / "data", max_length=1024,
                              held_out_only=True, progress=False), target=smollm2)
    report = run_doctor(DoctorConfig(checkpoint="shipped", data=tmp_path / "data", out=tmp_path / "out"),
                        target=smollm2)
    assert report.exit_code == 0, format_report(report)
    assert all(r.status == PASS for r in report.results), format_report(report)
    rows = report.result("numbers.tensors").data["rows"]
    assert [r["best"] for r in rows] == ["layer1.out", "layer14.out", "layer26.out", "final"]
    assert (tmp_path / "out" / "tensor_match.png").is_file()


def test_live_names_the_order_a_drafter_was_trained_on(smollm2, tmp_path):
    """A drafter trained with its aux states concatenated deepest first, whose checkpoint declares stream
    order: its fc column blocks are the shipped drafter's, reversed. Only the live check can see this."""
    from eaglewire.drafter.shipped import shipped_drafter

    folder = Path(shutil.copytree(shipped_drafter("smollm2-135m"), tmp_path / "reversed"))
    blocks = lambda t: torch.cat(list(reversed(t["fc.weight"].chunk(3, dim=1))), dim=1).contiguous()
    edit_weights(folder, lambda t: t.update({"fc.weight": blocks(t)}))
    report = run_doctor(DoctorConfig(checkpoint=str(folder)), target=smollm2)
    live = report.result("acceptance.live")
    assert live.status == FAIL, format_report(report)
    # the true order is named; orders that differ only in a slot the drafter barely reads may be named beside it
    named = live.fix.split("trained on ")[1].split(" (not told apart")[0].split(", not on")[0].split(" or ")
    assert "layer26.out,layer14.out,layer1.out" in live.detail and "layer26.out,layer14.out,layer1.out" in named
    assert report.result("checkpoint.load").status == PASS  # nothing else can tell
