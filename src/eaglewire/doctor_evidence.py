"""The doctor's checks that rerun the target: stored tensors matched numerically, offline and live acceptance."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from safetensors import safe_open

from .capture import capture
from .doctor_state import (
    HEATMAP_FILE,
    LIVE_MIN_ACCURACY,
    LIVE_MIN_WINS,
    LIVE_PROMPTS,
    LIVE_Z,
    OFFLINE_MIN_DROP,
    CheckResult,
    CheckState,
    result_fail,
    result_pass,
    result_skip,
)
from .drafter import Drafter
from .manifest import Manifest
from .probe import PROBE_RTOL, run_probe
from .samples import load_stored
from .shards import HIDDEN_PREFIX
from .target import Target, chat_template_of
from .tensor_match import MATCH_TOLERANCE, ErrorTable, Match
from .ttt import step_sums, teacher_targets, unroll, unroll_fused
from .wiring import CapturePoint, Wiring, WiringError, all_points

# ---- numbers: probe and stored tensors -----------------------------------------------------


def check_probe(st: CheckState) -> CheckResult:
    name = "numbers.probe"
    recorded = st.manifest.probe
    fresh = run_probe(st.target, tuple(all_points(st.target.num_layers)))
    if recorded["input_ids"] != fresh["input_ids"]:
        return result_fail(name, f"the manifest's probe input ({len(recorded['input_ids'])} tokens) tokenizes differently "
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
        return result_fail(name, "; ".join(bad), fix, rows=rows)
    return result_pass(name, f"all {len(rows)} probe tensors are reproduced by the tensors their labels name "
                     f"(max relative norm error {max(r['error'] for r in rows):.1e})", rows=rows)


def _stored_labels(manifest: Manifest) -> list[tuple[str, str]]:
    """(row name, shard label) for every stored tensor: the aux points in wiring order, then final."""
    wiring = manifest.wiring
    return [*((f"aux[{i}] {p}", str(p)) for i, p in enumerate(wiring.aux)), (f"teacher {wiring.teacher}", str(wiring.teacher))]


def check_stored_tensors(st: CheckState) -> CheckResult:
    name = "numbers.tensors"
    cfg, manifest, target = st.cfg, st.manifest, st.target
    labels = _stored_labels(manifest)
    candidates = all_points(target.num_layers)
    table = ErrorTable([row for row, _ in labels], [str(p) for p in candidates])
    samples = st.samples.refs[: cfg.match_samples]
    if not samples:
        return result_skip(name, "the dataset has no samples")
    for ref in samples:
        length = min(ref.length, cfg.match_tokens)
        with safe_open(str(cfg.data / ref.shard), framework="pt") as handle:
            stored = {row: handle.get_slice(HIDDEN_PREFIX + label)[ref.start: ref.start + length]
                      for row, label in labels}
        widths = {tuple(t.shape[1:]) for t in stored.values()}
        if widths != {(target.hidden_size,)}:
            return result_fail(name, f"the stored tensors are {sorted(widths)} wide; this target's hidden size is "
                               f"{target.hidden_size}: the data comes from another model",
                         "extract the data again from this target")
        if int(ref.input_ids.max()) >= target.fingerprint["vocab_size"]:
            return result_fail(name, "the stored token ids exceed this target's vocabulary: the data comes from another model",
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
        return result_pass(name, f"every stored tensor equals the tensor its label names ({where}): largest error "
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
    return result_fail(name, f"{'; '.join(problems)} ({where})", fix, **data)


def _match_row(m: Match, label: str) -> dict:
    return {"stored": m.stored, "label": label, "best": m.best, "error": m.error, "next": m.runner_up,
            "next_error": m.runner_up_error, "ok": m.found and m.best == label, "line": m.describe(m.stored)}


# ---- acceptance ----------------------------------------------------------------------------


def check_offline(st: CheckState) -> CheckResult:
    name = "acceptance.offline"
    cfg, meta, drafter = st.cfg, st.meta, st.drafter
    stored = {f"{HIDDEN_PREFIX}{p}" for p in st.manifest.wiring.points}
    lacking = [str(p) for p in meta.wiring.points if f"{HIDDEN_PREFIX}{p}" not in stored]
    if lacking:
        return result_skip(name, f"the data does not store {', '.join(lacking)}, which the drafter reads (see consistency.wiring)")
    refs = [r for r in st.samples.refs if r.held_out][: cfg.eval_samples]
    if not refs:
        return result_skip(name, "the dataset has no held-out samples (records whose index is a multiple of 50)")
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
        return result_skip(name, f"no accuracy was recorded at training (no held-out samples then); measured here: {shown} "
                           f"per draft position on {len(refs)} held-out samples", **data)
    if positions == 0:
        return result_skip(name, "the held-out samples have no trained (assistant) positions", **data)
    p = recorded[0]
    allowed = max(OFFLINE_MIN_DROP, 3 * math.sqrt(max(p * (1 - p), 1e-4) / positions))
    head = (f"held-out accuracy per draft position {shown} on {len(refs)} samples ({positions} positions); recorded at "
            f"training {', '.join(f'{a:.3f}' for a in recorded)}")
    data["allowed_drop"] = allowed
    if measured[0] < p - allowed:
        return result_fail(name, f"{head}: position 1 dropped by {p - measured[0]:.3f} (allowed {allowed:.3f}), so the drafter "
                           "is not fed here what it was trained on",
                     "look at the failing checks above for the cause (wiring, stored tensors, target, d2t); if all pass, "
                     "the checkpoint's weights changed after training: re-save it from its run", **data)
    return result_pass(name, f"{head}: within {allowed:.3f}", **data)


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


def check_live(st: CheckState) -> CheckResult:
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
        return result_fail(name, f"{summary}. Beating the declared wiring: {named}",
                     f"the drafter was most likely trained on {rows[top]['wiring']}, not on the wiring its checkpoint "
                     f"declares: correct the checkpoint's wiring record (or retrain on {declared})", **data)
    if max(r["accuracy"] for r in rows) < LIVE_MIN_ACCURACY:
        return result_skip(name, f"inconclusive: {summary}; under {LIVE_MIN_ACCURACY:.0%} for every wiring, the drafter "
                           "cannot rank wirings here (an untrained drafter, or a wrong vocabulary map)", **data)
    return result_pass(name, f"{summary}; no miswiring does significantly better (McNemar z < {LIVE_Z:g})", **data)


