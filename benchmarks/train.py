"""Training throughput and memory for the default drafter config, and where the time goes.

On the same samples, interleaved over rounds, it times per sample:
  target forward   the capture an --online run pays (decoder stack with hooks)
  teacher          the target's lm_head over `final` as training computes it (draft vocabulary rows only)
  teacher (full)   the same over the full vocabulary, as evaluation and earlier training did
  drafter step     TTT unroll + loss + backward for --ttt-steps steps
and reports tokens/s offline (teacher + drafter step, shards already on disk)
and online (all three), plus peak resident memory. Medians over rounds.

    python benchmarks/train.py --data sample-data --samples 6 --rounds 3
    python benchmarks/train.py --data sample-data --precision bf16 --out /tmp/bf16.json   # emulated bf16, where train refuses it
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from eaglewire.data.capture import capture
from eaglewire.data.samples import DatasetSamples, draft_vocabulary
from eaglewire.drafter.model import Drafter, DrafterConfig
from eaglewire.target import load_target
from eaglewire.train.loop import PRECISIONS, TTTModule, step_precision
from eaglewire.train.ttt import step_sums, step_weights, teacher_targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="an extracted dataset (e.g. from `make demo`: sample-data)")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--precision", choices=PRECISIONS, default="auto", help="as eaglewire train --precision")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/train.json"))
    args = parser.parse_args()

    target = load_target(args.target)
    data = DatasetSamples(Path(args.data))
    refs = data.refs[: args.samples]
    config = DrafterConfig.from_target(target.model.config, data.wiring, args.draft_vocab)
    drafter = Drafter(config, target.layout.embed, draft_vocabulary(data.refs, config.vocab_size, args.draft_vocab))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    # an explicit bf16 runs even where train refuses it, to measure what emulation costs
    precision = step_precision("auto", "cpu") if args.precision == "auto" else args.precision
    model = TTTModule(drafter, args.ttt_steps, precision)  # the module eaglewire train runs
    weights = step_weights(args.ttt_steps)
    tokens = sum(r.length for r in refs)

    rounds = {"target_forward_s": [], "teacher_s": [], "drafter_step_s": [], "teacher_full_vocab_s": []}
    for round_index in range(args.rounds):
        spent = dict.fromkeys(rounds, 0.0)
        for ref in refs:
            start = time.perf_counter()
            capture(target.layout, data.wiring.points, ref.input_ids[None])
            spent["target_forward_s"] += time.perf_counter() - start

            sample = data.load(ref)
            start = time.perf_counter()
            teacher_targets(sample.final, target.layout.lm_head.weight, drafter.t2d)
            spent["teacher_full_vocab_s"] += time.perf_counter() - start
            start = time.perf_counter()
            teacher = teacher_targets(sample.final, target.layout.lm_head.weight, drafter.t2d, full_vocab=False)
            spent["teacher_s"] += time.perf_counter() - start

            start = time.perf_counter()
            logits = model(sample.input_ids, sample.aux)
            losses, _, counts = step_sums(drafter, logits, sample.loss_mask, teacher)
            sum(w * l / max(c, 1.0) for w, l, c in zip(weights, losses, counts)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            spent["drafter_step_s"] += time.perf_counter() - start
        for key, value in spent.items():
            rounds[key].append(value)
        print(f"round {round_index + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in spent.items()) + f" for {tokens} tokens")

    median = {k: statistics.median(v) for k, v in rounds.items()}
    offline = tokens / (median["teacher_s"] + median["drafter_step_s"])
    offline_full_vocab_teacher = tokens / (median["teacher_full_vocab_s"] + median["drafter_step_s"])
    online = tokens / (median["target_forward_s"] + median["teacher_s"] + median["drafter_step_s"])
    shares = {k: median[k] for k in ("target_forward_s", "teacher_s", "drafter_step_s")}
    result = {
        "tokens_per_round": tokens,
        "samples": len(refs),
        "draft_vocab": args.draft_vocab,
        "ttt_steps": args.ttt_steps,
        "precision": precision,
        "rounds": rounds,
        "median": median,
        "offline_tokens_per_s": offline,
        "offline_tokens_per_s_full_vocab_teacher": offline_full_vocab_teacher,
        "online_tokens_per_s": online,
        "online_share": {k: v / sum(shares.values()) for k, v in shares.items()},
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
    }
    print(f"offline {offline:.0f} tok/s (with the full-vocabulary teacher: {offline_full_vocab_teacher:.0f}), "
          f"online {online:.0f} tok/s; online time split: "
          + ", ".join(f"{k} {v:.0%}" for k, v in result["online_share"].items())
          + f"; peak RSS {result['peak_rss_mib']:.0f} MiB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
