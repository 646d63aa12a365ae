"""The command line: help texts, the wiring table, and clear errors with exit codes."""

from __future__ import annotations

import subprocess

from conftest import EAGLEWIRE



def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EAGLEWIRE, *args], capture_output=True, text=True, timeout=300)


def test_help_explains_each_command():
    top = run("--help")
    assert top.returncode == 0
    for command in ("extract", "train", "wiring"):
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
    missing = run("extract", "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    bad_wiring = run("wiring", "--wiring", "layer3,layer4.out")
    assert bad_wiring.returncode == 2 and "unknown capture point 'layer3'" in bad_wiring.stderr
    no_convention = run("wiring", "--ids", "1,2")
    assert no_convention.returncode == 2 and "--ids needs --convention" in no_convention.stderr
    zero = run("train", "--data", "x", "--out", str(tmp_path / "r"), "--steps", "0")
    assert zero.returncode == 2 and "--steps must be >= 1" in zero.stderr
