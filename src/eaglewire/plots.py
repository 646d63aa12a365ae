"""PNG plots of training curves (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_training_curves(metrics_path: Path, png_path: Path) -> None:
    """Training loss (and held-out loss) over steps, and held-out accuracy per draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", alpha=0.6)
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out")
        for k in range(len(evals[0]["eval_acc"])):
            ax_acc.plot([r["step"] for r in evals], [r["eval_acc"][k] for r in evals], "o-", label=f"position {k + 1}")
    ax_loss.set(xlabel="step", ylabel="weighted soft cross-entropy", title="loss")
    ax_acc.set(xlabel="step", ylabel="top-1 agreement with target", title="held-out accuracy per draft position", ylim=(0, 1))
    ax_loss.legend()
    if evals:
        ax_acc.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
