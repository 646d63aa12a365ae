"""MT-bench tau of the shipped drafter's lineage against the tokens it has trained on (log scale).

Every ledger row continued the drafter shipped before it, so the rows form one lineage: a row's
tokens seen are its own plus every earlier row's. The chain's tau is fitted as a line in log2(tokens)
and the fit says how many more tokens, and CPU hours at the lineage's own tokens per second, the
line would need to reach --goal. It is an extrapolation of few points whose data changed between
runs (ShareGPT answers, then the target's own): read it as the order of magnitude.

    python benchmarks/drafter_ledger.py [--ledger src/eaglewire/drafters/smollm2-135m/ledger.json] [--goal 3.0]

Writes benchmarks/results/drafter_ledger.json and .png.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from eaglewire.plots import _pyplot

RESULTS = Path(__file__).parent / "results"
LEDGER = Path(__file__).parents[1] / "src" / "eaglewire" / "drafters" / "smollm2-135m" / "ledger.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ledger", type=Path, default=LEDGER)
    parser.add_argument("--goal", type=float, default=3.0, help="the chain tau to extrapolate to")
    args = parser.parse_args()
    rows = json.loads(args.ledger.read_text())
    points, seen = [], 0
    wall_min = {"cpu": 0.0, "gpu": 0.0}
    tokens = {"cpu": 0, "gpu": 0}
    for row in rows:
        seen += row["tokens"]
        kind = "cpu" if row.get("device", "cpu") == "cpu" else "gpu"  # rows before GPU runs record no device
        wall_min[kind] += row["wall_min"]
        tokens[kind] += row["tokens"]
        bench = row.get("mtbench") or {}
        points.append({"run": row["run"], "tokens_seen": seen, "prompts": bench.get("prompts"),
                       **{f"{name.removeprefix('eaglewire-')}_tau": bench[name]["tau"]
                          for name in ("eaglewire-chain", "eaglewire-tree") if name in bench}})
    chain = [(math.log2(p["tokens_seen"]), p["chain_tau"]) for p in points if "chain_tau" in p]
    n = len(chain)
    mx, my = sum(x for x, _ in chain) / n, sum(y for _, y in chain) / n
    slope = sum((x - mx) * (y - my) for x, y in chain) / sum((x - mx) ** 2 for x, _ in chain)
    tokens_needed = 2 ** (mx + (args.goal - my) / slope) if slope > 0 else math.inf
    rate = {kind: tokens[kind] / (wall_min[kind] * 60) for kind in tokens if wall_min[kind] > 0}
    hours = {kind: (tokens_needed - seen) / r / 3600 for kind, r in rate.items()}
    for p in points:
        taus = ", ".join(f"{k.removesuffix('_tau')} {v:.3f}" for k, v in p.items() if k.endswith("_tau")) or "not measured"
        print(f"{p['run']:16s} tokens seen {p['tokens_seen'] / 1e6:6.2f}M  tau {taus}"
              + (f" ({p['prompts']} q)" if p["prompts"] else ""))
    print(f"chain tau per doubling of tokens seen: {slope:+.3f}; tau {args.goal} at ~{tokens_needed / 1e6:,.0f}M tokens, "
          + ", or ".join(f"~{hours[k]:,.1f} {k.upper()} hours more at the lineage's {rate[k]:,.0f} tokens/s there"
                         for k in rate))

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, marker in (("chain", "o-"), ("tree", "s--")):
        pts = [(p["tokens_seen"], p[f"{kind}_tau"]) for p in points if f"{kind}_tau" in p]
        ax.plot([t for t, _ in pts], [v for _, v in pts], marker, label=kind)
    xs = [2 ** x for x in (chain[0][0], math.log2(min(tokens_needed, 2 ** (chain[-1][0] + 12))))]
    ax.plot(xs, [my + slope * (math.log2(x) - mx) for x in xs], ":", color="gray", label="chain fit, extrapolated")
    ax.axhline(args.goal, color="red", lw=0.8, label=f"goal tau {args.goal}")
    ax.set(xscale="log", xlabel="tokens seen by the lineage", ylabel="MT-bench tau (T=0, 256 tokens)",
           title="shipped SmolLM2 drafter: tau against training tokens")
    ax.legend()
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / "drafter_ledger.png", dpi=100)
    plt.close(fig)
    (RESULTS / "drafter_ledger.json").write_text(json.dumps(
        {"ledger": str(args.ledger), "points": points, "chain_tau_per_doubling": slope, "goal": args.goal,
         "tokens_for_goal": tokens_needed, "lineage_tokens_per_s": rate, "hours_more": hours}, indent=1))
    print(f"wrote {RESULTS / 'drafter_ledger.json'} and .png")


if __name__ == "__main__":
    main()
