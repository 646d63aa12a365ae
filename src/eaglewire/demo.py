"""``eaglewire demo``: the embedded target and its shipped drafter, end to end, in a few minutes.

It checks the wiring (the drafter's capture points exist in this target, its
fingerprint matches, and the engine's capture equals the extraction path's on a
probe), gives the doctor's verdict on the drafter, then answers a few MT-bench prompts with and without speculation,
interleaved, and prints the answers, tau and the speedup. Outputs with and
without speculation must be identical (greedy); the demo says so if they are not.
"""

from __future__ import annotations

import statistics
import sys

import torch

from .bench.prompts import load_prompts
from .data.capture import capture
from .doctor.checks import FAIL, PASS, SKIPPED, DoctorConfig, run_doctor
from .doctor.tensor_match import MATCH_TOLERANCE
from .engine.speculative import Chunk, Engine, Finished, GenerationConfig
from .target import DEFAULT_TARGET

PROBE = "Name three primary colors."


def check_wiring(engine: Engine) -> tuple[bool, str]:
    """The engine's capture of every aux point against the extraction path, on a probe prompt. With bf16
    products the capture is another model's: it must stay within the doctor's match tolerance instead."""
    ids = torch.tensor([engine.chat_prompt(PROBE)])
    reference = capture(engine.target.layout, engine.wiring.aux, ids)
    _, live = engine.lean(engine.lean.new_cache(), ids, torch.arange(ids.shape[1]), capture=engine.wiring.aux,
                          logits_rows=None)
    errors = {str(p): float((live[p] - reference[p]).norm() / reference[p].norm()) for p in engine.wiring.aux}
    ok = all(e < (1e-4 if engine.dtype == "fp32" else MATCH_TOLERANCE) for e in errors.values())
    detail = ", ".join(f"{p} rel. error {e:.1e}" for p, e in errors.items())
    return ok, detail


def run_demo(target: str = DEFAULT_TARGET, drafter: str = "shipped", prompts: int = 3, max_new_tokens: int = 128,
             chain_length: int = GenerationConfig.chain_length,
             min_confidence: float = GenerationConfig.min_confidence, write=print, dtype: str = "fp32") -> int:
    speculative = GenerationConfig(max_new_tokens=max_new_tokens, chain_length=chain_length,
                                   min_confidence=min_confidence)  # checked before loading
    plain_config = GenerationConfig(max_new_tokens=max_new_tokens, strategy="none")
    write(f"loading {target} and its drafter ({drafter}) ...")
    engine = Engine.load(target, drafter, dtype=dtype)
    write(f"target products: {engine.dtype}")
    write(f"wiring: {engine.wiring} (the drafter's fc reads {len(engine.wiring.aux)} x {engine.target.hidden_size} "
          f"features); target fingerprint matches the drafter's")
    ok, detail = check_wiring(engine)
    write(f"wiring check: engine capture equals the extraction path: {'yes' if ok else 'NO'} ({detail})")
    write("doctor (no dataset given, so the checks on stored tensors are skipped) ...")
    report = run_doctor(DoctorConfig(checkpoint=str(drafter), target=target, live_prompts=2, live_tokens=32),
                        target=engine.target)
    counts = report.to_json()["counts"]
    for result in report.results:
        if result.status != SKIPPED:
            write(f"  {result.status:4s} {result.name}: {result.detail}")
    doctor_ok = not report.failed
    write(f"doctor verdict: {'healthy' if doctor_ok else 'FAILED'} ({counts[PASS]} passed, {counts[FAIL]} failed, "
          f"{counts[SKIPPED]} skipped in {report.elapsed_s:.0f} s; `eaglewire doctor --data DIR` runs them all)")
    questions = load_prompts("mtbench", prompts)
    plain_total = spec_total = 0.0
    speedups, taus, identical = [], [], True
    for number, question in enumerate(questions, start=1):
        write(f"\n[{number}/{len(questions)}] {question.text}\n")
        ids = engine.chat_prompt(question.text)
        spec = None
        for event in engine.generate_ids(ids, speculative):  # stream the speculative answer as it comes
            if isinstance(event, Chunk):
                write(event.text, end="")
                sys.stdout.flush()
            elif isinstance(event, Finished):
                spec = event
        plain = engine.complete_ids(ids, plain_config)
        same = plain.token_ids == spec.token_ids
        identical &= same
        speedup = spec.metrics.tokens_per_s / plain.metrics.tokens_per_s
        speedups.append(speedup)
        taus.append(spec.metrics.tau)
        plain_total += plain.metrics.total_s
        spec_total += spec.metrics.total_s
        write(f"\n  -> speculative: {spec.metrics.summary()}")
        write(f"  -> plain:       {plain.metrics.new_tokens} tokens, {plain.metrics.tokens_per_s:.1f} tok/s; "
              f"same tokens: {'yes' if same else 'NO'}; speedup {speedup:.2f}x")
    write(f"\nsummary: tau {statistics.mean(taus):.2f}, median speedup {statistics.median(speedups):.2f}x over "
          f"plain decoding with the same engine, outputs identical: {'yes' if identical else 'NO'}, "
          f"wiring check: {'pass' if ok else 'FAIL'}, doctor: {'healthy' if doctor_ok else 'FAILED'}")
    return 0 if ok and identical and doctor_ok else 1
