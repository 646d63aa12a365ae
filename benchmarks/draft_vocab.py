"""How big should the draft vocabulary be? Coverage against draft cost.

A drafter can only propose tokens in its vocabulary, so the share of the
target's greedy (top-1) next tokens that fall inside the top-N vocabulary is
an upper bound on its per-position acceptance. The price is the drafter's
lm_head, paid at every draft step. For each N this prints:
  coverage   share of held-out assistant positions whose target top-1 token is in the vocabulary
  head_ms    one drafter lm_head over a single position (the decode-time cost per draft token)
  step_ms    a whole single-position draft step (fc + midlayer + norm + lm_head)
The vocabulary is built from the training split only (as `eaglewire train` does).

    python benchmarks/draft_vocab.py --data DATASET
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eaglewire.bench.report import median_time
from eaglewire.data.samples import DatasetSamples, draft_vocabulary
from eaglewire.drafter.model import Drafter, DrafterConfig
from eaglewire.target import load_target

SIZES = (2048, 4096, 8192, 16384, 32768)


def timed(fn, repeats: int = 50) -> float:
    return median_time(fn, repeats, warmup=5) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_vocab.json"))
    args = parser.parse_args()

    target = load_target(args.target)
    data = DatasetSamples(Path(args.data))
    train = [r for r in data.refs if not r.held_out]
    held_out = [r for r in data.refs if r.held_out][: args.eval_samples]
    top1, masks = [], []
    with torch.no_grad():
        for ref in held_out:
            final = data.load(ref).final
            top1.append((final @ target.layout.lm_head.weight.T).argmax(-1)[:-1])  # prediction for token t+1
            masks.append(ref.loss_mask[1:])
    top1, masks = torch.cat(top1), torch.cat(masks)
    predicted = top1[masks]

    rows = []
    for size in SIZES:
        ids = draft_vocabulary(train, target.fingerprint["vocab_size"], size)
        inside = torch.zeros(target.fingerprint["vocab_size"], dtype=torch.bool)
        inside[ids] = True
        config = DrafterConfig.from_target(target.model.config, data.wiring, size)
        drafter = Drafter(config, target.layout.embed, ids).eval()
        hidden = torch.randn(1, 1, config.hidden_size)
        token = torch.zeros(1, 1, dtype=torch.long)
        aux = torch.randn(1, 1, config.fc_in_features)
        with torch.inference_mode():
            head_ms = timed(lambda: drafter.logits(hidden))
            step_ms = timed(lambda: drafter.logits(drafter(drafter.embed(token), drafter.fuse(aux), torch.zeros(1, 1, dtype=torch.long))))
        rows.append({"draft_vocab": size, "coverage": float(inside[predicted].float().mean()), "head_ms": head_ms,
                     "step_ms": step_ms})
        print(f"N={size:6d}  coverage {rows[-1]['coverage']:.4f}  lm_head {head_ms:.3f} ms  draft step {step_ms:.3f} ms")
    result = {"train_samples": len(train), "held_out_positions": int(masks.sum()), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
