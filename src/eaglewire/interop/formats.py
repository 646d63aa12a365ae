"""Foreign drafter folders: what SGLang, vLLM, speculators, SpecForge and the EAGLE reference read and write.

A native checkpoint (drafter/checkpoint.py) carries its wiring; a foreign folder carries at
most engine layer ids, in the convention of the stack that reads them
(engine_ids.py). A ``Format`` is what differs per stack: the name of the decoder
layer in the weights file, where the config keeps the aux layer ids and which
conventions they may follow, and the config fields the stack reads. Export writes
every field that changes the forward; import refuses any field whose value the
eaglewire drafter cannot reproduce, and any tensor it cannot account for. Config
fields that change nothing (token ids, transformers_version, ...) are ignored.

What each stack reads (where the ids are and in which order, their convention, the flags
that change the forward and what each means there, the weights it needs) is one table,
``stacks.py``, read from the released wheels; this module writes and reads by it. What
only the layouts need is here: speculators names the decoder layer ``layers.0.*`` and
declares ``Eagle3Speculator`` with a ``transformer_layer_config`` and a
``speculators_config.verifier`` it resolves with from_pretrained; EAGLE (SafeAILab/EAGLE
@cb7e084, model/cnets.py, ea_model.py) loads pytorch_model.bin (else model.safetensors)
non-strictly, derives head_dim = hidden // heads whatever the config says, loads the
target's embedding only when the config has no target_hidden_size, and has no rope_theta
default.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..drafter.checkpoint import (
    ARCHITECTURE,
    CONFIG_FILE,
    LATER_LAYER_NORM,
    LAYER_PREFIX,
    WEIGHTS_FILE,
    CheckpointMeta,
    check_state_keys,
    drafter_from_state,
    llama_layer_fields,
    read_checkpoint_state,
    read_weights,
    rename_layer,
    save_checkpoint,
)
from ..drafter.model import DrafterConfig
from ..engine_ids import convention
from ..errors import EaglewireError
from ..files import atomic_write_bytes, replace_folder
from ..stacks import (
    IDS_KEY,
    SERVING_STACKS,
    STACKS,
    Stack,
    id_places_differ,
    ids_read,
    later_layer_norm_name,
    serving_problems,
    sglang_rules,
)
from ..target import Target, load_target
from ..wiring import Wiring, WiringError

# Every stack builds its fc for exactly 3 aux states (vLLM also when it serves a speculators folder).
EXPORT_AUX_STATES = 3
# speculators' proposal default; vLLM uses it as num_speculative_tokens when the command gives none.
SPECULATIVE_TOKENS = 3
BIN_WEIGHTS_FILE = "pytorch_model.bin"
# transformers' LlamaConfig defaults, which every one of these stacks parses the config with.
LLAMA_ROPE_THETA = 10000.0
LLAMA_RMS_NORM_EPS = 1e-6
LLAMA_MAX_POSITIONS = 2048
_REQUIRED = object()


class FormatError(EaglewireError):
    """A foreign drafter folder that cannot be converted exactly, or a conversion asked for wrongly."""


@dataclass(frozen=True)
class ForeignConfig:
    shape: dict  # DrafterConfig keyword arguments except num_aux (which the wiring decides)
    ids: list[int] | None  # the aux layer ids where the stack reads them; None when the config names none


@dataclass(frozen=True)
class Format:
    stack: Stack  # what the stack reads (stacks.py): where the ids are, their conventions, the forward's flags
    layer_prefix: str  # the decoder layer's name in its weights file
    weights_file: str  # what export writes
    write: Callable[[DrafterConfig, list[int], CheckpointMeta, torch.dtype], dict]
    read: Callable[[dict, str], ForeignConfig]
    ambiguity: str = ""  # why its config does not say which of its conventions the ids follow

    @property
    def name(self) -> str:
        return self.stack.name

    @property
    def conventions(self) -> tuple[str, ...]:
        return self.stack.conventions

    @property
    def ids_at(self) -> str:
        return self.stack.ids_at

    @property
    def ids_fixed(self) -> bool:
        """The stack captures hard-coded ids and reads none from the config."""
        return not self.stack.ids_paths


@dataclass(frozen=True)
class Conversion:
    """What export or import wrote."""

    out: Path
    wiring: Wiring
    ids: list[int] | None  # the ids the stack reads (None: the source named none, --wiring said)
    rules: tuple[str, ...]  # the conventions the ids were checked under
    ids_at: str
    warnings: tuple[str, ...] = ()  # how other stacks would misread the folder, if handed it


# ---- reading config fields -----------------------------------------------------------


def _get(data: dict, key: str, where: str, default=_REQUIRED):
    if key in data:
        return data[key]
    if default is _REQUIRED:
        raise FormatError(f"{where} has no {key!r}")
    return default


def _expect(data: dict, key: str, wanted, default, where: str, why: str) -> None:
    """``data[key]`` (or the stack's default for it) must be ``wanted``."""
    value = _get(data, key, where, default)
    if value != wanted:
        raise FormatError(f"{where}: {key} is {value!r}, but the eaglewire drafter needs {wanted!r} ({why})")


def _section(data: dict, key: str, where: str, default=_REQUIRED) -> dict:
    value = _get(data, key, where, default)
    if not isinstance(value, dict):
        raise FormatError(f"{where}: {key} must be an object, got {value!r}")
    return value


def _ids(value, where: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise FormatError(f"{where}: eagle_aux_hidden_state_layer_ids must be a non-empty list of integers, got {value!r}")
    return value


def _read_layer(data: dict, where: str) -> dict:
    """DrafterConfig fields of a LlamaConfig-style dict (absent fields take LlamaConfig's defaults)."""
    _expect(data, "model_type", "llama", _REQUIRED, where, "only Llama decoder layers are supported")
    layers = _get(data, "num_hidden_layers", where)
    if not (isinstance(layers, int) and layers >= 1):
        raise FormatError(f"{where}: num_hidden_layers must be a whole number >= 1, got {layers!r}")
    _expect(data, "hidden_act", "silu", "silu", where, "its MLP is SwiGLU")
    for flag in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        _expect(data, flag, False, False, where, "its projections have no bias and its lm_head is its own")
    _expect(data, "rope_scaling", None, None, where, "only plain RoPE is supported")
    rope = _get(data, "rope_parameters", where, None)  # transformers 5 writes it, 4 writes rope_theta
    if rope is not None and not isinstance(rope, dict):
        raise FormatError(f"{where}: rope_parameters must be an object, got {rope!r}")
    theta = _get(data, "rope_theta", where, LLAMA_ROPE_THETA if rope is None else rope.get("rope_theta"))
    if rope is not None and rope != {"rope_type": "default", "rope_theta": theta}:
        raise FormatError(f"{where}: rope_parameters {rope} is not plain RoPE with rope_theta {theta}")
    hidden, heads = _get(data, "hidden_size", where), _get(data, "num_attention_heads", where)
    return {
        "hidden_size": hidden,
        "intermediate_size": _get(data, "intermediate_size", where),
        "num_attention_heads": heads,
        "num_key_value_heads": _get(data, "num_key_value_heads", where, heads),
        "head_dim": _get(data, "head_dim", where, hidden // heads),
        "vocab_size": _get(data, "vocab_size", where),
        "rms_norm_eps": float(_get(data, "rms_norm_eps", where, LLAMA_RMS_NORM_EPS)),
        "rope_theta": float(theta),
        "max_position_embeddings": _get(data, "max_position_embeddings", where, LLAMA_MAX_POSITIONS),
        "num_layers": layers,
    }


def _with_drafter_fields(data: dict, shape: dict, where: str) -> dict:
    """The layer's fields plus the drafter's own: draft_vocab_size, and a target_hidden_size equal to hidden."""
    target_hidden = _get(data, "target_hidden_size", where, None)
    if target_hidden not in (None, shape["hidden_size"]):
        raise FormatError(
            f"{where}: target_hidden_size {target_hidden} != hidden_size {shape['hidden_size']}; "
            "eaglewire drafters share the target's width"
        )
    return shape | {"draft_vocab_size": _get(data, "draft_vocab_size", where)}


def _check_flags(data: dict, stack: Stack, where: str) -> None:
    """Every flag ``stack`` reads must have the value under which it computes the eaglewire forward."""
    for flag in stack.flags:
        _expect(data, flag.name, flag.eaglewire, _REQUIRED if flag.default is None else flag.default, where, flag.why)


def _read_eagle3_llama(data: dict, where: str, architectures: tuple[str, ...]) -> dict:
    if data.get("architectures") not in [[a] for a in architectures]:
        raise FormatError(f"{where} declares architectures {data.get('architectures')!r}, expected one of {list(architectures)}")
    _expect(data, "bias", False, False, where, "its fc has no bias")
    _expect(data, "norm_before_residual", False, False, where, "its residual is the un-normed fused hidden")
    eagle_config = _section(data, "eagle_config", where, {})
    _expect(eagle_config, "use_aux_hidden_state", True, True, f"{where} eagle_config", "it fuses aux states")
    return _with_drafter_fields(data, _read_layer(data, where), where)


def _stack_ids(data: dict, where: str, stack: Stack) -> list[int] | None:
    """The ids ``stack`` reads (stacks.py); a folder whose two id places differ, or that the stack's
    code paths read differently, is refused."""
    _ids(data.get(IDS_KEY), where)  # both places must hold lists of integers, whichever one the stack reads
    _ids(data.get("eagle_config", {}).get(IDS_KEY), f"{where} eagle_config")
    differ = id_places_differ(data)
    if differ is not None:
        raise FormatError(f"{where}: {differ}")
    read = ids_read(stack, data)
    values = {path: (None if found is None else found[1]) for path, found in read.items()}
    if len({repr(v) for v in values.values()}) > 1:
        readings = "; ".join(f"its {path} reads {read[path][0]} = {v}" if v is not None else
                             f"its {path} finds none and captures its default" for path, v in values.items())
        raise FormatError(
            f"{where}: {stack.name} {stack.version} reads this folder's ids differently per code path ({readings}), "
            f"so what it captures depends on how it is run; write the ids at {IDS_KEY} (top level), where every "
            f"{stack.name} path reads them, or import the folder with --from the stack it was written for"
        )
    return next(iter(values.values()))


def _read_vllm(data: dict, where: str) -> ForeignConfig:
    shape = _read_eagle3_llama(data, where, (ARCHITECTURE, "Eagle3LlamaForCausalLM"))
    _check_flags(data, STACKS["vllm"], where)
    return ForeignConfig(shape, _stack_ids(data, where, STACKS["vllm"]))


def _read_sglang(data: dict, where: str) -> ForeignConfig:
    shape = _read_eagle3_llama(data, where, (ARCHITECTURE,))
    _check_flags(data, STACKS["sglang"], where)
    return ForeignConfig(shape, _stack_ids(data, where, STACKS["sglang"]))


def _read_specforge(data: dict, where: str) -> ForeignConfig:
    shape = _read_eagle3_llama(data, where, (ARCHITECTURE,))
    _check_flags(data, STACKS["specforge"], where)
    return ForeignConfig(shape, _stack_ids(data, where, STACKS["specforge"]))


def _read_speculators(data: dict, where: str) -> ForeignConfig:
    _expect(data, "speculators_model_type", "eagle3", _REQUIRED, where, "it is an EAGLE-3 drafter")
    _check_flags(data, STACKS["speculators"], where)
    layer = _read_layer(_section(data, "transformer_layer_config", where), f"{where} transformer_layer_config")
    shape = _with_drafter_fields(data, layer, where)
    return ForeignConfig(shape, _stack_ids(data, where, STACKS["speculators"]))


def _read_eagle(data: dict, where: str) -> ForeignConfig:
    if data.get("architectures") != ["LlamaForCausalLM"]:
        raise FormatError(f"{where} declares architectures {data.get('architectures')!r}; EAGLE-3 writes ['LlamaForCausalLM']")
    _expect(data, "pretraining_tp", 1, 1, where, "its projections are not split")
    shape = _with_drafter_fields(data, _read_layer(data, where), where)
    derived = shape["hidden_size"] // shape["num_attention_heads"]
    if shape["head_dim"] != derived:
        raise FormatError(f"{where}: head_dim {shape['head_dim']}, but EAGLE's attention uses hidden_size // heads = {derived}")
    return ForeignConfig(shape, None)


# ---- writing configs -------------------------------------------------------------------


def _eagle3_llama(config: DrafterConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": [ARCHITECTURE],
        **llama_layer_fields(config, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "bias": False,  # SGLang builds fc with bias=config.bias
        "norm_before_residual": False,  # the residual is the un-normed fused hidden
    }


def _write_vllm(config: DrafterConfig, ids: list[int], meta: CheckpointMeta, dtype: torch.dtype) -> dict:
    # vLLM reads the ids at the top level only; eagle_config names none, so SGLang never reads vLLM's spelling.
    return _eagle3_llama(config, dtype) | {
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"use_aux_hidden_state": True},
    }


def _write_sglang(config: DrafterConfig, ids: list[int], meta: CheckpointMeta, dtype: torch.dtype) -> dict:
    # SGLang reads eagle_config only. No top-level ids, but vLLM 0.33.0's V1 runner falls back to these in its own
    # convention: export warns that this folder is not for vLLM (stacks.py).
    return _eagle3_llama(config, dtype) | {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    }


def _write_specforge(config: DrafterConfig, ids: list[int], meta: CheckpointMeta, dtype: torch.dtype) -> dict:
    return _write_sglang(config, ids, meta, dtype)  # its flags (norm_output: true) come from its row in stacks.py


def _write_speculators(config: DrafterConfig, ids: list[int], meta: CheckpointMeta, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": llama_layer_fields(config, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        # The forward's flags (norm_before_residual above all: vLLM reads it absent as True) come from stacks.py.
        "eagle_aux_hidden_state_layer_ids": ids,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": SPECULATIVE_TOKENS}],
            "default_proposal_method": "greedy",
            # export_checkpoint fills in the verifier (--verifier), which speculators resolves with from_pretrained.
        },
    }


def _write_eagle(config: DrafterConfig, ids: list[int], meta: CheckpointMeta, dtype: torch.dtype) -> dict:
    derived = config.hidden_size // config.num_attention_heads
    if config.head_dim != derived:
        raise FormatError(f"EAGLE's attention uses head_dim = hidden_size // heads = {derived}; this drafter has {config.head_dim}")
    # No target_hidden_size: with it EAGLE would not load the target's embedding. No ids: EAGLE reads none.
    return {
        "architectures": ["LlamaForCausalLM"],
        **llama_layer_fields(config, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "rope_scaling": None,
        "pretraining_tp": 1,
        "bias": False,
    }


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(STACKS["sglang"], LAYER_PREFIX, WEIGHTS_FILE, _write_sglang, _read_sglang,
               ambiguity="SGLang changed what an id means at PR #25454 (in sglang 0.5.23 llama.py "
                         "still adds 1 to every id, deepseek_v2.py only when the first id is 1), and its config does "
                         "not say which rule it was written for"),
        Format(STACKS["vllm"], LAYER_PREFIX, WEIGHTS_FILE, _write_vllm, _read_vllm),
        Format(STACKS["speculators"], "layers.0.", WEIGHTS_FILE, _write_speculators, _read_speculators),
        Format(STACKS["specforge"], LAYER_PREFIX, WEIGHTS_FILE, _write_specforge, _read_specforge),
        Format(STACKS["eagle"], LAYER_PREFIX, BIN_WEIGHTS_FILE, _write_eagle, _read_eagle),
    )
}


def format_named(name: str) -> Format:
    if name not in FORMATS:
        raise FormatError(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


# ---- export ----------------------------------------------------------------------------


def _reads_as(rule: str, ids: list[int], num_layers: int) -> Wiring | None:
    try:
        return convention(rule).from_ids(ids, num_layers)
    except WiringError:
        return None


def _stack_rules(fmt: Format, model_type: str) -> tuple[str, ...]:
    """The conventions ``fmt``'s stack reads ids by for a ``model_type`` target (SGLang: per model file)."""
    if fmt.name != "sglang":
        return fmt.conventions
    try:
        return sglang_rules(model_type)
    except WiringError as exc:
        raise FormatError(str(exc)) from exc


def _export_rules(fmt: Format, engine_version: str | None, model_type: str) -> tuple[str, ...]:
    if engine_version is None:
        return _stack_rules(fmt, model_type)
    versions = {rule.removeprefix(f"{fmt.name}-"): rule for rule in fmt.conventions if rule != fmt.name}
    if not versions:
        raise FormatError(f"{fmt.name} never changed what its ids mean; --engine-version applies only to --to sglang")
    if engine_version not in versions:
        raise FormatError(f"unknown {fmt.name} engine version {engine_version!r}; choose {' or '.join(versions)}")
    return (versions[engine_version],)


def _export_ids(fmt: Format, meta: CheckpointMeta, rules: tuple[str, ...]) -> list[int]:
    """Ids that every rule in ``rules`` reads as the drafter's wiring."""
    wiring, n = meta.wiring, meta.num_layers
    spellings = {}
    for rule in rules:
        try:
            spellings[rule] = convention(rule).to_ids(wiring, n)
        except WiringError as exc:
            raise FormatError(f"{fmt.name} cannot capture this drafter's wiring: {exc}") from exc
    for ids in spellings.values():
        if all(_reads_as(rule, ids, n) == wiring for rule in rules):
            break
    else:
        readings = "; ".join(f"{rule} needs {ids}" for rule, ids in spellings.items())
        raise FormatError(
            f"no ids capture {wiring} under every {fmt.name} rule ({readings}). {fmt.ambiguity}: pass --engine-version "
            + " or ".join(rule.removeprefix(f"{fmt.name}-") for rule in rules)
        )
    if fmt.ids_fixed and ids != convention(rules[0]).default_ids(n):
        fixed = convention(rules[0]).default_ids(n)
        raise FormatError(
            f"{fmt.name} captures only its hard-coded ids {fixed} = {convention(rules[0]).from_ids(fixed, n)}, "
            f"but this drafter was trained on {wiring}; serve it with another stack"
        )
    return ids


def _later_norms_renamed(tensors: dict[str, torch.Tensor], num_layers: int, old: str | None,
                         new: str | None) -> dict[str, torch.Tensor]:
    """``tensors`` with each later layer's pre-attention norm renamed from ``old`` to ``new`` (stacks.py)."""
    if num_layers == 1 or old == new:
        return tensors
    names = {later_layer_norm_name(i, old): later_layer_norm_name(i, new) for i in range(1, num_layers)}
    return {names.get(key, key): t for key, t in tensors.items()}


def _weights_bytes(tensors: dict[str, torch.Tensor], file_name: str) -> bytes:
    if file_name == BIN_WEIGHTS_FILE:
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        return buffer.getvalue()
    return save(tensors, metadata={"format": "pt"})


def _write_folder(out: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into ``out`` (new or empty) all at once: a crash leaves no half-written folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FormatError(f"will not write into {out}: it exists and is not an empty folder")

    def write(tmp: Path) -> None:
        for name, data in files.items():
            atomic_write_bytes(tmp / name, data)

    replace_folder(out, write)


# A Hugging Face hub repo id, as from_pretrained resolves it: owner/name.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def _verifier_embedding(verifier: str, meta: CheckpointMeta) -> tuple[torch.Tensor | None, list[str]]:
    """Check ``--verifier`` is a location speculators resolves to the drafter's target.

    A local Hugging Face folder is read: its config must match the target's shape and its token embedding
    is returned, to be compared with the target's. A hub id cannot be checked offline (None). Anything
    else (an eaglewire alias such as ``smollm2-135m``, a .gguf file) is refused.
    """
    path = Path(verifier).expanduser()
    how = ("speculators' from_pretrained resolves speculators_config.verifier.name_or_path as a local Hugging "
           "Face folder or a hub id (owner/name) to fill the verifier's lm_head and norm and resolve the layer ids")
    fix = ("pass --verifier with the target as a Hugging Face folder (config.json, model.safetensors and the "
           "tokenizer; for a .gguf target, load it with transformers and save_pretrained it) or its hub id, "
           "e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
    if not path.exists():
        if _HUB_ID.match(verifier):
            return None, []
        raise FormatError(f"--verifier {verifier!r} is neither a local folder nor a hub id: {how}, so it would ask "
                          f"the hub for a repo named {verifier!r} and fail. {fix}")
    if not (path.is_dir() and (path / CONFIG_FILE).is_file()):
        raise FormatError(f"--verifier {path} is not a Hugging Face model folder (no {CONFIG_FILE}): {how}. {fix}")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise FormatError(f"--verifier {path / CONFIG_FILE} is not valid JSON: {exc}") from exc
    wrong = [f"{key} {config.get(key)!r} (the target has {meta.target[field]})"
             for key, field in (("num_hidden_layers", "num_layers"), ("hidden_size", "hidden_size"),
                                ("vocab_size", "vocab_size")) if config.get(key) != meta.target[field]]
    if wrong:
        raise FormatError(f"--verifier {path} is not the target this drafter was trained on: it has "
                          f"{', '.join(wrong)}. {fix}")
    return _embedding_in_folder(path), []


def _embedding_in_folder(folder: Path) -> torch.Tensor:
    """The token embedding of a Hugging Face folder's safetensors weights (one file or an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (folder / WEIGHTS_FILE).is_file():
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as handle:
            weight_map = dict.fromkeys(handle.keys(), WEIGHTS_FILE)
    else:
        raise FormatError(f"--verifier {folder} has no {WEIGHTS_FILE} or model.safetensors.index.json; speculators "
                          "reads the verifier's weights from safetensors only")
    names = [k for k in weight_map if k.endswith("embed_tokens.weight")]
    if len(names) != 1:
        raise FormatError(f"--verifier {folder}: expected one token embedding (*embed_tokens.weight), found {names}")
    with safe_open(str(folder / weight_map[names[0]]), framework="pt") as handle:
        return handle.get_tensor(names[0])


def _speculators_extras(meta: CheckpointMeta, target: Target | None, verifier: str | None,
                        dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor], list[str]]:
    """What a speculators folder needs beyond the drafter: the verifier's location and the target's embedding."""
    if verifier is None:
        raise FormatError("--to speculators needs --verifier: the target as a local Hugging Face folder or a hub id, "
                          "which speculators loads to fill the verifier's lm_head and norm and to resolve the layer ids")
    verifier_embed, notes = _verifier_embedding(verifier, meta)
    if target is None:
        raise FormatError("--to speculators needs the target, to write its token embedding into the folder")
    try:
        meta.check_target(target.fingerprint)
    except ValueError as exc:
        raise FormatError(f"{exc}; pass --target with the model it was trained on") from exc
    table = target.layout.embed.weight.detach()
    if verifier_embed is not None:
        if verifier_embed.shape != table.shape or not torch.equal(verifier_embed.to(table.dtype), table):
            delta = ("shape " + str(tuple(verifier_embed.shape)) if verifier_embed.shape != table.shape else
                     f"max |delta| {(verifier_embed.to(table.dtype) - table).abs().max().item():.3g}")
            raise FormatError(
                f"--verifier {verifier} holds another token embedding than the target this drafter was trained on "
                f"({target.name}; {delta}); speculators and vLLM would verify and fill the drafter with other weights. "
                "Give the target the drafter was trained on (the same weights and quantization)")
    else:
        notes.append(f"--verifier {verifier} is a hub id and was not checked offline: it must hold the very weights "
                     f"of {target.name} (the same quantization) that the drafter was trained on")
    architectures = list(target.model.config.architectures or [])
    config = {"speculators_config": {"verifier": {"name_or_path": verifier, "architectures": architectures}}}
    # speculators reads the folder's own embedding (its NaN placeholder for one does not survive from_pretrained).
    return config, {"embed_tokens.weight": table.to(dtype).contiguous()}, notes


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def export_checkpoint(folder: Path, to: str, out: Path, engine_version: str | None = None,
                      verifier: str | None = None, target: Target | None = None) -> Conversion:
    """Write the native checkpoint ``folder`` as stack ``to`` loads it, into ``out``.

    ``verifier`` (speculators only): where speculators finds the target, a local Hugging Face folder or hub
    id. ``target`` (speculators only): the loaded target, whose embedding the folder carries; loaded from the
    checkpoint's record when not given.
    """
    fmt = format_named(to)
    if (verifier is not None or target is not None) and not fmt.stack.needs_embedding:
        raise FormatError(f"--verifier and --target apply only to --to speculators; {fmt.name} finds the target on its "
                          "command line")
    config, meta, tensors = read_checkpoint_state(Path(folder))
    if config.num_aux != EXPORT_AUX_STATES:
        raise FormatError(
            f"{fmt.name} builds its fc for exactly {EXPORT_AUX_STATES} aux states; this drafter fuses {config.num_aux} "
            f"({meta.wiring})"
        )
    if config.num_layers > 1 and fmt.stack.later_layer_norm is None:
        raise FormatError(f"{fmt.name} builds one decoder layer ({fmt.stack.layers_source}); this drafter has "
                          f"{config.num_layers}: export it --to vllm, sglang or speculators")
    rules = _export_rules(fmt, engine_version, meta.target["model_type"])
    ids = _export_ids(fmt, meta, rules)
    dtype = tensors["fc.weight"].dtype
    data = fmt.write(config, ids, meta, dtype) | {flag.name: flag.eaglewire for flag in fmt.stack.flags}
    renamed = _later_norms_renamed({rename_layer(key, LAYER_PREFIX, fmt.layer_prefix): t for key, t in tensors.items()},
                                   config.num_layers, LATER_LAYER_NORM, fmt.stack.later_layer_norm)
    notes: list[str] = []
    if fmt.stack.needs_embedding:
        if target is None and verifier is not None:
            _verifier_embedding(verifier, meta)  # refuse a bad --verifier before loading the target
            target = load_target(meta.target["name"])
        extra_config, extra_tensors, notes = _speculators_extras(meta, target, verifier, dtype)
        data, renamed = _merge(data, extra_config), renamed | extra_tensors
    for name in SERVING_STACKS:
        if name != fmt.name and fmt.name in SERVING_STACKS + ("specforge",):
            problems = serving_problems(STACKS[name], data, meta.wiring, meta.num_layers, set(renamed))
            if problems:
                notes.append(f"do not serve this folder with {name}: " + "; ".join(problems)
                             + f" (export --to {name} for that)")
    _write_folder(Path(out), {
        CONFIG_FILE: (json.dumps(data, indent=2) + "\n").encode(),
        fmt.weights_file: _weights_bytes(renamed, fmt.weights_file),
    })
    return Conversion(Path(out), meta.wiring, ids, rules, fmt.ids_at, tuple(notes))


# ---- import ----------------------------------------------------------------------------


def _read_config(folder: Path) -> tuple[dict, str]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise FormatError(f"{folder} has no {CONFIG_FILE}")
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path} is not valid JSON: {exc}") from exc


def read_foreign_weights(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The folder's one weights file; shards or a second file would leave tensors unaccounted for."""
    found = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")
                   or p.name.endswith(".index.json"))
    if found not in ([WEIGHTS_FILE], [BIN_WEIGHTS_FILE]):
        raise FormatError(
            f"{folder} must hold exactly one weights file, {WEIGHTS_FILE} or {BIN_WEIGHTS_FILE}; found {found or 'none'}"
        )
    path = folder / found[0]
    if path.name == WEIGHTS_FILE:
        return read_weights(path), path
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError) as exc:
        raise FormatError(f"cannot read {path}: {exc}") from exc
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise FormatError(f"{path} is not a flat dict of tensors")
    return tensors, path


def _import_rules(fmt: Format, requested: str | None, ids: list[int] | None, num_layers: int,
                  model_type: str) -> tuple[str, ...]:
    """The conventions the source's ids are read under; without --ids-convention, all of the stack's (for this
    target's family) when they all read the ids as the same tensors."""
    if requested is None:
        rules = _stack_rules(fmt, model_type)
        if len(rules) == 1:
            return rules
        if ids is not None:
            readings = {_reads_as(rule, ids, num_layers) for rule in rules}
            if len(readings) == 1 and None not in readings:
                return rules
        readings = "" if ids is None else f" Its ids {ids} mean " + " and ".join(
            f"{_reads_as(rule, ids, num_layers) or 'nothing capturable'} under {rule}" for rule in rules
        ) + "."
        raise FormatError(
            f"{fmt.ambiguity}: pass --ids-convention {' or '.join(rules)}.{readings}"
        )
    if requested not in fmt.conventions:
        raise FormatError(
            f"{fmt.name} reads its ids by the {' or '.join(fmt.conventions)} rule; --ids-convention {requested} would "
            f"name other tensors than {fmt.name} captures"
        )
    return (requested,)


def _import_wiring(fmt: Format, rule: str, ids: list[int] | None, wiring: str | None, where: str,
                   num_layers: int) -> tuple[Wiring, list[int] | None]:
    conv = convention(rule)
    if fmt.ids_fixed:
        ids = conv.default_ids(num_layers)
    if ids is None:
        if wiring is None:
            default = conv.from_ids(conv.default_ids(num_layers), num_layers)
            raise FormatError(
                f"{where} names no aux layer ids ({fmt.ids_at}), so nothing records which tensors the drafter was "
                f"trained on ({fmt.name} would capture its default, {default}); pass --wiring with the points it was "
                "trained on"
            )
        return Wiring.resolve(wiring, num_layers), None
    try:
        read = conv.from_ids(ids, num_layers)
    except WiringError as exc:
        raise FormatError(f"{where}: ids {ids} cannot be captured under {rule}: {exc}") from exc
    if wiring is not None and Wiring.parse(wiring) != read:
        raise FormatError(f"--wiring {wiring} disagrees with {where}: {rule} reads its ids {ids} as {read}")
    return read, ids


def _without_target_embedding(tensors: dict[str, torch.Tensor], embed: torch.nn.Embedding,
                              where: Path) -> dict[str, torch.Tensor]:
    """Drop a stored embedding that is the target's; any other would change what the drafter computes."""
    if "embed_tokens.weight" not in tensors:
        return tensors
    own, table = tensors["embed_tokens.weight"], embed.weight.detach()
    if own.shape != table.shape or not torch.equal(own, table.to(own.dtype)):
        raise FormatError(
            f"{where} carries an embed_tokens.weight that is not the target's embedding; an eaglewire drafter "
            "reads the target's frozen embedding, so importing it would change what the drafter computes"
        )
    return {key: t for key, t in tensors.items() if key != "embed_tokens.weight"}


def import_checkpoint(folder: Path, from_: str, out: Path, target: Target, ids_convention: str | None = None,
                      wiring: str | None = None) -> Conversion:
    """Turn the ``from_`` drafter in ``folder`` into a native checkpoint at ``out`` for the loaded ``target``."""
    fmt, folder = format_named(from_), Path(folder)
    data, where = _read_config(folder)
    foreign = fmt.read(data, where)
    tensors, weights_path = read_foreign_weights(folder)
    rules = _import_rules(fmt, ids_convention, foreign.ids, target.num_layers, target.fingerprint["model_type"])
    rule = rules[-1]  # several only when they all read the ids alike; the native checkpoint records the newest
    read, ids = _import_wiring(fmt, rule, foreign.ids, wiring, where, target.num_layers)
    try:
        config = DrafterConfig(**foreign.shape, num_aux=len(read.aux))
    except ValueError as exc:
        raise FormatError(f"{where}: {exc}") from exc
    for key in ("hidden_size", "vocab_size"):
        if getattr(config, key) != target.fingerprint[key]:
            raise FormatError(f"{where}: {key} {getattr(config, key)}, but target {target.name!r} has {target.fingerprint[key]}")
    tensors = _without_target_embedding(tensors, target.layout.embed, weights_path)
    if config.num_layers > 1:
        if fmt.stack.later_layer_norm is None:
            raise FormatError(f"{where}: {fmt.name} builds one decoder layer ({fmt.stack.layers_source}), so no "
                              f"{fmt.name} folder holds {config.num_layers}; import it --from the stack that wrote it")
        unread = [name for i in range(1, config.num_layers) if fmt.stack.later_layer_norm != LATER_LAYER_NORM
                  and (name := later_layer_norm_name(i, LATER_LAYER_NORM)) in tensors]
        if unread:
            raise FormatError(f"{weights_path}: {fmt.name} never reads {', '.join(unread)} (its layers after the first "
                              f"normalise with {fmt.stack.later_layer_norm}), so what it serves is not this file's "
                              "drafter; import the folder --from the stack it was written for")
        tensors = _later_norms_renamed(tensors, config.num_layers, fmt.stack.later_layer_norm, LATER_LAYER_NORM)
    check_state_keys(tensors, config, str(weights_path), fmt.layer_prefix)
    native = {rename_layer(key, fmt.layer_prefix, LAYER_PREFIX): t for key, t in tensors.items()}
    drafter = drafter_from_state(config, target.layout.embed, native, str(weights_path))
    save_checkpoint(Path(out), drafter, CheckpointMeta(read, target.fingerprint, convention=rule))
    return Conversion(Path(out), read, ids, rules, fmt.ids_at)
