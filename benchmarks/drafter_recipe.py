"""Recipe search by learning curve: short training runs at an equal token budget, side by side.

Each recipe is an `eaglewire train` run on the same dataset, the same held-out
records and the same number of training tokens (so about the same CPU time:
every recipe costs the same per token, and the wall and CPU seconds are
recorded to show it). Runs go `--parallel` at a time with `--threads` each.
Then each drafter drafts chains on MT-bench questions (never trained on: the
training data is ShareGPT) at T=0 for its tau and first-draft acceptance.

    python benchmarks/drafter_recipe.py --data data/sg1280 --budget-tokens 300000 --out runs/recipe
    python benchmarks/drafter_recipe.py --data data/sg1280 --recipes today,b2k-lr3e-3 --out runs/recipe

Writes OUT/<recipe>/ (the runs), benchmarks/results/drafter_recipe.json and
drafter_recipe.png (held-out first-draft accuracy against tokens seen and
against seconds). Finished runs are reused when rerun with the same settings.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

EAGLEWIRE = [sys.executable, "-m", "eaglewire"]
RESULTS = Path(__file__).parent / "results"

# name -> eaglewire train options. "today" is the recipe the first shipped drafter was trained with.
RECIPES: dict[str, list[str]] = {
    # (its 15 warmup steps of 244 scaled to a short run: 3 of ~20)
    "today": ["--batch-tokens", "8192", "--lr", "1e-3", "--warmup-steps", "3"],
    "b2k-lr1e-3": ["--batch-tokens", "2048", "--lr", "1e-3", "--warmup-steps", "15"],
    "b2k-lr3e-3": ["--batch-tokens", "2048", "--lr", "3e-3", "--warmup-steps", "15"],
    "b2k-lr1e-2": ["--batch-tokens", "2048", "--lr", "1e-2", "--warmup-steps", "15"],
    "b2k-lr3e-3-head": ["--batch-tokens", "2048", "--lr", "3e-3", "--warmup-steps", "15", "--init-head", "target"],
    "b2k-lr3e-3-head-frozen": ["--batch-tokens", "2048", "--lr", "3e-3", "--warmup-steps", "15", "--init-head",
                               "target", "--freeze-lm-head"],
    "b2k-lr3e-3-fc-last": ["--batch-tokens", "2048", "--lr", "3e-3", "--warmup-steps", "15", "--init-fc", "last-aux"],
    "b2k-lr3e-3-mid-last": ["--batch-tokens", "2048", "--lr", "3e-3", "--warmup-steps", "15", "--init-midlayer",
                            "target-last"],
    "b1k-lr3e-3": ["--batch-tokens", "1024", "--lr", "3e-3", "--warmup-steps", "15"],
    "b2k-lr3e-3-wsd": ["--batch-tokens", "2048", "--lr", "3e-3", "--warmup-steps", "15", "--schedule", "wsd"],
    "b2k-lr3e-3-fcrms": ["--batch-tokens", "2048", "--lr", "3e-3", "--warmup-steps", "15", "--fc-input-scale", "rms"],
    "b2k-lr1e-3-fcrms": ["--batch-tokens", "2048", "--lr", "1e-3", "--warmup-steps", "15", "--fc-input-scale", "rms"],
}


def batch_tokens(options: list[str]) -> int:
    return int(options[options.index("--batch-tokens") + 1])


def train_command(args, name: str, options: list[str]) -> list[str]:
    steps = max(1, args.budget_tokens // batch_tokens(options))
    eval_every = max(1, steps // args.evals)
    return [*EAGLEWIRE, "train", "--data", args.data, "--out", str(args.out / name), "--steps", str(steps),
            "--eval-every", str(eval_every), "--save-every", str(steps), "--eval-samples", str(args.eval_samples),
            "--draft-vocab", "8192", "--ttt-steps", "3", "--no-progress", *options, *args.extra]


def run_all(commands: dict[str, list[str]], parallel: int, threads: int, log_dir: Path) -> dict[str, float]:
    """Run commands `parallel` at a time; returns each one's CPU seconds (user + system of the child)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    waiting, running, cpu = list(commands.items()), {}, {}
    while waiting or running:
        while waiting and len(running) < parallel:
            name, command = waiting.pop(0)
            log = (log_dir / f"{name}.log").open("w")
            print(f"start {name}: {shlex.join(command)}", flush=True)
            running[subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT).pid] = (name, log)
        pid, status, usage = os.wait4(-1, 0)
        name, log = running.pop(pid)
        log.close()
        if status != 0:
            raise SystemExit(f"{name} failed (status {status}); see {log_dir / f'{name}.log'}")
        cpu[name] = usage.ru_utime + usage.ru_stime
        print(f"done {name}: {cpu[name]:.0f} CPU s", flush=True)
    return cpu


def curve(run: Path) -> list[dict]:
    """Held-out accuracy per position at each evaluation, with the tokens and seconds spent by then."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    progress = {r["step"]: r for r in rows if "loss" in r}
    return [{"step": r["step"], "tokens": progress[r["step"]]["tokens"], "seconds": progress[r["step"]]["elapsed_s"],
             "eval_acc": r["eval_acc"], "eval_loss": r["eval_loss"]} for r in rows if "eval_acc" in r]


def tau(args, name: str) -> dict:
    out = args.out / name / "bench"
    if not (out / "bench.json").is_file():
        command = [*EAGLEWIRE, "bench", "--dataset", "mtbench", "--limit", str(args.questions), "--max-new-tokens",
                   str(args.max_new_tokens), "--systems", "eaglewire-chain", "--drafter", str(args.out / name / "checkpoint"),
                   "--out", str(out), "--no-progress"]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.parallel * args.threads)}
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    chain = json.loads((out / "bench.json").read_text())["systems"]["eaglewire-chain"]
    return {"tau": chain["tau"], "acceptance_at": chain["acceptance_at"]}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_seconds) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        points = r["curve"]
        acc = [p["eval_acc"][0] for p in points]
        by_tokens.plot([p["tokens"] for p in points], acc, marker=".", label=name)
        by_seconds.plot([p["seconds"] for p in points], acc, marker=".", label=name)
    for ax, label in ((by_tokens, "training tokens seen"), (by_seconds, "wall seconds (one thread per run)")):
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out top-1 agreement, draft position 1")
        ax.grid(alpha=0.3)
    by_tokens.legend(fontsize=7)
    fig.suptitle("Drafter recipes at an equal token budget (SmolLM2-135M, ShareGPT)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="an extracted dataset folder (eaglewire extract)")
    parser.add_argument("--out", type=Path, default=Path("runs/recipe"), help="folder for the runs")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated subset of {', '.join(RECIPES)}")
    parser.add_argument("--budget-tokens", type=int, default=300_000, help="training tokens per recipe")
    parser.add_argument("--evals", type=int, default=6, help="held-out evaluations per run")
    parser.add_argument("--eval-samples", type=int, default=32, help="held-out conversations evaluated")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--threads", type=int, default=1, help="threads per run")
    parser.add_argument("--questions", type=int, default=12, help="MT-bench questions for tau (0: skip)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--results", type=Path, default=RESULTS / "drafter_recipe.json")
    parser.add_argument("extra", nargs="*", help="more eaglewire train options for every run (after --)")
    args = parser.parse_args()
    names = args.recipes.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; choose from {', '.join(RECIPES)}")
    args.out.mkdir(parents=True, exist_ok=True)

    todo = {n: train_command(args, n, RECIPES[n]) for n in names if not _finished(args.out / n)}
    for name in todo:  # an unfinished run is started over: its schedule belongs to its own step count
        subprocess.run(["rm", "-rf", str(args.out / name)], check=True)
    started = time.perf_counter()
    cpu = run_all(todo, args.parallel, args.threads, args.out)
    cpu_file = args.out / "cpu_seconds.json"
    known = json.loads(cpu_file.read_text()) if cpu_file.is_file() else {}
    known.update(cpu)
    cpu_file.write_text(json.dumps(known, indent=1))

    results = {}
    for name in names:
        points = curve(args.out / name)
        results[name] = {"options": RECIPES[name], "steps": points[-1]["step"], "tokens": points[-1]["tokens"],
                         "wall_s": points[-1]["seconds"], "cpu_s": known.get(name), "curve": points,
                         "final_eval_acc": points[-1]["eval_acc"]}
        if args.questions:
            results[name].update(tau(args, name))
        r = results[name]
        print(f"{name:24s} steps {r['steps']:4d}  tokens {r['tokens']:7d}  wall {r['wall_s']:6.0f}s  held-out acc "
              + " / ".join(f"{a:.3f}" for a in r["final_eval_acc"])
              + (f"  tau {r['tau']:.3f}  first-draft acceptance {r['acceptance_at'][0]:.3f}" if "tau" in r else ""),
              flush=True)
    report = {"data": args.data, "budget_tokens": args.budget_tokens, "threads_per_run": args.threads,
              "parallel": args.parallel, "eval_samples": args.eval_samples,
              "tau_setting": {"dataset": "mtbench", "questions": args.questions, "max_new_tokens": args.max_new_tokens,
                              "strategy": "chain", "chain_length": 4, "temperature": 0},
              "extra_options": args.extra, "wall_s_total": time.perf_counter() - started,
              "resources": {"max_rss_mib_children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024},
              "recipes": results}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(report, indent=1))
    plot(results, args.results.with_suffix(".png"))
    print(f"wrote {args.results} and {args.results.with_suffix('.png')}")


def _finished(run: Path) -> bool:
    if not (run / "run.json").is_file() or not (run / "metrics.jsonl").is_file():
        return False
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return max((r["step"] for r in rows), default=0) == json.loads((run / "run.json").read_text())["total_steps"]


if __name__ == "__main__":
    main()
