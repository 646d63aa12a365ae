"""Is the product over block codes bound by the bytes it reads or by its arithmetic, on this CPU?

The target's layer matrices are multiplied two ways, for M = 1 (a decode step) and a few verify rows:
  cold  every matrix once, in the forward's order: ~80 MB of codes, scales and offsets come from memory
  hot   the first layer's q and o matrices again and again (0.5 MB of codes, scales and offsets), as many
        weights in all: they stay in the core's L2 cache
Both run the engine's product (``rowwise_kernel.rowwise_linear_blocks``) with one thread, in a rotating
order, and report microseconds per million weights (medians). Where cold costs what hot does, the arithmetic
(decoding the codes, one FMA per weight per row) sets the pace and fewer bytes would not help; each row's
cost over one row's is what a verify step pays for it.

    python benchmarks/codes_bound.py --rounds 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eaglewire.engine import rowwise_kernel
from eaglewire.engine.lean import LeanModel
from eaglewire.engine.projection import Projection, cpu_features
from eaglewire.target import load_target


def layer_projections(lean: LeanModel, target: str) -> list[Projection]:
    """Every layer matrix, in the order a forward reads them; each must multiply from block codes."""
    matrices = [p for layer in lean.layers for p in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down)]
    if any(p.codes is None for p in matrices):
        raise SystemExit(f"{target}'s layer matrices are not all block codes here: nothing to measure")
    return matrices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", default="1,2,3,4,5,8", help="x rows per product (1 = a decode step)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/codes_bound.json"))
    args = parser.parse_args()
    row_counts = [int(m) for m in args.rows.split(",")]
    if args.rounds < 1 or min(row_counts) < 1:
        parser.error(f"--rounds and --rows must be >= 1; got --rounds {args.rounds}, --rows {args.rows}")
    torch.set_num_threads(1)
    if not rowwise_kernel.available():
        raise SystemExit("the rowwise kernel does not run here (x86 with AVX2 and a compiler are needed)")

    lean = LeanModel.from_hf(load_target(args.target).model, 64, packed=True, rowwise=True)
    cold = layer_projections(lean, args.target)
    first = (lean.layers[0].q, lean.layers[0].o)
    hot = [first[i % len(first)] for i in range(len(cold))]
    weights = sum(p.codes.codes.shape[0] * p.codes.codes.shape[1] * 32 for p in cold)
    hot_weights = sum(p.codes.codes.shape[0] * p.codes.codes.shape[1] * 32 for p in hot)
    inputs = {m: {k: torch.randn(m, k) for k in {p.codes.codes.shape[1] * 32 for p in cold}} for m in row_counts}

    def run(matrices, m: int) -> float:
        start = time.perf_counter()
        for p in matrices:
            rowwise_kernel.rowwise_linear_blocks(inputs[m][p.codes.codes.shape[1] * 32], p.codes, None)
        return time.perf_counter() - start

    variants = [(where, m) for m in row_counts for where in ("cold", "hot")]
    times: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        shift = round_index % len(variants)
        for where, m in variants[shift:] + variants[:shift]:
            seconds = run(cold if where == "cold" else hot, m)
            if round_index:
                times[(where, m)].append(seconds * 1e6 / ((weights if where == "cold" else hot_weights) / 1e6))

    per_mweights = {f"{where}{m}": statistics.median(v) for (where, m), v in times.items()}
    result = {
        "target": args.target,
        "weights": weights,
        "weight_bits": sorted({p.codes.bits for p in cold}),
        "rounds": args.rounds,
        "us_per_million_weights": per_mweights,
        "cold_over_hot": {m: per_mweights[f"cold{m}"] / per_mweights[f"hot{m}"] for m in row_counts},
        "cold_relative_to_one_row": {m: per_mweights[f"cold{m}"] / per_mweights["cold1"] for m in row_counts}
        if 1 in row_counts else {},
        "torch": torch.__version__,
        "cpu": cpu_features(),
    }
    print(f"{weights / 1e6:.0f}M weights ({result['weight_bits']} bits), one thread, us per million weights")
    print(f"{'rows':>4} {'cold':>8} {'hot':>8} {'cold/hot':>9}")
    for m in row_counts:
        print(f"{m:>4} {per_mweights[f'cold{m}']:>8.1f} {per_mweights[f'hot{m}']:>8.1f} {result['cold_over_hot'][m]:>9.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
