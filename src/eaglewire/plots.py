"""PNG plots of training curves and benchmark results (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training_curves(metrics_path: Path, png_path: Path) -> None:
    """Training loss (and held-out loss) over steps, and held-out accuracy per draft position."""
    plt = _pyplot()

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


def plot_bench(report: dict, png_path: Path) -> None:
    """Tokens/s per system, acceptance per draft position, and the verify cost curve."""
    plt = _pyplot()
    systems = report["systems"]
    fig, (ax_speed, ax_acc, ax_cost) = plt.subplots(1, 3, figsize=(16, 4.5))
    names = list(systems)
    ax_speed.bar(range(len(names)), [systems[n]["tokens_per_s"] for n in names])
    ax_speed.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax_speed.set(ylabel="tokens/s", title="throughput (one request at a time)")
    for name in names:
        if systems[name].get("acceptance_at"):
            acc = systems[name]["acceptance_at"]
            ax_acc.plot(range(1, len(acc) + 1), acc, "o-", label=f"{name} (tau {systems[name]['tau']:.2f})")
    ax_acc.set(xlabel="draft position", ylabel="P(accepted)", title="acceptance per draft position", ylim=(0, 1))
    if ax_acc.lines:
        ax_acc.legend()
    costs = report.get("cost_model")
    if costs:
        sizes = [int(k) for k in costs["verify_relative"]]
        ax_cost.plot(sizes, list(costs["verify_relative"].values()), "o-")
        ax_cost.set(xlabel="tokens verified in one forward", ylabel="time / one decode step",
                    title=f"verify cost at {costs['context']} tokens of context")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def plot_tensor_match(errors, stored: list[str], candidates: list[str], tolerance: float, png_path: Path) -> None:
    """Heatmap of per-token relative error, stored tensors (rows) x the target's capture points (columns).

    ``errors`` is a [stored, candidates] tensor or nested list; each row's best candidate is boxed,
    and cells under ``tolerance`` (a match) are marked with a dot.
    """
    import numpy as np

    plt = _pyplot()
    values = np.log10(np.clip(np.asarray(errors, dtype=float), 1e-6, None))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(candidates) + 2.5), 1.8 + 0.45 * len(stored)))
    image = ax.imshow(values, aspect="auto", cmap="viridis_r", vmin=-4, vmax=max(1.0, float(values.max())))
    ax.set_xticks(range(len(candidates)), candidates, rotation=90, fontsize=7)
    ax.set_yticks(range(len(stored)), stored, fontsize=8)
    for row in range(len(stored)):
        best = int(values[row].argmin())
        ax.add_patch(plt.Rectangle((best - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
        for col in range(len(candidates)):
            if values[row, col] <= np.log10(tolerance):
                ax.plot(col, row, "w.", markersize=4)
    ax.set(xlabel="candidate tensor of the target", ylabel="stored tensor (label in the data)",
           title=f"per-token relative error (log10); match below {tolerance:g}, best per row boxed")
    fig.colorbar(image, ax=ax, label="log10 error")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
