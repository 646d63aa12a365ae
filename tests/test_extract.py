"""eaglewire extract: stored tensors, manifest, skipping, refusal, resume, torchrun."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import EAGLEWIRE, conversation, write_jsonl
from safetensors import safe_open

from eaglewire.data.capture import capture
from eaglewire.data.conversations import DataError
from eaglewire.data.extract import ExtractConfig, run_extract
from eaglewire.data.manifest import ManifestError, open_dataset
from eaglewire.data.shards import HIDDEN_PREFIX, Sample, ShardError
from eaglewire.target import load_target
from eaglewire.wiring import CapturePoint


def records(n: int) -> list:
    return [conversation(f"Question {i}: what is {i} times {i + 3}?", f"Answer {i}: it is {i * (i + 3)}. " * (1 + i % 4),
                         f"Thanks {i}", f"You're welcome, {i}.") for i in range(n)]


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return load_target(str(tiny_target_dir("llama")))


def extract(tmp_path, target, data, **kw):
    cfg = ExtractConfig(data=str(data), out=tmp_path / kw.pop("name", "out"), target=target.name, progress=False,
                        wiring=kw.pop("wiring", "layer1.out,layer2.out,layer4.out"), **kw)
    return run_extract(cfg, target=target), cfg.out


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a shard file, whatever its name (training reads only the wiring's, by name)."""
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def unpack(tensors: dict[str, torch.Tensor]) -> list[Sample]:
    """Split a shard's packed tensors back into samples, every stored hidden state included."""
    offsets = tensors["offsets"].tolist()
    hidden = {CapturePoint.parse(k[len(HIDDEN_PREFIX):]): v for k, v in tensors.items() if k.startswith(HIDDEN_PREFIX)}
    return [Sample(int(tensors["record_index"][s]), tensors["input_ids"][a:b].long(), tensors["loss_mask"][a:b],
                   {p: v[a:b] for p, v in hidden.items()})
            for s, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))]


def test_shards_hold_exactly_the_wiring_tensors(tmp_path, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", records(7))
    manifest, out = extract(tmp_path, tiny, data, shard_records=3, dtype="fp32")
    assert manifest.complete and [s.file for s in manifest.shards] == [f"shard-00000{i}.safetensors" for i in range(3)]
    assert manifest.totals["samples"] == 7 and manifest.totals["skipped"] == 0
    assert str(manifest.wiring) == "layer1.out,layer2.out,layer4.out"
    open_dataset(out)  # every sha256 verifies
    samples = [s for e in manifest.shards for s in unpack(read_shard(out / e.file))]
    assert [s.record_index for s in samples] == list(range(7))
    for sample in samples[:3]:
        with torch.inference_mode():
            states = tiny.model(sample.input_ids[None], output_hidden_states=True).hidden_states
        for name, index in [("layer1.out", 2), ("layer2.out", 3), ("layer4.out", 5), ("final", 6)]:
            stored = sample.hidden[CapturePoint.parse(name)]
            assert torch.equal(stored, states[index][0]), name
        assert len(sample.hidden) == 4  # three aux points and the teacher's final, nothing else
    # probe: the recorded norms are those of the probe input's captured tensors
    ids = torch.tensor(manifest.probe["input_ids"])[None]
    again = capture(tiny.layout, manifest.wiring.points, ids)
    for point, tensor in again.items():
        assert manifest.probe["tensors"][str(point)]["token_norms"] == pytest.approx(tensor[0].norm(dim=-1).tolist(), rel=1e-4)


def test_bf16_storage_and_bytes_per_token(tmp_path, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", records(3))
    manifest, out = extract(tmp_path, tiny, data)
    tensors = read_shard(out / manifest.shards[0].file)
    assert tensors["hidden.layer2.out"].dtype == torch.bfloat16
    # 4 tensors x 64 wide x 2 bytes, plus id and mask
    assert 4 * 64 * 2 <= manifest.totals["bytes"] / manifest.totals["tokens"] < 4 * 64 * 2 + 64


def test_malformed_records_are_skipped_with_a_count_or_refused_with_strict(tmp_path, tiny):
    good = records(4)
    lines = [good[0], "{not json", good[1], {"conversations": [{"from": "robot", "value": "x"}]}, good[2], good[3]]
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    manifest, _ = extract(tmp_path, tiny, data)
    assert manifest.totals["samples"] == 4 and manifest.totals["skipped"] == 2
    assert manifest.skipped["malformed"] == 2 and manifest.skipped["first"].startswith("line 2: invalid JSON")
    with pytest.raises(DataError, match="line 2 .*invalid JSON.*--strict"):
        extract(tmp_path, tiny, data, name="strict", strict=True)


def test_truncated_json_array_is_reported(tmp_path, tiny):
    text = json.dumps(records(3))
    data = tmp_path / "cut.json"
    data.write_text(text[: len(text) - 40])
    manifest, _ = extract(tmp_path, tiny, data)
    assert manifest.totals["samples"] == 2 and "breaks off" in manifest.skipped["first"]


def test_bad_inputs_are_refused_and_lose_nothing(tmp_path, tiny, tiny_target_dir):
    with pytest.raises(DataError, match="does not exist"):
        extract(tmp_path, tiny, tmp_path / "missing.jsonl")
    data = write_jsonl(tmp_path / "d.jsonl", records(2))
    manifest, out = extract(tmp_path, tiny, data)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ManifestError, match=r"wiring: layer1.out,layer2.out,layer4.out vs layer0.out"):
        extract(tmp_path, tiny, data, wiring="layer0.out,layer2.out,layer4.out")
    other = load_target(str(tiny_target_dir("qwen2")))
    with pytest.raises(ManifestError, match="target .*model_type"):
        extract(tmp_path, other, data)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(ManifestError, match="not an eaglewire dataset"):
        extract(tmp_path, tiny, data, name="junk")
    # a completed dataset reruns as a no-op
    again, _ = extract(tmp_path, tiny, data)
    assert again.to_json() == manifest.to_json()
    # a corrupted shard is caught by its hash
    shard = out / manifest.shards[0].file
    blob = bytearray(shard.read_bytes())
    blob[-1] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(ShardError, match="sha256"):
        open_dataset(out)


def _cli(data: Path, out: Path, target: Path) -> list[str]:
    return ["extract", "--data", str(data), "--out", str(out), "--target", str(target),
            "--wiring", "layer1.out,layer3.out", "--shard-records", "8", "--max-length", "256", "--no-progress"]


def _shard_hashes(out: Path) -> dict:
    return {s["file"]: s["sha256"] for s in json.loads((out / "manifest.json").read_text())["shards"]}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_extraction_resumes_to_identical_shards(tmp_path, tiny_target_dir, sig):
    target = tiny_target_dir("llama")
    data = write_jsonl(tmp_path / "d.jsonl", records(400))
    subprocess.run([EAGLEWIRE, *_cli(data, tmp_path / "whole", target)], check=True, capture_output=True)

    out = tmp_path / "resumed"
    # A shell that starts the test run in the background makes its children ignore SIGINT, and the
    # ignore is inherited; give the extraction the disposition an interactive Ctrl-C would meet.
    proc = subprocess.Popen([EAGLEWIRE, *_cli(data, out, target)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not list(out.glob("shard-*.safetensors")) and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "extraction finished before it could be interrupted; make the data larger"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and b"run the same command again to resume" in err
    done_before = len(list(out.glob("shard-*.safetensors")))
    assert 1 <= done_before < 50
    subprocess.run([EAGLEWIRE, *_cli(data, out, target)], check=True, capture_output=True)
    assert _shard_hashes(out) == _shard_hashes(tmp_path / "whole")
    assert not list(out.glob(".*.tmp-*"))


def test_torchrun_two_processes_make_one_identical_dataset(tmp_path, tiny_target_dir):
    target = tiny_target_dir("llama")
    data = write_jsonl(tmp_path / "d.jsonl", records(40))
    subprocess.run([EAGLEWIRE, *_cli(data, tmp_path / "one", target)], check=True, capture_output=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*torchrun, EAGLEWIRE, *_cli(data, tmp_path / "two", target)], capture_output=True, env=env)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert _shard_hashes(tmp_path / "two") == _shard_hashes(tmp_path / "one")
    assert len(_shard_hashes(tmp_path / "two")) == 5


def test_blank_lines_do_not_leave_a_chunk_unfinishable(tmp_path, tiny):
    recs = records(3)
    data = tmp_path / "gaps.jsonl"
    data.write_text(json.dumps(recs[0]) + "\n\n\n\n\n" + json.dumps(recs[1]) + "\n\n" + json.dumps(recs[2]) + "\n")
    manifest, _ = extract(tmp_path, tiny, data, shard_records=2)
    assert manifest.totals["records"] == 3 and manifest.totals["samples"] == 3
    assert [(s.first_record, s.end_record) for s in manifest.shards] == [(0, 2), (2, 3)]


def test_a_strict_failure_can_be_rerun_after_fixing_the_data(tmp_path, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", [records(1)[0], {"conversations": [{"from": "robot", "value": "x"}]}])
    with pytest.raises(DataError, match="unknown role 'robot'"):
        extract(tmp_path, tiny, data, strict=True)
    write_jsonl(data, records(2))  # fixed: the file's identity changes, no shard was written yet
    manifest, _ = extract(tmp_path, tiny, data, strict=True)
    assert manifest.complete and manifest.totals["samples"] == 2


def test_no_usable_sample_exits_2_naming_the_first_skip(tmp_path, tiny_target_dir, capsys):
    from eaglewire.cli import main

    data = write_jsonl(tmp_path / "g.jsonl", ["garbage", "{bad", {"conversations": [{"from": "robot", "value": "x"}]}])
    argv = ["extract", "--data", str(data), "--out", str(tmp_path / "out"), "--target", str(tiny_target_dir("llama")),
            "--wiring", "layer1.out,layer2.out,layer4.out", "--no-progress"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "no usable sample: all 3 records were skipped" in error and "the first: line 1: invalid JSON" in error
    assert main(argv) == 2  # the finished (empty) dataset is refused again, not passed on to train


def test_held_out_only_keeps_exactly_the_held_out_records_as_the_full_dataset_has_them(tmp_path, tiny):
    """Data for `doctor` at 1/50 of the cost: records 0, 50 and 100 of 101, with their source indices, each
    sample equal to the full extraction's; what a rerun must match, and refused by train."""
    from eaglewire.data.samples import DatasetSamples
    from eaglewire.train.loop import TrainConfig, TrainingError, run_train

    data = write_jsonl(tmp_path / "d.jsonl", records(101))
    full, _ = extract(tmp_path, tiny, data, name="full", dtype="fp32")
    held, out = extract(tmp_path, tiny, data, name="held", dtype="fp32", held_out_only=True)
    assert held.totals["records"] == full.totals["records"] == 101
    assert held.totals["samples"] == 3 and held.totals["skipped"] == 0 and held.settings.held_out_only
    ours, theirs = DatasetSamples(out), DatasetSamples(tmp_path / "full")
    assert [r.record_index for r in ours.refs] == [0, 50, 100] and all(r.held_out for r in ours.refs)
    by_record = {r.record_index: r for r in theirs.refs}
    for ref in ours.refs:
        mine, full_sample = ours.load(ref), theirs.load(by_record[ref.record_index])
        assert torch.equal(mine.input_ids, full_sample.input_ids) and torch.equal(mine.aux, full_sample.aux)
        assert torch.equal(mine.final, full_sample.final)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ManifestError, match="held_out_only: True vs False"):
        extract(tmp_path, tiny, data, name="held", dtype="fp32")  # the full extraction into the held-out folder
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(TrainingError, match="--held-out-only"):
        run_train(TrainConfig(out=tmp_path / "run", data=str(out), target=tiny.name), target=tiny)


def test_a_manifest_from_before_held_out_only_existed_still_opens(tmp_path, tiny):
    """The setting stays out of the hash at its default, so a manifest (and shards) written before it existed,
    hashed over the other settings, still verify."""
    data = write_jsonl(tmp_path / "d.jsonl", records(2))
    manifest, out = extract(tmp_path, tiny, data)
    written = json.loads((out / "manifest.json").read_text())
    del written["settings"]["held_out_only"]
    before = hashlib.sha256(json.dumps(written["settings"], sort_keys=True).encode()).hexdigest()  # the old hash
    assert written["settings_sha256"] == before
    (out / "manifest.json").write_text(json.dumps(written))
    assert open_dataset(out).to_json() == manifest.to_json()
    again, _ = extract(tmp_path, tiny, data)  # and a rerun of the same command takes it as the same dataset
    assert again.to_json() == manifest.to_json()
