"""Drafters shipped inside the package, one per embedded target.

``python -m eaglewire.drafter.shipped install RUN [BENCH_JSON]`` copies a finished
training run's checkpoint into the package with a report (held-out accuracy
per draft position, curves, how it was trained) and adds the run to the
drafter's ledger (``ledger.json``, rendered in REPORT.md): one row per run that
led to the shipped weights, each continuing the one before, with its data,
tokens, steps, wall time, held-out accuracy and, given an ``eaglewire bench``
JSON, its MT-bench tau. ``python -m eaglewire.drafter.shipped tau BENCH_JSON`` adds a
tau measured after installing to the newest row.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ..errors import EaglewireError
from ..files import replace_folder
from ..plots import plot_training_curves
from .checkpoint import read_checkpoint_config

SHIPPED_DIR = Path(__file__).parent.parent / "drafters"
LEDGER = "ledger.json"
MAX_BYTES = 30 * 1024 * 1024  # the package must stay small: half-precision weights, modest draft vocabulary


class ShippedDrafterError(EaglewireError):
    """No drafter is shipped for that target, or a run is not fit to ship."""


def shipped_drafter(target_name: str) -> Path:
    path = SHIPPED_DIR / target_name
    if not (path / "config.json").is_file():
        known = sorted(p.name for p in SHIPPED_DIR.iterdir() if p.is_dir()) if SHIPPED_DIR.is_dir() else []
        raise ShippedDrafterError(
            f"no drafter is shipped for target {target_name!r} (shipped: {', '.join(known) or 'none'}); "
            "train one with `eaglewire train` and pass --drafter"
        )
    return path


def ledger_row(run: Path, bench: dict | None) -> dict:
    """What one training run contributed: enough to compare runs and to continue the newest."""
    settings = json.loads((run / "run.json").read_text())
    train, evals = shipped_records(run)
    s = settings["settings"]
    row = {"run": run.name, "data": s["data"], "replay": s.get("replay", []), "online": s["online"],
           "skip_samples": s.get("skip_samples", 0),
           "init": s.get("init_from") or "new", "train_samples": settings["train_samples"],
           "steps": train[-1]["step"], "tokens": train[-1]["tokens"], "wall_min": round(train[-1]["elapsed_s"] / 60, 1),
           "recipe": {k: s.get(k) for k in ("lr", "schedule", "batch_tokens", "ttt_steps", "init_head",
                                            "freeze_lm_head", "init_fc", "init_midlayer", "rebuild_draft_vocab",
                                            "mlp_width", "draft_layers")},
           "eval_acc": [round(a, 4) for a in evals[-1]["eval_acc"]], "eval_samples": settings["eval_samples"],
           "device": settings["hardware"]["device"] if "hardware" in settings else "cpu"}  # unrecorded: before GPU rows
    row["recipe"]["precision"] = settings.get("step_precision", s["precision"])  # what --precision auto chose
    if bench is not None:
        row["mtbench"] = bench_summary(bench)
    return row


def bench_summary(bench: dict) -> dict:
    """tau and first-draft acceptance per drafting system of an ``eaglewire bench`` report, plus its prompts."""
    systems = {name: {"tau": round(r["tau"], 3), "first_draft_acceptance": round(r["acceptance_at"][0], 3)}
               for name, r in bench["systems"].items() if r.get("acceptance_at")}
    return {"prompts": bench["settings"]["prompts"], "max_new_tokens": bench["settings"]["max_new_tokens"], **systems}


def _ledger_table(ledger: list[dict]) -> list[str]:
    lines = ["| # | run | started from | data | tokens | steps | wall (min) | held-out acc | MT-bench tau |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(ledger, start=1):
        taus = row.get("mtbench")
        tau = ("; ".join(f"{k.removeprefix('eaglewire-')} {v['tau']}" for k, v in taus.items() if isinstance(v, dict))
               + f" ({taus['prompts']} q, {taus['max_new_tokens']} tok)") if taus else "not measured"
        data = f"{row['data']}" + (f" (records >= {row['skip_samples']})" if row["skip_samples"] else "")
        if row.get("replay"):  # rows before --replay existed have no such key
            data += " + replayed " + ", ".join(row["replay"])
        lines.append(f"| {i} | {row['run']} | {row['init']} | {data} | {row['tokens']} | {row['steps']} | "
                     f"{row['wall_min']} | {' / '.join(f'{a:.3f}' for a in row['eval_acc'])} | {tau} |")
    return lines


def shipped_records(run: Path) -> tuple[list[dict], list[dict]]:
    """Training and evaluation lines of metrics.jsonl up to the checkpoint that ships (a run killed
    between checkpoints logged steps past its last one)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saved = json.loads((run / "checkpoint" / "config.json").read_text())["eaglewire"]["metrics"]["step"]
    return ([r for r in records if "loss" in r and r["step"] <= saved],
            [r for r in records if "eval_acc" in r and r["step"] <= saved])


def _hardware(settings: dict) -> str:
    """Where the run trained, as run.json records it; a run from before it was recorded says so rather than
    guess."""
    if "hardware" not in settings:
        return "on hardware its run.json does not record"
    hw = settings["hardware"]
    threads = f"{hw['threads']} thread{'s' if hw['threads'] > 1 else ''}"
    processes = f"{hw['processes']} processes of {threads} each" if hw["processes"] > 1 else threads
    cpu = hw["cpu"]  # recorded with the hardware since it was recorded
    kernels = f" ({cpu['capability']}{', AMX' if cpu['amx'] else ''})" if hw["device"] == "cpu" else ""
    return f"on {hw['device']}{kernels}, {processes}"


def _report(run: Path, config: dict, ledger: list[dict]) -> str:
    settings = json.loads((run / "run.json").read_text())
    train, evals = shipped_records(run)
    last_eval = evals[-1]
    accs = " | ".join(f"{a:.3f}" for a in last_eval["eval_acc"])
    heads = " | ".join(str(k + 1) for k in range(len(last_eval["eval_acc"])))
    return "\n".join([
        "# Shipped drafter for smollm2-135m",
        "",
        f"Wiring: `{settings['wiring']}`; draft vocabulary {config['draft_vocab_size']}; "
        f"eagle_config ids {config['eagle_config']['eagle_aux_hidden_state_layer_ids']} "
        f"({config['eaglewire']['engine_convention']} convention).",
        "",
        f"The newest run ({run.name}) trained for {train[-1]['step']} steps on {settings['train_samples']} "
        f"conversations of `{settings['settings']['data']}`"
        + "".join(f", `{folder}`" for folder in settings["settings"].get("replay", []))
        + f" ({train[-1]['tokens']} tokens seen) in "
        f"{train[-1]['elapsed_s'] / 60:.0f} minutes "
        + _hardware(settings) + (f", continuing `{settings['settings']['init_from']}`" if settings["settings"].get("init_from")
                             else "") + ". The ledger below lists every run behind these weights; "
        "`scripts/train_shipped_drafter.sh` reproduces the first, `scripts/train_drafter_long.sh` the continuations on a CPU, "
        "`scripts/train_shipped_drafter_gpu.sh` those on a GPU.",
        "",
        f"Held-out top-1 agreement with the target per draft position ({settings['eval_samples']} held-out "
        "conversations, assistant tokens):",
        "",
        f"| position | {heads} |",
        "|---" * (len(last_eval["eval_acc"]) + 1) + "|",
        f"| accuracy | {accs} |",
        "",
        f"Final training loss {train[-1]['loss']:.4f}; held-out loss {last_eval['eval_loss']:.4f}.",
        "",
        "![training curves](curves.png)",
        "",
        "Settings: `" + json.dumps(settings["settings"], sort_keys=True) + "`",
        "",
        "## Ledger",
        "",
        "Every run behind these weights, oldest first; each row after the first continues the one above "
        "(`--init-from`). Held-out accuracy is per draft position on that run's held-out records.",
        "",
        *_ledger_table(ledger),
        "",
    ])


def install(run: Path, target_name: str = "smollm2-135m", bench: dict | None = None) -> Path:
    run = Path(run)
    checkpoint = run / "checkpoint"
    read_checkpoint_config(checkpoint)  # strict: refuse anything that is not a valid checkpoint
    size = sum(f.stat().st_size for f in checkpoint.iterdir())
    if size > MAX_BYTES:
        raise ShippedDrafterError(f"{checkpoint} is {size / 2**20:.1f} MiB; the shipped drafter must stay under 30 MiB")
    dest = SHIPPED_DIR / target_name
    ledger = json.loads((dest / LEDGER).read_text()) if (dest / LEDGER).is_file() else []
    ledger.append(ledger_row(run, bench))

    def build(staged: Path) -> None:  # a failure leaves the shipped drafter as it was
        shutil.copytree(checkpoint, staged, dirs_exist_ok=True)
        plot_training_curves(run / "metrics.jsonl", staged / "curves.png")  # also for a run stopped before its end
        shutil.copy(run / "metrics.jsonl", staged / "metrics.jsonl")
        _write_ledger(staged, run, ledger)

    return replace_folder(dest, build)


def record_tau(bench: dict, target_name: str = "smollm2-135m") -> Path:
    """Add an MT-bench measurement of the shipped drafter to the newest ledger row."""
    dest = shipped_drafter(target_name)
    ledger = json.loads((dest / LEDGER).read_text())
    ledger[-1]["mtbench"] = bench_summary(bench)
    (dest / LEDGER).write_text(json.dumps(ledger, indent=1) + "\n")
    report = (dest / "REPORT.md").read_text()
    head = report[: report.index("| # | run |")]
    (dest / "REPORT.md").write_text(head + "\n".join(_ledger_table(ledger)) + "\n")
    return dest


def _write_ledger(dest: Path, run: Path, ledger: list[dict]) -> None:
    config = json.loads((dest / "config.json").read_text())
    (dest / LEDGER).write_text(json.dumps(ledger, indent=1) + "\n")
    (dest / "REPORT.md").write_text(_report(run, config, ledger))


if __name__ == "__main__":
    usage = "usage: python -m eaglewire.drafter.shipped install RUN_FOLDER [BENCH_JSON] | tau BENCH_JSON"
    if len(sys.argv) in (3, 4) and sys.argv[1] == "install":
        print(install(Path(sys.argv[2]), bench=json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) == 4 else None))
    elif len(sys.argv) == 3 and sys.argv[1] == "tau":
        print(record_tau(json.loads(Path(sys.argv[2]).read_text())))
    else:
        sys.exit(usage)
