"""The doctor's checks that rerun the target: stored tensors matched numerically, offline and live acceptance."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import torch

from ..data.capture import CaptureHooks, capture
from ..data.probe import PROBE_RTOL, probe_error, run_probe
from ..data.samples import SampleRef, load_stored
from ..data.shards import hidden_key
from ..drafter.model import Drafter
from ..engine.context_lookup import LookupShape, lookup_drafts
from ..interop.foreign_data import ForeignDataError
from ..target import Target
from ..train.ttt import step_sums, teacher_targets, unroll, unroll_fused
from ..wiring import CapturePoint, Wiring, WiringError, all_points
from .checkpoint_checks import is_training_data
from .state import (
    CAPTURE_FIX,
    HEATMAP_FILE,
    LIVE_MIN_ACCURACY,
    LIVE_MIN_WINS,
    LIVE_Z,
    MATCH_MIN_TOKENS,
    OBSERVED_EXACT_TOKENS,
    OFFLINE_DETECT_DROP,
    OFFLINE_MIN_SAMPLES,
    OFFLINE_POWER_Z,
    OFFLINE_Z,
    CheckResult,
    CheckState,
    DoctorConfig,
    LiveSample,
    result_fail,
    result_pass,
    result_skip,
)
from .stored import StoredTensors, stored_tensors
from .tensor_match import MATCH_TOLERANCE, ErrorTable, Match, SampleVerdict, diagnose

# ---- numbers: probe and stored tensors -----------------------------------------------------


def check_probe_tensors(st: CheckState) -> CheckResult:
    """The manifest's probe against every tensor of the target rerun now: each label should be reproduced
    by the tensor it names (data/probe.py's error), and by no other."""
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
        errors = {cand: probe_error(entry, v) for cand, v in fresh["tensors"].items()}
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


def matched_samples(refs: list[SampleRef], budget: int, max_tokens: int,
                    max_samples: int | None = None) -> tuple[list[SampleRef], int]:
    """The samples numbers.tensors reruns and how many leading tokens of each: every sample while
    ``budget`` tokens allow ``MATCH_MIN_TOKENS`` each (or ``max_samples``), else an even spread over
    every shard, its first and last sample included; the budget is then shared out evenly."""
    limit = max(1, budget // MATCH_MIN_TOKENS)
    if max_samples is not None:
        limit = min(limit, max_samples)
    if len(refs) <= limit:
        chosen = list(refs)
    else:
        by_shard: dict[str | None, list[SampleRef]] = {}
        for ref in refs:
            by_shard.setdefault(ref.shard, []).append(ref)
        chosen = []
        for shard_refs in by_shard.values():
            quota = max(1, round(limit * len(shard_refs) / len(refs)))
            picks = sorted({round(i * (len(shard_refs) - 1) / max(quota - 1, 1)) for i in range(quota)})
            chosen += [shard_refs[i] for i in picks]
    per = max(MATCH_MIN_TOKENS, min(max_tokens, budget // max(len(chosen), 1)))
    return chosen, min(per, max_tokens)


class SharedPrefix:
    """Captures every candidate on token sequences that begin with the same tokens (a chat template's
    system prompt): the shared prefix runs once, each sample runs on from its KV cache. Numerically the
    same as a full forward (float rounding, ~1e-6 relative), at the cost of the tokens after the prefix."""

    MIN_LENGTH = 4  # below this a prefix saves too little to be worth its cache

    def __init__(self, target: Target, points: list[CapturePoint], sequences: list[torch.Tensor]):
        self.target, self.points = target, points
        length = min(len(ids) for ids in sequences) - 1  # every sample keeps at least one token of its own
        first = sequences[0]
        for ids in sequences[1:]:
            same = (ids[:length] == first[:length]).long()
            length = int(same.cumprod(0).sum())
        self.length = length if length >= self.MIN_LENGTH and len(sequences) > 1 else 0
        self.cache, self.states = None, {}
        if self.length:
            from transformers import DynamicCache

            self.cache = DynamicCache()
            self.states = self._run(first[: self.length])

    def _run(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.inference_mode(), CaptureHooks(self.target.layout, self.points) as hooks:
            self.target.layout.base(input_ids=ids.long()[None], cache=self.cache,
                                    use_cache=self.cache is not None)
        return {str(p): t[0] for p, t in hooks.result(len(ids)).items()}

    def capture(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every candidate [T, H] on ``ids``, which begin with the shared prefix."""
        if not self.length:
            return {str(p): t[0] for p, t in capture(self.target.layout, self.points, ids.long()[None]).items()}
        rest = self._run(ids[self.length:])
        self.cache.crop(self.length - len(ids))  # negative: drop this sample's tokens, keep the prefix
        return {name: torch.cat([self.states[name], rest[name]]) for name in rest}


def check_stored_tensors(st: CheckState) -> CheckResult:
    name = "numbers.tensors"
    cfg, target, source = st.cfg, st.target, stored_tensors(st)
    labels = source.labels
    candidates = all_points(target.num_layers)
    table = ErrorTable([row for row, _ in labels], [str(p) for p in candidates])
    refs = source.refs
    samples, per = matched_samples(refs, cfg.match_budget, cfg.match_tokens, cfg.match_samples)
    if not samples:
        return result_skip(name, "the dataset has no samples")
    shared = SharedPrefix(target, candidates, [ref.input_ids for ref in samples])
    verdicts: list[tuple[SampleRef, dict[str, SampleVerdict]]] = []
    for ref in samples:
        length = min(ref.length, shared.length + per)
        try:
            stored = source.read(ref, length)
        except ForeignDataError as exc:
            return result_fail(name, str(exc), "regenerate the hidden states with the stack that wrote them")
        widths = {tuple(t.shape[1:]) for t in stored.values()}
        if widths != {(target.hidden_size,)}:
            return result_fail(name, f"the stored tensors are {sorted(widths)} wide; this target's hidden size is "
                               f"{target.hidden_size}: the data comes from another model",
                         "extract the data again from this target")
        if int(ref.input_ids.max()) >= target.fingerprint["vocab_size"]:
            return result_fail(name, "the stored token ids exceed this target's vocabulary: the data comes from another model",
                         "extract the data again from this target")
        found = shared.capture(ref.input_ids[:length])
        errors = table.add(stored, found)
        verdicts.append((ref, {row: diagnose(label, stored[row].float(), found, errors[row])
                               for row, label in labels}))
    matches = table.matches()
    wrong_in = {row: sum(v[row].kind != "ok" for _, v in verdicts) for row, _ in labels}
    rows = [_match_row(m, label, wrong_in[m.stored], len(samples)) for m, (_, label) in zip(matches, labels)]
    data = {"rows": rows, "samples": len(samples), "dataset_samples": len(refs), "tokens_per_sample": per,
            "shared_prefix": shared.length, "tokens": table.tokens, "tolerance": MATCH_TOLERANCE, "stored": table.stored,
            "candidates": table.candidates, "errors": table.errors().tolist()}
    if cfg.out is not None:
        from ..plots import plot_tensor_match

        cfg.out.mkdir(parents=True, exist_ok=True)
        plot_tensor_match(table.errors(), table.stored, table.candidates, MATCH_TOLERANCE, cfg.out / HEATMAP_FILE)
        data["heatmap"] = str(cfg.out / HEATMAP_FILE)
    shards = len({ref.shard for ref in refs})
    coverage = ("every sample" if len(samples) == len(refs) else
                f"{len(samples)} of {len(refs)} samples spread over all {shards} shards")
    prefix = (f" (the first {shared.length}, which every one shares, computed once)" if shared.length else "")
    where = (f"{coverage}, up to {shared.length + per} leading tokens each{prefix}, {table.tokens} tokens; "
             f"per-token tolerance {MATCH_TOLERANCE:g}")
    groups = _group_verdicts(verdicts, labels)
    data["groups"] = [{"records": [ref.record_index for ref in group], "problems": [vars(v) | {"row": row}
                       for row, v in problems]} for problems, group in groups]
    if not groups:
        return result_pass(name, f"every stored tensor equals the tensor its label names in every sample checked "
                         f"({where}): largest error {max(m.error for m in matches):.4f}, nearest other candidate at "
                         f"{min(m.runner_up_error for m in matches):.4f}", **data)
    texts, causes = [], []
    for problems, group in groups:
        text, cause = _describe_group(problems, group, len(samples), labels, st, source)
        texts.append(text)
        causes += [c for c in cause if c not in causes]
    data["causes"] = causes
    if len(texts) > MAX_GROUPS_SHOWN:  # the largest groups first; every group is in --json
        order = sorted(range(len(groups)), key=lambda i: -len(groups[i][1]))[:MAX_GROUPS_SHOWN]
        rest = len(groups) - MAX_GROUPS_SHOWN
        more = f"... and {rest} more group{'s' * (rest > 1)} of samples wrong in other ways (see --json)"
        texts = [texts[i] for i in sorted(order)] + [more]
    fixes = dict(_CAUSE_FIX)
    if source.stack is not None:  # the stack's own generation captured the wrong layers
        fixes["relabelled"] = (f"{source.stack}'s loader takes each stored entry for the tensor its row names: "
                               f"regenerate the hidden states with {_FOREIGN_IDS[source.stack]} set to the wiring "
                               "the drafter reads (or extract with `eaglewire extract`, which records what it "
                               "stores), then retrain the drafter.")
    fix = " ".join(fixes[c] for c in causes)
    return result_fail(name, f"{'; '.join(texts)} ({where})", fix, **data)


MAX_GROUPS_SHOWN = 4  # groups of samples wrong in the same way, named in the detail
# where each stack's data generation takes the layer ids it captures
_FOREIGN_IDS = {"speculators 0.9.0": "the eagle_aux_hidden_state_layer_ids vLLM captures (plus the last layer)",
                "SpecForge 0.2.0": "aux_hidden_state_layer_ids (SGLang's capture)"}
MAX_FILES_NAMED = 8  # another stack stores one file per sample: name a few

# What each per-sample verdict means for the user's pipeline, and what to do.
_CAUSE_FIX = {
    "relabelled": "the tool that assembled the data put other tensors under these labels (an index off by one, the "
                  "aux order swapped, the embedding in place of a layer, or the final state after a failed capture): "
                  "extract again with `eaglewire extract`, then retrain the drafter on the new data.",
    "misaligned": "the tensors do not belong to the stored tokens: find where your pipeline pairs hidden states with "
                  "input_ids (a slice shifting one of them for next-token prediction, a dropped BOS, or the states "
                  "computed on another rendering of the conversation: another system prompt, chat template or "
                  "truncation), then extract again with `eaglewire extract` and retrain.",
    "unmatched": "the values were altered (noise, a lossy conversion) or come from another model or quantization: "
                 "extract again from this target and retrain.",
}


def _group_verdicts(verdicts, labels) -> list[tuple[tuple, list[SampleRef]]]:
    """Samples grouped by what is wrong in them (nothing: left out), in dataset order of their first sample."""
    groups: dict[tuple, list[SampleRef]] = {}
    for ref, by_row in verdicts:
        # the same fault in every sample, whatever its closest candidate or first differing token
        key = tuple((row, replace(v, error=0.0, at=0, best=row if v.kind == "unmatched" else v.best))
                    for row, v in by_row.items() if v.kind != "ok")
        if key:
            groups.setdefault(key, []).append(ref)
    out, per_ref = [], {id(r): by_row for r, by_row in verdicts}
    for key, refs in groups.items():
        problems = []
        for row, v in key:  # put the group's mean error, first divergence and closest candidate back
            mine = [per_ref[id(r)][row] for r in refs]
            problems.append((row, replace(v, error=sum(m.error for m in mine) / len(mine), at=mine[0].at,
                                          best=mine[0].best)))
        out.append((tuple(problems), refs))
    return out


def _records(refs: list[SampleRef]) -> str:
    """'records 4-29, 31' from their record indices."""
    indices, spans = sorted(r.record_index for r in refs), []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return "records " + ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _describe_group(problems, refs: list[SampleRef], checked: int, labels, st: CheckState,
                    source: StoredTensors | None = None) -> tuple[str, list[str]]:
    """One sentence per kind of problem in a group of samples, and the causes (keys of _CAUSE_FIX).
    ``source``: where the samples are stored (default: an eaglewire dataset's shards)."""
    label_of = dict(labels)
    where, files = (source.where, source.files) if source is not None else (lambda r: str(r.shard), "shards")
    kept_as = source.kept_as if source is not None else {}
    files_of = sorted({where(r) for r in refs})
    listed = ", ".join(files_of[:MAX_FILES_NAMED]) + (f" and {len(files_of) - MAX_FILES_NAMED} more"
                                                      if len(files_of) > MAX_FILES_NAMED else "")
    scope = (f"in all {checked} samples checked" if len(refs) == checked else
             f"in {len(refs)} of {checked} samples checked ({_records(refs)}; {files} {listed})")

    def stored_as(row: str, best: str) -> str:
        if row in kept_as:  # another stack's dataset: name its own entry, and what it takes the entry for
            return f"the data stores {best} in {kept_as[row]}, which {source.stack} takes for {label_of[row]}"
        return f"the data stores {best} under the label {label_of[row]}"

    by_kind: dict[str, list[tuple[str, SampleVerdict]]] = {}
    diverging = [v for _, v in problems if v.kind == "diverges"]
    # Other tokens change every stored tensor from the same token on; a tensor that merely happens to
    # match on its first tokens (a quantization's first token, say) is no match.
    other_text = len(diverging) == len(labels) and len({v.at for v in diverging}) == 1
    for row, v in problems:
        kind = "unmatched" if v.kind == "diverges" and not other_text else v.kind
        by_kind.setdefault(kind, []).append((row, v))
    texts, causes = [], []
    if "relabelled" in by_kind:
        moved = by_kind["relabelled"]
        parts = [f"{stored_as(row, v.best)} (rel. error {v.error:.4f})" for row, v in moved]
        swapped = {v.best for _, v in moved} == {label_of[row] for row, _ in moved} and len(moved) > 1
        texts.append(("the aux order is swapped: " if swapped else "") + "; ".join(parts))
        causes.append("relabelled")
    if "shifted" in by_kind:
        rows = by_kind["shifted"]
        whole = len(rows) == len(labels)
        for shift in sorted({v.shift for _, v in rows}):
            named = [label_of[row] for row, v in rows if v.shift == shift]
            others = [label for row, label in labels if row not in {r for r, _ in rows}]
            which = ("every stored tensor" if whole else f"{', '.join(named)} (while {', '.join(others)} "
                     f"{'is' if len(others) == 1 else 'are'} in place)")
            plural = "s" if abs(shift) > 1 else ""
            texts.append(f"misaligned: {which} shifted {abs(shift)} position{plural} against the stored tokens: the "
                         f"value stored at token t is the target's {named[0]} at token t{shift:+d}")
        causes.append("misaligned")
    if "diverges" in by_kind:
        at, ref = by_kind["diverges"][0][1].at, refs[0]
        ids = ref.input_ids.long()
        before = st.target.tokenizer.decode(ids[max(0, at - 6): at])
        token = st.target.tokenizer.decode(ids[at: at + 1])
        texts.append(f"the tensors do not belong to these tokens: every stored tensor equals the target's on the "
                     f"first {at} tokens (record {ref.record_index}, ...{before!r}) and differs from token {at} "
                     f"({token!r}) on, all at once: they were computed on another text than the stored input_ids "
                     "(another system prompt, chat template or truncation)")
        causes.append("misaligned")
    if "unmatched" in by_kind:
        for row, v in by_kind["unmatched"]:
            texts.append(f"the values stored as {label_of[row]} match no tensor of this target (closest {v.best}, "
                         f"rel. error {v.error:.4f} > {MATCH_TOLERANCE:g}, at any alignment)")
        causes.append("unmatched")
    return f"{scope}: " + "; ".join(texts), causes


def _match_row(m: Match, label: str, wrong: int, samples: int) -> dict:
    """One row of the table of errors over all samples; ``wrong``: samples where this tensor is not its label."""
    line = m.describe(m.stored) + (f"; not {label} in {wrong} of {samples} samples" if wrong else "")
    return {"stored": m.stored, "label": label, "best": m.best, "error": m.error, "next": m.runner_up,
            "next_error": m.runner_up_error, "ok": m.found and m.best == label and not wrong,
            "samples_wrong": wrong, "line": line}


# ---- acceptance ----------------------------------------------------------------------------


def positions_to_detect(p: float, drop: float = OFFLINE_DETECT_DROP) -> int:
    """Positions a binomial test needs to tell accuracy ``p - drop`` from ``p`` (two-sided 5% level, 80%
    power, normal approximation): n = ((z_a sqrt(p(1-p)) + z_b sqrt(q(1-q))) / drop)^2, q = p - drop.
    About 700 at p = 0.35 and at most 783 (near p = 0.5 + drop/2) for a drop of 0.05."""
    p = min(max(p, drop), 1.0)
    q = p - drop
    return math.ceil(((OFFLINE_Z * math.sqrt(p * (1 - p)) + OFFLINE_POWER_Z * math.sqrt(q * (1 - q))) / drop) ** 2)


def detectable_drop(p: float, positions: int) -> float:
    """The drop from ``p`` that ``positions`` detect with 80% power at the two-sided 5% level."""
    return (OFFLINE_Z + OFFLINE_POWER_Z) * math.sqrt(max(p * (1 - p), 1e-4) / max(positions, 1))


def between_samples_variance(hits: list[float], counted: list[float]) -> float:
    """Variance of pooled accuracy sum(hits) / sum(counted) when the samples (conversations), not the positions,
    are the independent draws: the ratio estimator's k/(k-1) * sum(n_i^2 (a_i - a)^2) / N^2. Zero for one sample,
    whose spread it cannot see."""
    k, total = len(hits), sum(counted)
    if k < 2 or total == 0:
        return 0.0
    pooled = sum(hits) / total
    return k / (k - 1) * sum((h - pooled * n) ** 2 for h, n in zip(hits, counted)) / total**2


def check_offline(st: CheckState) -> CheckResult:
    name = "acceptance.offline"
    cfg, meta, drafter = st.cfg, st.meta, st.drafter
    stored = {hidden_key(p) for p in st.manifest.wiring.points}
    lacking = [str(p) for p in meta.wiring.points if hidden_key(p) not in stored]
    if lacking:
        return result_skip(name, f"the data does not store {', '.join(lacking)}, which the drafter reads (see consistency.wiring)")
    held_out = [r for r in st.samples.refs if r.held_out][: cfg.eval_samples]
    if not held_out:
        return result_skip(name, "the dataset has no held-out samples (records whose index is a multiple of 50)")
    recorded = meta.metrics.get("eval_acc_per_position")
    # 1. How many positions a 0.05 drop needs at the recorded accuracy.
    p = recorded[0] if recorded else 0.5
    needed = positions_to_detect(p)
    # 2. The drafter on the stored tensors its checkpoint names, scored against the stored final state, sample
    #    by sample in the order training evaluated them, until the samples read detect that drop: enough
    #    positions, at least OFFLINE_MIN_SAMPLES samples, and a spread between them small enough.
    steps = len(recorded) if recorded is not None else 3
    correct, count = torch.zeros(steps, dtype=torch.float64), torch.zeros(steps, dtype=torch.float64)
    first_hits, first_counted = [], []  # position 1 per sample, for the spread between samples
    lm_head = st.target.layout.lm_head.weight

    def sized() -> bool:
        spread = (OFFLINE_Z + OFFLINE_POWER_Z) * math.sqrt(between_samples_variance(first_hits, first_counted))
        return sum(first_counted) >= needed and spread <= OFFLINE_DETECT_DROP

    with torch.no_grad():
        for ref in held_out:
            sample = load_stored(cfg.data, ref, meta.wiring)
            teacher = teacher_targets(sample.final, lm_head, drafter.t2d)
            _, hits, counted = step_sums(drafter, unroll(drafter, sample.input_ids, sample.aux, steps),
                                         sample.loss_mask, teacher)
            correct += torch.tensor(hits, dtype=torch.float64)
            count += torch.tensor(counted, dtype=torch.float64)
            first_hits.append(float(hits[0]))
            first_counted.append(float(counted[0]))
            if len(first_hits) >= OFFLINE_MIN_SAMPLES and sized():
                break
    measured = (correct / count.clamp(min=1)).tolist()
    positions = int(count[0])
    samples = len(first_hits)
    data = {"measured": measured, "recorded": recorded, "samples": samples, "held_out_samples": len(held_out),
            "positions": positions, "positions_needed": needed, "detect_drop": OFFLINE_DETECT_DROP,
            "per_sample_accuracy": [h / max(n, 1.0) for h, n in zip(first_hits, first_counted)]}
    shown = ", ".join(f"{a:.3f}" for a in measured)
    if recorded is None:
        return result_skip(name, f"no accuracy was recorded at training (no held-out samples then); measured here: {shown} "
                           f"per draft position on {samples} held-out samples", **data)
    if positions == 0:
        return result_skip(name, "the held-out samples have no trained (assistant) positions", **data)
    # 3. A drop beyond the two-sided 5% margin of the difference fails: the measured figure's variance is the
    #    larger of the binomial one and the spread between samples; the recorded figure's own (binomial) spread
    #    counts when training recorded how many positions it had.
    recorded_positions = meta.metrics.get("eval_positions")
    measured_variance = max(p * (1 - p) / positions, between_samples_variance(first_hits, first_counted))
    variance = measured_variance + (p * (1 - p) / recorded_positions if recorded_positions else 0.0)
    allowed = OFFLINE_Z * math.sqrt(max(variance, 1e-8))
    power = max(detectable_drop(p, positions), (OFFLINE_Z + OFFLINE_POWER_Z) * math.sqrt(measured_variance))
    data.update(allowed_drop=allowed, detectable_drop=power, recorded_positions=recorded_positions)
    head = (f"held-out accuracy per draft position {shown} on {samples} samples ({positions} positions); recorded at "
            f"training {', '.join(f'{a:.3f}' for a in recorded)}")
    data["powered"] = powered = sized()
    if powered:
        sizing = (f"{positions} positions >= the {needed} a {OFFLINE_DETECT_DROP:g} drop from {p:.3f} needs (binomial, "
                  f"two-sided 5%, 80% power), over {samples} samples whose spread detects it too")
    else:
        sizing = (f"UNDERPOWERED: a {OFFLINE_DETECT_DROP:g} drop from {p:.3f} needs {needed} positions over samples "
                  f"that agree, and the data's {len(held_out)} held-out samples give {positions}"
                  + (f" over {samples} samples whose accuracies spread" if positions >= needed else "")
                  + f", which detect only a drop of {power:.3f}; give --data with more held-out records (every 50th "
                  "record is held out; `eaglewire extract --held-out-only` extracts only those)")
    data["training_data"] = trained_here = is_training_data(st)
    if measured[0] < p - allowed:
        # The recorded figure was measured on the training dataset's held-out records; other data may differ.
        cause = ("so the drafter is not fed here what it was trained on" if trained_here else
                 "either the drafter is not fed here what it was trained on, or this data, which is not its "
                 "training dataset (consistency.target), is harder for it")
        fix = ("look at the failing checks above for the cause (wiring, stored tensors, target, d2t, changed weights)"
               + ("; if all pass, the data is not like the data the drafter was trained on" if trained_here else
                  "; if all pass, rerun with --data the dataset it was trained on to tell the two apart"))
        return result_fail(name, f"{head}: position 1 dropped by {p - measured[0]:.3f} (two-sided 5% margin "
                           f"{allowed:.3f}; {sizing}), {cause}", fix, **data)
    rise = f"; it rose by {measured[0] - p:.3f}, beyond the margin" if measured[0] > p + allowed else ""
    return result_pass(name, f"{head}: within the two-sided 5% margin {allowed:.3f}{rise} ({sizing})", **data)


@dataclass(frozen=True)
class Alternative:
    description: str
    wiring: Wiring | None  # None: the final state alone, fed past the fc (a failed capture, fusion bypassed)


def miswirings(wiring: Wiring, num_layers: int) -> list[Alternative]:
    """Plausible wrong wirings of ``wiring``: ids shifted by +-1 (all, or one at a time), the embedding in
    place of one point (in its slot, as a loader may put it, and in stream order, as an engine captures it),
    the aux order permuted, and the final state alone. Unreachable ones are left out."""
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
        substituted = [*aux[:i], CapturePoint.parse("embed"), *aux[i + 1:]]
        add(f"embed in place of aux[{i}] {point}", substituted)
        # an engine that captures the embedding for a wrong id still concatenates in stream order
        add(f"embed in place of aux[{i}] {point}, in stream order as an engine concatenates", sorted(substituted))
    for order in itertools.permutations(range(len(aux))):
        add(f"aux order permuted to {','.join(str(aux[i]) for i in order)}", [aux[i] for i in order])
    out.append(Alternative("the final state alone, fc bypassed (capture fell back to final)", None))
    return out


def _step1_hits(drafter: Drafter, fused: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                top1: torch.Tensor) -> torch.Tensor:
    """Per base position t, whether the drafter's first draft token equals the target's greedy token at t+1
    (counted where ``mask[t+2]``, as step_sums counts step 1)."""
    logits = unroll_fused(drafter, ids, fused, 1)[0]
    valid = max(ids.shape[0] - 2, 0)
    drafted = drafter.draft_to_target(logits[:valid].argmax(-1))
    return ((drafted == top1[1: 1 + valid]) & mask[2: 2 + valid])[mask[2: 2 + valid]]


def _fed(drafter: Drafter, alt: Alternative, captured: dict, declared: Wiring) -> torch.Tensor:
    """Step 1's hidden input [T-1, H] under ``alt``: fc over its aux points, or the final state past the fc."""
    if alt.wiring is None:
        return captured[declared.teacher][:-1]
    return drafter.fuse(torch.cat([captured[p] for p in alt.wiring.aux], dim=-1)[:-1])


def live_candidates(st: CheckState) -> list[Alternative]:
    """The wirings the live checks compare: the declared one first, then what the engine captures (when
    that differs), then every plausible miswiring."""
    declared = st.meta.wiring
    alternatives = miswirings(declared, st.target.num_layers)
    if st.engine_wiring is not None and st.engine_wiring != declared:
        alternatives.insert(0, Alternative(f"what {st.engine_reading.source} captures", st.engine_wiring))
    return [Alternative("declared", declared), *alternatives]


def check_live(st: CheckState) -> CheckResult:
    name = "acceptance.live"
    if st.live_error is not None:
        return result_fail(name, st.live_error, CAPTURE_FIX)
    cfg, drafter, declared = st.cfg, st.drafter, st.meta.wiring
    candidates = live_candidates(st)
    hits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(candidates))}
    with torch.no_grad():
        for sample in st.live:
            mask = torch.arange(sample.ids.shape[0]) >= sample.prompt_len  # the generated tokens
            for i, alt in enumerate(candidates):
                fused = _fed(drafter, alt, sample.captured, declared)
                hits[i].append(_step1_hits(drafter, fused, sample.ids, mask, sample.top1))
    vectors = {i: torch.cat(h) for i, h in hits.items()}
    positions = int(vectors[0].numel())
    rows = [{"wiring": "final alone (fc bypassed)" if a.wiring is None else str(a.wiring), "description": a.description,
             "accuracy": float(vectors[i].float().mean()) if positions else 0.0} for i, a in enumerate(candidates)]
    base = vectors[0]
    beating = []
    for i in range(1, len(candidates)):
        wins, losses, z = _paired_wins(vectors[i], base)
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
        # Wirings the top one does not beat significantly are named with it: a drafter that barely reads one
        # aux slot cannot tell orders that differ only there, and picking one of them would be a guess.
        tied = [i for i in beating if i != top and _paired_wins(vectors[top], vectors[i])[2] < LIVE_Z]
        orders = " or ".join(rows[i]["wiring"] for i in [top, *tied])
        return result_fail(name, f"{summary}. Beating the declared wiring: {named}",
                     f"the drafter was most likely trained on {orders}"
                     f"{' (not told apart on these prompts)' if tied else ''}, not on the wiring its checkpoint "
                     f"declares: correct the checkpoint's wiring record (or retrain on {declared})", **data)
    if max(r["accuracy"] for r in rows) < LIVE_MIN_ACCURACY:
        return result_skip(name, f"inconclusive: {summary}; under {LIVE_MIN_ACCURACY:.0%} for every wiring, the drafter "
                           "cannot rank wirings here (an untrained drafter, or a wrong vocabulary map)", **data)
    return result_pass(name, f"{summary}; no miswiring does significantly better (McNemar z < {LIVE_Z:g})", **data)




def chain_hits(drafter: Drafter, fused: torch.Tensor, sample: LiveSample, chain: int,
               min_confidence: float = 0.0) -> torch.Tensor:
    """[T-1, chain] bool: whether draft k of a greedy chain from row r (hidden state r, token r+1) is the
    target's greedy token r+k+1. Where the earlier drafts match, they are the sequence's own tokens, so the
    teacher-forced unroll is the chain an engine runs; drafts past the sequence's end are misses, and so are
    drafts the chain never made: as eaglewire's engine does, it ends after a draft whose probability under
    the drafter is below ``min_confidence``."""
    ids, top1 = sample.ids, sample.top1
    rows = torch.arange(ids.shape[0] - 1)
    columns = []
    drafted = torch.ones_like(rows, dtype=torch.bool)  # every draft before this one was confident enough
    for k, step in enumerate(unroll_fused(drafter, ids, fused, chain), start=1):
        inside = rows + k <= ids.shape[0] - 2
        confidence, best = step.float().softmax(-1).max(-1)
        columns.append(drafted & inside & (drafter.draft_to_target(best) == top1[(rows + k).clamp(max=ids.shape[0] - 1)]))
        drafted = drafted & (confidence >= min_confidence)
    return torch.stack(columns, dim=1)


def served_steps(hits: torch.Tensor, ids: torch.Tensor, prompt_len: int, max_new_tokens: int,
                 lookup: LookupShape | None = None) -> tuple[torch.Tensor, int]:
    """The drafts accepted at each verify step the drafter drafted for, as a greedy chain server runs them
    over one sequence ``ids`` (prompt, then its continuation), from ``chain_hits``; and how many steps drafted
    from the context instead (``lookup``, as ``engine/context_lookup.py`` finds them: the server's drafter
    counters skip those steps, so they are walked over but not returned).

    The first step drafts after the prefill's token (row ``prompt_len - 1``); a step accepting a drafts adds
    them and the target's own token, so the next step starts a + 1 rows on. As the engine does, a step drafts
    at most the tokens ``max_new_tokens`` still allows beyond the bonus, and a step with nothing to draft is a
    plain decode step that no counter counts."""
    generated = ids.shape[0] - prompt_len
    tokens = ids.tolist()
    row, steps, looked_up = prompt_len - 1, [], 0
    while (produced := row + 2 - prompt_len) < generated:
        room = max_new_tokens - produced - 1
        if room <= 0:
            row += 1
            continue
        drafts = lookup_drafts(tokens[:row + 2], lookup, room) if lookup is not None else []
        if drafts:
            following = tokens[row + 2: row + 2 + len(drafts)]
            accepted = next((i for i, (a, b) in enumerate(zip(drafts, following)) if a != b), len(following))
            looked_up += 1
        else:
            accepted = int(hits[row, :min(hits.shape[1], room)].long().cumprod(0).sum())
            steps.append(accepted)
        row += accepted + 1
    return torch.tensor(steps, dtype=torch.float64), looked_up


def check_observed(st: CheckState) -> CheckResult:
    """A served acceptance figure explained: the accept length each wiring (declared and every miswiring of
    acceptance.live) predicts for a greedy chain server on the live continuations, ranked by how close it
    comes to the observed one."""
    name = "acceptance.observed"
    cfg, drafter, live = st.cfg, st.drafter, st.live
    if cfg.observed_accept_len is None and cfg.observed_accept_rate is None:
        return result_skip(name, "no served figure given (--observed-accept-len, --observed-accept-rate or --server)")
    if not live:  # the continuations could not be computed (see acceptance.live)
        return result_skip(name, "acceptance.live did not run, so there are no continuations to predict on")
    candidates = live_candidates(st)
    chain = cfg.served_chain
    if cfg.observed_accept_len is not None:
        observed, what = cfg.observed_accept_len, "accept length (tokens per verify step, bonus included)"
    else:
        observed, what = 1 + cfg.observed_accept_rate * chain, f"accept rate {cfg.observed_accept_rate:g} x {chain} + 1"
    rows = []
    with torch.no_grad():
        for alt in candidates:
            walks = [served_steps(chain_hits(drafter, _fed(drafter, alt, s.captured, st.meta.wiring), s, chain,
                                             cfg.served_min_confidence), s.ids, s.prompt_len, cfg.live_tokens,
                                  cfg.served_lookup) for s in live]
            accepted = torch.cat([steps for steps, _ in walks])
            looked_up = sum(count for _, count in walks)
            n = max(accepted.numel(), 1)
            mean = float(accepted.mean()) if accepted.numel() else 0.0
            se = max(float(accepted.std()) / math.sqrt(n) if n > 1 else 1.0, 1e-3)
            predicted = 1 + mean
            # the share of steps accepting the draft at depth k, as vLLM's per-position counters count it
            per_position = [float((accepted >= k).double().mean()) if accepted.numel() else 0.0
                            for k in range(1, chain + 1)]
            rows.append({"wiring": "final alone (fc bypassed)" if alt.wiring is None else str(alt.wiring),
                         "description": alt.description, "predicted_accept_len": predicted,
                         "predicted_accept_rate": mean / chain, "interval": [predicted - 1.96 * se, predicted + 1.96 * se],
                         "z": (observed - predicted) / se, "steps": accepted.numel(), "lookup_steps": looked_up,
                         "predicted_per_position": per_position})
    ranked = sorted(range(len(rows)), key=lambda i: abs(observed - rows[i]["predicted_accept_len"]))
    data = {"observed_accept_len": observed, "chain": chain, "rows": [rows[i] for i in ranked],
            "served_from": cfg.served_from, "observed_per_position": cfg.observed_per_position,
            "observed_lookup_steps": cfg.served_lookup_steps}

    def named(i: int) -> str:
        alt = candidates[i]
        return alt.description if alt.wiring is None else f"{alt.wiring} ({alt.description})"

    def shown(i: int) -> str:
        r = rows[i]
        return f"{named(i)} predicts {r['predicted_accept_len']:.3f} [{r['interval'][0]:.2f}, {r['interval'][1]:.2f}]"

    declared = rows[0]
    source = f" ({cfg.served_from})" if cfg.served_from is not None else ""
    head = (f"observed {what} = {observed:.3f}{source}; predicted for {_served_chain(cfg)} over {declared['steps']} "
            f"verify steps of the live continuations{_looked_up(cfg, declared)}: declared {declared['wiring']} "
            f"{declared['predicted_accept_len']:.3f} [{declared['interval'][0]:.2f}, {declared['interval'][1]:.2f}]")
    if cfg.observed_per_position:  # per depth, the served shares beside the declared wiring's and the best's
        best_row = rows[ranked[0]]
        head += (f"; per draft position served {_shares(cfg.observed_per_position)}, declared predicts "
                 f"{_shares(declared['predicted_per_position'])}")
        if ranked[0] != 0:
            head += f", {best_row['wiring']} {_shares(best_row['predicted_per_position'])}"
    same = _same_continuations(st)
    if same is not None and same == len(live):
        return _reproduced(name, head, observed, rows, ranked, shown, named, data)
    if same is not None:
        head += (f"; {same} of {len(live)} served answers equal the live continuations (another build or dtype "
                 "serves), so each prediction carries its sampling interval")
    consistent = [i for i in ranked if abs(rows[i]["z"]) < 1.96]
    best = ranked[0]
    if rows[0]["z"] >= 1.96:  # a miswiring lowers acceptance; a higher figure points at easier served prompts
        return result_pass(name, f"{head}: the served figure is above the declared wiring's prediction, which no "
                           "miswiring explains (the served prompts are likely more predictable than the live "
                           "check's)", **data)
    if 0 in consistent:
        others = [i for i in consistent if i != 0]
        also = f"; also consistent: {'; '.join(shown(i) for i in others[:3])}" if others else ""
        return result_pass(name, f"{head}: the declared wiring explains it{also}", **data)
    if consistent:
        return result_fail(name, f"{head}, which does not explain it. Best explanations: "
                           + "; ".join(shown(i) for i in consistent[:3]),
                           _feeds_fix(named(best)), **data)
    return result_fail(name, f"{head}; no modelled wiring explains it (closest: {shown(best)})",
                       "the served figure differs for a reason the doctor does not model (sampling temperature, a tree "
                       "or another chain length, another target build): compare with --served-chain and the engine's "
                       "settings", **data)


def _served_chain(cfg: DoctorConfig) -> str:
    """The chain the walk models, as the report names it."""
    doubted = (f", ending after a draft below {cfg.served_min_confidence:g} confidence"
               if cfg.served_min_confidence > 0 else "")
    return f"a greedy chain of {cfg.served_chain}{doubted}"


def _looked_up(cfg: DoctorConfig, declared: dict) -> str:
    """The looked-up steps of the declared wiring's walk, beside the server's count, for the report."""
    lookup = cfg.served_lookup
    if lookup is None:
        return ""
    counted = f"; the server counted {cfg.served_lookup_steps}" if cfg.served_lookup_steps is not None else ""
    return (f" (and {declared['lookup_steps']} that drafted from the context, matching {lookup.min_match}+ "
            f"tokens, up to {lookup.max_drafts} drafts: the drafter's counters skip them{counted})")


def _feeds_fix(wirings: str) -> str:
    return (f"the serving engine most likely feeds the drafter {wirings}: check which layers it captures and whether "
            "its fc runs (checkpoint.engine_config and checkpoint.serving say what it reads from the folder)")


def _same_continuations(st: CheckState) -> int | None:
    """How many of the server's answers to the live prompts are the live continuations' text (None: the
    figure was typed, or read over the server's own traffic)."""
    texts = st.cfg.served_texts
    if texts is None:
        return None
    decode = st.target.tokenizer.decode
    return sum(text == decode(s.ids[s.prompt_len:], skip_special_tokens=True) for s, text in zip(st.live, texts))


def _reproduced(name: str, head: str, observed: float, rows: list[dict], ranked: list[int], shown, named,
                data: dict) -> CheckResult:
    """acceptance.observed when the server answered the live prompts with the live continuations: the figure
    is no sample of other traffic but the same walk, so a wiring explains it only by reproducing it."""
    tolerance = OBSERVED_EXACT_TOKENS / max(rows[0]["steps"], 1)
    matching = [i for i in ranked if abs(observed - rows[i]["predicted_accept_len"]) <= tolerance]
    data.update(reproduced_within=tolerance, reproduced_by=[rows[i]["wiring"] for i in matching])
    head += (f"; the server answered the live prompts token for token as the live continuations, so a wiring "
             f"explains the figure only by reproducing it, to within {OBSERVED_EXACT_TOKENS} accepted tokens "
             f"({tolerance:.3f})")
    if 0 in matching:
        others = [i for i in matching if i != 0]
        alike = (f"; so do {'; '.join(shown(i) for i in others[:4])}"
                 f"{f' and {len(others) - 4} more' if len(others) > 4 else ''} (this drafter's acceptance cannot "
                 "tell them from the declared wiring)") if others else ""
        return result_pass(name, f"{head}: the declared wiring reproduces it{alike}", **data)
    if matching:
        return result_fail(name, f"{head}: the declared wiring does not. Reproduced by: "
                           + "; ".join(shown(i) for i in matching[:4]),
                           _feeds_fix(" or ".join(named(i) for i in matching[:3])), **data)
    return result_fail(name, f"{head}; no modelled wiring reproduces it (closest: {shown(ranked[0])})",
                       "the server runs something the doctor does not model (another chain length or a tree, "
                       "a drafter other than this checkpoint, a miswiring outside the list): compare its settings "
                       "and the checkpoint it loaded", **data)


def _shares(values) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def _paired_wins(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, float]:
    """Two hit vectors on the same positions: where only a hits, where only b hits, and McNemar's z for a over b."""
    wins, losses = int((a & ~b).sum()), int((b & ~a).sum())
    return wins, losses, (wins - losses) / math.sqrt(wins + losses) if wins + losses else 0.0
