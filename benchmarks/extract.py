"""Extraction throughput against a bare HF forward over the same batches, interleaved in one run.

Each round times (a) the target's decoder stack alone on every sample, one
sample per forward exactly as extraction batches them, and (b) a complete
`eaglewire extract` of the same samples into a fresh folder: reading,
templating, capture, bf16 conversion, shard writing, hashing and manifest.
Rounds alternate so machine noise hits both; medians are reported.

    python benchmarks/extract.py --samples 16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eaglewire.chat import tokenize_conversation
from eaglewire.conversations import iter_records, open_source
from eaglewire.extract import ExtractConfig, run_extract
from eaglewire.target import chat_template_of, load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--data", default="sharegpt")
    parser.add_argument("--samples", type=int, default=16, help="conversations per round")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/extract.json"))
    args = parser.parse_args()

    target = load_target(args.target)
    template = chat_template_of(target.tokenizer)
    batches = []
    for record in iter_records(open_source(args.data)):
        if record.index >= args.samples:
            break
        if record.messages is not None:
            tokens = tokenize_conversation(target.tokenizer, template, record.messages, args.max_length)
            if tokens.loss_mask.any():
                batches.append(tokens.input_ids[None])
    tokens_per_round = sum(b.shape[1] for b in batches)

    bare, extract, bytes_per_token = [], [], None
    for round_index in range(args.rounds):
        start = time.perf_counter()
        with torch.inference_mode():
            for ids in batches:
                target.layout.base(input_ids=ids, use_cache=False)
        bare.append(tokens_per_round / (time.perf_counter() - start))

        with tempfile.TemporaryDirectory() as tmp:
            cfg = ExtractConfig(data=args.data, out=Path(tmp) / "d", target=args.target, max_samples=args.samples,
                                max_length=args.max_length, progress=False)
            start = time.perf_counter()
            manifest = run_extract(cfg, target=target)
            seconds = time.perf_counter() - start
        assert manifest.totals["tokens"] == tokens_per_round, "extraction and bare loop must see the same tokens"
        extract.append(tokens_per_round / seconds)
        bytes_per_token = manifest.totals["bytes"] / manifest.totals["tokens"]
        print(f"round {round_index + 1}: bare forward {bare[-1]:.0f} tok/s, extract {extract[-1]:.0f} tok/s")

    result = {
        "target": args.target,
        "samples": len(batches),
        "tokens_per_round": tokens_per_round,
        "rounds": args.rounds,
        "bare_forward_tok_s": bare,
        "extract_tok_s": extract,
        "median_bare_forward_tok_s": statistics.median(bare),
        "median_extract_tok_s": statistics.median(extract),
        "extract_over_bare": statistics.median(e / b for e, b in zip(extract, bare)),
        "bytes_per_token": bytes_per_token,
        "threads": torch.get_num_threads(),
    }
    print(f"median: bare {result['median_bare_forward_tok_s']:.0f} tok/s, extract {result['median_extract_tok_s']:.0f} tok/s, "
          f"ratio {result['extract_over_bare']:.3f} (target >= 0.85); {bytes_per_token:.0f} bytes/token on disk")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
