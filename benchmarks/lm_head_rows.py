"""The lm_head by row count: its own path (``engine/projection.py``: one row through MKL on a contiguous W^T,
several rows one at a time, to stay row-invariant) against the packed kernel every other matrix uses.

One row is what single-stream decoding asks; several rows is what batches ask (``regenerate``, a server's
sequences) and what a tree's frontier gives the drafter's lm_head. Every round times both, in alternating
order; medians are reported.
With ``--turns FILE`` it also regenerates the first ``--conversations`` of FILE both ways, in one process,
and checks the answers are identical.

    python benchmarks/lm_head_rows.py --threads 1
    python benchmarks/lm_head_rows.py --threads 1 --turns first_turns.jsonl   # plus regenerate, ~4 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eaglewire.engine.projection import Projection, native_bf16
from eaglewire.engine.speculative import Engine
from eaglewire.target import load_target
from eaglewire.train.regenerate import RegenerateConfig, run_regenerate


def time_products(weights: dict[str, torch.Tensor], rows: list[int], rounds: int) -> dict:
    out = {}
    for name, weight in weights.items():
        kernels = {"packed": Projection(weight, None, packed=True),
                   "one_row_at_a_time": Projection(weight, None, packed=True, transposed_for_one_row=True)}
        for m in rows:
            x = torch.randn(m, weight.shape[1])
            times = {k: [] for k in kernels}
            for r in range(rounds):
                for k in (sorted(kernels) if r % 2 else sorted(kernels, reverse=True)):
                    start = time.perf_counter()
                    kernels[k](x)
                    times[k].append((time.perf_counter() - start) * 1000)
            median = out[f"{name} x {m} rows"] = {k: statistics.median(v[1:]) for k, v in times.items()}  # 1st: warm-up
            print(f"{name:>8} {tuple(weight.shape)} x {m:>2} rows: packed {median['packed']:7.2f} ms,"
                  f" one row at a time {median['one_row_at_a_time']:7.2f} ms")
    return out


def time_regenerate(engine: Engine, lines: list[str], new_tokens: int) -> dict:
    own = engine.lean.lm_head
    heads = {"packed": Projection(own.weight, None, packed=True), "one_row_at_a_time": own}
    seconds, answers = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        subset = Path(tmp) / "turns.jsonl"
        subset.write_text("".join(lines))
        for name, head in heads.items():
            engine.lean.lm_head = head
            out = Path(tmp) / f"{name}.jsonl"
            cfg = RegenerateConfig(data=str(subset), out=out, max_new_tokens=new_tokens, batch=32,
                                   max_len=engine.max_len, progress=False)
            start = time.perf_counter()
            run_regenerate(cfg, engine)
            seconds[name] = time.perf_counter() - start
            answers[name] = out.read_text()
            print(f"regenerate {len(lines)} conversations, {new_tokens} new tokens, {name}: {seconds[name]:.1f} s")
    engine.lean.lm_head = own
    return {"conversations": len(lines), "max_new_tokens": new_tokens, "batch": 32, "seconds": seconds,
            "speedup_packed": seconds["one_row_at_a_time"] / seconds["packed"],
            "identical_answers": answers["packed"] == answers["one_row_at_a_time"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--rows", default="1,2,8,32", help="row counts to time")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--turns", type=Path, default=None, help="a .jsonl of first turns: also time regenerate")
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lm_head_rows.json"))
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lines = []
    if args.turns is not None:  # checked before the slow part
        lines = args.turns.read_text().splitlines(keepends=True)[: args.conversations]
        if len(lines) < args.conversations:
            parser.error(f"--turns {args.turns} has {len(lines)} lines, fewer than --conversations "
                         f"{args.conversations}")
    target = load_target(args.target)
    lm_head = target.layout.lm_head.weight.detach().float()
    weights = {"target": lm_head, "drafter": lm_head[:8192]}  # a draft vocabulary of 8192 rows
    rows = [int(m) for m in args.rows.split(",")]
    result = {"target": args.target, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "cpu_native_bf16": native_bf16(), "rounds": args.rounds,
              "median_ms": time_products(weights, rows, args.rounds)}
    if args.turns is not None:
        result["regenerate"] = time_regenerate(Engine(target, None, None, 1024), lines, args.max_new_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
