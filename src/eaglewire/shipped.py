"""Drafters shipped inside the package, one per embedded target.

``python -m eaglewire.shipped install RUN`` copies a finished training run's
checkpoint into the package with a report (held-out accuracy per draft
position, curves, how it was trained); scripts/train_shipped_drafter.sh is the
whole recipe.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from .checkpoint import read_checkpoint_config

SHIPPED_DIR = Path(__file__).parent / "drafters"
MAX_BYTES = 30 * 1024 * 1024  # the package must stay small: half-precision weights, modest draft vocabulary


class ShippedDrafterError(ValueError):
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


def _report(run: Path, config: dict) -> str:
    settings = json.loads((run / "run.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_acc" in r]
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
        f"Trained for {train[-1]['step']} steps on {settings['train_samples']} ShareGPT conversations "
        f"({train[-1]['tokens']} tokens seen) in {train[-1]['elapsed_s'] / 60:.0f} minutes on a 2-core CPU; "
        "reproduce with `scripts/train_shipped_drafter.sh`.",
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
    ])


def install(run: Path, target_name: str = "smollm2-135m") -> Path:
    run = Path(run)
    checkpoint = run / "checkpoint"
    read_checkpoint_config(checkpoint)  # strict: refuse anything that is not a valid checkpoint
    config = json.loads((checkpoint / "config.json").read_text())
    size = sum(f.stat().st_size for f in checkpoint.iterdir())
    if size > MAX_BYTES:
        raise ShippedDrafterError(f"{checkpoint} is {size / 2**20:.1f} MiB; the shipped drafter must stay under 30 MiB")
    dest = SHIPPED_DIR / target_name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(checkpoint, dest)
    shutil.copy(run / "curves.png", dest / "curves.png")
    (dest / "REPORT.md").write_text(_report(run, config))
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "install":
        sys.exit("usage: python -m eaglewire.shipped install RUN_FOLDER")
    print(install(Path(sys.argv[2])))
