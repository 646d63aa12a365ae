"""``eaglewire doctor``: prove with numbers that a drafter is fed what it was trained on.

Every check its inputs allow runs and reports pass, fail or skipped (with the
reason); a failure says what is wrong and what to do next.

  checkpoint.*    the checkpoint loads strictly; its fc takes num_aux x H; d2t/t2d
                  agree; the config fields the declared engine reads mean, under that
                  engine's id convention, the wiring the drafter was trained on
  data.integrity  the dataset's shards are the ones its manifest hashed
  consistency.*   data, checkpoint and engine name the same tensors; target,
                  data and checkpoint fingerprints agree
  numbers.*       the target is rerun on the manifest's probe and on stored samples;
                  every stored tensor is matched to the capture point it equals
                  (``tensor_match``), whatever its label says
  acceptance.*    offline: the drafter's held-out accuracy against the one recorded
                  at training; live: its agreement with the target's greedy tokens
                  under the declared wiring against plausible miswirings
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .capture import capture
from .checkpoint import (
    ARCHITECTURE, CONFIG_FILE, WEIGHTS_FILE, CheckpointError, CheckpointMeta, check_state_keys, load_checkpoint,
    read_checkpoint_config,
)
from .drafter import Drafter, expected_state_shapes
from .engine_ids import convention
from .manifest import Manifest, ManifestError
from .probe import PROBE_RTOL, run_probe
from .samples import DatasetSamples, load_stored
from .shards import HIDDEN_PREFIX, ShardError
from .target import DEFAULT_TARGET, Target, TargetError, chat_template_of, fingerprint_mismatches, load_target
from .tensor_match import MATCH_TOLERANCE, ErrorTable, Match
from .ttt import step_sums, teacher_targets, unroll, unroll_fused
from .wiring import CapturePoint, Wiring, WiringError, all_points

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
ENGINES = ("eaglewire", "vllm", "sglang")
# SGLang's rule for explicit ids depends on the model file of the build (engine_ids.py): PR #25454
# (merged 2026-05-18 as f504970) made the +1 shift conditional on ids[0] == 1, in deepseek_v2.py.
SGLANG_VERSIONS = {"pre-25454": "sglang-pre-25454", "post-25454": "sglang-post-25454"}
HEATMAP_FILE = "tensor_match.png"
REPORT_FILE = "doctor.json"
# acceptance.offline fails when position-1 accuracy falls below the recorded one by more than
# max(OFFLINE_MIN_DROP, 3 standard errors of the measurement).
OFFLINE_MIN_DROP = 0.05
# acceptance.live: an alternative "beats" the declared wiring when McNemar's z over the positions where
# exactly one of them agrees with the target reaches LIVE_Z (about 1 in 700 by chance, one-sided; there
# are ~15 alternatives) and it wins at least LIVE_MIN_WINS more positions.
LIVE_Z = 3.0
LIVE_MIN_WINS = 4
LIVE_MIN_ACCURACY = 0.05  # below this for every wiring the live check cannot rank wirings
LIVE_PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about a lighthouse.",
    "List three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how to make a cup of tea.",
    "Summarize the plot of Romeo and Juliet.",
)
_FINGERPRINT_MEANING = {
    "weights_sha256": "weights (another checkpoint, fine-tune or quantization)",
    "chat_template_sha256": "chat template",
    "tokenizer_sha256": "tokenizer",
    "config_sha256": "architecture config",
    "model_type": "model family",
    "num_layers": "layer count",
    "hidden_size": "hidden size",
    "vocab_size": "vocabulary size",
}


class DoctorError(ValueError):
    """The doctor was asked for something it cannot do (a bad option or a missing folder)."""


@dataclass
class CheckResult:
    name: str
    status: str  # PASS, FAIL or SKIPPED
    detail: str  # what was measured, or why the check was skipped
    fix: str = ""  # what to do next (failures)
    data: dict = field(default_factory=dict)  # the numbers behind the verdict, for --json


@dataclass
class DoctorConfig:
    checkpoint: str  # a checkpoint folder, or 'shipped' (the drafter packaged for the target)
    data: Path | None = None
    target: str | None = None  # default: the target the checkpoint records
    engine: str = "eaglewire"
    engine_version: str | None = None
    out: Path | None = None
    match_samples: int = 4  # stored samples the target reruns for numbers.tensors
    match_tokens: int = 512  # leading tokens of each
    eval_samples: int = 32  # held-out samples for acceptance.offline (training evaluates 32)
    live_prompts: int = 4
    live_tokens: int = 48

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise DoctorError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine_version is not None and self.engine == "sglang" and self.engine_version not in SGLANG_VERSIONS:
            raise DoctorError(
                f"--engine-version for sglang must be one of {', '.join(SGLANG_VERSIONS)} (whether your build's "
                f"model file shifts explicit ids by +1 always, or only when the first id is 1; PR #25454), got "
                f"{self.engine_version!r}. eaglewire cannot tell from a release number: the PR changed "
                "deepseek_v2.py only, so look at set_eagle3_layers_to_capture in your build's model file"
            )
        for name in ("match_samples", "match_tokens", "live_prompts", "live_tokens"):
            if getattr(self, name) < 1:
                raise DoctorError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.eval_samples < 0:
            raise DoctorError(f"--eval-samples must be >= 0, got {self.eval_samples}")
        if self.live_prompts > len(LIVE_PROMPTS):
            raise DoctorError(f"--live-prompts must be at most {len(LIVE_PROMPTS)}, got {self.live_prompts}")
        if self.data is not None:
            self.data = Path(self.data)
        if self.out is not None:
            self.out = Path(self.out)


@dataclass
class Report:
    checkpoint: str
    engine: str
    target: str | None
    data: str | None
    results: list[CheckResult]
    elapsed_s: float
    files: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == FAIL]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def result(self, name: str) -> CheckResult:
        matches = [r for r in self.results if r.name == name]
        if not matches:
            raise KeyError(f"no check named {name!r}; ran: {', '.join(r.name for r in self.results)}")
        return matches[0]

    def to_json(self) -> dict:
        counts = {s: sum(r.status == s for r in self.results) for s in (PASS, FAIL, SKIPPED)}
        return {"checkpoint": self.checkpoint, "engine": self.engine, "target": self.target, "data": self.data,
                "ok": not self.failed, "counts": counts, "elapsed_s": round(self.elapsed_s, 2), "files": self.files,
                "results": [asdict(r) for r in self.results]}


# ---- state shared by the checks ------------------------------------------------------------


@dataclass
class _State:
    cfg: DoctorConfig
    folder: Path
    raw: dict | None = None  # config.json
    meta: CheckpointMeta | None = None
    target: Target | None = None
    drafter: Drafter | None = None
    manifest: Manifest | None = None
    samples: DatasetSamples | None = None
    config_error: str | None = None  # why config.json or its eaglewire section cannot be read
    engine_wiring: Wiring | None = None  # what the declared engine captures from config.json, when known
    engine_reading: str = ""  # how it reads them, for messages


def _ok(name: str, detail: str, **data) -> CheckResult:
    return CheckResult(name, PASS, detail, "", data)


def _fail(name: str, detail: str, fix: str, **data) -> CheckResult:
    return CheckResult(name, FAIL, detail, fix, data)


def _skip(name: str, reason: str, **data) -> CheckResult:
    return CheckResult(name, SKIPPED, reason, "", data)


# ---- checkpoint ----------------------------------------------------------------------------


def _read_config(st: _State) -> str | None:
    """Fill st.raw and st.meta; returns why they cannot be read, or None."""
    path = st.folder / CONFIG_FILE
    if not path.is_file():
        return f"{path} is missing"
    try:
        st.raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        return f"{path} is not valid JSON: {exc}"
    if "eaglewire" not in st.raw:
        return (f"{path} has no 'eaglewire' section, so the wiring and target it was trained on are unknown; bring a "
                "foreign checkpoint in with `eaglewire import`")
    try:
        st.meta = CheckpointMeta.from_json(st.raw["eaglewire"])
    except (CheckpointError, KeyError, TypeError) as exc:
        return f"{path}: the eaglewire section is invalid: {exc}"
    return None


def _weight_file_keys(folder: Path) -> dict[str, tuple[int, ...]] | str:
    """Names and shapes of the tensors in model.safetensors (header only), or why it cannot be read."""
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        return f"{path} is missing"
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except (SafetensorError, OSError) as exc:
        return f"cannot read {path}: {exc}"


def check_load(st: _State) -> CheckResult:
    name = "checkpoint.load"
    if st.config_error is not None:
        return _fail(name, st.config_error, "re-save the checkpoint from its training run, or bring a foreign one in "
                                            "with `eaglewire import`")
    if st.target is None:
        return _check_keys_without_target(st)
    try:
        checkpoint = load_checkpoint(st.folder, st.target.layout.embed)
        st.drafter = checkpoint.drafter.float()
        dtype = str(checkpoint.drafter.fc.weight.dtype).removeprefix("torch.")
        return _ok(name, f"loads strictly: {len(expected_state_shapes(checkpoint.drafter.config))} tensors, {dtype}, "
                         f"wiring {checkpoint.meta.wiring}, draft vocabulary {checkpoint.drafter.config.draft_vocab_size}")
    except CheckpointError as exc:
        strict_error = str(exc)
    try:  # the same load without the engine-id check: do the weights themselves load?
        st.drafter = load_checkpoint(st.folder, st.target.layout.embed, check_ids=False).drafter.float()
    except CheckpointError:
        return _fail(name, strict_error, _load_fix(st))
    return _fail(name, f"{strict_error}. The weights themselves load; the checks below use the wiring the "
                       "eaglewire section records", "correct the layer ids as checkpoint.engine_config says")


def _check_keys_without_target(st: _State) -> CheckResult:
    """Without a target there is no embedding to build the drafter on; the file's keys can still be checked."""
    name = "checkpoint.load"
    try:
        config, _ = read_checkpoint_config(st.folder)
        keys = _weight_file_keys(st.folder)
        if isinstance(keys, str):
            raise CheckpointError(keys)
        with safe_open(str(st.folder / WEIGHTS_FILE), framework="pt") as handle:
            check_state_keys({k: handle.get_tensor(k) for k in keys}, config, str(st.folder / WEIGHTS_FILE))
    except CheckpointError as exc:
        return _fail(name, str(exc), _load_fix(st))
    return _ok(name, "config.json and the weight names, shapes and dtypes are what an EAGLE-3 drafter needs "
                     "(no target loaded, so the drafter itself was not built)")


def _load_fix(st: _State) -> str:
    keys = _weight_file_keys(st.folder)
    if st.raw is None or st.meta is None or isinstance(keys, str):
        return "re-save the checkpoint from its training run (`eaglewire train` writes config.json and weights together)"
    names = set(keys)
    if any(k.startswith("layers.0.") for k in names) and not any(k.startswith("midlayer.") for k in names):
        return ("rename layers.0.* to midlayer.* (`eaglewire import --from speculators`); never serve this file as is: "
                "SGLang silently skips weight names it does not know and serves a random midlayer")
    try:
        config, _ = read_checkpoint_config(st.folder, check_ids=False)
    except CheckpointError:
        return "re-save the checkpoint from its training run: its config.json is not what the weights need"
    if set(expected_state_shapes(config)) != names:
        return ("bring the file to the native layout (`eaglewire import`), or re-save it from its training run; an "
                "engine that skips unknown names would serve random weights in their place")
    return "see checkpoint.fc_width and checkpoint.vocab_maps for the tensors that do not fit config.json"


def _hidden_size(st: _State) -> int:
    return st.target.hidden_size if st.target is not None else int(st.meta.target["hidden_size"])


def check_fc_width(st: _State) -> CheckResult:
    name = "checkpoint.fc_width"
    keys = _weight_file_keys(st.folder)
    if isinstance(keys, str):
        return _skip(name, keys)
    if "fc.weight" not in keys:
        return _skip(name, "the weights have no fc.weight (see checkpoint.load)")
    rows, cols = keys["fc.weight"]
    hidden, aux = _hidden_size(st), st.meta.wiring.aux
    want = len(aux) * hidden
    data = {"fc_shape": [rows, cols], "expected": [hidden, want], "num_aux": len(aux), "hidden_size": hidden}
    if (rows, cols) == (hidden, want):
        return _ok(name, f"fc.weight is [{rows}, {cols}]: it fuses the {len(aux)} aux states of the wiring "
                         f"({len(aux)} x {hidden})", **data)
    if cols == hidden and len(aux) > 1:
        return _fail(
            name,
            f"fc.weight is [{rows}, {cols}]: it takes ONE hidden state of width {hidden}, but the wiring {st.meta.wiring} "
            f"names {len(aux)} aux states ({len(aux)} x {hidden} = {want} features). An H-wide fc is what a drafter "
            "gets when fusion was bypassed on equal widths (a single, usually wrong, hidden state reached the "
            "midlayer without error)",
            "retrain with the fc applied to the concatenated aux states of the wiring (eaglewire's drafter always "
            "applies it and refuses other widths); do not serve this checkpoint", **data)
    return _fail(name, f"fc.weight is [{rows}, {cols}], but {len(aux)} aux states of width {hidden} need "
                       f"[{hidden}, {want}]", "re-save the checkpoint from the training run that matches its wiring",
                 **data)


def check_vocab_maps(st: _State) -> CheckResult:
    name = "checkpoint.vocab_maps"
    path = st.folder / WEIGHTS_FILE
    keys = _weight_file_keys(st.folder)
    if isinstance(keys, str):
        return _skip(name, keys)
    if not {"d2t", "t2d"} <= set(keys):
        return _skip(name, "the weights lack d2t or t2d (see checkpoint.load)")
    with safe_open(str(path), framework="pt") as handle:
        d2t, t2d = handle.get_tensor("d2t"), handle.get_tensor("t2d")
    if not isinstance(st.raw.get("draft_vocab_size"), int):
        return _skip(name, "config.json has no draft_vocab_size to check d2t against (see checkpoint.engine_config)")
    draft_vocab, vocab = st.raw["draft_vocab_size"], int(st.meta.target["vocab_size"])
    fix = ("take d2t and t2d from the training run whose lm_head this is (`eaglewire train` writes all three "
           "together); a d2t from another draft vocabulary maps every draft token to the wrong target token")
    problems = []
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        problems.append(f"d2t is {d2t.dtype} and t2d is {t2d.dtype}; expected int64 and bool")
    if tuple(d2t.shape) != (draft_vocab,):
        problems.append(f"d2t has shape {tuple(d2t.shape)}, config.json's draft_vocab_size is {draft_vocab}")
    if tuple(t2d.shape) != (vocab,):
        problems.append(f"t2d has shape {tuple(t2d.shape)}, the target vocabulary has {vocab} tokens")
    if "lm_head.weight" in keys and keys["lm_head.weight"][0] != d2t.numel():
        problems.append(f"lm_head has {keys['lm_head.weight'][0]} rows, d2t {d2t.numel()} entries")
    if problems:
        return _fail(name, "; ".join(problems), fix)
    ids = torch.arange(d2t.numel()) + d2t.long()
    outside = ((ids < 0) | (ids >= vocab)).nonzero().flatten()
    if outside.numel():
        i = int(outside[0])
        return _fail(name, f"d2t maps {outside.numel()} draft ids outside the target vocabulary 0..{vocab - 1} "
                           f"(first: draft {i} -> target {int(ids[i])})", fix)
    descending = (ids[1:] <= ids[:-1]).nonzero().flatten()
    if descending.numel():
        i = int(descending[0])
        return _fail(name, f"d2t's target ids are not strictly ascending (draft {i} -> {int(ids[i])}, draft {i + 1} -> "
                           f"{int(ids[i + 1])}); t2d-ordered logits would not line up with the draft logits", fix)
    marked = t2d.nonzero().flatten()
    if marked.numel() != ids.numel() or not torch.equal(marked, ids):
        unmarked = ids[~t2d[ids]]
        extra = marked[~torch.isin(marked, ids)]
        first = (f"first: draft {int((ids == unmarked[0]).nonzero()[0])} -> target {int(unmarked[0])}, which t2d does not mark"
                 if unmarked.numel() else f"first: t2d marks target {int(extra[0])}, which no draft id maps to")
        return _fail(name, f"d2t and t2d disagree: d2t selects {ids.numel()} target ids, t2d marks {marked.numel()}, "
                           f"{unmarked.numel()} of d2t's are not marked ({first}); one of them is stale", fix,
                     unmarked=int(unmarked.numel()), extra=int(extra.numel()))
    return _ok(name, f"d2t and t2d agree on {ids.numel()} target ids in 0..{vocab - 1}, ascending")


def _engine_ids(st: _State) -> tuple[list[int] | None, list[str]]:
    """The ids the declared engine reads from config.json, and the fields it needs that are missing or wrong."""
    raw, engine = st.raw, st.cfg.engine
    problems = []
    if raw.get("architectures") != [ARCHITECTURE]:
        problems.append(f"architectures is {raw.get('architectures')!r}; {engine} picks the EAGLE-3 model class "
                        f"by [{ARCHITECTURE!r}]")
    if not isinstance(raw.get("draft_vocab_size"), int):
        problems.append("draft_vocab_size is missing: the engine would size the drafter's lm_head by the full vocabulary")
    if raw.get("num_hidden_layers") != 1:
        problems.append(f"num_hidden_layers is {raw.get('num_hidden_layers')!r}; an EAGLE-3 drafter (SGLang's "
                        f"{ARCHITECTURE}) has exactly 1")
    nested = raw.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if engine == "sglang":
        ids = nested
        if ids is None:
            problems.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing: SGLang then captures its "
                            "default layers, whatever the drafter was trained on")
    else:
        if top is not None and nested is not None and top != nested:
            problems.append(f"eagle_aux_hidden_state_layer_ids {top} disagrees with eagle_config's {nested}; "
                            "SGLang and vLLM versions would capture different layers")
        ids = nested if nested is not None else top
        if ids is None:
            problems.append("no eagle_aux_hidden_state_layer_ids (top level or in eagle_config): the engine would "
                            "capture its default layers")
    return ids, problems


def _conventions(st: _State) -> list[str]:
    cfg = st.cfg
    if cfg.engine == "eaglewire":
        return [st.meta.convention]
    if cfg.engine == "vllm":
        return ["vllm"]
    if cfg.engine_version is not None:
        return [SGLANG_VERSIONS[cfg.engine_version]]
    return list(SGLANG_VERSIONS.values())


def check_engine_config(st: _State) -> CheckResult:
    name = "checkpoint.engine_config"
    cfg, meta, trained = st.cfg, st.meta, st.meta.wiring
    layers = st.target.num_layers if st.target is not None else meta.num_layers
    ids, problems = _engine_ids(st)
    if ids is None:
        return _fail(name, "; ".join(problems), "rewrite config.json with `eaglewire train`'s writer (or export)")
    readings: dict[str, Wiring | str] = {}
    for conv in _conventions(st):
        try:
            readings[conv] = convention(conv).from_ids(ids, layers)
        except (ValueError, TypeError) as exc:  # WiringError, or ids that are not integers
            readings[conv] = str(exc)
    described = "; ".join(f"under {c} they capture {w}" if isinstance(w, Wiring) else f"{c} cannot capture them: {w}"
                          for c, w in readings.items())
    if cfg.engine == "eaglewire":  # its engine reads the wiring itself; other engines will read these ids
        head = (f"eaglewire reads the wiring from the eaglewire section; config.json's ids {ids} are written for "
                f"{meta.convention} (the convention that section records): {described}")
    else:
        head = f"{cfg.engine} reads ids {ids}: {described}"
    data = {"ids": ids, "readings": {c: str(w) for c, w in readings.items()}, "trained": str(trained)}
    wrong = {c: w for c, w in readings.items() if w != trained}
    values = list(readings.values())
    if all(isinstance(w, Wiring) for w in values) and len(set(values)) == 1:  # unknown while SGLang builds disagree
        st.engine_wiring, st.engine_reading = values[0], f"{cfg.engine} reading config.json ids {ids}"
    good_ids = _ids_for(trained, layers, list(readings))
    if wrong and len(wrong) < len(readings) and cfg.engine == "sglang" and cfg.engine_version is None:
        fine = [c for c in readings if c not in wrong]
        return _fail(name, f"{head}. SGLang builds disagree on these ids: only {', '.join(fine)} reads them as the "
                           f"trained wiring {trained}",
                     f"pass --engine-version {' or '.join(k for k, v in SGLANG_VERSIONS.items() if v in fine)} if your "
                     f"build's model file does that, or write ids {good_ids}", **data)
    if wrong:
        return _fail(name, f"{head}, but the drafter was trained on {trained}" + (f"; also: {'; '.join(problems)}"
                                                                                  if problems else ""),
                     f"write eagle_aux_hidden_state_layer_ids {good_ids} (top level and in eagle_config) for {cfg.engine}; "
                     f"`eaglewire wiring --wiring {trained}` prints every engine's ids", **data)
    if problems:
        return _fail(name, f"{head}, as trained, but: {'; '.join(problems)}",
                     "re-save the checkpoint with eaglewire, which writes every field the engines read", **data)
    return _ok(name, f"{head} = the trained wiring; architectures, draft_vocab_size and num_hidden_layers are as "
                     f"{cfg.engine} needs", **data)


def _ids_for(wiring: Wiring, layers: int, conventions: list[str]) -> str:
    """The ids every listed convention reads as ``wiring``, or each one's."""
    spelled = {}
    for conv in conventions:
        try:
            spelled[conv] = convention(conv).to_ids(wiring, layers)
        except WiringError as exc:
            spelled[conv] = f"(none: {exc})"
    agreed = {json.dumps(v) for v in spelled.values()}
    if len(agreed) == 1:
        return str(next(iter(spelled.values())))
    # SGLang: ids starting with 1 are read the same way before and after PR #25454.
    both = [ids for ids in spelled.values() if isinstance(ids, list) and ids and ids[0] == 1]
    if both:
        return str(both[0])
    return " / ".join(f"{v} ({c})" for c, v in spelled.items())


# ---- data and consistency ------------------------------------------------------------------


def check_data(st: _State) -> CheckResult:
    name = "data.integrity"
    try:
        st.samples = DatasetSamples(st.cfg.data)  # verifies every shard's sha256
        st.manifest = st.samples.manifest
    except (ManifestError, ShardError) as exc:
        return _fail(name, str(exc), "restore the dataset or extract it again (`eaglewire extract`)")
    totals = st.manifest.totals
    return _ok(name, f"{len(st.manifest.shards)} shards match their sha256; {totals['samples']} samples, "
                     f"{totals['tokens']} tokens, stored {st.manifest.settings.dtype}, wiring {st.manifest.wiring}")


def check_wiring_consistency(st: _State) -> CheckResult:
    name = "consistency.wiring"
    named: dict[str, Wiring] = {}
    if st.manifest is not None:
        named["the data (manifest)"] = st.manifest.wiring
    if st.meta is not None:
        named["the checkpoint (eaglewire section)"] = st.meta.wiring
    if st.engine_wiring is not None:
        named[st.engine_reading] = st.engine_wiring
    if len(named) < 2:
        return _skip(name, "fewer than two wiring records to compare (give --data, and see checkpoint.engine_config)")
    data = {k: str(v) for k, v in named.items()}
    if len(set(named.values())) == 1:
        return _ok(name, f"{', '.join(named)} all name {next(iter(named.values()))}", **data)
    reference = named.get("the checkpoint (eaglewire section)")
    lines = [f"{who}: {w}" for who, w in named.items()]
    fix = (f"re-extract the data with --wiring {reference}, or train a drafter on this data; for the engine, see "
           "checkpoint.engine_config") if reference is not None else "make the records agree"
    return _fail(name, "they name different tensors: " + "; ".join(lines), fix, **data)


def check_target_consistency(st: _State) -> CheckResult:
    name = "consistency.target"
    reference = (f"the target ({st.target.name})", st.target.fingerprint) if st.target is not None else (
        (f"the checkpoint's target ({st.meta.target.get('name')})", st.meta.target) if st.meta is not None else None)
    others = []
    if st.meta is not None and st.target is not None:
        others.append(("checkpoint", f"the checkpoint's target ({st.meta.target.get('name')})", st.meta.target))
    if st.manifest is not None:
        others.append(("data", f"the data's target ({st.manifest.settings.target.get('name')})",
                       st.manifest.settings.target))
    if reference is None or not others:
        return _skip(name, "fewer than two target fingerprints to compare")
    ref_name, ref_print = reference
    differing, lines = set(), []
    for kind, who, fingerprint in others:
        keys = [k.split(":")[0] for k in fingerprint_mismatches(fingerprint, ref_print)]
        if keys:
            differing.add(kind)
            lines.append(f"{who} differs from {ref_name} in {', '.join(_FINGERPRINT_MEANING.get(k, k) for k in keys)}")
    same_data = (st.manifest is not None and st.meta is not None
                 and st.meta.data_manifest_sha256 == _sha256(st.cfg.data / "manifest.json"))
    note = ""
    if st.manifest is not None and st.meta is not None:
        note = (" The data is the dataset this drafter was trained on." if same_data else
                " The data is not the dataset this drafter was trained on (its manifest hash differs); fine for "
                "checking if it comes from the same target and wiring.")
    compared = ", ".join([ref_name, *(who for _, who, _ in others)])
    if not differing:
        return _ok(name, f"{compared}: same config, tokenizer, chat template and weights." + note,
                   same_training_data=same_data)
    if "checkpoint" in differing:
        fix = (f"check and serve the drafter with the target it was trained on (--target {st.meta.target.get('name')}), "
               "or train a drafter for this target")
    else:
        fix = "extract the data again from this target (`eaglewire extract --target ...`)"
    return _fail(name, "; ".join(lines) + "." + note, fix, same_training_data=same_data)


def _sha256(path: Path) -> str | None:
    from .files import sha256_file

    return sha256_file(path) if path.is_file() else None


# ---- numbers: probe and stored tensors -----------------------------------------------------


def check_probe(st: _State) -> CheckResult:
    name = "numbers.probe"
    recorded = st.manifest.probe
    fresh = run_probe(st.target, tuple(all_points(st.target.num_layers)))
    if recorded["input_ids"] != fresh["input_ids"]:
        return _fail(name, f"the manifest's probe input ({len(recorded['input_ids'])} tokens) tokenizes differently "
                           f"with this target ({len(fresh['input_ids'])} tokens): its tokenizer or chat template is "
                           "not the one the data was made with",
                     "extract the data again with this target, or check with the target the data came from")
    rows, bad = [], []
    for label, entry in recorded["tensors"].items():
        want = torch.tensor(entry["token_norms"])
        errors = {cand: float(((torch.tensor(v["token_norms"]) - want).abs() / torch.tensor(v["token_norms"]).abs()
                               .clamp(min=1e-6)).max()) for cand, v in fresh["tensors"].items()}
        ranked = sorted(errors, key=errors.get)
        best, second = ranked[0], ranked[1]
        row = {"label": label, "best": best, "error": errors[best], "next": second, "next_error": errors[second]}
        rows.append(row)
        if errors[best] > PROBE_RTOL:
            bad.append(f"probe {label} matches no tensor of the target (closest {best}, max relative norm error "
                       f"{errors[best]:.2e} > {PROBE_RTOL:g})")
        elif best != label:
            bad.append(f"probe {label} = {best} (max relative norm error {errors[best]:.1e}; {label} is off by "
                       f"{errors[label]:.2e})")
    if bad:
        relabelled = any(r["error"] <= PROBE_RTOL for r in rows if r["best"] != r["label"])
        fix = ("the tool that made the data captured other tensors than its labels say: extract again with "
               "`eaglewire extract`" if relabelled else
               "the data's probe values come from another model, quantization or capture code: extract again from "
               "this target")
        return _fail(name, "; ".join(bad), fix, rows=rows)
    return _ok(name, f"all {len(rows)} probe tensors are reproduced by the tensors their labels name "
                     f"(max relative norm error {max(r['error'] for r in rows):.1e})", rows=rows)


def _stored_labels(manifest: Manifest) -> list[tuple[str, str]]:
    """(row name, shard label) for every stored tensor: the aux points in wiring order, then final."""
    wiring = manifest.wiring
    return [*((f"aux[{i}] {p}", str(p)) for i, p in enumerate(wiring.aux)), (f"teacher {wiring.teacher}", str(wiring.teacher))]


def check_stored_tensors(st: _State) -> CheckResult:
    name = "numbers.tensors"
    cfg, manifest, target = st.cfg, st.manifest, st.target
    labels = _stored_labels(manifest)
    candidates = all_points(target.num_layers)
    table = ErrorTable([row for row, _ in labels], [str(p) for p in candidates])
    samples = st.samples.refs[: cfg.match_samples]
    if not samples:
        return _skip(name, "the dataset has no samples")
    for ref in samples:
        length = min(ref.length, cfg.match_tokens)
        with safe_open(str(cfg.data / ref.shard), framework="pt") as handle:
            stored = {row: handle.get_slice(HIDDEN_PREFIX + label)[ref.start: ref.start + length]
                      for row, label in labels}
        widths = {tuple(t.shape[1:]) for t in stored.values()}
        if widths != {(target.hidden_size,)}:
            return _fail(name, f"the stored tensors are {sorted(widths)} wide; this target's hidden size is "
                               f"{target.hidden_size}: the data comes from another model",
                         "extract the data again from this target")
        if int(ref.input_ids.max()) >= target.fingerprint["vocab_size"]:
            return _fail(name, "the stored token ids exceed this target's vocabulary: the data comes from another model",
                         "extract the data again from this target")
        captured = capture(target.layout, candidates, ref.input_ids[:length].long()[None])
        table.add(stored, {str(p): t[0] for p, t in captured.items()})
    matches = table.matches()
    rows = [_match_row(m, label) for m, (_, label) in zip(matches, labels)]
    data = {"rows": rows, "samples": len(samples), "tokens": table.tokens, "tolerance": MATCH_TOLERANCE,
            "stored": table.stored, "candidates": table.candidates, "errors": table.errors().tolist()}
    if cfg.out is not None:
        from .plots import plot_tensor_match

        cfg.out.mkdir(parents=True, exist_ok=True)
        plot_tensor_match(table.errors(), table.stored, table.candidates, MATCH_TOLERANCE, cfg.out / HEATMAP_FILE)
        data["heatmap"] = str(cfg.out / HEATMAP_FILE)
    wrong = [(m, label) for m, (_, label) in zip(matches, labels) if not (m.found and m.best == label)]
    where = f"{len(samples)} samples, {table.tokens} tokens, tolerance {MATCH_TOLERANCE:g}"
    if not wrong:
        return _ok(name, f"every stored tensor equals the tensor its label names ({where}): largest error "
                         f"{max(m.error for m in matches):.4f}, nearest other candidate at "
                         f"{min(m.runner_up_error for m in matches):.4f}", **data)
    problems = []
    for m, label in wrong:
        runner_up = f"next best {m.runner_up}, rel. error {m.runner_up_error:.4f}"
        if m.found:
            problems.append(f"the data stores {m.best} under the label {label} (rel. error {m.error:.4f}; {runner_up})")
        else:
            problems.append(f"the values stored as {label} match no tensor of this target (closest {m.best}, rel. "
                            f"error {m.error:.4f} > {MATCH_TOLERANCE:g}; {runner_up})")
    any_found = any(m.found for m, _ in wrong)
    fix = ("the tool that assembled the data put other tensors under these labels (an index off by one, the embedding "
           "in place of a layer, or the final state after a failed capture): extract again with `eaglewire extract`, "
           "then retrain the drafter on the new data" if any_found else
           "the values were altered (noise, a lossy conversion) or come from another model or quantization: extract "
           "again from this target and retrain")
    return _fail(name, f"{'; '.join(problems)} ({where})", fix, **data)


def _match_row(m: Match, label: str) -> dict:
    return {"stored": m.stored, "label": label, "best": m.best, "error": m.error, "next": m.runner_up,
            "next_error": m.runner_up_error, "ok": m.found and m.best == label, "line": m.describe(m.stored)}


# ---- acceptance ----------------------------------------------------------------------------


def check_offline(st: _State) -> CheckResult:
    name = "acceptance.offline"
    cfg, meta, drafter = st.cfg, st.meta, st.drafter
    stored = {f"{HIDDEN_PREFIX}{p}" for p in st.manifest.wiring.points}
    lacking = [str(p) for p in meta.wiring.points if f"{HIDDEN_PREFIX}{p}" not in stored]
    if lacking:
        return _skip(name, f"the data does not store {', '.join(lacking)}, which the drafter reads (see consistency.wiring)")
    refs = [r for r in st.samples.refs if r.held_out][: cfg.eval_samples]
    if not refs:
        return _skip(name, "the dataset has no held-out samples (records whose index is a multiple of 50)")
    recorded = meta.metrics.get("eval_acc_per_position")
    steps = len(recorded) if recorded is not None else 3
    correct, count = torch.zeros(steps, dtype=torch.float64), torch.zeros(steps, dtype=torch.float64)
    lm_head = st.target.layout.lm_head.weight
    with torch.no_grad():
        for ref in refs:
            sample = load_stored(cfg.data, ref, meta.wiring)
            teacher = teacher_targets(sample.final, lm_head, drafter.t2d)
            _, hits, counted = step_sums(drafter, unroll(drafter, sample.input_ids, sample.aux, steps),
                                         sample.loss_mask, teacher)
            correct += torch.tensor(hits, dtype=torch.float64)
            count += torch.tensor(counted, dtype=torch.float64)
    measured = (correct / count.clamp(min=1)).tolist()
    positions = int(count[0])
    data = {"measured": measured, "recorded": recorded, "samples": len(refs), "positions": positions}
    shown = ", ".join(f"{a:.3f}" for a in measured)
    if recorded is None:
        return _skip(name, f"no accuracy was recorded at training (no held-out samples then); measured here: {shown} "
                           f"per draft position on {len(refs)} held-out samples", **data)
    if positions == 0:
        return _skip(name, "the held-out samples have no trained (assistant) positions", **data)
    p = recorded[0]
    allowed = max(OFFLINE_MIN_DROP, 3 * math.sqrt(max(p * (1 - p), 1e-4) / positions))
    head = (f"held-out accuracy per draft position {shown} on {len(refs)} samples ({positions} positions); recorded at "
            f"training {', '.join(f'{a:.3f}' for a in recorded)}")
    data["allowed_drop"] = allowed
    if measured[0] < p - allowed:
        return _fail(name, f"{head}: position 1 dropped by {p - measured[0]:.3f} (allowed {allowed:.3f}), so the drafter "
                           "is not fed here what it was trained on",
                     "look at the failing checks above for the cause (wiring, stored tensors, target, d2t); if all pass, "
                     "the checkpoint's weights changed after training: re-save it from its run", **data)
    return _ok(name, f"{head}: within {allowed:.3f}", **data)


@dataclass(frozen=True)
class Alternative:
    description: str
    wiring: Wiring | None  # None: the final state alone, fed past the fc (a failed capture, fusion bypassed)


def miswirings(wiring: Wiring, num_layers: int) -> list[Alternative]:
    """Plausible wrong wirings of ``wiring``: ids shifted by +-1 (all, or one at a time), the embedding in
    place of one point, the aux order permuted, and the final state alone. Unreachable ones are left out."""
    out: list[Alternative] = []

    def add(description: str, points) -> None:
        try:
            candidate = Wiring(tuple(points))
            candidate.check_reachable(num_layers)
        except WiringError:
            return
        if candidate != wiring and all(a.wiring != candidate for a in out):
            out.append(Alternative(description, candidate))

    def shifted(point: CapturePoint, by: int) -> CapturePoint | None:
        depth = point.depth + by
        return CapturePoint(depth) if -1 <= depth < num_layers and not point.is_final else None

    aux = wiring.aux
    for by in (1, -1):
        points = [shifted(p, by) for p in aux]
        if None not in points:
            add(f"every id shifted {by:+d}", points)
    for i, point in enumerate(aux):
        for by in (1, -1):
            moved = shifted(point, by)
            if moved is not None:
                add(f"aux[{i}] {point} -> {moved}", [*aux[:i], moved, *aux[i + 1:]])
    for i, point in enumerate(aux):
        add(f"embed in place of aux[{i}] {point}", [*aux[:i], CapturePoint.parse("embed"), *aux[i + 1:]])
    for order in itertools.permutations(range(len(aux))):
        add(f"aux order permuted to {','.join(str(aux[i]) for i in order)}", [aux[i] for i in order])
    out.append(Alternative("the final state alone, fc bypassed (capture fell back to final)", None))
    return out


def _live_samples(target: Target, prompts: int, new_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """(prompt + the target's greedy continuation, prompt length) for the first ``prompts`` prompts."""
    template = chat_template_of(target.tokenizer)
    out = []
    for text in LIVE_PROMPTS[:prompts]:
        rendered = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], chat_template=template,
                                                       tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([target.tokenizer(rendered, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            full = target.model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                         pad_token_id=target.tokenizer.eos_token_id)
        out.append((full[0], ids.shape[1]))
    return out


def _step1_hits(drafter: Drafter, fused: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                top1: torch.Tensor) -> torch.Tensor:
    """Per base position t, whether the drafter's first draft token equals the target's greedy token at t+1
    (counted where ``mask[t+2]``, as step_sums counts step 1)."""
    logits = unroll_fused(drafter, ids, fused, 1)[0]
    valid = max(ids.shape[0] - 2, 0)
    drafted = drafter.draft_to_target(logits[:valid].argmax(-1))
    return ((drafted == top1[1: 1 + valid]) & mask[2: 2 + valid])[mask[2: 2 + valid]]


def check_live(st: _State) -> CheckResult:
    name = "acceptance.live"
    cfg, target, drafter, declared = st.cfg, st.target, st.drafter, st.meta.wiring
    alternatives = miswirings(declared, target.num_layers)
    if st.engine_wiring is not None and st.engine_wiring != declared:
        alternatives.insert(0, Alternative(f"what {st.engine_reading} captures", st.engine_wiring))
    candidates = [Alternative("declared", declared), *alternatives]
    hits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(candidates))}
    lm_head = target.layout.lm_head.weight
    with torch.no_grad():
        for ids, prompt_len in _live_samples(target, cfg.live_prompts, cfg.live_tokens):
            captured = {p: t[0] for p, t in capture(target.layout, all_points(target.num_layers), ids[None]).items()}
            final = captured[declared.teacher]
            top1 = teacher_targets(final, lm_head, drafter.t2d).top1
            mask = torch.arange(ids.shape[0]) >= prompt_len  # the generated tokens
            for i, alt in enumerate(candidates):
                if alt.wiring is None:
                    fused = final[:-1]
                else:
                    fused = drafter.fuse(torch.cat([captured[p] for p in alt.wiring.aux], dim=-1)[:-1])
                hits[i].append(_step1_hits(drafter, fused, ids, mask, top1))
    vectors = {i: torch.cat(h) for i, h in hits.items()}
    positions = int(vectors[0].numel())
    rows = [{"wiring": "final alone (fc bypassed)" if a.wiring is None else str(a.wiring), "description": a.description,
             "accuracy": float(vectors[i].float().mean()) if positions else 0.0} for i, a in enumerate(candidates)]
    base = vectors[0]
    beating = []
    for i in range(1, len(candidates)):
        wins, losses = int((vectors[i] & ~base).sum()), int((base & ~vectors[i]).sum())
        z = (wins - losses) / math.sqrt(wins + losses) if wins + losses else 0.0
        rows[i].update(wins=wins, losses=losses, z=z)
        if z >= LIVE_Z and wins - losses >= LIVE_MIN_WINS:
            beating.append(i)
    data = {"rows": rows, "positions": positions, "prompts": cfg.live_prompts}
    best_other = max(range(1, len(candidates)), key=lambda i: rows[i]["accuracy"])
    summary = (f"first-draft agreement with the target's greedy tokens over {positions} generated positions "
               f"({cfg.live_prompts} prompts): declared {declared} {rows[0]['accuracy']:.3f}; best of "
               f"{len(candidates) - 1} miswirings: {rows[best_other]['wiring']} ({rows[best_other]['description']}) "
               f"{rows[best_other]['accuracy']:.3f}")
    if beating:
        top = max(beating, key=lambda i: rows[i]["accuracy"])
        named = "; ".join(f"{rows[i]['wiring']} ({rows[i]['description']}) {rows[i]['accuracy']:.3f}, z {rows[i]['z']:.1f}"
                          for i in sorted(beating, key=lambda i: -rows[i]["accuracy"]))
        return _fail(name, f"{summary}. Beating the declared wiring: {named}",
                     f"the drafter was most likely trained on {rows[top]['wiring']}, not on the wiring its checkpoint "
                     f"declares: correct the checkpoint's wiring record (or retrain on {declared})", **data)
    if max(r["accuracy"] for r in rows) < LIVE_MIN_ACCURACY:
        return _skip(name, f"inconclusive: {summary}; under {LIVE_MIN_ACCURACY:.0%} for every wiring, the drafter "
                           "cannot rank wirings here (an untrained drafter, or a wrong vocabulary map)", **data)
    return _ok(name, f"{summary}; no miswiring does significantly better (McNemar z < {LIVE_Z:g})", **data)


# ---- running -------------------------------------------------------------------------------


def _resolve_checkpoint(cfg: DoctorConfig) -> Path:
    if cfg.checkpoint == "shipped":
        from .shipped import shipped_drafter

        return shipped_drafter(cfg.target if cfg.target is not None else DEFAULT_TARGET)
    folder = Path(cfg.checkpoint)
    if not folder.is_dir():
        raise DoctorError(f"checkpoint {folder} is not a folder: give a drafter checkpoint folder (e.g. RUN/checkpoint) "
                          "or 'shipped'")
    return folder


def _load_target(st: _State, target: Target | None, progress: Callable[[str], None] | None) -> CheckResult:
    name = "target"
    if target is not None:
        st.target = target
        return _ok(name, f"{target.name}: {target.num_layers} layers, hidden size {target.hidden_size} (given)")
    if progress is not None:
        progress("target (loading)")
    if st.cfg.target is not None:
        spec, why = st.cfg.target, "--target"
    elif st.meta is not None:
        spec, why = st.meta.target["name"], "named by the checkpoint"
    else:
        return _skip(name, "no --target, and the checkpoint does not name its target")
    try:
        st.target = load_target(spec)
    except TargetError as exc:
        return _fail(name, str(exc), "pass --target with the model the drafter was trained for")
    return _ok(name, f"{spec} ({why}): {st.target.num_layers} layers, hidden size {st.target.hidden_size}")


Check = Callable[[_State], CheckResult]
# (name, check, what it needs); consistency checks compare whatever records exist and skip themselves.
CHECKS: list[tuple[str, Check, tuple[str, ...]]] = [
    ("checkpoint.load", check_load, ()),
    ("checkpoint.fc_width", check_fc_width, ("checkpoint",)),
    ("checkpoint.vocab_maps", check_vocab_maps, ("checkpoint",)),
    ("checkpoint.engine_config", check_engine_config, ("checkpoint",)),
    ("data.integrity", check_data, ("data",)),
    ("consistency.wiring", check_wiring_consistency, ()),
    ("consistency.target", check_target_consistency, ()),
    ("numbers.probe", check_probe, ("target", "dataset")),
    ("numbers.tensors", check_stored_tensors, ("target", "dataset")),
    ("acceptance.offline", check_offline, ("target", "dataset", "drafter")),
    ("acceptance.live", check_live, ("target", "drafter")),
]


def _unmet(st: _State, needs: tuple[str, ...]) -> str | None:
    """Why a check that needs ``needs`` cannot run now, or None."""
    reasons = {
        "checkpoint": (st.meta is None, "the checkpoint's config.json could not be read (see checkpoint.load)"),
        "target": (st.target is None, "no target loaded (see target)"),
        "data": (st.cfg.data is None, "no --data given"),
        "dataset": (st.samples is None, "no --data given" if st.cfg.data is None
                    else "the dataset did not open (see data.integrity)"),
        "drafter": (st.drafter is None, "the drafter's weights did not load (see checkpoint.load)"),
    }
    for need in needs:
        unmet, reason = reasons[need]
        if unmet:
            return reason
    return None


def run_doctor(cfg: DoctorConfig, target: Target | None = None, progress: Callable[[str], None] | None = None) -> Report:
    """Run every check the inputs allow. ``target``: an already loaded target (tests, notebooks)."""
    start = time.perf_counter()
    st = _State(cfg, _resolve_checkpoint(cfg))
    st.config_error = _read_config(st)
    if cfg.out is not None and (cfg.out / HEATMAP_FILE).is_file():
        (cfg.out / HEATMAP_FILE).unlink()  # never report a heatmap of an earlier run
    results = [_load_target(st, target, progress)]
    for name, check, needs in CHECKS:
        reason = _unmet(st, needs)
        if reason is not None:
            results.append(_skip(name, reason))
            continue
        if progress is not None:
            progress(name)
        tick = time.perf_counter()
        result = check(st)
        result.data["seconds"] = round(time.perf_counter() - tick, 2)
        results.append(result)
    report = Report(str(st.folder), cfg.engine if cfg.engine_version is None else f"{cfg.engine} {cfg.engine_version}",
                    st.target.name if st.target is not None else None, str(cfg.data) if cfg.data else None,
                    results, time.perf_counter() - start)
    if cfg.out is not None:
        cfg.out.mkdir(parents=True, exist_ok=True)
        report.files = [str(cfg.out / REPORT_FILE)] + [str(p) for p in [cfg.out / HEATMAP_FILE] if p.is_file()]
        (cfg.out / REPORT_FILE).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report


# ---- the human-readable report -------------------------------------------------------------

_MARK = {PASS: "PASS", FAIL: "FAIL", SKIPPED: "skip"}


def format_report(report: Report) -> str:
    lines = [f"eaglewire doctor: {report.checkpoint}",
             f"  engine {report.engine}; target {report.target or '-'}; data {report.data or '-'}", ""]
    width = max(len(r.name) for r in report.results)
    for r in report.results:
        lines.append(f"{_MARK[r.status]}  {r.name:<{width}}  {r.detail}")
        if r.fix:
            lines.append(f"{'':6}{'':<{width}}  -> {r.fix}")
    lines += _tensor_table(report) + _live_table(report)
    counts = report.to_json()["counts"]
    lines += ["", f"{counts[FAIL]} failed, {counts[PASS]} passed, {counts[SKIPPED]} skipped in {report.elapsed_s:.1f} s"
              + (f"; wrote {', '.join(report.files)}" if report.files else "")]
    return "\n".join(lines)


def _tensor_table(report: Report) -> list[str]:
    tensors = [r for r in report.results if r.name == "numbers.tensors" and "rows" in r.data]
    if not tensors:
        return []
    data = tensors[0].data
    out = ["", f"stored tensors vs the target's (per-token relative error, {data['samples']} samples, "
               f"{data['tokens']} tokens; a match is below {data['tolerance']:g}):"]
    for row in data["rows"]:
        out.append(f"  {'ok' if row['ok'] else 'WRONG':5s} {row['line']}")
    return out


def _live_table(report: Report) -> list[str]:
    live = [r for r in report.results if r.name == "acceptance.live" and "rows" in r.data]
    if not live:
        return []
    rows = sorted(live[0].data["rows"], key=lambda r: -r["accuracy"])
    out = ["", f"live first-draft agreement ({live[0].data['positions']} positions), best first:"]
    for row in rows[:8]:
        z = f"  z {row['z']:+.1f}" if "z" in row else ""
        out.append(f"  {row['accuracy']:.3f}  {row['wiring']:<36} {row['description']}{z}")
    if len(rows) > 8:
        out.append(f"  ... {len(rows) - 8} more in --json")
    return out
