"""The doctor's loading phase: everything its checks read, loaded once from what the inputs allow.

What cannot be loaded is recorded with why, and the check that reports on it (checkpoint.load,
data.integrity, checkpoint.engine_config, acceptance.live) gives that failure; the other checks
skip. No check loads or fills in anything, so the order of CHECKS does not change a verdict.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..data.capture import CaptureError, capture
from ..data.manifest import MANIFEST, ManifestError
from ..data.samples import DatasetSamples
from ..data.shards import ShardError
from ..drafter.checkpoint import (
    ARCHITECTURE,
    CONFIG_FILE,
    LATER_LAYER_NORM,
    CheckpointError,
    CheckpointMeta,
    load_checkpoint,
)
from ..drafter.model import Drafter
from ..engine_ids import convention
from ..interop.foreign_data import ForeignDataError, ForeignDataset, detect_foreign_data
from ..stacks import (
    IDS_KEY,
    NESTED_IDS_KEY,
    STACKS,
    config_value,
    id_places_differ,
    ids_read,
    later_layer_norm_name,
    layer_problems,
    sglang_rules,
)
from ..target import Target, TargetError, chat_template_of, load_target
from ..train.ttt import teacher_targets
from ..wiring import Wiring, WiringError, all_points
from .state import (
    LIVE_PROMPTS,
    SGLANG_VERSIONS,
    CheckResult,
    CheckState,
    DoctorConfig,
    DrafterLoad,
    EngineReading,
    LiveSample,
    result_fail,
    result_pass,
    result_skip,
)

Progress = Callable[[str], None] | None


def load_state(cfg: DoctorConfig, folder: Path, target: Target | None = None,
               progress: Progress = None) -> tuple[CheckState, CheckResult]:
    """The state the checks read, and the report's target line. ``target``: an already loaded one."""
    raw, meta, config_error = read_config(folder)
    target, target_line = _load_target(cfg, meta, target, progress)
    drafter_load = None
    if config_error is None and target is not None:
        _tell(progress, "checkpoint (loading the drafter)")
        drafter_load = _load_drafter(folder, target)
    samples, data_error, foreign_data = None, None, None
    stack = detect_foreign_data(cfg.data) if cfg.data is not None and not (cfg.data / MANIFEST).is_file() else None
    if stack is not None:
        _tell(progress, f"data (listing a {stack} dataset)")
        foreign_data, data_error = _open_foreign(cfg.data, stack, meta, target)
    elif cfg.data is not None:
        _tell(progress, "data (hashing every shard)")
        try:
            samples = DatasetSamples(cfg.data)  # verifies every shard's sha256
        except (ManifestError, ShardError) as exc:
            data_error = str(exc)
    engine_reading = None
    if meta is not None:
        layers = target.num_layers if target is not None else meta.num_layers
        engine_reading = read_engine_ids(cfg, raw, meta, layers)
    live, live_error = None, None
    if target is not None and drafter_load is not None and drafter_load.drafter is not None:
        _tell(progress, "acceptance (generating the live continuations)")
        try:
            live = _live_samples(target, drafter_load.drafter, meta.wiring, cfg.live_prompts, cfg.live_tokens)
        except CaptureError as exc:  # the target's forward never produced a captured tensor
            live_error = f"capture failed on this target: {exc}"
    state = CheckState(cfg, folder, raw=raw, meta=meta, config_error=config_error, target=target,
                       drafter_load=drafter_load, samples=samples, data_error=data_error, foreign_data=foreign_data,
                       engine_reading=engine_reading,
                       live=live, live_error=live_error)
    return state, target_line


def _tell(progress: Progress, what: str) -> None:
    if progress is not None:
        progress(what)


def _open_foreign(folder: Path, stack: str, meta: CheckpointMeta | None,
                  target: Target | None) -> tuple[ForeignDataset | None, str | None]:
    """Another stack's dataset, its entries claimed as the drafter's wiring says (else the stack's defaults)."""
    layers = target.num_layers if target is not None else meta.num_layers if meta is not None else None
    if layers is None:
        return None, f"{folder} is a {stack} dataset; reading it needs the target's layer count (give --target)"
    try:
        return ForeignDataset(folder, stack, meta.wiring if meta is not None else None, layers), None
    except ForeignDataError as exc:
        return None, str(exc)


# ---- checkpoint ----------------------------------------------------------------------------


def read_config(folder: Path) -> tuple[dict | None, CheckpointMeta | None, str | None]:
    """config.json and its eaglewire section, and why they cannot be read (None when they can)."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        return None, None, f"{path} is missing"
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        return None, None, f"{path} is not valid JSON: {exc}"
    if "eaglewire" not in raw:
        return raw, None, (f"{path} has no 'eaglewire' section, so the wiring and target it was trained on are "
                           "unknown; bring a foreign checkpoint in with `eaglewire import`")
    try:
        return raw, CheckpointMeta.from_json(raw["eaglewire"]), None
    except (CheckpointError, KeyError, TypeError) as exc:
        return raw, None, f"{path}: the eaglewire section is invalid: {exc}"


def _load_target(cfg: DoctorConfig, meta: CheckpointMeta | None, target: Target | None,
                 progress: Progress) -> tuple[Target | None, CheckResult]:
    name = "target"
    if target is not None:
        return target, result_pass(name, f"{target.name}: {target.num_layers} layers, hidden size "
                                         f"{target.hidden_size} (given)")
    _tell(progress, "target (loading)")
    if cfg.target is not None:
        spec, why = cfg.target, "--target"
    elif meta is not None:
        spec, why = meta.target["name"], "named by the checkpoint"
    else:
        return None, result_skip(name, "no --target, and the checkpoint does not name its target")
    try:
        target = load_target(spec)
    except TargetError as exc:
        return None, result_fail(name, str(exc), "pass --target with the model the drafter was trained for")
    return target, result_pass(name, f"{spec} ({why}): {target.num_layers} layers, hidden size {target.hidden_size}")


def _load_drafter(folder: Path, target: Target) -> DrafterLoad:
    try:
        checkpoint = load_checkpoint(folder, target.layout.embed)
        dtype = str(checkpoint.drafter.fc.weight.dtype).removeprefix("torch.")  # as stored: .float() converts in place
        return DrafterLoad(checkpoint.drafter.float(), dtype, checkpoint.meta.wiring)
    except CheckpointError as exc:
        strict_error = str(exc)
    try:  # the same load without the engine-id check: do the weights themselves load?
        drafter = load_checkpoint(folder, target.layout.embed, check_ids=False).drafter.float()
    except CheckpointError:
        return DrafterLoad(None, strict_error=strict_error)
    return DrafterLoad(drafter, strict_error=strict_error)


# ---- what the declared engine reads --------------------------------------------------------


def read_engine_ids(cfg: DoctorConfig, raw: dict, meta: CheckpointMeta, layers: int) -> EngineReading:
    """The ids ``cfg.engine`` reads from config.json (where and in which order: stacks.py), the fields it
    needs that are missing or wrong, and the wiring they capture under each convention it may follow."""
    ids, problems = _engine_ids(cfg.engine, raw)
    captures: dict[str, Wiring | str] = {}
    try:
        conventions = _conventions(cfg, meta) if ids is not None else []
    except WiringError as exc:  # SGLang cannot capture on this target family, or its rule is not recorded
        problems.append(str(exc))
        conventions = []
    for conv in conventions:
        try:
            captures[conv] = convention(conv).from_ids(ids, layers)
        except (ValueError, TypeError) as exc:  # WiringError, or ids that are not integers
            captures[conv] = str(exc)
    return EngineReading(cfg.engine, ids, problems, captures, layers)


def _engine_ids(engine: str, raw: dict) -> tuple[list[int] | None, list[str]]:
    problems = []
    if raw.get("architectures") != [ARCHITECTURE]:
        problems.append(f"architectures is {raw.get('architectures')!r}; {engine} picks the EAGLE-3 model class "
                        f"by [{ARCHITECTURE!r}]")
    if not isinstance(raw.get("draft_vocab_size"), int):
        problems.append("draft_vocab_size is missing: the engine would size the drafter's lm_head by the full vocabulary")
    layers = raw.get("num_hidden_layers")
    if not (isinstance(layers, int) and layers >= 1):
        problems.append(f"num_hidden_layers is {layers!r}; the engine builds that many decoder layers (1 for EAGLE-3)")
    elif engine in STACKS:  # a stack that builds later layers otherwise than this native file names them
        native = {later_layer_norm_name(i, LATER_LAYER_NORM) for i in range(1, layers)}
        problems += [f"{problem} (`eaglewire export --to {engine}` writes it)"
                     for problem in layer_problems(STACKS[engine], raw, native)]
    differ = id_places_differ(raw)
    if differ is not None:
        problems.append(differ)
    nested, top = config_value(raw, NESTED_IDS_KEY), config_value(raw, IDS_KEY)
    if engine == "eaglewire":  # the ids the native checkpoint writes for its recorded convention
        ids = nested if nested is not None else top
        if ids is None:
            problems.append(f"no {IDS_KEY} (top level or in eagle_config): an engine would capture its default layers")
        return ids, problems
    stack = STACKS[engine]
    read = ids_read(stack, raw)
    blind = [path or stack.name for path, found in read.items() if found is None]
    if blind:
        problems.append(f"{stack.name} {stack.version} ({', '.join(blind)}) finds no ids where it reads them "
                        f"({stack.ids_at}): it then captures its default layers, whatever the drafter was trained on")
    found = [f[1] for f in read.values() if f is not None]
    if len({json.dumps(v) for v in found}) > 1:
        problems.append(f"{stack.name}'s code paths read different ids ({stack.ids_at})")
    return (found[0] if found else None), problems


def _conventions(cfg: DoctorConfig, meta: CheckpointMeta) -> list[str]:
    """The conventions the engine may read ids by: eaglewire's records its own; a stack's are in stacks.py.
    SGLang's are its target family's model file's (stacks.sglang_rules): both PR #25454 builds for the
    llama family unless --engine-version says which one serves, the one rule of any other family. Raises
    WiringError for a family SGLang cannot capture on, or whose rule is not recorded."""
    if cfg.engine == "eaglewire":
        return [meta.convention]
    if cfg.engine == "sglang" and cfg.engine_version is not None:
        return [SGLANG_VERSIONS[cfg.engine_version]]
    if cfg.engine == "sglang":
        return list(sglang_rules(meta.target["model_type"]))
    return list(STACKS[cfg.engine].conventions)


# ---- the live continuations ----------------------------------------------------------------


def _live_samples(target: Target, drafter: Drafter, declared: Wiring, prompts: int,
                  new_tokens: int) -> tuple[LiveSample, ...]:
    """The first ``prompts`` prompts with the target's greedy continuation, every point captured on them."""
    template = chat_template_of(target.tokenizer)
    lm_head, out = target.layout.lm_head.weight, []
    for text in LIVE_PROMPTS[:prompts]:
        rendered = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], chat_template=template,
                                                       tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([target.tokenizer(rendered, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            full = target.model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                         pad_token_id=target.tokenizer.eos_token_id)[0]
            captured = {p: t[0] for p, t in capture(target.layout, all_points(target.num_layers), full[None]).items()}
            top1 = teacher_targets(captured[declared.teacher], lm_head, drafter.t2d).top1
        out.append(LiveSample(full, ids.shape[1], captured, top1))
    return tuple(out)
