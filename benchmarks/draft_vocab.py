"""How big should the draft vocabulary be, and chosen on what? Coverage against draft cost.

A drafter can only propose tokens in its vocabulary, so the share of the target's
tokens that fall inside it is an upper bound on its per-position acceptance. The
price is the drafter's lm_head, paid at every draft step. For each size N this prints:
  coverage   share of the measured tokens inside the N most trained-on tokens
  head_ms    one drafter lm_head over a single position (the decode-time cost per draft token)
  step_ms    a whole single-position draft step (fc + midlayer + norm + lm_head)
The vocabulary is built from the training split only (as `eaglewire train` does), from an
extracted dataset (--data) or from conversation files (--conversations, repeatable).

What is measured: by default the target's top-1 next token at --data's held-out assistant
positions; with --mtbench, the target's own greedy answers to the 80 MT-bench questions
(--max-new-tokens each), the tokens a drafter must propose when it is benchmarked.
--drafter adds a row for that drafter's own vocabulary (e.g. one chosen on other text).

    python benchmarks/draft_vocab.py --data DATASET
    python benchmarks/draft_vocab.py --mtbench --conversations A.jsonl --conversations B.jsonl \
        --drafter src/eaglewire/drafters/smollm2-135m --out benchmarks/results/draft_vocab_mtbench.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eaglewire.bench.prompts import load_prompts
from eaglewire.bench.report import BenchConfig, median_time
from eaglewire.data.samples import DatasetSamples, OnlineSamples, draft_vocabulary
from eaglewire.drafter.checkpoint import load_checkpoint
from eaglewire.drafter.model import Drafter, DrafterConfig, draft_ids_of
from eaglewire.engine.speculative import Engine
from eaglewire.target import Target, load_target
from eaglewire.wiring import Wiring

SIZES = (2048, 4096, 8192, 16384, 32768)


def timed(fn, repeats: int = 50) -> float:
    return median_time(fn, repeats, warmup=5) * 1e3


def held_out_top1(target: Target, data: DatasetSamples, eval_samples: int) -> torch.Tensor:
    """The target's top-1 next token at the held-out records' assistant positions."""
    top1 = []
    with torch.no_grad():
        for ref in [r for r in data.refs if r.held_out][:eval_samples]:
            final = data.load(ref).final
            predicted = (final @ target.layout.lm_head.weight.T).argmax(-1)[:-1]  # prediction for token t+1
            top1.append(predicted[ref.loss_mask[1:]])
    return torch.cat(top1)


def mtbench_answers(engine: Engine, max_new_tokens: int) -> torch.Tensor:
    """Every token of the target's greedy answers to the MT-bench questions, in order."""
    config = BenchConfig(dataset="mtbench", max_new_tokens=max_new_tokens).generation("none")
    tokens = []
    for prompt in load_prompts("mtbench"):
        tokens += engine.complete_ids(engine.chat_prompt(prompt.text), config).token_ids
    return torch.tensor(tokens)


def cost_ms(config: DrafterConfig, target: Target, ids: torch.Tensor) -> tuple[float, float]:
    drafter = Drafter(config, target.layout.embed, ids).eval()
    hidden = torch.randn(1, 1, config.hidden_size)
    token = torch.zeros(1, 1, dtype=torch.long)
    aux = torch.randn(1, 1, config.fc_in_features)
    with torch.inference_mode():
        head_ms = timed(lambda: drafter.logits(hidden))
        step_ms = timed(lambda: drafter.logits(drafter(drafter.embed(token), drafter.fuse(aux),
                                                       torch.zeros(1, 1, dtype=torch.long))))
    return head_ms, step_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="an extracted dataset: its training split builds the vocabularies")
    parser.add_argument("--conversations", action="append", default=[], metavar="FILE",
                        help="a conversation file (.jsonl, e.g. `eaglewire regenerate`'s) whose training split builds "
                             "the vocabularies instead; repeat it for several")
    parser.add_argument("--mtbench", action="store_true",
                        help="measure coverage of the target's greedy MT-bench answers (otherwise: --data's held-out "
                             "top-1 tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="--mtbench: tokens per answer")
    parser.add_argument("--drafter", type=Path, help="also measure this drafter checkpoint's own vocabulary")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="draft vocabulary sizes, comma-separated")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_vocab.json"))
    args = parser.parse_args()
    if bool(args.data) == bool(args.conversations):
        parser.error("give the vocabularies' source: --data DATASET or --conversations FILE (repeatable), one of them")
    if not args.mtbench and not args.data:
        parser.error("without --mtbench, coverage is measured on --data's held-out records: pass --data or --mtbench")

    engine = Engine.load(args.target, None) if args.mtbench else None
    target = engine.target if engine is not None else load_target(args.target)
    vocab_size = target.fingerprint["vocab_size"]
    wiring = Wiring.resolve(None, target.num_layers)
    if args.data:
        data = DatasetSamples(Path(args.data))
        wiring, refs = data.wiring, data.refs
        source = {"data": args.data}
    else:
        refs = [r for path in args.conversations for r in OnlineSamples(target, wiring, path, None, 2048).refs]
        source = {"conversations": args.conversations}
    train = [r for r in refs if not r.held_out]
    measured = mtbench_answers(engine, args.max_new_tokens) if args.mtbench else held_out_top1(target, data, args.eval_samples)
    print(f"{len(measured)} tokens measured ({'MT-bench answers' if args.mtbench else 'held-out top-1'}), "
          f"vocabularies from {len(train)} training samples", flush=True)

    def coverage(ids: torch.Tensor) -> float:
        inside = torch.zeros(vocab_size, dtype=torch.bool)
        inside[ids] = True
        return float(inside[measured].float().mean())

    rows = []
    if args.drafter is not None:
        own = draft_ids_of(load_checkpoint(args.drafter, target.layout.embed).drafter.d2t)
        rows.append({"vocabulary": f"{args.drafter}'s own", "draft_vocab": len(own), "coverage": coverage(own)})
        print(f"{rows[-1]['vocabulary']} (N={len(own)}): coverage {rows[-1]['coverage']:.4f}")
    for size in map(int, args.sizes.split(",")):
        ids = draft_vocabulary(train, vocab_size, size)
        head_ms, step_ms = cost_ms(DrafterConfig.from_target(target.model.config, wiring, size), target, ids)
        rows.append({"vocabulary": "most trained on", "draft_vocab": size, "coverage": coverage(ids),
                     "head_ms": head_ms, "step_ms": step_ms})
        print(f"N={size:6d}  coverage {rows[-1]['coverage']:.4f}  lm_head {head_ms:.3f} ms  draft step {step_ms:.3f} ms")
    result = {**source, "measured": "mtbench answers" if args.mtbench else "held-out top-1",
              "measured_tokens": len(measured), "train_samples": len(train), "threads": torch.get_num_threads(),
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
