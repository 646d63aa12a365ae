"""The learning curve of a drafter across the runs that continued it, on one held-out set.

Each run started `--init-from` the one before; its evaluations are placed at
the tokens seen by the whole lineage. The starting checkpoint is evaluated here
on the same held-out records, so every point is comparable.

    python benchmarks/drafter_lineage.py --data data/sg704 --start src/eaglewire/drafters/smollm2-135m \\
        --start-tokens 1871172 --runs runs/long runs/long2

Writes benchmarks/results/drafter_lineage.json and .png (held-out top-1 agreement
per draft position against tokens seen, log scale).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eaglewire.data.samples import DatasetSamples
from eaglewire.distributed import init_world
from eaglewire.drafter.checkpoint import load_checkpoint
from eaglewire.target import load_target
from eaglewire.train.loop import TrainConfig, TTTModule, _evaluate

RESULTS = Path(__file__).parent / "results"


def evaluate_checkpoint(folder: Path, data: DatasetSamples, target, eval_samples: int, ttt_steps: int) -> list[float]:
    """Held-out accuracy per position, exactly as `eaglewire train` evaluates (full-vocabulary teacher)."""
    drafter = load_checkpoint(folder, target.layout.embed).drafter.float()
    refs = [r for r in data.refs if r.held_out][:eval_samples]
    cfg = TrainConfig(out=Path("unused"), data="unused", ttt_steps=ttt_steps)
    totals = _evaluate(TTTModule(drafter, ttt_steps, "bf16"), drafter, data, refs, init_world(), cfg,
                       target.layout.lm_head.weight)
    return totals.accuracy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, type=Path, help="the dataset whose held-out records every run used")
    parser.add_argument("--start", required=True, type=Path, help="the checkpoint the first run started from")
    parser.add_argument("--start-tokens", required=True, type=int, help="tokens the starting checkpoint was trained on")
    parser.add_argument("--runs", nargs="+", type=Path, required=True, help="run folders, in the order they continued")
    parser.add_argument("--eval-samples", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "drafter_lineage.json")
    args = parser.parse_args()

    target = load_target("smollm2-135m")
    data = DatasetSamples(args.data)
    points = [{"run": "start", "tokens": args.start_tokens,
               "eval_acc": evaluate_checkpoint(args.start, data, target, args.eval_samples, 3)}]
    offset = args.start_tokens
    for run in args.runs:
        settings = json.loads((run / "run.json").read_text())["settings"]
        if Path(settings["data"]).resolve() != args.data.resolve():
            raise SystemExit(f"{run} trained on {settings['data']}, not {args.data}: its held-out set differs")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        tokens = {r["step"]: r["tokens"] for r in rows if "loss" in r}
        for r in rows:
            if "eval_acc" in r:
                points.append({"run": run.name, "step": r["step"], "tokens": offset + tokens[r["step"]],
                               "eval_acc": r["eval_acc"]})
        saved = json.loads((run / "checkpoint" / "config.json").read_text())["eaglewire"]["metrics"]["step"]
        offset += tokens[saved]  # the next run started from this run's last checkpoint
    for p in points:
        print(f"{p['run']:10s} {p.get('step', 0):5d} {p['tokens']:9d}  " + " / ".join(f"{a:.3f}" for a in p["eval_acc"]))
    args.out.write_text(json.dumps({"data": str(args.data), "start": str(args.start), "points": points}, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in range(len(points[0]["eval_acc"])):
        ax.plot([p["tokens"] for p in points], [p["eval_acc"][k] for p in points], marker=".", label=f"position {k + 1}")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens seen by the lineage")
    ax.set_ylabel("held-out top-1 agreement with the target")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Shipped SmolLM2 drafter, continued on CPU")
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
