"""``eaglewire doctor``: prove with numbers that a drafter is fed what it was trained on.

Every check its inputs allow runs and reports pass, fail or skipped (with the
reason); a failure says what is wrong and what to do next.

  checkpoint.*    the checkpoint loads strictly; its fc takes num_aux x H; d2t/t2d
                  agree; its tensors are the ones saved at training (their sha256 in
                  the eaglewire section); the config fields the declared engine reads
                  mean, under that engine's id convention, the wiring the drafter was
                  trained on. A foreign folder is recognised from its config, imported
                  strictly, and judged as the stack that runs it reads it
  data.integrity  the dataset's shards are the ones its manifest hashed
  consistency.*   data, checkpoint and engine name the same tensors; target,
                  data and checkpoint fingerprints agree
  numbers.*       the target is rerun on the manifest's probe and on stored samples
                  (every shard, every sample the budget allows); each stored tensor is
                  diagnosed per sample and token (``tensor_match``): its label, another
                  capture point, its label at other tokens, or nothing
  acceptance.*    offline: the drafter's held-out accuracy against the one recorded
                  at training, on enough positions to see a 0.05 drop; live: its
                  agreement with the target's greedy tokens under the declared wiring
                  against plausible miswirings

This module runs the checks and writes the report. ``loading.py`` first loads
once what the inputs allow into the state the checks read (``state.py``); the
checks (``checkpoint_checks.py``: checkpoint, data integrity, consistency;
``evidence.py``: numbers, acceptance) only read it, so their order is free.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..data.capture import CaptureError
from ..drafter.checkpoint import (
    ARCHITECTURE,
    CONFIG_FILE,
    CheckpointError,
    CheckpointMeta,
)
from ..target import DEFAULT_TARGET, Target, load_target
from ..wiring import Wiring
from .checkpoint_checks import (
    check_data,
    check_engine_config,
    check_fc_width,
    check_load,
    check_target_consistency,
    check_vocab_maps,
    check_weights_hash,
    check_wiring_consistency,
)
from .evidence import (
    check_live,
    check_observed,
    check_offline,
    check_probe_tensors,
    check_stored_tensors,
)
from .loading import load_state
from .served import with_served_figures
from .state import (
    CAPTURE_FIX,
    FAIL,
    HEATMAP_FILE,
    PASS,
    REPORT_FILE,
    SKIPPED,
    CheckResult,
    CheckState,
    DoctorConfig,
    DoctorError,
    result_fail,
    result_pass,
    result_skip,
)

__all__ = ["FAIL", "PASS", "SKIPPED", "CheckResult", "DoctorConfig", "DoctorError", "Report", "detect_format",
           "format_report", "run_doctor", "run_doctor_detected", "run_doctor_on_foreign"]


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


# ---- running -------------------------------------------------------------------------------


def _resolve_checkpoint(cfg: DoctorConfig) -> Path:
    if cfg.checkpoint == "shipped":
        from ..drafter.shipped import shipped_drafter

        return shipped_drafter(cfg.target if cfg.target is not None else DEFAULT_TARGET)
    folder = Path(cfg.checkpoint)
    if not folder.is_dir():
        raise DoctorError(f"checkpoint {folder} is not a folder: give a drafter checkpoint folder (e.g. RUN/checkpoint) "
                          "or 'shipped'")
    return folder


Check = Callable[[CheckState], CheckResult]
# (name, check, what of the state it needs); consistency checks compare whatever records exist and skip
# themselves. Checks only read the state, so this order is the report's, nothing more.
CHECKS: list[tuple[str, Check, tuple[str, ...]]] = [
    ("checkpoint.load", check_load, ()),
    ("checkpoint.fc_width", check_fc_width, ("checkpoint",)),
    ("checkpoint.vocab_maps", check_vocab_maps, ("checkpoint",)),
    ("checkpoint.weights_hash", check_weights_hash, ("checkpoint",)),
    ("checkpoint.engine_config", check_engine_config, ("checkpoint",)),
    ("data.integrity", check_data, ("data",)),
    ("consistency.wiring", check_wiring_consistency, ()),
    ("consistency.target", check_target_consistency, ()),
    ("numbers.probe", check_probe_tensors, ("target", "dataset")),
    ("numbers.tensors", check_stored_tensors, ("target", "stored")),
    ("acceptance.offline", check_offline, ("target", "dataset", "drafter")),
    ("acceptance.live", check_live, ("target", "drafter")),
    ("acceptance.observed", check_observed, ("target", "drafter")),
]


# Checks that run only when asked for (they are left out of the report, not skipped, otherwise).
ASKED_FOR: dict[str, Callable[[DoctorConfig], bool]] = {
    "acceptance.observed": lambda cfg: cfg.observed_accept_len is not None or cfg.observed_accept_rate is not None,
}


def _unmet(st: CheckState, needs: tuple[str, ...]) -> str | None:
    """Why a check that needs ``needs`` cannot run now, or None."""
    reasons = {
        "checkpoint": (st.meta is None, "the checkpoint's config.json could not be read (see checkpoint.load)"),
        "target": (st.target is None, "no target loaded (see target)"),
        "data": (st.cfg.data is None, "no --data given"),
        "dataset": (st.samples is None, "no --data given" if st.cfg.data is None
                    else f"a {st.foreign_data.source} dataset records no probe and no held-out split"
                    if st.foreign_data is not None else "the dataset did not open (see data.integrity)"),
        "stored": (st.samples is None and st.foreign_data is None, "no --data given" if st.cfg.data is None
                   else "the dataset did not open (see data.integrity)"),
        "drafter": (st.drafter is None, "the drafter's weights did not load (see checkpoint.load)"),
    }
    for need in needs:
        unmet, reason = reasons[need]
        if unmet:
            return reason
    return None


def run_checks(st: CheckState, checks: list[tuple[str, Check, tuple[str, ...]]] = CHECKS,
               progress: Callable[[str], None] | None = None) -> list[CheckResult]:
    """Each check of ``checks`` on ``st``, in that order (any order gives the same verdicts)."""
    results = []
    for name, check, needs in checks:
        if name in ASKED_FOR and not ASKED_FOR[name](st.cfg):
            continue
        reason = _unmet(st, needs)
        if reason is not None:
            results.append(result_skip(name, reason))
            continue
        if progress is not None:
            progress(name)
        tick = time.perf_counter()
        try:
            result = check(st)
        except CaptureError as exc:  # the target's forward never produced a captured tensor: the wiring is broken
            result = result_fail(name, f"capture failed on this target: {exc}", CAPTURE_FIX)
        result.data["seconds"] = round(time.perf_counter() - tick, 2)
        results.append(result)
    return results


def run_doctor(cfg: DoctorConfig, target: Target | None = None, progress: Callable[[str], None] | None = None) -> Report:
    """Run every check the inputs allow. ``target``: an already loaded target (tests, notebooks)."""
    start = time.perf_counter()
    cfg = with_served_figures(cfg)  # before the target loads: a server that cannot be read ends the run now
    st, target_line = load_state(cfg, _resolve_checkpoint(cfg), target, progress)
    if cfg.out is not None and (cfg.out / HEATMAP_FILE).is_file():
        (cfg.out / HEATMAP_FILE).unlink()  # never report a heatmap of an earlier run
    results = [target_line, *run_checks(st, CHECKS, progress)]
    report = Report(str(st.folder), cfg.engine if cfg.engine_version is None else f"{cfg.engine} {cfg.engine_version}",
                    st.target.name if st.target is not None else None, str(cfg.data) if cfg.data else None,
                    results, time.perf_counter() - start)
    if cfg.out is not None:
        cfg.out.mkdir(parents=True, exist_ok=True)
        report.files = [str(cfg.out / REPORT_FILE)] + [str(p) for p in [cfg.out / HEATMAP_FILE] if p.is_file()]
        (cfg.out / REPORT_FILE).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report



def detect_format(folder: Path, engine: str) -> tuple[str | None, str]:
    """The layout of a folder whose config.json has no eaglewire section: (format, why), or (None, why not).

    A speculators config says so (its model type, its layer config, its architecture); an EAGLE-3 Llama
    config is the folder of whichever stack serves it: the ``engine`` named, else the one stack that finds
    ids where it reads them (stacks.py); the EAGLE reference writes a plain Llama config with a draft
    vocabulary. Native checkpoints (with the section) and unreadable configs give (None, ...).
    """
    from ..stacks import SERVING_STACKS, STACKS, ids_read

    try:
        raw = json.loads((Path(folder) / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"cannot read {CONFIG_FILE}: {exc}"
    if not isinstance(raw, dict) or "eaglewire" in raw:
        return None, "an eaglewire checkpoint"
    signs = [key for key in ("speculators_model_type", "speculators_config", "transformer_layer_config") if key in raw]
    if raw.get("architectures") == ["Eagle3Speculator"]:
        signs.insert(0, "architectures Eagle3Speculator")
    if signs:
        return "speculators", f"a speculators config ({', '.join(signs)})"
    if raw.get("architectures") in ([ARCHITECTURE], ["Eagle3LlamaForCausalLM"]):
        if engine in SERVING_STACKS:
            return engine, f"an EAGLE-3 Llama config, read as --engine {engine} serves it"
        if raw.get("norm_output") is True:
            return "specforge", "an EAGLE-3 Llama config with norm_output true, which SpecForge writes"
        readers = [name for name in SERVING_STACKS if all(ids_read(STACKS[name], raw).values())]
        if len(readers) == 1:
            where = STACKS[readers[0]].ids_at
            return readers[0], f"an EAGLE-3 Llama config whose ids only {readers[0]} finds where it reads them ({where})"
        return None, ("an EAGLE-3 Llama config that " + ("vLLM and SGLang both" if readers else "no serving stack")
                      + " would read ids from; give --engine vllm or sglang (the engine that will serve it), or --format")
    if raw.get("architectures") == ["LlamaForCausalLM"] and "draft_vocab_size" in raw:
        return "eagle", "a Llama config with a draft vocabulary, as the EAGLE reference writes"
    return None, f"architectures {raw.get('architectures')!r} is no drafter layout eaglewire knows"


def run_doctor_detected(cfg: DoctorConfig, ids_convention: str | None = None, wiring: str | None = None,
                        progress: Callable[[str], None] | None = None) -> Report:
    """``run_doctor`` on a native checkpoint; a folder without an eaglewire section is examined in the layout
    its config.json shows (``detect_format``), with a checkpoint.format line saying how it was recognised."""
    cfg = with_served_figures(cfg)
    folder = _resolve_checkpoint(cfg)
    fmt, why = detect_format(folder, cfg.engine) if (folder / CONFIG_FILE).is_file() else (None, "")
    if fmt is None:
        if ids_convention is not None or wiring is not None:
            raise DoctorError("--ids-convention and --wiring describe a foreign folder; a native checkpoint records "
                              "its wiring. Drop them, or give --format")
        report = run_doctor(cfg, progress=progress)
        if why and why != "an eaglewire checkpoint":
            report.results.insert(1, result_fail("checkpoint.format", f"no eaglewire section, and the layout is not "
                                                 f"recognised: {why}", "give --format (and --engine)"))
        return report
    report = run_doctor_on_foreign(replace(cfg, checkpoint=str(folder)), fmt, ids_convention, wiring, progress)
    report.results.insert(0, result_pass("checkpoint.format", f"no eaglewire section: read as a {fmt} folder, from "
                                         f"{why} (--format {fmt})", format=fmt))
    return report


def run_doctor_on_foreign(cfg: DoctorConfig, source_format: str, ids_convention: str | None = None,
                          wiring: str | None = None, progress: Callable[[str], None] | None = None) -> Report:
    """Import a folder in another stack's layout strictly into a temporary native checkpoint, then examine
    that; a failed import is the checkpoint.load verdict (keys named, likely cause), and the weights'
    names are still checked against what the stack loads (checkpoint.keys)."""
    from ..interop.formats import FormatError, import_checkpoint

    cfg = with_served_figures(cfg)
    target = load_target(cfg.target or DEFAULT_TARGET)
    with tempfile.TemporaryDirectory() as tmp:
        native = Path(tmp) / "imported"
        try:
            import_checkpoint(Path(cfg.checkpoint), source_format, native, target, ids_convention, wiring)
        except (FormatError, CheckpointError) as exc:
            fix = (f"fix the folder or the options (--format {source_format}, --ids-convention, --wiring); "
                   "`eaglewire import` gives the same verdict")
            return Report(cfg.checkpoint, cfg.engine, target.name, str(cfg.data) if cfg.data else None,
                          [CheckResult("checkpoint.load", FAIL, f"as a {source_format} folder: {exc}", fix),
                           check_foreign_keys(Path(cfg.checkpoint), source_format)], 0.0)
        report = run_doctor(replace(cfg, checkpoint=str(native)), target=target, progress=progress)
        wiring = CheckpointMeta.from_json(json.loads((native / CONFIG_FILE).read_text())["eaglewire"]).wiring
    report.checkpoint = f"{cfg.checkpoint} ({source_format}, imported strictly)"
    report.results.insert(1, check_foreign_serving(Path(cfg.checkpoint), source_format, cfg.engine, wiring,
                                                   target.num_layers))
    # the imported copy was hashed when saved; the folder's own weights are what the import checked
    report.results = [r for r in report.results if r.name != "checkpoint.weights_hash"]
    return report


def check_foreign_keys(folder: Path, source_format: str) -> CheckResult:
    """The decoder layer's weight names against the ones the stack of ``source_format`` loads: a stack that
    drops names it does not know serves a random layer in their place."""
    from ..interop.formats import FormatError, format_named, read_foreign_weights

    name = "checkpoint.keys"
    fmt = format_named(source_format)
    try:
        tensors, path = read_foreign_weights(folder)
    except (FormatError, CheckpointError) as exc:
        return result_skip(name, str(exc))
    namings = {"midlayer.": "EAGLE, SpecForge, SGLang and vLLM", "layers.0.": "speculators"}
    present = [prefix for prefix in namings if any(k.startswith(prefix) for k in tensors)]
    stack = f"{fmt.stack.name} {fmt.stack.version}"
    loads = f"{stack} loads the decoder layer as {fmt.layer_prefix}*"
    if present == [fmt.layer_prefix]:
        return result_pass(name, f"{path.name} names the decoder layer {fmt.layer_prefix}*, as {stack} loads it")
    fix = (f"rename the decoder layer's weights to {fmt.layer_prefix}* (or give the --format of the stack that wrote "
           "the folder); never serve it as is")
    if not present:
        return result_fail(name, f"{path.name} has no decoder layer weights (neither midlayer.* nor layers.0.*); "
                                 f"{loads}", fix)
    others = [p for p in present if p != fmt.layer_prefix]
    detail = (f"{path.name} names the decoder layer {' and '.join(p + '*' for p in present)} "
              f"({', '.join(namings[p] + ' naming' for p in others)}), but {loads}: {fmt.stack.unknown_weights}")
    if fmt.layer_prefix in present:
        detail += "; with both namings one set is never loaded"
    else:
        detail += ", so the drafter's decoder layer would keep its random initialisation"
    return result_fail(name, detail, fix)


def check_foreign_serving(folder: Path, source_format: str, engine: str, wiring: Wiring, num_layers: int) -> CheckResult:
    """The folder as the stack that will run it reads it (stacks.py): a speculators folder as speculators
    loads it, any other as ``--engine`` serves it. Importing proves the drafter; this proves the folder."""
    from ..interop.formats import read_foreign_weights
    from ..stacks import STACKS, serving_problems

    name = "checkpoint.serving"
    if source_format == "speculators":
        stack = STACKS["speculators"]
    elif engine in STACKS:
        stack = STACKS[engine]
    else:
        return CheckResult(name, SKIPPED, f"eaglewire serves the imported drafter itself; give --engine vllm or sglang "
                                          f"to check how that engine would read the {source_format} folder as is")
    data = json.loads((folder / CONFIG_FILE).read_text())
    tensors, _ = read_foreign_weights(folder)
    problems = serving_problems(stack, data, wiring, num_layers, set(tensors))
    served = f"{stack.name} {stack.version} ({'run' if stack.checked == 'run' else 'read from its source'})"
    if problems:
        return CheckResult(name, FAIL, f"as {served} reads this {source_format} folder: " + "; ".join(problems),
                           f"export the imported drafter for the stack that will run it (`eaglewire import --from "
                           f"{source_format}`, then `eaglewire export --to {stack.name}`)")
    return CheckResult(name, PASS, f"{served} reads this {source_format} folder as trained: ids capture {wiring}, "
                                   "every flag that changes the forward as the drafter computes it")

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
    checked = (f"{data['samples']} samples" if data["samples"] == data["dataset_samples"]
               else f"{data['samples']} of {data['dataset_samples']} samples")
    out = ["", (f"stored tensors vs the target's (per-token relative error, {checked}, {data['tokens']} tokens; a "
                f"match is below {data['tolerance']:g}):")]
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
