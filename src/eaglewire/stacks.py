"""What each stack reads from a drafter folder, per released version: the one table.

``formats`` (export and import), checkpoint loading and the doctor all read this
table; none keeps its own copy. A stack's new release is one new row in ``STACKS``
(and the old row kept while its folders are still served).

Every rule below was read from the released wheel (``pip download --no-deps
NAME==VERSION``, unzip), in the file named beside it. ``checked`` says how the row
was verified: "run" (the stack itself loaded and ran an eaglewire export, see
``scripts/interop/``) or "read" (its source was read, it was not run here).

A stack may read the aux layer ids on more than one code path (vLLM's two model
runners); a folder is wired unambiguously for that stack only when every path
reads the same ids. A path that finds no ids captures the target's default
``(2, n//2, n-3)`` in its own convention.
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine_ids import convention
from .wiring import Wiring, WiringError

IDS_KEY = "eagle_aux_hidden_state_layer_ids"
NESTED_IDS_KEY = f"eagle_config.{IDS_KEY}"
# The stacks that serve a LlamaForCausalLMEagle3 folder (native, --to sglang, --to vllm) as is. SpecForge
# trains on one; EAGLE and speculators folders declare other architectures.
SERVING_STACKS = ("vllm", "sglang")


@dataclass(frozen=True)
class IdsPath:
    """One code path of a stack that reads the aux layer ids."""

    name: str  # e.g. "V1 runner"; "" when the stack has one path
    keys: tuple[str, ...]  # config keys in order of precedence ("a.b" = data["a"]["b"]); the first present wins
    source: str  # wheel file it was read from


@dataclass(frozen=True)
class Flag:
    """A config flag that changes the drafter's forward in this stack."""

    name: str
    default: bool | None  # what the stack reads when the folder omits it; None: its readers disagree, so it must be written
    meaning: str  # what ``true`` does in this stack
    eaglewire: bool  # the value under which this stack computes what the eaglewire drafter computes
    why: str  # the eaglewire drafter's behaviour that value matches
    source: str


@dataclass(frozen=True)
class Stack:
    name: str  # also the ``--to`` / ``--from`` format name
    version: str  # the released version this row was read from
    checked: str  # "run" or "read"
    ids_paths: tuple[IdsPath, ...]  # empty: the stack captures hard-coded ids and reads none
    conventions: tuple[str, ...]  # engine_ids conventions its ids follow (several where builds differ)
    flags: tuple[Flag, ...]
    weights: str  # the weight names it loads
    unknown_weights: str  # what it does with names it does not know
    embedding: str  # where its token embedding comes from
    needs_embedding: bool  # the folder must carry embed_tokens.weight
    # Drafters of more than one decoder layer: the norm whose weight a layer after the first applies before its
    # attention, as named in the weights file (None: the stack builds one layer whatever the config says), and where
    # that was read. Every stack that builds later layers builds them as Llama decoder layers over the hidden state.
    later_layer_norm: str | None
    layers_source: str

    @property
    def ids_at(self) -> str:
        """Where the stack reads the ids, in words."""
        if not self.ids_paths:
            return "nowhere: hard-coded (2, n//2, n-3)"
        return "; ".join((f"{p.name}: " if p.name else "") + ", else ".join(_key_name(k) for k in p.keys)
                         for p in self.ids_paths)


def _key_name(key: str) -> str:
    return key if "." in key else f"{key} (top level)"


def config_value(data: dict, key: str):
    """``data[key]``, with ``a.b`` reading ``data["a"]["b"]``; None when absent."""
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def id_places_differ(data: dict) -> str | None:
    """The sentence saying that a config's two id places hold different ids (the top level, which vLLM reads
    first, and eagle_config, which SGLang and SpecForge read), or None when they agree or one is absent."""
    top, nested = config_value(data, IDS_KEY), config_value(data, NESTED_IDS_KEY)
    if top is None or nested is None or top == nested:
        return None
    return (f"{IDS_KEY} {top} disagrees with eagle_config's {nested}: vLLM reads the top level first, SGLang and "
            "SpecForge read eagle_config, so the engines would capture different layers")


def ids_read(stack: Stack, data: dict) -> dict[str, tuple[str, object] | None]:
    """Per ids path of ``stack``: (the key it reads, the value there), or None (it captures its default).

    A key holding nothing (absent, null, empty) falls through to the next, as in every stack's code.
    """
    read = {}
    for path in stack.ids_paths:
        found = None
        for key in path.keys:
            value = config_value(data, key)
            if value:
                found = (key, value)
                break
        read[path.name] = found
    return read


# ---- the table -------------------------------------------------------------------------------

_VLLM = "vllm 0.33.0"
_SGLANG = "sglang 0.5.23"
_SPECULATORS = "speculators 0.9.0"
_SPECFORGE = "specforge 0.2.0"

_NORM_OUTPUT_NEXT_STEP = "the next draft step reads the normed hidden instead of the pre-norm one"
_PRE_NORM_NEXT = "its next draft step reads its pre-norm output"
_NORM_BEFORE_RESIDUAL = "the residual is the normed fused hidden instead of the un-normed one"
_UNNORMED_RESIDUAL = "its residual is the un-normed fused hidden"
_FC_NORM = "each aux state is RMS-normed before fc"
_NORM_BEFORE_FC = "the concatenated aux states are RMS-normed before fc"
_UNNORMED_FC = "it feeds the aux states to fc un-normed"

STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack(
            "vllm", "0.33.0", "read",
            ids_paths=(
                IdsPath("V1 runner", (IDS_KEY, NESTED_IDS_KEY), f"{_VLLM} vllm/v1/worker/gpu_model_runner.py "
                        "_get_eagle3_aux_layers_from_config"),
                IdsPath("V2 runner", (IDS_KEY,), f"{_VLLM} vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py "
                        "get_eagle3_aux_layers_from_config (its eagle_config fallback reads 'layer_ids', which no "
                        "EAGLE-3 folder writes; V2 is the default runner, vllm/config/vllm.py)"),
            ),
            conventions=("vllm",),
            flags=(
                Flag("norm_before_residual", False, _NORM_BEFORE_RESIDUAL, False, _UNNORMED_RESIDUAL,
                     f"{_VLLM} vllm/model_executor/models/llama_eagle3.py"),
                Flag("norm_before_fc", False, _NORM_BEFORE_FC, False, _UNNORMED_FC,
                     f"{_VLLM} vllm/model_executor/models/llama_eagle3.py"),
                Flag("fc_norm", False, _FC_NORM, False, _UNNORMED_FC, f"{_VLLM} vllm/model_executor/models/llama_eagle3.py"),
                Flag("norm_output", False, _NORM_OUTPUT_NEXT_STEP, False, _PRE_NORM_NEXT,
                     f"{_VLLM} vllm/model_executor/models/llama_eagle3.py (aux_output)"),
            ),
            weights="fc, midlayer.* (renamed layers.0.*), norm, lm_head, d2t (as draft_id_to_target_id); t2d skipped; "
                    "embed_tokens when present (llama_eagle3.py load_weights)",
            unknown_weights="AutoWeightsLoader raises on a name it cannot place",
            embedding="the target's, shared when the folder has no embed_tokens",
            needs_embedding=False,
            later_layer_norm="input_layernorm",
            layers_source=f"{_VLLM} vllm/model_executor/models/llama_eagle3.py: num_hidden_layers layers, q/k/v of "
                          "layers after the first read hidden_size, their input_layernorm normalises the residual "
                          "stream (their hidden_norm is built and unused); layer i loads layers.i.*",
        ),
        Stack(
            "speculators", "0.9.0", "run",
            ids_paths=(IdsPath("", (IDS_KEY,), f"{_SPECULATORS} speculators/models/eagle3/config.py; vLLM maps it "
                               f"unchanged ({_VLLM} vllm/transformers_utils/configs/speculators/algos.py)"),),
            conventions=("speculators",),
            flags=(
                # vLLM reads a speculators config without norm_before_residual as True, speculators as False.
                Flag("norm_before_residual", None, _NORM_BEFORE_RESIDUAL, False, _UNNORMED_RESIDUAL,
                     f"{_VLLM} vllm/transformers_utils/configs/speculators/algos.py (default True; "
                     f"{_SPECULATORS} config.py defaults it to False)"),
                Flag("norm_before_fc", False, _NORM_BEFORE_FC, False, _UNNORMED_FC,
                     f"{_SPECULATORS} speculators/models/eagle3/config.py"),
                Flag("fc_norm", False, _FC_NORM, False, _UNNORMED_FC, f"{_SPECULATORS} speculators/models/eagle3/config.py"),
                Flag("norm_output", False, _NORM_OUTPUT_NEXT_STEP, False, _PRE_NORM_NEXT,
                     f"{_SPECULATORS} speculators/models/eagle3/core.py forward"),
            ),
            weights="fc, layers.0.*, norm, lm_head, d2t, t2d, embed_tokens (speculators/models/eagle3/core.py)",
            unknown_weights="transformers from_pretrained warns and drops them",
            embedding=("the folder's embed_tokens.weight: from_pretrained's load_verifier_weights copies the "
                       "verifier's only into a NaN placeholder, and the placeholder does not survive from_pretrained "
                       f"({_SPECULATORS} speculators/model.py), so a folder without it drafts on a zero embedding"),
            needs_embedding=True,
            later_layer_norm="input_layernorm",
            layers_source=f"{_SPECULATORS} speculators/models/eagle3/core.py: transformer_layer_config."
                          "num_hidden_layers layers, those after the first transformers' LlamaDecoderLayer "
                          "(layers.i.*)",
        ),
        Stack(
            "sglang", "0.5.23", "read",
            ids_paths=(IdsPath("", (NESTED_IDS_KEY,), f"{_SGLANG} sglang/srt/model_executor/model_runner_components/"
                               "spec_aux_hidden_state.py _resolve_eagle_aux_hidden_state"),),
            # llama.py shifts every explicit id by +1; deepseek_v2.py only when ids[0] == 1 (PR #25454).
            conventions=("sglang-pre-25454", "sglang-post-25454"),
            flags=(
                Flag("norm_before_fc", False, _NORM_BEFORE_FC, False, _UNNORMED_FC,
                     f"{_SGLANG} sglang/srt/models/llama_eagle3.py"),
                Flag("fc_norm", False, _FC_NORM, False, _UNNORMED_FC, f"{_SGLANG} sglang/srt/models/llama_eagle3.py"),
                Flag("norm_output", False, _NORM_OUTPUT_NEXT_STEP, False, _PRE_NORM_NEXT,
                     f"{_SGLANG} sglang/srt/models/llama_eagle3.py (aux of the draft decode)"),
            ),
            weights="fc, midlayer.*, norm, lm_head; d2t turned into hot token ids; t2d skipped (llama_eagle3.py)",
            unknown_weights="skipped silently: a misnamed layer serves random weights",
            embedding="the target's (tie_word_embeddings makes lm_head the embedding)",
            needs_embedding=False,
            later_layer_norm="hidden_norm",
            layers_source=f"{_SGLANG} sglang/srt/models/llama_eagle3.py: num_hidden_layers layers; those after the "
                          "first normalise the residual stream with hidden_norm (their input_layernorm is built and "
                          "unused, and a missing norm weight loads silently as ones); layer i loads layers.i.*",
        ),
        Stack(
            "specforge", "0.2.0", "read",
            ids_paths=(IdsPath("", (NESTED_IDS_KEY,), f"{_SPECFORGE} specforge/algorithms/model_providers.py "
                               "resolve_eagle_capture_layers"),),
            conventions=("specforge",),
            flags=(
                Flag("fc_norm", False, _FC_NORM, False, _UNNORMED_FC, f"{_SPECFORGE} specforge/modeling/draft/llama3_eagle.py"),
                Flag("norm_output", True, "logits are computed from the normed hidden", True,
                     "its logits read the normed hidden", f"{_SPECFORGE} specforge/modeling/draft/llama3_eagle.py "
                     "compute_logits"),
            ),
            weights="fc, midlayer.*, norm, lm_head, d2t, t2d, optional fc_norm.*, embed_tokens",
            unknown_weights="transformers from_pretrained warns and drops them",
            embedding="the target's, loaded by the trainer",
            needs_embedding=False,
            later_layer_norm=None,
            layers_source=f"{_SPECFORGE} specforge/modeling/draft/llama3_eagle.py builds one midlayer; "
                          "algorithms/eagle3/providers.py fixes num_hidden_layers at 1",
        ),
        Stack(
            "eagle", "cb7e084 (SafeAILab/EAGLE, no release)", "read",
            ids_paths=(),
            conventions=("eagle",),
            flags=(),
            weights="fc, midlayer.*, norm, lm_head, d2t, t2d (model/cnets.py), loaded non-strictly",
            unknown_weights="ignored (non-strict load)",
            embedding="the target's, loaded only when the config has no target_hidden_size",
            needs_embedding=False,
            later_layer_norm=None,
            layers_source="SafeAILab/EAGLE model/cnets.py builds one midlayer",
        ),
    )
}


# SGLang captures aux states in each target's own model file (set_eagle3_layers_to_capture), and the files
# disagree on what an id means. Per target family (config.model_type): the engine_ids conventions its
# model file follows, and where that was read (sglang 0.5.23 wheel, sglang/srt/models/). The llama family
# keeps both builds' rules (PR #25454 was written against llama.py; builds differ), so ids must read alike
# under both; every other family is its one file's rule.
_SGLANG_MODELS = "sglang 0.5.23 sglang/srt/models"
_PLUS_ONE = "adds 1 to every explicit id (layer{j}.out)"
SGLANG_ID_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    **{family: (("sglang-pre-25454", "sglang-post-25454"), (f"{_SGLANG_MODELS}/llama.py {_PLUS_ONE}; PR #25454 "
                                                                "builds change it")) for family in ("llama", "qwen2", "mistral")},
    "qwen3": (("sglang-pre-25454",), f"{_SGLANG_MODELS}/qwen3.py {_PLUS_ONE}"),
    "qwen3_moe": (("sglang-pre-25454",), f"{_SGLANG_MODELS}/qwen3_moe.py {_PLUS_ONE}"),
    "gemma3_text": (("sglang-pre-25454",), f"{_SGLANG_MODELS}/gemma3_causal.py {_PLUS_ONE}"),
    "deepseek_v3": (("sglang-post-25454",), (f"{_SGLANG_MODELS}/deepseek_v2.py adds 1 only when ids[0] == 1, "
                                              "else uses the ids verbatim as slots (the stream entering layer j)")),
    "qwen2_5_vl": (("sglang-pre-25454",), f"{_SGLANG_MODELS}/qwen2_5_vl.py {_PLUS_ONE}"),
    "qwen3_vl": (("sglang-pre-25454",), f"{_SGLANG_MODELS}/qwen3_vl.py {_PLUS_ONE}"),
    "gemma3": (("sglang-pre-25454",), (f"{_SGLANG_MODELS}/gemma3_mm.py delegates to gemma3_causal.py, which "
                                        f"{_PLUS_ONE}")),
    "llava": ((), f"{_SGLANG_MODELS}/llava.py has no set_eagle3_layers_to_capture: no EAGLE-3 on this target"),
}


def sglang_rules(model_type: str) -> tuple[str, ...]:
    """The conventions SGLang's model file for a ``model_type`` target reads its ids by; refuses unknown ones."""
    if model_type not in SGLANG_ID_RULES:
        raise WiringError(f"no SGLang id rule is recorded for {model_type!r} targets (stacks.SGLANG_ID_RULES)")
    rules, source = SGLANG_ID_RULES[model_type]
    if not rules:
        raise WiringError(f"SGLang cannot capture aux states of a {model_type!r} target: {source}")
    return rules


def flag_problems(stack: Stack, data: dict) -> list[str]:
    """Flags in ``data`` under which ``stack`` computes something else than the eaglewire drafter, in words."""
    problems = []
    for flag in stack.flags:
        if flag.name not in data and flag.default is None:
            problems.append(f"{flag.name} is absent, and {stack.name}'s readers disagree on its default (see "
                            f"{flag.source}); the drafter needs {flag.eaglewire}: {flag.why}")
            continue
        value = data.get(flag.name, flag.default)
        if value != flag.eaglewire:
            stated = "" if flag.name in data else f" (absent, read as {flag.default})"
            effect = flag.meaning if value else f"the opposite of: {flag.meaning}"
            problems.append(f"{flag.name} is {value}{stated}: in {stack.name} {stack.version} that means {effect}, "
                            f"but the drafter was trained so that {flag.why}")
    return problems


def captured_by(stack: Stack, data: dict, num_layers: int) -> dict[str, tuple[str, object]]:
    """Per ids path and convention of ``stack``: (where the ids come from, the ``Wiring`` it captures for
    ``data``, or why it can capture nothing)."""
    captured = {}
    for path, found in ids_read(stack, data).items():
        for rule in stack.conventions:
            label = " ".join(part for part in (path, f"({rule})" if len(stack.conventions) > 1 else "") if part)
            conv = convention(rule)
            ids = conv.default_ids(num_layers) if found is None else found[1]
            where = f"no ids, so its default {ids}" if found is None else f"{found[0]} = {ids}"
            try:
                captured[label] = (where, conv.from_ids(ids, num_layers))
            except (WiringError, TypeError, ValueError) as exc:
                captured[label] = (where, f"nothing it can capture ({exc})")
    return captured


def serving_problems(stack: Stack, data: dict, wiring: Wiring, num_layers: int,
                     weight_names: set[str] | None = None) -> list[str]:
    """How ``stack`` would run the folder ``data`` (config.json) differently from the drafter trained on ``wiring``:
    ids it reads as other tensors, flags it reads otherwise, a weight it needs that the folder lacks."""
    problems = []
    for label, (where, reading) in captured_by(stack, data, num_layers).items():
        if reading != wiring:
            problems.append(f"{stack.name} {stack.version}{' ' + label if label else ''} reads {where}, which "
                            f"captures {reading}, not the trained {wiring}")
    problems += flag_problems(stack, data)
    if stack.needs_embedding and weight_names is not None and "embed_tokens.weight" not in weight_names:
        problems.append(f"the folder has no embed_tokens.weight: {stack.embedding}")
    return problems + layer_problems(stack, data, weight_names)


def decoder_layers_of(data: dict) -> int:
    """The decoder layers a drafter config declares (speculators nests them in transformer_layer_config)."""
    return (config_value(data, "num_hidden_layers") or config_value(data, "transformer_layer_config.num_hidden_layers")
            or 1)


def later_layer_norm_name(index: int, norm: str) -> str:
    """The weight of decoder layer ``index``'s pre-attention norm, named ``norm`` in a stack's file."""
    return f"layers.{index}.{norm}.weight"


def layer_problems(stack: Stack, data: dict, weight_names: set[str] | None = None) -> list[str]:
    """How ``stack`` would build a drafter of more than one decoder layer otherwise than it was trained."""
    layers = decoder_layers_of(data)
    if layers == 1:
        return []
    if stack.later_layer_norm is None:
        return [f"{stack.name} {stack.version} builds one decoder layer ({stack.layers_source}); this drafter has {layers}"]
    if weight_names is None:  # the names are unknown: nothing to check them against
        return []
    missing = [name for i in range(1, layers)
               if (name := later_layer_norm_name(i, stack.later_layer_norm)) not in weight_names]
    if missing:
        return [f"{stack.name} {stack.version} normalises each layer after the first with its "
                f"{stack.later_layer_norm}, which the folder lacks ({', '.join(missing)}; {stack.layers_source})"]
    return []
