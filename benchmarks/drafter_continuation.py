"""Continuations of one drafter side by side: held-out curves and MT-bench tau per arm.

Each arm is a run that continued the same drafter (`--init-from`) and evaluated the
same held-out records (the first ones of its `--data`), and the `eaglewire bench`
report of its checkpoint on the same MT-bench questions. The arms differ in what
was being asked (learning rate, replayed data, ...); run them side by side with
one thread each so their wall times compare.

    python benchmarks/drafter_continuation.py --baseline benchmarks/results/mtbench20/bench_drafter_row11.json \\
        --arm lr5e-4=runs/rp1:runs/bench20_rp1/bench.json --arm lr2e-4=runs/rp2:runs/bench20_rp2/bench.json \\
        --question "..." --out benchmarks/results/drafter_continuation

Writes OUT.json and OUT.png (held-out first-position accuracy against steps, with each arm's learning rate).
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

from eaglewire.drafter.shipped import bench_summary, shipped_records
from eaglewire.plots import _pyplot


def arm(spec: str) -> tuple[str, Path, Path]:
    name, _, paths = spec.partition("=")
    run, _, bench = paths.partition(":")
    if not (name and run and bench):
        raise argparse.ArgumentTypeError(f"expected NAME=RUN_FOLDER:BENCH_JSON, got {spec!r}")
    return name, Path(run), Path(bench)


def summarize(run: Path, bench: Path) -> dict:
    train, evals = shipped_records(run)
    lr = {r["step"]: r["lr"] for r in train}
    settings = json.loads((run / "run.json").read_text())
    return {"run": str(run), "settings": settings["settings"], "train_samples": settings["train_samples"],
            "steps": train[-1]["step"], "tokens": train[-1]["tokens"], "wall_min": round(train[-1]["elapsed_s"] / 60, 1),
            "held_out": [{"step": r["step"], "lr": lr.get(r["step"]), "acc": [round(a, 4) for a in r["eval_acc"]]}
                         for r in evals],
            "mtbench": bench_summary(json.loads(bench.read_text())), "bench": str(bench)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", type=arm, action="append", required=True, help="NAME=RUN_FOLDER:BENCH_JSON")
    parser.add_argument("--baseline", type=Path, required=True, help="bench report of the drafter the arms continued")
    parser.add_argument("--question", required=True, help="what the arms compare, recorded in the JSON")
    parser.add_argument("--out", type=Path, required=True, help="output path without extension")
    args = parser.parse_args()
    arms = {name: summarize(run, bench) for name, run, bench in args.arm}
    result = {"question": args.question, "baseline": {"bench": str(args.baseline),
                                                      "mtbench": bench_summary(json.loads(args.baseline.read_text()))},
              "arms": arms}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    for name, a in arms.items():
        taus = ", ".join(f"{k.removeprefix('eaglewire-')} tau {v['tau']:.3f}" for k, v in a["mtbench"].items()
                         if isinstance(v, dict))
        print(f"{name:12s} {a['steps']} steps, {a['wall_min']} min, held-out {a['held_out'][-1]['acc']}, {taus}")

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, a in arms.items():
        ax.plot([h["step"] for h in a["held_out"]], [h["acc"][0] for h in a["held_out"]], "o-",
                label=f"{name} (lr {a['settings']['lr']:g})")
    ax.set(xlabel="step", ylabel="held-out top-1 agreement, position 1")
    ax.set_title(textwrap.fill(args.question, 90), fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=100)
    plt.close(fig)
    print(f"wrote {args.out.with_suffix('.json')} and .png")


if __name__ == "__main__":
    main()
