"""Which draft shape pays on this machine? Chains and EAGLE-2 trees of several sizes, one drafter, same prompts.

A wider tree accepts more tokens a step (higher tau), but on a CPU verifying N
tokens is not free (``eaglewire bench``'s cost model; on the machine of the README's
80-question run ~0.95 of a decode step up to 6 tokens, ~1.5 at 16, ~2.5 at 32), and a tree's draft runs top-k rows
per level. This runs plain decoding and every shape on each prompt, in rotating
order (greedy, so each output must equal plain decoding), and reports per shape:
tau, acceptance per depth, the measured speedup over plain decoding (median of
per-prompt ratios), and the speedup the cost model predicts from tau, measured
once on an idle engine after the runs. tau does not depend on machine load; the
measured speedup does, so run it on an idle machine to choose by it.

    OMP_NUM_THREADS=1 python benchmarks/draft_shape.py --drafter shipped --limit 10 --max-new-tokens 128

A shape may also draft from the context (``context_lookup.py``): ``chain:6@0.5+lookup:3x4`` looks up to 4
drafts where the context's last 3 or more tokens occurred before, and runs the chain elsewhere; its
report adds the share of steps looked up and the drafter's own tau over the other steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from eaglewire.bench.prompts import load_prompts
from eaglewire.bench.report import (
    chain_step_cost,
    measure_costs,
    median_time,
    verify_cost,
)
from eaglewire.engine.context_lookup import LookupShape
from eaglewire.engine.drafting import TreeShape
from eaglewire.engine.speculative import Engine, GenerationConfig
from eaglewire.errors import ConfigError

CHAINS = ("chain:2", "chain:3", "chain:4", "chain:5", "chain:6@0.3")
TREES = ("tree:3x2:4", "tree:4x2:5", "tree:4x2:6", "tree:4x3:6", "tree:5x3:8", "tree:5x4:8", "tree:5x4:12",
         "tree:4x4:16", "tree:5x8:32")


def parse_shape(name: str, max_new_tokens: int) -> GenerationConfig:
    """'none', 'chain:K' or 'chain:K@MINCONF', 'tree:DEPTHxTOPK:TOKENS', either + 'lookup:MINxDRAFTS'."""
    if name == "none":
        return GenerationConfig(max_new_tokens=max_new_tokens, strategy="none")
    drafting, _, lookup = name.partition("+lookup:")
    kind, _, spec = drafting.partition(":")
    try:
        config = _parse_drafting(kind, spec, max_new_tokens)
        if lookup:
            min_match, _, drafts = lookup.partition("x")
            config = dataclasses.replace(config, lookup=LookupShape(min_match=int(min_match), max_drafts=int(drafts)))
        return config
    except (ValueError, ConfigError) as exc:
        raise SystemExit(f"bad shape {name!r} ({exc}): use none, chain:K[@MINCONF] or tree:DEPTHxTOPK:TOKENS, "
                         "optionally followed by +lookup:MINxDRAFTS") from exc


def _parse_drafting(kind: str, spec: str, max_new_tokens: int) -> GenerationConfig:
    if kind == "chain":
        length, _, confidence = spec.partition("@")
        return GenerationConfig(max_new_tokens=max_new_tokens, strategy="chain", chain_length=int(length),
                                min_confidence=float(confidence or 0.0))
    if kind == "tree":
        size, _, tokens = spec.partition(":")
        depth, _, top_k = size.partition("x")
        return GenerationConfig(max_new_tokens=max_new_tokens, strategy="tree",
                                tree=TreeShape(int(depth), int(top_k), int(tokens)))
    raise ValueError(f"unknown kind {kind!r}")


def predicted_step_cost(costs: dict, engine: Engine, config: GenerationConfig, metrics, context: int,
                        repeats: int) -> float:
    """Decode steps one speculative step costs: verify(drafts + 1) plus its draft, timed on the idle engine.
    A chain's steps are costed as deep as they drafted (``metrics``), which a confidence stop shortens."""
    if config.strategy == "chain":
        return chain_step_cost(costs, config.chain_length, metrics.attempted_at, metrics.verify_steps)
    root = torch.randn(engine.target.hidden_size)
    tree_s = median_time(lambda: engine.runner.tree(root, context - 1, config.tree), repeats)
    return verify_cost(costs, config.tree.total_tokens + 1) + tree_s / costs["decode_step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="shipped")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dataset", default="mtbench")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--shapes", default=",".join(CHAINS + TREES),
                        help="comma-separated: chain:K[@MINCONF], tree:DEPTHxTOPK:TOKENS, either + lookup:MINxDRAFTS "
                             "(plain decoding always runs)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_shape.json"))
    args = parser.parse_args()

    shapes = [s for s in args.shapes.split(",") if s and s != "none"]  # plain decoding always runs, as the reference
    if len(set(shapes)) != len(shapes):
        raise SystemExit(f"--shapes lists a shape twice ({args.shapes}): each runs once per prompt")
    names = ["none"] + shapes
    configs = {name: parse_shape(name, args.max_new_tokens) for name in names}
    prompts = load_prompts(args.dataset, args.limit)
    engine = Engine.load(args.target, args.drafter)
    runs: dict[str, list] = {name: [] for name in names}
    lengths = []
    for index, prompt in enumerate(prompts):
        ids = engine.chat_prompt(prompt.text)
        lengths.append(len(ids))
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            finished = engine.complete_ids(ids, configs[name])
            runs[name].append((finished, time.perf_counter() - start))
        print(f"prompt {index + 1}/{len(prompts)} done", flush=True)

    context = int(statistics.median(lengths)) + args.max_new_tokens // 2
    costs = measure_costs(engine, context, TreeShape())
    plain = runs["none"]
    shapes = {}
    for name in names[1:]:
        rs = runs[name]
        metrics = rs[0][0].metrics
        for finished, _ in rs[1:]:
            metrics = metrics.merge(finished.metrics)
        ratios = [(tp / len(p.token_ids)) / (t / len(f.token_ids)) for (f, t), (p, tp) in zip(rs, plain)]
        step_cost = predicted_step_cost(costs, engine, configs[name], metrics, context, repeats=7)
        shapes[name] = {
            "tau": metrics.tau, "acceptance_at": metrics.acceptance_at,
            "outputs_differing_from_plain_decoding": sum(f.token_ids != p.token_ids
                                                         for (f, _), (p, _) in zip(rs, plain)),
            "median_speedup_vs_plain": statistics.median(ratios),
            "draft_share": metrics.draft_s / max(metrics.draft_s + metrics.verify_s, 1e-9),
            "predicted_step_cost": step_cost, "predicted_speedup": metrics.tau / step_cost,
            "lookup_steps": metrics.lookup_steps, "verify_steps": metrics.verify_steps,
            "drafter_tau": metrics.drafter_tau,
        }
        s = shapes[name]
        print(f"{name:14s} tau {s['tau']:.2f}  measured {s['median_speedup_vs_plain']:.2f}x  "
              f"predicted {s['predicted_speedup']:.2f}x (step {step_cost:.2f})  draft share {s['draft_share']:.2f}  "
              f"differing {s['outputs_differing_from_plain_decoding']}"
              + (f"  looked up {s['lookup_steps']}/{s['verify_steps']} steps, drafter tau {s['drafter_tau']:.2f}"
                 if s["lookup_steps"] else ""), flush=True)
    report = {"shapes": shapes, "cost_model": costs,
              "settings": {"drafter": args.drafter, "dataset": args.dataset, "limit": args.limit,
                           "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
                           "prompts": len(prompts)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
