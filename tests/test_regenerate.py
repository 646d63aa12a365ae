"""eaglewire regenerate: the target's own answers, turn by turn, batched, resumable, and trainable."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_target, conversation, write_jsonl

from eaglewire.engine.speculative import Engine
from eaglewire.target import load_target
from eaglewire.train.regenerate import (
    META_SUFFIX,
    RegenerateConfig,
    RegenerateError,
    run_regenerate,
)

MAX_LEN = 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer_dir):
    # a peaked head: answers that end (EOS) at different lengths, so conversations finish out of order
    return load_target(str(build_tiny_target(tmp_path_factory.mktemp("regen"), "llama", tokenizer_dir, lm_head_scale=30.0)))


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny, None, None, MAX_LEN, batched_lm_head=True)  # as run_regenerate builds it


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    records = [conversation(f"Question {i}?", "an answer to replace", f"And then {i}?", "another one")
               for i in range(5)]
    records.insert(2, "{not json")  # malformed: skipped, indices stay contiguous
    records.append({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "old"}, {"role": "user", "content": "unanswered"}]})
    return write_jsonl(tmp_path_factory.mktemp("src") / "src.jsonl", records)


def _cfg(out, source, **kw):
    return RegenerateConfig(data=str(source), out=out, max_new_tokens=12, batch=3, max_len=MAX_LEN, progress=False, **kw)


def test_greedy_answers_are_the_targets_own_greedy_decode_turn_by_turn(tmp_path, tiny, engine, source):
    out = tmp_path / "regen.jsonl"
    meta = run_regenerate(_cfg(out, source), engine=engine)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["source_index"] for r in rows] == [0, 1, 3, 4, 5, 6]  # source order; the malformed record 2 skipped
    assert meta["complete"] and meta["conversations"] == 6 and meta["skipped_this_run"] == {"malformed": 1}
    assert meta["target"] == tiny.fingerprint and meta["settings"]["temperature"] == 0.0
    for row in rows:
        messages = row["messages"]
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert answers and messages[-1]["role"] == "assistant"  # a trailing unanswered user turn is dropped
        for i in answers:
            prompt = tiny.tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, return_tensors="pt",
                                                        return_dict=True)["input_ids"]
            with torch.inference_mode():
                hf = tiny.model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=sorted(engine.eos_ids),
                                         pad_token_id=0)[0, prompt.shape[1]:]
            expected = tiny.tokenizer.decode(hf, skip_special_tokens=True)
            assert messages[i]["content"] == expected, (row["source_index"], i)
    system = rows[-1]["messages"]
    assert system[0] == {"role": "system", "content": "Be brief."} and len(system) == 3


def test_a_killed_run_continues_to_the_identical_file(tmp_path, engine, source, monkeypatch):
    import eaglewire.train.regenerate as regenerate

    whole = tmp_path / "whole.jsonl"
    run_regenerate(_cfg(whole, source, temperature=0.8, seed=3), engine=engine)
    cut = tmp_path / "cut.jsonl"
    real_finish = regenerate._OrderedWriter.finish
    calls = []

    def finish_then_die(self, index, messages):
        real_finish(self, index, messages)
        calls.append(index)
        if len(calls) == 3:
            self.handle.write('{"messages": [{"role": "user", "con')  # a line cut in half by the kill
            self.handle.flush()
            raise KeyboardInterrupt

    monkeypatch.setattr(regenerate._OrderedWriter, "finish", finish_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_regenerate(_cfg(cut, source, temperature=0.8, seed=3), engine=engine)
    monkeypatch.setattr(regenerate._OrderedWriter, "finish", real_finish)
    assert 0 < len(cut.read_text().splitlines()) < 6
    assert not json.loads((tmp_path / ("cut.jsonl" + META_SUFFIX)).read_text())["complete"]
    run_regenerate(_cfg(cut, source, temperature=0.8, seed=3), engine=engine)
    assert cut.read_bytes() == whole.read_bytes()
    # a different setting is refused and the file is left alone
    before = cut.read_bytes()
    with pytest.raises(RegenerateError, match="temperature"):
        run_regenerate(_cfg(cut, source, temperature=0.5, seed=3), engine=engine)
    assert cut.read_bytes() == before


def test_kept_answers_are_copied_and_only_later_turns_are_answered(tmp_path, engine, source):
    full = tmp_path / "full.jsonl"
    run_regenerate(_cfg(full, source), engine=engine)
    rows = [json.loads(line) for line in full.read_text().splitlines()]
    # a file written before --keep-answers existed (no such setting in its meta) still continues
    meta_path = full.with_name(full.name + META_SUFFIX)
    meta = json.loads(meta_path.read_text())
    assert "keep_answers" not in meta["settings"]
    before = full.read_bytes()
    assert run_regenerate(_cfg(full, source), engine=engine)["complete"] and full.read_bytes() == before
    # the target's own first answers, and second answers it must write again
    seeded = [{"messages": [dict(m, content="to replace") if i == 3 else m for i, m in enumerate(r["messages"])]}
              for r in rows]
    assert any(len(r["messages"]) == 4 for r in seeded)
    later = tmp_path / "later.jsonl"
    meta = run_regenerate(_cfg(later, write_jsonl(tmp_path / "seeded.jsonl", seeded), keep_answers=1), engine=engine)
    # only the system-prompt record (one answer, nothing after it) is skipped; the rest equal the full run's answers
    answered = [json.loads(line) for line in later.read_text().splitlines()]
    assert meta["skipped_this_run"] == {"no_turn_to_answer": 1} and meta["settings"]["keep_answers"] == 1
    expected = [(i, r["messages"]) for i, r in enumerate(rows) if len(r["messages"]) == 4]
    assert [(r["source_index"], r["messages"]) for r in answered] == expected
    kept = write_jsonl(tmp_path / "kept.jsonl", [conversation("Q?", "not the target's words", "And?", "x")])
    out = tmp_path / "kept_out.jsonl"
    run_regenerate(_cfg(out, kept, keep_answers=1), engine=engine)
    assert json.loads(out.read_text())["messages"][1]["content"] == "not the target's words"
    with pytest.raises(RegenerateError, match="--keep-answers"):
        _cfg(tmp_path / "x.jsonl", source, keep_answers=-1)


def test_sampled_answers_follow_the_seed(tmp_path, engine, source):
    a, b, c = (tmp_path / f"{n}.jsonl" for n in "abc")
    run_regenerate(_cfg(a, source, temperature=1.0, seed=1, max_samples=3), engine=engine)
    run_regenerate(_cfg(b, source, temperature=1.0, seed=1, max_samples=3), engine=engine)
    run_regenerate(_cfg(c, source, temperature=1.0, seed=2, max_samples=3), engine=engine)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_bad_settings_are_refused(tmp_path, source):
    with pytest.raises(RegenerateError, match="must end in .jsonl"):
        _cfg(tmp_path / "x.json", source)
    with pytest.raises(RegenerateError, match="--batch"):
        RegenerateConfig(data=str(source), out=tmp_path / "x.jsonl", batch=0)
    with pytest.raises(ValueError, match="temperature"):
        RegenerateConfig(data=str(source), out=tmp_path / "x.jsonl", temperature=-1)
    foreign = write_jsonl(tmp_path / "foreign.jsonl", [{"messages": []}])
    with pytest.raises(RegenerateError, match="not written by eaglewire regenerate"):
        run_regenerate(_cfg(foreign, source), engine=None)
    assert foreign.read_text() == '{"messages": []}\n'


def test_a_regenerated_file_extracts_and_trains(tmp_path, tiny, engine, source):
    from eaglewire.data.extract import ExtractConfig, run_extract
    from eaglewire.train.loop import TrainConfig, run_train

    data = tmp_path / "regen.jsonl"
    run_regenerate(_cfg(data, source), engine=engine)
    manifest = run_extract(ExtractConfig(data=str(data), out=tmp_path / "ds", target=tiny.name,
                                         wiring="layer1.out,layer2.out,layer4.out", dtype="fp32", progress=False),
                           target=tiny)
    assert manifest.totals["samples"] == 6
    metrics = run_train(TrainConfig(out=tmp_path / "run", data=str(tmp_path / "ds"), target=tiny.name, draft_vocab=512,
                                    steps=2, batch_tokens=200, warmup_steps=1, progress=False), target=tiny)
    assert metrics["step"] == 2
