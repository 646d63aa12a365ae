"""The command line: help texts, its defaults, the wiring table, and clear errors with exit codes."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import fields

import pytest
from conftest import EAGLEWIRE

from eaglewire import cli
from eaglewire.bench.report import BenchConfig
from eaglewire.data.extract import ExtractConfig
from eaglewire.doctor.state import DoctorConfig
from eaglewire.engine.drafting import TreeShape
from eaglewire.engine.projection import cpu_features
from eaglewire.engine.sampling import SamplingParams
from eaglewire.engine.speculative import GenerationConfig
from eaglewire.errors import ConfigError, EaglewireError
from eaglewire.serve.server import ServeConfig
from eaglewire.target import DEFAULT_TARGET, TargetError
from eaglewire.train.loop import TrainConfig
from eaglewire.train.regenerate import RegenerateConfig


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([EAGLEWIRE, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_help_explains_each_command():
    top = run("--help")
    assert top.returncode == 0
    for command in ("extract", "train", "wiring", "generate", "bench", "demo", "serve", "export", "import", "doctor"):
        assert command in top.stdout
        assert run(command, "--help").returncode == 0
    assert "resume" in run("extract", "--help").stdout.lower()


def test_wiring_table_for_the_embedded_target():
    result = run("wiring")
    assert result.returncode == 0, result.stderr
    assert "wiring layer1.out,layer14.out,layer26.out" in result.stdout
    assert "vllm               [2, 15, 27]" in result.stdout
    assert "sglang-pre-25454   [1, 14, 26]" in result.stdout
    back = run("wiring", "--ids", "2,15,27", "--convention", "sglang-pre-25454")
    assert "capture: layer2.out,layer15.out,layer27.out" in back.stdout


def test_bad_input_is_a_sentence_and_exit_code_2(tmp_path):
    cases = [  # (arguments, what stderr must say)
        (("extract", "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")), "does not exist"),
        (("wiring", "--wiring", "layer3,layer4.out"), "unknown capture point 'layer3'"),
        (("wiring", "--ids", "1,2"), "--ids needs --convention"),
        (("wiring", "--ids", "2,x", "--convention", "vllm"), "--ids must be comma-separated integers"),
        # draft and serving settings are refused at start, not on every request or after the target has loaded
        (("serve", "--chain-length", "0"), "chain length must be >= 1"),
        (("serve", "--max-queue", "0"), "--max-queue must be >= 1"),
        (("serve", "--max-batch", "0"), "--max-batch must be >= 1, got 0"),
        (("serve", "--draft-up-to", "some"), "expected a number or 'all', got 'some'"),
        (("bench", "--min-confidence", "2", "--dataset", str(tmp_path / "nope.jsonl")), "min_confidence must be in [0, 1]"),
        (("bench", "--dtype", "fp32,fp16", "--dataset", str(tmp_path / "nope.jsonl")), "--dtype must be one of fp32, bf16"),
        (("generate", "--prompt", "hi", "--dtype", "fp16"), "argument --dtype: invalid choice: 'fp16'"),
        (("generate", "--prompt", "hi", "--lookup-min", "-1"), "--lookup-min must be >= 0 (0: off), got -1"),
        (("generate", "--prompt", "hi", "--lookup-min", "5", "--no-speculation"), "drop it or --no-speculation"),
        (("generate", "--prompt", "hi", "--lookup-min", "3", "--lookup-drafts", "0"), "max_drafts must be >= 1"),
        (("bench", "--lookup-min", "0", "--dataset", str(tmp_path / "nope.jsonl")), "--lookup-min must be >= 1, got 0"),
        # a lookup option that would do nothing is refused, not ignored
        (("generate", "--prompt", "hi", "--lookup-drafts", "4"), "lookups, which are off: add --lookup-min N"),
        (("bench", "--lookup-min", "3", "--dataset", str(tmp_path / "nope.jsonl")), "--systems names none"),
        (("serve", "--lookup-min", "3", "--strategy", "none"), "drop it or --strategy none"),
        (("serve", "--lookup-drafts", "4"), "lookups, which are off: add --lookup-min N"),
        (("serve", "--lookup-min", "3", "--lookup-drafts", "0"), "max_drafts must be >= 1"),
        (("doctor", "shipped", "--wiring", "layer1.out,layer2.out"), "describe a foreign folder"),
        (("train", "--data", "x", "--out", str(tmp_path / "r"), "--steps", "0"), "--steps must be >= 1"),
    ]
    for args, message in cases:
        result = run(*args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr, args


PROMPT = "Name three primary colors."


def test_generate_json_equals_plain_decoding_and_streams_text():
    spec = run("generate", "--prompt", PROMPT, "--max-new-tokens", "24", "--json")
    plain = run("generate", "--prompt", PROMPT, "--max-new-tokens", "24", "--json", "--no-speculation")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    a, b = json.loads(spec.stdout), json.loads(plain.stdout)
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"] and a["text"]
    assert a["metrics"]["drafted"] > 0 and b["metrics"]["drafted"] == 0 and b["metrics"]["tau"] == 1.0
    streamed = run("generate", "--prompt", PROMPT, "--max-new-tokens", "24", "--strategy", "tree")
    assert streamed.returncode == 0 and streamed.stdout.strip() == a["text"].strip()
    assert "tau" in streamed.stderr and "tok/s" in streamed.stderr
    bad = run("generate", "--prompt", PROMPT, "--temperature", "-1")
    assert bad.returncode == 2 and "temperature must be in" in bad.stderr


def _prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": PROMPT}) + "\n" + json.dumps({"turns": ["Say hello in French."]}) + "\n")
    return path


def test_bench_on_a_prompt_file_writes_report_and_plot(tmp_path):
    out = tmp_path / "bench"
    result = run("bench", "--dataset", str(_prompt_file(tmp_path)), "--max-new-tokens", "12", "--out", str(out),
                 "--no-progress", "--tree-tokens", "8", "--tree-depth", "3", "--tree-top-k", "4")
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    assert set(report["systems"]) == {"hf-greedy", "hf-prompt-lookup", "eaglewire-none", "eaglewire-chain", "eaglewire-tree"}
    for system, entry in report["systems"].items():
        assert entry["outputs_differing_from_hf_greedy"] == [], system
    assert report["cost_model"]["verify_relative"]["1"] == 1.0
    assert report["settings"]["cpu"] == cpu_features()  # which kernels the figures came from
    assert set(report["cost_model"]["speedup"]) == {"chain", "tree"}
    assert (out / "bench.png").stat().st_size > 0
    assert "cost model" in result.stdout and "speedup ceiling" in result.stdout
    # without the bar, each prompt still reports itself on stderr, with every system's speed and tau where drafted
    lines = [line for line in result.stderr.splitlines() if line.startswith("bench prompt")]
    assert [line.split(" (")[0] for line in lines] == ["bench prompt 1/2", "bench prompt 2/2"]
    assert all(line.count("tok/s") == 5 and line.count("tau") == 2 for line in lines), lines


def test_demo_answers_and_checks_the_wiring(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "mtbench_question.jsonl").write_text(
        json.dumps({"question_id": 1, "category": "x", "turns": [PROMPT, "again"]}) + "\n")
    result = run("demo", "--prompts", "1", "--max-new-tokens", "16", env={"EAGLEWIRE_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    assert "wiring check: engine capture equals the extraction path: yes" in result.stdout
    assert "same tokens: yes" in result.stdout and "summary: tau" in result.stdout
    assert "doctor verdict: healthy" in result.stdout and "pass acceptance.live" in result.stdout


def test_bench_refuses_a_missing_prompt_file(tmp_path):
    result = run("bench", "--dataset", str(tmp_path / "none.jsonl"), "--systems", "eaglewire-none")
    assert result.returncode == 2 and "no such file" in result.stderr


# ---- one source of defaults: each option's default is its config field's ----------------------


class Built(Exception):
    """Carries the config a command built out of main, before anything loads."""

    def __init__(self, config):
        super().__init__(type(config).__name__)
        self.config = config


def _built_config(monkeypatch, *argv):
    """The config dataclass ``eaglewire ARGV`` builds from its options."""
    build = cli._config

    def stop(config_class, args, **settings):
        raise Built(build(config_class, args, **settings))

    monkeypatch.setattr(cli, "_config", stop)
    with pytest.raises(Built) as built:
        cli.main(list(argv))
    return built.value.config


def _differing_fields(built, expected) -> list[str]:
    return [f"{f.name}: command line {getattr(built, f.name)!r}, dataclass {getattr(expected, f.name)!r}"
            for f in fields(expected) if getattr(built, f.name) != getattr(expected, f.name)]


def test_command_line_defaults_are_the_config_defaults(monkeypatch, tmp_path):
    out = tmp_path / "out"
    cases = [  # (arguments, the config with only the required fields given)
        (("train", "--data", "d", "--out", str(out)), TrainConfig(data="d", out=out)),
        (("extract", "--data", "d", "--out", str(out)), ExtractConfig(data="d", out=out)),
        (("regenerate", "--data", "d", "--out", str(out) + ".jsonl"), RegenerateConfig(data="d", out=f"{out}.jsonl")),
        (("doctor", "shipped"), DoctorConfig(checkpoint="shipped")),
        (("serve",), ServeConfig(model_name=DEFAULT_TARGET)),
        (("bench",), BenchConfig()),
    ]
    for argv, expected in cases:
        built = _built_config(monkeypatch, *argv)
        assert type(built) is type(expected) and not _differing_fields(built, expected), \
            (argv, _differing_fields(built, expected))


def test_generate_defaults_are_the_generation_defaults():
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi"])
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    tree = TreeShape(depth=args.tree_depth, top_k=args.tree_top_k, total_tokens=args.tree_tokens)
    built = GenerationConfig(max_new_tokens=args.max_new_tokens, strategy=args.strategy, chain_length=args.chain_length,
                             min_confidence=args.min_confidence, tree=tree, sampling=sampling)
    assert built == GenerationConfig()


# ---- only eaglewire's own errors are user errors ---------------------------------------------


def test_an_eaglewire_error_is_a_sentence_and_exit_code_2(monkeypatch, capsys):
    def refuse(spec):
        raise TargetError(f"cannot read the config of target {spec!r}: no config.json")

    monkeypatch.setattr("eaglewire.target.load_target_config", refuse)
    assert cli.main(["wiring", "--target", "nowhere"]) == 2
    err = capsys.readouterr().err
    assert err == "eaglewire wiring: error: cannot read the config of target 'nowhere': no config.json\n"


def test_a_value_error_from_elsewhere_is_a_crash_not_bad_input(monkeypatch):
    def broken(spec):  # e.g. torch or transformers failing on valid input: a bug, shown with its traceback
        raise ValueError("cannot reshape tensor of 0 elements")

    monkeypatch.setattr("eaglewire.target.load_target_config", broken)
    with pytest.raises(ValueError, match="cannot reshape") as raised:
        cli.main(["wiring"])
    assert not isinstance(raised.value, EaglewireError)


def test_config_errors_are_eaglewire_errors_and_value_errors():
    with pytest.raises(ConfigError, match="--max-queue must be >= 1"):
        ServeConfig(model_name="m", max_queue=0)
    assert issubclass(ConfigError, EaglewireError) and issubclass(EaglewireError, ValueError)
