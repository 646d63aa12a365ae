"""eaglewire doctor --data on other stacks' hidden-state datasets: speculators 0.9.0 and SpecForge 0.2.0.

Each test writes a tiny dataset in the stack's layout (as interop/foreign_data.py describes it) from a
tiny random target's own captures, with one entry deliberately the wrong tensor, and checks that
numbers.tensors names the entry, the tensor it really holds, and what the stack takes it for.
"""

from __future__ import annotations

import gzip
import io

import pytest
import torch
from safetensors.torch import save_file
from test_doctor_server import random_drafter

from eaglewire.data.capture import capture
from eaglewire.doctor.checks import (
    FAIL,
    PASS,
    SKIPPED,
    DoctorConfig,
    format_report,
    run_doctor,
)
from eaglewire.interop.foreign_data import (
    ForeignDataError,
    ForeignDataset,
    detect_foreign_data,
)
from eaglewire.target import load_target
from eaglewire.wiring import CapturePoint, Wiring

PROMPTS = ["Tell me about the sea.", "Write a line about a red fox.", "Why is winter rain cold?",
           "Name three old trains.", "How is green tea made?"]
WIRING = "layer1.out,layer2.out,layer4.out"
# what each stack stores, in its order: speculators the aux states then layer{n-1}.out (pre-norm), SpecForge
# the aux states (concatenated) then final
SPECULATORS_ENTRIES = ["layer1.out", "layer2.out", "layer4.out", "layer5.out"]
SPECFORGE_ENTRIES = ["layer1.out", "layer2.out", "layer4.out", "final"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_dir):
    target = load_target(str(tiny_target_dir("llama")))
    checkpoint = random_drafter(target, tmp_path_factory.mktemp("foreign") / "checkpoint", WIRING)
    samples = []
    for prompt in PROMPTS:
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                   return_tensors="pt", return_dict=False)[0]
        points = [CapturePoint.parse(p) for p in ("embed", *SPECULATORS_ENTRIES, "final")]
        with torch.no_grad():
            captured = {str(p): t[0] for p, t in capture(target.layout, points, ids[None]).items()}
        samples.append((ids, captured))
    return target, checkpoint, samples


def write_speculators(folder, samples, entries):
    (folder / "hidden_states").mkdir(parents=True)
    for i, (ids, captured) in enumerate(samples):
        states = torch.stack([captured[p] for p in entries], dim=1).to(torch.bfloat16)  # [T, k+1, H]
        save_file({"token_ids": ids, "hidden_states": states}, str(folder / "hidden_states" / f"hs_{i}.safetensors"))
    return folder


def write_specforge(folder, samples, entries):
    (folder / "rows_0-5").mkdir(parents=True)
    for i, (ids, captured) in enumerate(samples):
        aux = torch.cat([captured[p] for p in entries[:-1]], dim=-1)
        data = {"input_ids": ids, "loss_mask": torch.ones_like(ids),
                "aux_hidden_state": aux[None].to(torch.bfloat16), "hidden_state": captured[entries[-1]][None].to(torch.bfloat16)}
        path = folder / "rows_0-5" / f"data_{i}.ckpt"
        if i == 0:  # SpecForge also reads gzipped feature files
            buffer = io.BytesIO()
            torch.save(data, buffer)
            path.with_suffix(".ckpt.gz").write_bytes(gzip.compress(buffer.getvalue()))
        else:
            torch.save(data, path)
    return folder


LAYOUTS = {"speculators": (write_speculators, SPECULATORS_ENTRIES, "hidden_states[:, {i}]", "speculators 0.9.0"),
           "specforge": (write_specforge, SPECFORGE_ENTRIES, None, "SpecForge 0.2.0")}


def doctor(setup, data):
    target, checkpoint, _ = setup
    return run_doctor(DoctorConfig(checkpoint=str(checkpoint), data=data, engine="vllm", live_prompts=1, live_tokens=8),
                      target=target)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dataset_as_its_stack_stores_it_passes(layout, setup, tmp_path):
    write, entries, _, source = LAYOUTS[layout]
    data = write(tmp_path / layout, setup[2], entries)
    assert detect_foreign_data(data) == layout
    report = doctor(setup, data)
    tensors = report.result("numbers.tensors")
    assert tensors.status == PASS, format_report(report)
    assert [r["best"] for r in tensors.data["rows"]] == entries
    integrity = report.result("data.integrity")
    assert integrity.status == SKIPPED and source in integrity.detail and "the drafter's wiring" in integrity.detail
    assert report.result("numbers.probe").status == SKIPPED


def test_speculators_embed_in_place_of_an_aux_layer_is_named(setup, tmp_path):
    wrong = ["layer1.out", "embed", "layer4.out", "layer5.out"]
    report = doctor(setup, write_speculators(tmp_path / "speculators", setup[2], wrong))
    tensors = report.result("numbers.tensors")
    assert tensors.status == FAIL, format_report(report)
    assert [r["best"] for r in tensors.data["rows"]] == wrong
    assert "the data stores embed in hidden_states[:, 1], which speculators 0.9.0 takes for layer2.out" in tensors.detail
    assert "stored hidden_states[:, 1] layer2.out = embed" in format_report(report)


def test_specforge_the_last_layer_in_place_of_final_is_named(setup, tmp_path):
    wrong = ["layer1.out", "layer2.out", "layer4.out", "layer5.out"]  # the state before the final norm
    report = doctor(setup, write_specforge(tmp_path / "specforge", setup[2], wrong))
    tensors = report.result("numbers.tensors")
    assert tensors.status == FAIL, format_report(report)
    assert [r["best"] for r in tensors.data["rows"]] == wrong
    assert "the data stores layer5.out in hidden_state, which SpecForge 0.2.0 takes for final" in tensors.detail


def test_claims_fall_back_to_the_stacks_default_ids(setup, tmp_path):
    """Without a drafter whose wiring has as many aux states, the stack's default ids say what they are."""
    data = write_specforge(tmp_path / "specforge", setup[2][:2], SPECFORGE_ENTRIES)
    dataset = ForeignDataset(data, "specforge", Wiring.parse("layer1.out,layer2.out"), 12)
    assert dataset.claims_from == "SpecForge 0.2.0's default ids [1, 5, 8]"
    assert [(e.role, str(e.claim)) for e in dataset.entries] == [
        ("aux[0]", "layer1.out"), ("aux[1]", "layer5.out"), ("aux[2]", "layer8.out"), ("teacher", "final")]
    with pytest.raises(ForeignDataError, match=r"default ids \[1, 2, 2\] name no wiring of this 6-layer target"):
        ForeignDataset(data, "specforge", None, 6)


def test_an_aux_count_neither_the_wiring_nor_the_defaults_have_is_refused(setup, tmp_path):
    data = write_speculators(tmp_path / "speculators", setup[2][:1], ["layer1.out", "layer2.out", "layer5.out"])
    with pytest.raises(ForeignDataError, match=r"stores 2 aux states, the drafter's wiring has 3 and speculators "
                                               r"0.9.0's default ids \[2, 6, 9\] are 3"):
        ForeignDataset(data, "speculators", Wiring.parse(WIRING), 12)


def test_files_of_another_layout_are_refused_with_what_is_missing(setup, tmp_path):
    folder = tmp_path / "broken" / "hidden_states"
    folder.mkdir(parents=True)
    save_file({"input_ids": torch.arange(4)}, str(folder / "hs_0.safetensors"))
    with pytest.raises(ForeignDataError, match="lacks token_ids"):
        ForeignDataset(folder.parent, "speculators", None, 6)
    report = doctor(setup, folder.parent)
    assert report.result("data.integrity").status == FAIL and "lacks token_ids" in report.result("data.integrity").detail


def test_unreadable_files_are_refused_by_name(tmp_path):
    (tmp_path / "specforge").mkdir()
    (tmp_path / "specforge" / "data_0.ckpt").write_bytes(b"not a pickle")
    with pytest.raises(ForeignDataError, match="data_0.ckpt is not a SpecForge feature file"):
        ForeignDataset(tmp_path / "specforge", "specforge", None, 6)
    (tmp_path / "speculators").mkdir()
    (tmp_path / "speculators" / "hs_0.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ForeignDataError, match="hs_0.safetensors is not a readable safetensors file"):
        ForeignDataset(tmp_path / "speculators", "speculators", None, 6)
