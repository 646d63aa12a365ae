"""Shared fixtures: tiny random targets built here, and the real SmolLM2 target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eaglewire.serve.launch import EAGLEWIRE
from eaglewire.target import load_target, smollm2_gguf_path

# The console script beside the interpreter running the tests (the venv's, in CI); PATH may point at
# another installation or none.
assert Path(EAGLEWIRE).is_file(), f"{EAGLEWIRE} is missing: install the package (make install) first"

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer (with its chat template), saved as a plain HF tokenizer folder."""
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    out = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(out)
    return out


def build_tiny_target(out: Path, family: str, tokenizer_dir: Path, seed: int = 0, lm_head_scale: float = 1.0,
                      **overrides) -> Path:
    """A randomly initialised target of ``family`` with SmolLM2's tokenizer, saved as an HF folder.

    ``lm_head_scale`` sharpens its next-token distributions: at the default init they are
    nearly uniform, which leaves a drafter nothing to learn.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, vocab_size=49152, tie_word_embeddings=False, **{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(out)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)
    return out


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tokenizer_dir):
    made: dict[str, Path] = {}

    def make(family: str = "llama") -> Path:
        if family not in made:
            made[family] = build_tiny_target(tmp_path_factory.mktemp(f"tiny-{family}"), family, tokenizer_dir)
        return made[family]

    return make


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded target (about 15 s to load; shared by the whole session)."""
    return load_target("smollm2-135m")


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def conversation(user: str, assistant: str, *more: str) -> dict:
    turns = [{"from": "human", "value": user}, {"from": "gpt", "value": assistant}]
    for i, text in enumerate(more):
        turns.append({"from": "human" if i % 2 == 0 else "gpt", "value": text})
    return {"conversations": turns}
