"""How many training-time-test steps? Held-out acceptance proxy against training cost.

Trains one drafter per K on the same samples with the same budget (epochs),
then reads the held-out top-1 agreement per draft position a_1..a_P (P = the
longest K, evaluated by unrolling P steps whatever K was trained) and the
proxy accept length of a P-token chain, 1 + a_1 + a_1 a_2 + ... , next to the
training time.

    python benchmarks/ttt_steps.py --data DATASET --samples 128 --steps-list 1,2,3,4
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from eaglewire.data.samples import DatasetSamples
from eaglewire.drafter.checkpoint import load_checkpoint
from eaglewire.target import load_target
from eaglewire.train.loop import TrainConfig, run_train
from eaglewire.train.ttt import step_sums, teacher_targets, unroll


def held_out_accuracy(drafter, data: DatasetSamples, lm_head, positions: int, limit: int) -> list[float]:
    correct, count = torch.zeros(positions), torch.zeros(positions)
    with torch.no_grad():
        for ref in [r for r in data.refs if r.held_out][:limit]:
            sample = data.load(ref)
            teacher = teacher_targets(sample.final, lm_head, drafter.t2d)
            _, c, n = step_sums(drafter, unroll(drafter, sample.input_ids, sample.aux, positions), sample.loss_mask, teacher)
            correct += torch.tensor(c)
            count += torch.tensor(n)
    return (correct / count.clamp(min=1)).tolist()


def proxy_accept_length(accuracy: list[float]) -> float:
    total, running = 1.0, 1.0
    for a in accuracy:
        running *= a
        total += running
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--steps-list", default="1,2,3,4")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--eval-samples", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ttt_steps.json"))
    args = parser.parse_args()

    target = load_target(args.target)
    data = DatasetSamples(Path(args.data))
    ks = [int(k) for k in args.steps_list.split(",")]
    positions = max(ks)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in ks:
            cfg = TrainConfig(out=Path(tmp) / f"k{k}", data=args.data, target=args.target, ttt_steps=k,
                              draft_vocab=args.draft_vocab, epochs=args.epochs, max_samples=args.samples,
                              batch_tokens=8192, lr=1e-3, warmup_steps=5, eval_every=10_000, save_every=10_000,
                              progress=False)
            start = time.perf_counter()
            run_train(cfg, target=target)
            seconds = time.perf_counter() - start
            drafter = load_checkpoint(cfg.out / "checkpoint", target.layout.embed).drafter
            accuracy = held_out_accuracy(drafter, data, target.layout.lm_head.weight, positions, args.eval_samples)
            rows.append({"ttt_steps": k, "train_seconds": seconds, "held_out_accuracy": accuracy,
                         "proxy_accept_length": proxy_accept_length(accuracy)})
            print(f"K={k}: train {seconds:.0f} s, held-out accuracy per position "
                  + ", ".join(f"{a:.3f}" for a in accuracy) + f", proxy tau {rows[-1]['proxy_accept_length']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"samples": args.samples, "epochs": args.epochs, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
