"""A chain's draft steps with the shipped drafter: each product kernel, with and without the row kernels.

Every round drafts one greedy chain below the same root per variant, in a rotating order so machine
noise hits all of them:
  bf16-torch   oneDNN-packed bf16 products, torch ops between them (the default before, on CPUs with native bf16)
  bf16-rows    the same products, norms, RoPE, cache write and attention in the row kernels
  fp32-torch   fp32 products with the CPU's default fp32 kernel (the rowwise kernel reads an fp16-saved drafter
               as its fp16 codes), torch ops between them
  fp32-rows    the same products, the row kernels between them
Rows whose kernels this CPU lacks are left out. Medians are reported, per chain and per draft, and every
variant's chain is checked to be the same drafts. ``--layers N`` also times the drafter grown to N decoder layers
(as ``train --draft-layers`` grows it: zero output weights, so the same drafts) through this CPU's default variant:
what each added layer costs a draft step.

    python benchmarks/draft_step.py --rounds 40 --threads 1
    python benchmarks/draft_step.py --rounds 40 --threads 1 --layers 2 --out benchmarks/results/draft_step_layers.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eaglewire.drafter.checkpoint import load_checkpoint
from eaglewire.drafter.shipped import shipped_drafter
from eaglewire.engine import rowwise_kernel
from eaglewire.engine.drafting import (
    DraftRunner,
    default_matmul_dtype,
    row_kernels_apply,
)
from eaglewire.engine.projection import cpu_features, native_bf16
from eaglewire.target import load_target
from eaglewire.train.drafter_growth import with_num_layers


def variant_name(dtype: torch.dtype, row_kernels: bool) -> str:
    return f"{'bf16' if dtype == torch.bfloat16 else 'fp32'}-{'rows' if row_kernels else 'torch'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--context", type=int, default=300, help="committed tokens before the chain")
    parser.add_argument("--length", type=int, default=6, help="drafts per chain")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--layers", type=int, default=1, help="also time the drafter grown to this many layers")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_step.json"))
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target = load_target(args.target)
    drafter = load_checkpoint(shipped_drafter(args.target), target.layout.embed).drafter.float().eval()
    dtypes = [torch.bfloat16] if native_bf16() else []
    dtypes.append(torch.float32)
    modes = [False, True] if row_kernels_apply(drafter) else [False]
    runners = {variant_name(dtype, rows):
               DraftRunner(drafter, args.context + 64, matmul_dtype=dtype, row_kernels=rows)
               for dtype in dtypes for rows in modes}
    default = variant_name(default_matmul_dtype(drafter.fc.weight), row_kernels_apply(drafter))
    if args.layers > 1:
        grown, _ = with_num_layers(drafter, args.layers, target.layout.embed)
        runners[f"{default}-{args.layers}layers"] = DraftRunner(grown, args.context + 64)
    torch.manual_seed(0)
    n = args.context
    tokens = torch.randint(0, drafter.config.vocab_size, (n,))
    aux = torch.randn(n, drafter.config.fc_in_features)
    roots = {name: runner.extend(tokens[1:], aux[: n - 1], 0) for name, runner in runners.items()}
    drafts = {name: runner.chain(roots[name], n - 2, args.length).tokens.tolist() for name, runner in runners.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            start = time.perf_counter()
            runners[name].chain(roots[name], n - 2, args.length)
            times[name].append((time.perf_counter() - start) * 1000.0)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"chain of {args.length} drafts after {n} tokens, {args.rounds} rounds (default here: {default})")
    for name, ms in medians.items():
        print(f"  {name:12s} {ms:6.2f} ms  ({ms / args.length:.2f} ms a draft)  kernel {runners[name].projections.layers[0].q.kernel}")
    same = len({tuple(d) for d in drafts.values()}) == 1
    print("the same drafts in every variant:", same)
    result = {"target": args.target, "context": n, "length": args.length, "rounds": args.rounds,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu_features(),
              "rowwise_kernel_default": rowwise_kernel.default_here(), "default_variant": default,
              "median_chain_ms": medians, "product_kernel": {n: r.projections.layers[0].q.kernel for n, r in runners.items()},
              "same_drafts": same}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
