"""The native drafter checkpoint: a folder SGLang and vLLM load as is.

  config.json        LlamaForCausalLMEagle3 config, eagle_config ids written for one
                     engine convention, and an ``eaglewire`` section (canonical wiring,
                     target fingerprint, data manifest hash, metrics, format version,
                     and the sha256 of the tensors as saved; older checkpoints lack it)
  model.safetensors  fc.weight, midlayer.*, layers.N.* (N >= 1, deeper drafters only),
                     norm.weight, lm_head.weight, d2t, t2d
                     (no embedding: the drafter uses the target's)

Saving builds the new folder beside the old one and swaps it in with renames,
so a crash leaves either the previous checkpoint or the new one, never a mix.
Loading is strict: missing or unexpected keys, wrong shapes, and layer ids that
do not read back to the recorded wiring are errors that say what went wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from ..engine_ids import convention
from ..errors import EaglewireError
from ..files import (
    atomic_write_bytes,
    atomic_write_json,
    previous_of,
    recover_folder_swap,
    replace_folder,
)
from ..stacks import IDS_KEY, SERVING_STACKS, STACKS, id_places_differ, ids_read
from ..target import fingerprint_mismatches
from ..wiring import Wiring, WiringError
from .model import (
    Drafter,
    DrafterConfig,
    draft_ids_of,
    expected_state_shapes,
    vocab_maps,
)

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_PREFIX = "midlayer."  # the decoder layer's name in the file
LATER_LAYER_NORM = "input_layernorm"  # a later decoder layer's pre-attention norm in the file (vLLM's name)
DEFAULT_CONVENTION = "vllm"
_OWNED_FILES = {CONFIG_FILE, WEIGHTS_FILE}
TENSORS_HASH_KEY = "tensors_sha256"  # in the eaglewire section
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class CheckpointError(EaglewireError):
    """A checkpoint folder that is missing, malformed, or not what the caller expects."""


@dataclass
class CheckpointMeta:
    """The ``eaglewire`` section of config.json."""

    wiring: Wiring
    target: dict  # target.fingerprint_of(...); its num_layers resolves the engine ids
    convention: str = DEFAULT_CONVENTION  # engine convention the eagle_config ids are written in
    data_manifest_sha256: str | None = None
    metrics: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # tensors_sha256() of the weights as saved (None before it existed). It describes the weights file, not
    # the drafter's identity, so it takes no part in comparing two metas.
    tensors_sha256: dict[str, str] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        lacking = [key for key in ("num_layers", "hidden_size", "vocab_size") if key not in self.target]
        if lacking:
            raise CheckpointError(f"the target fingerprint lacks {', '.join(lacking)}; pass target.fingerprint_of(...)")
        try:
            convention(self.convention)
        except WiringError as exc:
            raise CheckpointError(str(exc)) from exc

    @property
    def num_layers(self) -> int:
        return int(self.target["num_layers"])

    def check_target(self, fingerprint: dict) -> None:
        """Raise unless ``fingerprint`` is the target this drafter was trained on."""
        differences = fingerprint_mismatches(self.target, fingerprint)
        if differences:
            raise CheckpointError(
                f"this drafter was trained on target {self.target.get('name')!r}, which differs from "
                f"{fingerprint.get('name')!r}: " + "; ".join(differences)
            )

    def to_json(self) -> dict:
        out = {
            "format_version": self.format_version,
            "wiring": self.wiring.to_json(),
            "engine_convention": self.convention,
            "target": self.target,
            "data_manifest_sha256": self.data_manifest_sha256,
            "metrics": self.metrics,
        }
        if self.tensors_sha256 is not None:
            out[TENSORS_HASH_KEY] = self.tensors_sha256
        return out

    @classmethod
    def from_json(cls, data: dict) -> CheckpointMeta:
        keys = {"format_version", "wiring", "engine_convention", "target", "data_manifest_sha256", "metrics"}
        if set(data) - {TENSORS_HASH_KEY} != keys:  # the hash is optional: checkpoints saved before it lack it
            raise CheckpointError(f"the eaglewire section must have exactly the keys {sorted(keys)} (and optionally "
                                  f"{TENSORS_HASH_KEY!r}), got {sorted(data)}")
        if data["format_version"] != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint format version {data['format_version']!r} is not supported (this eaglewire reads {FORMAT_VERSION})"
            )
        try:
            wiring = Wiring.from_json(data["wiring"])
        except WiringError as exc:
            raise CheckpointError(f"the eaglewire section's wiring is invalid: {exc}") from exc
        return cls(wiring, data["target"], data["engine_convention"], data["data_manifest_sha256"], data["metrics"],
                   tensors_sha256=data.get(TENSORS_HASH_KEY))


@dataclass
class Checkpoint:
    drafter: Drafter
    meta: CheckpointMeta


# ---- config.json ---------------------------------------------------------------------


def engine_layer_ids(meta: CheckpointMeta) -> list[int]:
    try:
        return convention(meta.convention).to_ids(meta.wiring, meta.num_layers)
    except WiringError as exc:
        raise CheckpointError(f"cannot write {meta.wiring} as {meta.convention!r} layer ids: {exc}") from exc


def llama_layer_fields(config: DrafterConfig, dtype: torch.dtype) -> dict:
    """The drafter's decoder layer as the fields of a transformers LlamaConfig, which every stack parses.

    Every field that changes the forward is written, none left to a reader's default.
    """
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        # transformers 4 reads rope_theta, transformers 5 reads rope_parameters: write both.
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def config_json(config: DrafterConfig, meta: CheckpointMeta, dtype: torch.dtype) -> dict:
    ids = engine_layer_ids(meta)
    return {
        "architectures": [ARCHITECTURE],
        **llama_layer_fields(config, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        # SGLang reads eagle_config, vLLM's V2 runner only the top-level key (stacks.py). Same ids in both.
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "eaglewire": meta.to_json(),
    }


def _require(data: dict, key: str, where: str):
    if key not in data:
        raise CheckpointError(f"{where} has no {key!r}")
    return data[key]


def parse_config(data: dict, where: str, check_ids: bool = True) -> tuple[DrafterConfig, CheckpointMeta]:
    """Drafter config and eaglewire metadata from a config.json dict, checked for consistency.

    ``check_ids=False`` leaves out the engine-id check; only ``eaglewire doctor`` uses it, after
    reporting that check's failure, to go on diagnosing the weights.
    """
    if data.get("architectures") != [ARCHITECTURE]:
        raise CheckpointError(f"{where} declares architectures {data.get('architectures')!r}, expected [{ARCHITECTURE!r}]")
    if "eaglewire" not in data:
        raise CheckpointError(
            f"{where} has no 'eaglewire' section, so its wiring and target are unknown; "
            "bring a foreign checkpoint in with `eaglewire import`"
        )
    meta = CheckpointMeta.from_json(data["eaglewire"])
    layers = _require(data, "num_hidden_layers", where)
    if not (isinstance(layers, int) and layers >= 1):
        raise CheckpointError(f"{where}: num_hidden_layers must be a whole number >= 1, got {layers!r}")
    hidden = _require(data, "hidden_size", where)
    if _require(data, "target_hidden_size", where) != hidden:
        raise CheckpointError(
            f"{where}: target_hidden_size {data['target_hidden_size']} != hidden_size {hidden}; "
            "eaglewire drafters share the target's width"
        )
    rope = _require(data, "rope_parameters", where)
    if rope != {"rope_type": "default", "rope_theta": _require(data, "rope_theta", where)}:
        raise CheckpointError(f"{where}: rope_parameters {rope} disagree with rope_theta {data['rope_theta']}")
    if check_ids:
        _check_layer_ids(data, meta, where)
    try:
        config = DrafterConfig(
            hidden_size=hidden,
            intermediate_size=_require(data, "intermediate_size", where),
            num_attention_heads=_require(data, "num_attention_heads", where),
            num_key_value_heads=_require(data, "num_key_value_heads", where),
            head_dim=_require(data, "head_dim", where),
            vocab_size=_require(data, "vocab_size", where),
            draft_vocab_size=_require(data, "draft_vocab_size", where),
            num_aux=len(meta.wiring.aux),
            rms_norm_eps=_require(data, "rms_norm_eps", where),
            rope_theta=data["rope_theta"],
            max_position_embeddings=_require(data, "max_position_embeddings", where),
            num_layers=layers,
        )
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    return config, meta


def _check_layer_ids(data: dict, meta: CheckpointMeta, where: str) -> None:
    """The engine ids must capture exactly the recorded wiring under the recorded convention."""
    ids = _require(_require(data, "eagle_config", where), "eagle_aux_hidden_state_layer_ids", f"{where} eagle_config")
    differ = id_places_differ(data)
    if differ is not None:
        raise CheckpointError(f"{where}: {differ}")
    for stack in (STACKS[name] for name in SERVING_STACKS):
        blind = [path or stack.name for path, found in ids_read(stack, data).items() if found is None]
        if blind:
            raise CheckpointError(
                f"{where}: {stack.name} {stack.version} ({', '.join(blind)}) finds no layer ids where it reads them "
                f"({stack.ids_at}) and would capture its default layers; a native checkpoint writes the same ids at "
                f"{IDS_KEY} (top level) and in eagle_config: add \"{IDS_KEY}\": {ids} at the top level, or re-save "
                "the checkpoint with eaglewire"
            )
    try:
        read_back = convention(meta.convention).from_ids(ids, meta.num_layers)
    except WiringError as exc:
        raise CheckpointError(f"{where}: eagle_config ids {ids} are invalid for convention {meta.convention!r}: {exc}") from exc
    if read_back != meta.wiring:
        raise CheckpointError(
            f"{where}: eagle_config ids {ids} mean {read_back} in the {meta.convention!r} convention, "
            f"but the eaglewire wiring is {meta.wiring}; an engine would feed the drafter other tensors than it was trained on"
        )


def read_checkpoint_config(folder: Path, check_ids: bool = True) -> tuple[DrafterConfig, CheckpointMeta]:
    """Config and metadata of a checkpoint, without reading its weights (``check_ids``: see parse_config)."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file():
        backup = previous_of(folder)
        if backup.is_dir():
            raise CheckpointError(
                f"no checkpoint at {folder}: a save was interrupted; the previous checkpoint is intact at {backup} "
                "(the next save restores it, or rename it back)"
            )
        raise CheckpointError(f"no checkpoint at {folder}: {CONFIG_FILE} is missing")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    return parse_config(data, str(path), check_ids)


# ---- weights -------------------------------------------------------------------------


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Per tensor, the sha256 of its dtype, shape and raw bytes, in name order.

    It depends on the values only, not on the file (header order, safetensors metadata), so a
    file rewritten with the same tensors keeps its hashes, and an edited tensor is named by its own.
    """
    out = {}
    for key in sorted(tensors):
        t = tensors[key].detach().cpu().contiguous()
        digest = hashlib.sha256(json.dumps([str(t.dtype).removeprefix("torch."), list(t.shape)]).encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[key] = digest.hexdigest()
    return out


# Who names the drafter's decoder layer how, and the import that reads that naming.
_LAYER_NAMINGS = {
    LAYER_PREFIX: ("EAGLE, SpecForge, SGLang and vLLM naming", "--from sglang, vllm, specforge or eagle"),
    "layers.0.": ("speculators naming", "--from speculators"),
}


def rename_layer(key: str, old_prefix: str, new_prefix: str) -> str:
    """``key`` with the decoder layer's prefix ``old_prefix`` replaced by ``new_prefix`` (other keys unchanged)."""
    return new_prefix + key.removeprefix(old_prefix) if key.startswith(old_prefix) else key


def _likely_causes(missing: set[str], unexpected: set[str], layer_prefix: str) -> list[str]:
    """Known foreign namings, recognised from the keys a file lacks and the keys it has extra."""
    causes = []
    for prefix, (who, flag) in _LAYER_NAMINGS.items():
        if prefix != layer_prefix and any(k.startswith(prefix) for k in unexpected) and any(
            k.startswith(layer_prefix) for k in missing
        ):
            causes.append(
                f"{who} of the decoder layer (`{prefix}*` instead of `{layer_prefix}*`); "
                f"import it with `eaglewire import {flag}`"
            )
    if any(k.startswith("model.") for k in unexpected):
        causes.append("vLLM-internal naming (a `model.` prefix), as dumped from a running engine; not a native checkpoint")
    if any(".qkv_proj." in k or ".gate_up_proj." in k for k in unexpected):
        causes.append("fused engine-internal projections (qkv_proj, gate_up_proj); the native format keeps them separate")
    if any("embed_tokens" in k for k in unexpected):
        causes.append(
            "the file carries its own token embedding; an eaglewire drafter uses the target's frozen embedding "
            "and never saves one (import it with `eaglewire import`)"
        )
    if "draft_id_to_target_id" in unexpected:
        causes.append("vLLM's in-memory name for d2t (`draft_id_to_target_id`)")
    if any(k.startswith(("fc_norm.", "input_norm.")) for k in unexpected):
        causes.append(
            "norms of the aux states before fc (SpecForge/speculators `fc_norm`, speculators `norm_before_fc`), "
            "which the eaglewire drafter does not have"
        )
    if any(k.startswith(("verifier_norm.", "verifier_lm_head.")) for k in unexpected):
        causes.append("speculators' training-only copies of the verifier's norm and lm_head")
    if {"d2t", "t2d"} & missing:
        causes.append("a drafter over the full target vocabulary, which stores no d2t/t2d; eaglewire needs both")
    return causes


def _listing(keys: set[str], limit: int = 12) -> str:
    names = sorted(keys)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_state_keys(tensors: dict[str, torch.Tensor], config: DrafterConfig, where: str,
                     layer_prefix: str = LAYER_PREFIX) -> None:
    """Raise unless ``tensors`` is exactly a drafter state: keys, shapes, dtypes and a consistent d2t/t2d.

    ``layer_prefix`` is the decoder layer's name in the file (``midlayer.`` natively).
    """
    expected = {rename_layer(k, LAYER_PREFIX, layer_prefix): s for k, s in expected_state_shapes(config).items()}
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or unexpected:
        found = [f"{label} keys: {_listing(keys)}" for label, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        cause = "; ".join(_likely_causes(missing, unexpected, layer_prefix)) or "written by another tool, or for another drafter layout"
        raise CheckpointError(f"{where} does not hold an EAGLE-3 drafter: {'; '.join(found)}. Likely cause: {cause}")
    wrong = [
        f"{key}: file {tuple(tensors[key].shape)} vs config {shape}"
        for key, shape in expected.items()
        if tuple(tensors[key].shape) != shape
    ]
    if wrong:
        raise CheckpointError(f"{where}: tensor shapes disagree with config.json: " + "; ".join(wrong))
    for key, dtype in (("d2t", torch.int64), ("t2d", torch.bool)):
        if tensors[key].dtype != dtype:
            raise CheckpointError(f"{where}: {key} must be {dtype}, got {tensors[key].dtype}")
    float_dtypes = {t.dtype for key, t in tensors.items() if key not in ("d2t", "t2d")}
    if len(float_dtypes) != 1:
        raise CheckpointError(f"{where}: weights mix dtypes {sorted(map(str, float_dtypes))}")
    # The drafter rebuilds d2t/t2d from the ids in ascending order; the file must agree exactly.
    try:
        d2t, t2d = vocab_maps(draft_ids_of(tensors["d2t"]), config.vocab_size)
    except ValueError as exc:
        raise CheckpointError(f"{where}: d2t is invalid: {exc}") from exc
    if not (torch.equal(d2t, tensors["d2t"]) and torch.equal(t2d, tensors["t2d"])):
        raise CheckpointError(f"{where}: d2t and t2d disagree (or d2t is not in ascending target-id order)")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc


def read_checkpoint_state(folder: Path, check_ids: bool = True) -> tuple[DrafterConfig, CheckpointMeta, dict[str, torch.Tensor]]:
    """Config, metadata and checked weights of a checkpoint, without building a drafter."""
    folder = Path(folder)
    config, meta = read_checkpoint_config(folder, check_ids)
    path = folder / WEIGHTS_FILE
    tensors = read_weights(path)
    check_state_keys(tensors, config, str(path))
    return config, meta, tensors


def drafter_from_state(config: DrafterConfig, embed: nn.Embedding, tensors: dict[str, torch.Tensor], where: str) -> Drafter:
    """A drafter holding ``tensors`` (checked by ``check_state_keys``), in their dtype; ``embed`` is the target's."""
    try:
        drafter = Drafter(config, embed, draft_ids_of(tensors["d2t"]))
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    drafter.to(tensors["fc.weight"].dtype)
    drafter.load_state_dict(tensors, strict=True)
    return drafter


def load_checkpoint(folder: Path, embed: nn.Embedding, check_ids: bool = True) -> Checkpoint:
    """Load strictly; ``embed`` is the target's token embedding. Weights keep the file's dtype.

    ``check_ids=False`` (the doctor, after reporting the ids) skips only the engine-id check.
    """
    config, meta, tensors = read_checkpoint_state(folder, check_ids)
    return Checkpoint(drafter_from_state(config, embed, tensors, str(Path(folder) / WEIGHTS_FILE)), meta)


# ---- atomic save ---------------------------------------------------------------------


def _check_replaceable(folder: Path) -> None:
    """Refuse to replace a folder that holds anything but an eaglewire checkpoint."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {folder}: it is a file")
    entries = set(os.listdir(folder))
    if not entries:
        return
    foreign = entries - _OWNED_FILES
    if foreign:
        raise CheckpointError(
            f"will not replace {folder}: it holds files that are not part of a drafter checkpoint ({_listing(foreign)})"
        )
    try:
        read_checkpoint_config(folder)
    except CheckpointError as exc:
        raise CheckpointError(f"will not replace {folder}: it is not a readable eaglewire checkpoint ({exc})") from exc


def save_checkpoint(folder: Path, drafter: Drafter, meta: CheckpointMeta, dtype: torch.dtype | None = None) -> Path:
    """Write ``drafter`` to ``folder`` atomically; ``dtype`` casts the float weights (e.g. torch.float16)."""
    folder = Path(folder)
    config = drafter.config
    if len(meta.wiring.aux) != config.num_aux:
        raise CheckpointError(f"the wiring has {len(meta.wiring.aux)} aux points, the drafter's fc takes {config.num_aux}")
    for key, value in (("hidden_size", config.hidden_size), ("vocab_size", config.vocab_size)):
        if meta.target[key] != value:
            raise CheckpointError(f"the target fingerprint has {key} {meta.target[key]!r}, the drafter has {value}")
    dtype = drafter.fc.weight.dtype if dtype is None else dtype
    if dtype not in _DTYPE_NAMES:
        raise CheckpointError(f"cannot save weights as {dtype}; choose one of {', '.join(_DTYPE_NAMES.values())}")
    tensors = {
        key: (t if key in ("d2t", "t2d") else t.to(dtype)).detach().cpu().contiguous()
        for key, t in drafter.state_dict().items()
    }
    # The hash of the tensors as written goes into config.json: the doctor notices weights edited after the save.
    meta = replace(meta, tensors_sha256=tensors_sha256(tensors))
    config_data = config_json(config, meta, dtype)  # fails before any file is touched if the ids cannot be written
    recover_folder_swap(folder)  # a save killed between its renames: judge the checkpoint it was replacing
    _check_replaceable(folder)

    def write(tmp: Path) -> None:
        atomic_write_bytes(tmp / WEIGHTS_FILE, save(tensors, metadata={"format": "pt"}))
        atomic_write_json(tmp / CONFIG_FILE, config_data)

    return replace_folder(folder, write)
