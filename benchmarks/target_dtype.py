"""The target at fp32 and at bf16 products: speed, exactness, and what bf16 does to the drafter's inputs.

For each MT-bench question, in a rotating order so machine noise falls on all of them alike:
  fp32-none, fp32-chain   the engine's plain decoding and chain speculation, fp32 products
  bf16-none, bf16-chain   the same with bf16 products (lean.py; needs a CPU that multiplies bf16)
Each dtype's chain output must equal its own plain decoding token for token (the exactness claim).

Capture under bf16: the shipped drafter was trained on aux states from the fp32 target. For each
question, both targets run over the prompt plus the fp32 plain answer, and the aux states they capture
are compared with the doctor's tensor-match metric (mean per-token relative error, tensor_match.py;
a stored tensor "is" a capture point below MATCH_TOLERANCE = 0.02). The acceptance difference is
the chain's tau and acceptance rate at bf16 against fp32.

The cost model (bench.py's measure_costs) is measured for both dtypes at the same context.

    python benchmarks/target_dtype.py                       # 80 questions, 256 tokens
    python benchmarks/target_dtype.py --questions 10 --max-new-tokens 128 --threads 1

Writes benchmarks/results/target_dtype.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eaglewire.bench.prompts import load_prompts
from eaglewire.bench.report import measure_costs
from eaglewire.doctor.tensor_match import MATCH_TOLERANCE, relative_error
from eaglewire.engine.drafting import TreeShape
from eaglewire.engine.speculative import Engine, GenerationConfig

DTYPES = ("fp32", "bf16")


def aux_distance(fp32: Engine, bf16: Engine, ids: list[int]) -> dict[str, float]:
    """Per aux point: the tensor-match error of the bf16 target's capture against the fp32 one's."""
    tokens = torch.tensor([ids])
    positions = torch.arange(len(ids))
    captured = {}
    for name, engine in (("fp32", fp32), ("bf16", bf16)):
        _, captured[name] = engine.lean(engine.lean.new_cache(), tokens, positions, capture=engine.wiring.aux,
                                        logits_rows=None)
    return {str(p): relative_error(captured["bf16"][p][0], captured["fp32"][p][0]) for p in fp32.wiring.aux}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=80)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--chain-length", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "target_dtype.json")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    questions = load_prompts("mtbench", args.questions)
    engines = {"fp32": Engine.load(dtype="fp32")}
    engines["bf16"] = engines["fp32"].with_dtype("bf16")
    configs = {s: GenerationConfig(max_new_tokens=args.max_new_tokens, strategy=s, chain_length=args.chain_length)
               for s in ("none", "chain")}
    systems = [(d, s) for d in DTYPES for s in configs]
    runs: dict[str, list[dict]] = {f"{d}-{s}": [] for d, s in systems}
    distances: list[dict[str, float]] = []
    lengths = []
    for index, question in enumerate(questions):
        ids = engines["fp32"].chat_prompt(question.text)
        lengths.append(len(ids))
        shift = index % len(systems)
        for dtype, strategy in systems[shift:] + systems[:shift]:
            start = time.perf_counter()
            finished = engines[dtype].complete_ids(ids, configs[strategy])
            seconds = time.perf_counter() - start
            runs[f"{dtype}-{strategy}"].append({"id": question.id, "tokens": finished.token_ids, "seconds": seconds,
                                                "metrics": finished.metrics})
        distances.append(aux_distance(engines["fp32"], engines["bf16"], ids + runs["fp32-none"][-1]["tokens"]))
        line = "  ".join(f"{name} {r[-1]['metrics'].tokens_per_s:5.1f} tok/s tau {r[-1]['metrics'].tau:.2f}"
                         for name, r in runs.items())
        print(f"[{index + 1}/{len(questions)}] {question.id}: {line}", flush=True)

    report: dict = {"settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                 "threads": torch.get_num_threads()}, "systems": {}}
    for name, rs in runs.items():
        dtype = name.split("-")[0]
        plain = runs[f"{dtype}-none"]
        merged = rs[0]["metrics"]
        for r in rs[1:]:
            merged = merged.merge(r["metrics"])
        tokens, seconds = sum(len(r["tokens"]) for r in rs), sum(r["seconds"] for r in rs)
        report["systems"][name] = {
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tau": merged.tau,
            "acceptance_rate": merged.acceptance_rate, "acceptance_at": merged.acceptance_at,
            "outputs_equal_to_plain_decoding": sum(r["tokens"] == p["tokens"] for r, p in zip(rs, plain)),
            "prompts": len(rs),
            "differing_from_plain_decoding": [r["id"] for r, p in zip(rs, plain) if r["tokens"] != p["tokens"]],
            "median_speedup_vs_fp32_none": statistics.median(
                (p["seconds"] / len(p["tokens"])) / (r["seconds"] / len(r["tokens"])) for r, p in zip(rs, runs["fp32-none"])),
        }
    report["bf16_vs_fp32_answers_equal"] = sum(a["tokens"] == b["tokens"] for a, b in zip(runs["bf16-none"], runs["fp32-none"]))
    points = list(distances[0])
    report["aux_distance"] = {
        "metric": "tensor_match.relative_error (mean per-token relative L2), bf16-product capture vs fp32",
        "match_tolerance": MATCH_TOLERANCE,
        "per_point_mean": {p: statistics.mean(d[p] for d in distances) for p in points},
        "per_point_max": {p: max(d[p] for d in distances) for p in points},
    }
    chain = report["systems"]
    report["acceptance_difference"] = {
        "tau_fp32": chain["fp32-chain"]["tau"], "tau_bf16": chain["bf16-chain"]["tau"],
        "tau_bf16_minus_fp32": chain["bf16-chain"]["tau"] - chain["fp32-chain"]["tau"],
        "acceptance_rate_bf16_minus_fp32": chain["bf16-chain"]["acceptance_rate"] - chain["fp32-chain"]["acceptance_rate"],
    }
    context = int(statistics.median(lengths)) + args.max_new_tokens // 2
    report["cost_model"] = {d: measure_costs(engines[d], context, TreeShape()) for d in DTYPES}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"\n{len(questions)} questions, {args.max_new_tokens} new tokens, {torch.get_num_threads()} threads")
    for name, r in report["systems"].items():
        print(f"{name:11s} {r['tokens_per_s']:6.1f} tok/s  tau {r['tau']:.2f}  vs fp32 plain "
              f"{r['median_speedup_vs_fp32_none']:.2f}x  equal to own plain decoding "
              f"{r['outputs_equal_to_plain_decoding']}/{r['prompts']}")
    print(f"bf16 plain answers equal to fp32 plain answers: {report['bf16_vs_fp32_answers_equal']}/{len(questions)}")
    for p in points:
        print(f"aux {p}: bf16 vs fp32 error mean {report['aux_distance']['per_point_mean'][p]:.4f}, "
              f"max {report['aux_distance']['per_point_max'][p]:.4f} (match tolerance {MATCH_TOLERANCE})")
    diff = report["acceptance_difference"]
    print(f"chain tau fp32 {diff['tau_fp32']:.3f}, bf16 {diff['tau_bf16']:.3f} ({diff['tau_bf16_minus_fp32']:+.3f}); "
          f"acceptance rate {diff['acceptance_rate_bf16_minus_fp32']:+.3f}")
    for d, c in report["cost_model"].items():
        rel = c["verify_relative"]
        print(f"cost {d}: decode step {c['decode_step_s'] * 1000:.1f} ms, verify k=5 {rel[5]:.2f}, k=16 {rel[16]:.2f} "
              f"steps, draft step {c.get('draft_step_relative', float('nan')):.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
