"""The doctor's checks on the checkpoint, the data's integrity, and what data, checkpoint and engine name."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..drafter.checkpoint import (
    TENSORS_HASH_KEY,
    WEIGHTS_FILE,
    CheckpointError,
    check_state_keys,
    read_checkpoint_config,
    read_weights,
    tensors_sha256,
)
from ..drafter.model import expected_state_shapes
from ..engine_ids import convention
from ..target import fingerprint_mismatches
from ..wiring import Wiring, WiringError
from .state import (
    FINGERPRINT_MEANING,
    SGLANG_VERSIONS,
    CheckResult,
    CheckState,
    result_fail,
    result_pass,
    result_skip,
)

# ---- checkpoint ----------------------------------------------------------------------------


def _weight_file_keys(folder: Path) -> dict[str, tuple[int, ...]] | str:
    """Names and shapes of the tensors in model.safetensors (header only), or why it cannot be read."""
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        return f"{path} is missing"
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except (SafetensorError, OSError) as exc:
        return f"cannot read {path}: {exc}"


def check_load(st: CheckState) -> CheckResult:
    name = "checkpoint.load"
    if st.config_error is not None:
        return result_fail(name, st.config_error, "re-save the checkpoint from its training run, or bring a foreign one in "
                                            "with `eaglewire import`")
    if st.target is None:
        return _check_keys_without_target(st)
    loaded, drafter = st.drafter_load, st.drafter  # loaded strictly, else without the engine-id check
    if loaded.strict_error is None:
        tensors = len(expected_state_shapes(drafter.config))
        return result_pass(name, f"loads strictly: {tensors} tensors, {loaded.dtype}, wiring {loaded.wiring}, draft "
                                 f"vocabulary {drafter.config.draft_vocab_size}")
    if drafter is None:
        return result_fail(name, loaded.strict_error, _load_fix(st))
    return result_fail(name, f"{loaded.strict_error}. The weights themselves load; the checks below use the wiring the "
                       "eaglewire section records", "correct the layer ids as checkpoint.engine_config says")


def _check_keys_without_target(st: CheckState) -> CheckResult:
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
        return result_fail(name, str(exc), _load_fix(st))
    return result_pass(name, "config.json and the weight names, shapes and dtypes are what an EAGLE-3 drafter needs "
                     "(no target loaded, so the drafter itself was not built)")


def _load_fix(st: CheckState) -> str:
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


def _hidden_size(st: CheckState) -> int:
    return st.target.hidden_size if st.target is not None else int(st.meta.target["hidden_size"])


def check_fc_width(st: CheckState) -> CheckResult:
    name = "checkpoint.fc_width"
    keys = _weight_file_keys(st.folder)
    if isinstance(keys, str):
        return result_skip(name, keys)
    if "fc.weight" not in keys:
        return result_skip(name, "the weights have no fc.weight (see checkpoint.load)")
    rows, cols = keys["fc.weight"]
    hidden, aux = _hidden_size(st), st.meta.wiring.aux
    want = len(aux) * hidden
    data = {"fc_shape": [rows, cols], "expected": [hidden, want], "num_aux": len(aux), "hidden_size": hidden}
    if (rows, cols) == (hidden, want):
        return result_pass(name, f"fc.weight is [{rows}, {cols}]: it fuses the {len(aux)} aux states of the wiring "
                         f"({len(aux)} x {hidden})", **data)
    if cols == hidden and len(aux) > 1:
        return result_fail(
            name,
            f"fc.weight is [{rows}, {cols}]: it takes ONE hidden state of width {hidden}, but the wiring {st.meta.wiring} "
            f"names {len(aux)} aux states ({len(aux)} x {hidden} = {want} features). An H-wide fc is what a drafter "
            "gets when fusion was bypassed on equal widths (a single, usually wrong, hidden state reached the "
            "midlayer without error)",
            "retrain with the fc applied to the concatenated aux states of the wiring (eaglewire's drafter always "
            "applies it and refuses other widths); do not serve this checkpoint", **data)
    return result_fail(name, f"fc.weight is [{rows}, {cols}], but {len(aux)} aux states of width {hidden} need "
                       f"[{hidden}, {want}]", "re-save the checkpoint from the training run that matches its wiring",
                 **data)


def check_vocab_maps(st: CheckState) -> CheckResult:
    name = "checkpoint.vocab_maps"
    path = st.folder / WEIGHTS_FILE
    keys = _weight_file_keys(st.folder)
    if isinstance(keys, str):
        return result_skip(name, keys)
    if not {"d2t", "t2d"} <= set(keys):
        return result_skip(name, "the weights lack d2t or t2d (see checkpoint.load)")
    with safe_open(str(path), framework="pt") as handle:
        d2t, t2d = handle.get_tensor("d2t"), handle.get_tensor("t2d")
    if not isinstance(st.raw.get("draft_vocab_size"), int):
        return result_skip(name, "config.json has no draft_vocab_size to check d2t against (see checkpoint.engine_config)")
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
        return result_fail(name, "; ".join(problems), fix)
    ids = torch.arange(d2t.numel()) + d2t.long()
    outside = ((ids < 0) | (ids >= vocab)).nonzero().flatten()
    if outside.numel():
        i = int(outside[0])
        return result_fail(name, f"d2t maps {outside.numel()} draft ids outside the target vocabulary 0..{vocab - 1} "
                           f"(first: draft {i} -> target {int(ids[i])})", fix)
    descending = (ids[1:] <= ids[:-1]).nonzero().flatten()
    if descending.numel():
        i = int(descending[0])
        return result_fail(name, f"d2t's target ids are not strictly ascending (draft {i} -> {int(ids[i])}, draft {i + 1} -> "
                           f"{int(ids[i + 1])}); t2d-ordered logits would not line up with the draft logits", fix)
    marked = t2d.nonzero().flatten()
    if marked.numel() != ids.numel() or not torch.equal(marked, ids):
        unmarked = ids[~t2d[ids]]
        extra = marked[~torch.isin(marked, ids)]
        first = (f"first: draft {int((ids == unmarked[0]).nonzero()[0])} -> target {int(unmarked[0])}, which t2d does not mark"
                 if unmarked.numel() else f"first: t2d marks target {int(extra[0])}, which no draft id maps to")
        return result_fail(name, f"d2t and t2d disagree: d2t selects {ids.numel()} target ids, t2d marks {marked.numel()}, "
                           f"{unmarked.numel()} of d2t's are not marked ({first}); one of them is stale", fix,
                     unmarked=int(unmarked.numel()), extra=int(extra.numel()))
    return result_pass(name, f"d2t and t2d agree on {ids.numel()} target ids in 0..{vocab - 1}, ascending")


def check_weights_hash(st: CheckState) -> CheckResult:
    """The weights are the ones saved at training: each tensor's sha256 against the one the save recorded."""
    name = "checkpoint.weights_hash"
    recorded = st.meta.tensors_sha256
    if recorded is None:
        return result_skip(name, f"the checkpoint records no hash of its tensors (no {TENSORS_HASH_KEY} in its eaglewire "
                           "section: saved before eaglewire recorded one), so an edit of its weights after training "
                           "cannot be seen here; saving it again with eaglewire records one")
    try:
        tensors = read_weights(st.folder / WEIGHTS_FILE)
    except CheckpointError as exc:
        return result_skip(name, f"{exc} (see checkpoint.load)")
    now = tensors_sha256(tensors)
    changed = [key for key in sorted(recorded.keys() & now.keys()) if recorded[key] != now[key]]
    missing, added = sorted(set(recorded) - set(now)), sorted(set(now) - set(recorded))
    data = {"changed": changed, "missing": missing, "added": added, "tensors": len(now)}
    if not (changed or missing or added):
        return result_pass(name, f"all {len(now)} tensors are the ones saved at training (sha256 of each, recorded "
                           "in config.json's eaglewire section)", **data)
    problems = [f"{key} changed since the checkpoint was saved{_looks_like(tensors[key])}" for key in changed]
    problems += [f"{key} was saved but is gone" for key in missing]
    problems += [f"{key} was added after the save" for key in added]
    return result_fail(name, f"the weights are not the ones saved at training: {'; '.join(problems)} "
                       f"({len(now) - len(changed) - len(added)} of {len(now)} tensors unchanged)",
                       "the weights were edited after training (by hand, by a conversion or a merge): take the "
                       "checkpoint from its training run again (or retrain); if the edit is meant, save the drafter "
                       "with eaglewire, which records the new hashes", **data)


def _looks_like(tensor: torch.Tensor) -> str:
    """What an edited tensor now holds, when that names a likely edit."""
    if tensor.is_floating_point() and tensor.numel():
        for value, what in ((1.0, "all ones, as a freshly initialised norm"), (0.0, "all zeros")):
            if bool((tensor == value).all()):
                return f" (now {what})"
    return ""


def check_engine_config(st: CheckState) -> CheckResult:
    name = "checkpoint.engine_config"
    cfg, meta, trained = st.cfg, st.meta, st.meta.wiring
    reading = st.engine_reading  # what the engine reads from config.json, and what that captures
    ids, problems, readings, layers = reading.ids, reading.problems, reading.captures, reading.layers
    if ids is None:
        return result_fail(name, "; ".join(problems), "rewrite config.json with `eaglewire train`'s writer (or export)")
    if not readings:  # no rule says what the engine captures with them (loading.read_engine_ids says why)
        return result_fail(name, f"{cfg.engine} reads ids {ids}, but " + "; ".join(problems),
                           "serve this drafter with an engine that captures aux states on this target, or, if your "
                           f"{cfg.engine} build does, pass --engine-version with the rule its model file follows",
                           ids=ids, readings={}, trained=str(trained))
    described = "; ".join(f"under {c} they capture {w}" if isinstance(w, Wiring) else f"{c} cannot capture them: {w}"
                          for c, w in readings.items())
    if cfg.engine == "eaglewire":  # its engine reads the wiring itself; other engines will read these ids
        head = (f"eaglewire reads the wiring from the eaglewire section; config.json's ids {ids} are written for "
                f"{meta.convention} (the convention that section records): {described}")
    else:
        head = f"{cfg.engine} reads ids {ids}: {described}"
    data = {"ids": ids, "readings": {c: str(w) for c, w in readings.items()}, "trained": str(trained)}
    wrong = {c: w for c, w in readings.items() if w != trained}
    good_ids = _ids_for(trained, layers, list(readings))
    if wrong and len(wrong) < len(readings) and cfg.engine == "sglang" and cfg.engine_version is None:
        fine = [c for c in readings if c not in wrong]
        return result_fail(name, f"{head}. SGLang builds disagree on these ids: only {', '.join(fine)} reads them as the "
                           f"trained wiring {trained}",
                     f"pass --engine-version {' or '.join(k for k, v in SGLANG_VERSIONS.items() if v in fine)} if your "
                     f"build's model file does that, or write ids {good_ids}", **data)
    if wrong:
        return result_fail(name, f"{head}, but the drafter was trained on {trained}" + (f"; also: {'; '.join(problems)}"
                                                                                  if problems else ""),
                     f"write eagle_aux_hidden_state_layer_ids {good_ids} (top level and in eagle_config) for {cfg.engine}; "
                     f"`eaglewire wiring --wiring {trained}` prints every engine's ids", **data)
    if problems:
        return result_fail(name, f"{head}, as trained, but: {'; '.join(problems)}",
                     "re-save the checkpoint with eaglewire, which writes every field the engines read", **data)
    return result_pass(name, f"{head} = the trained wiring; architectures, draft_vocab_size and num_hidden_layers are as "
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


def check_data(st: CheckState) -> CheckResult:
    name = "data.integrity"
    if st.data_error is not None:  # opening the dataset verified every shard's sha256
        return result_fail(name, st.data_error, "restore the dataset or extract it again (`eaglewire extract`)")
    if st.foreign_data is not None:
        data = st.foreign_data
        return result_skip(name, f"a {data.source} dataset ({len(data.refs)} samples): it records no hashes to check; "
                                 f"its entries are taken for {', '.join(f'{e.name} = {e.claim}' for e in data.entries)} "
                                 f"({data.claims_from}), which numbers.tensors checks")
    totals = st.manifest.totals
    return result_pass(name, f"{len(st.manifest.shards)} shards match their sha256; {totals['samples']} samples, "
                     f"{totals['tokens']} tokens, stored {st.manifest.settings.dtype}, wiring {st.manifest.wiring}")


def check_wiring_consistency(st: CheckState) -> CheckResult:
    name = "consistency.wiring"
    named: dict[str, Wiring] = {}
    if st.manifest is not None:
        named["the data (manifest)"] = st.manifest.wiring
    if st.meta is not None:
        named["the checkpoint (eaglewire section)"] = st.meta.wiring
    if st.engine_wiring is not None:
        named[st.engine_reading.source] = st.engine_wiring
    if len(named) < 2:
        return result_skip(name, "fewer than two wiring records to compare (give --data, and see checkpoint.engine_config)")
    data = {k: str(v) for k, v in named.items()}
    if len(set(named.values())) == 1:
        return result_pass(name, f"{', '.join(named)} all name {next(iter(named.values()))}", **data)
    reference = named.get("the checkpoint (eaglewire section)")
    lines = [f"{who}: {w}" for who, w in named.items()]
    fix = (f"re-extract the data with --wiring {reference}, or train a drafter on this data; for the engine, see "
           "checkpoint.engine_config") if reference is not None else "make the records agree"
    return result_fail(name, "they name different tensors: " + "; ".join(lines), fix, **data)


def check_target_consistency(st: CheckState) -> CheckResult:
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
        return result_skip(name, "fewer than two target fingerprints to compare")
    ref_name, ref_print = reference
    differing, lines = set(), []
    for kind, who, fingerprint in others:
        keys = [k.split(":")[0] for k in fingerprint_mismatches(fingerprint, ref_print)]
        if keys:
            differing.add(kind)
            lines.append(f"{who} differs from {ref_name} in {', '.join(FINGERPRINT_MEANING.get(k, k) for k in keys)}")
    same_data = is_training_data(st)
    note = ""
    if st.manifest is not None and st.meta is not None:
        note = (" The data is the dataset this drafter was trained on." if same_data else
                " The data is not the dataset this drafter was trained on (its manifest hash differs); fine for "
                "checking if it comes from the same target and wiring.")
    compared = ", ".join([ref_name, *(who for _, who, _ in others)])
    if not differing:
        return result_pass(name, f"{compared}: same config, tokenizer, chat template and weights." + note,
                   same_training_data=same_data)
    if "checkpoint" in differing:
        fix = (f"check and serve the drafter with the target it was trained on (--target {st.meta.target.get('name')}), "
               "or train a drafter for this target")
    else:
        fix = "extract the data again from this target (`eaglewire extract --target ...`)"
    return result_fail(name, "; ".join(lines) + "." + note, fix, same_training_data=same_data)


def is_training_data(st: CheckState) -> bool:
    """``--data`` is the dataset the checkpoint was trained on (its manifest hash is the one the checkpoint records)."""
    return (st.manifest is not None and st.meta is not None
            and st.meta.data_manifest_sha256 == _sha256(st.cfg.data / "manifest.json"))


def _sha256(path: Path) -> str | None:
    from ..files import sha256_file

    return sha256_file(path) if path.is_file() else None


