"""Extraction throughput against a bare HF forward over the same batches, interleaved in one run.

Each round times (a) the target's decoder stack alone on every sample, one
sample per forward exactly as extraction batches them, and (b) a complete
`eaglewire extract` of the same samples into a fresh folder: reading,
templating, capture, bf16 conversion, shard writing, hashing and manifest.
Rounds alternate so machine noise hits both; medians are reported.

    python benchmarks/extract.py --samples 16 --rounds 3
    python benchmarks/extract.py --random qwen3_moe --out benchmarks/results/extract_qwen3_moe.json
    python benchmarks/extract.py --random llava --out benchmarks/results/extract_llava.json

``--random`` measures a randomly initialised model of that family or wrapper (SmolLM2's width and
tokenizer, 8 layers; MoE: 8 experts, top 2): what the capture costs on that layout, not a real
model's speed. For a wrapper the bare forward is its inner language model, which extraction runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eaglewire.data.chat import tokenize_conversation
from eaglewire.data.conversations import iter_records, open_source
from eaglewire.data.extract import ExtractConfig, run_extract
from eaglewire.target import chat_template_of, load_target

_TEXT = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 9,
         "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 2048}
RANDOM_CONFIGS = {
    "qwen3_moe": {**_TEXT, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 384},
    "deepseek_v3": {**_TEXT, "num_key_value_heads": 9, "n_routed_experts": 8, "num_experts_per_tok": 2,
                    "n_shared_experts": 1, "moe_intermediate_size": 384, "first_k_dense_replace": 1, "n_group": 1,
                    "topk_group": 1, "kv_lora_rank": 128, "q_lora_rank": 256, "qk_rope_head_dim": 32,
                    "qk_nope_head_dim": 32, "v_head_dim": 64},
    "llava": {"text_config": {"model_type": "llama", **_TEXT},
              "vision_config": {"model_type": "clip_vision_model", "image_size": 28, "patch_size": 14,
                                "projection_dim": 32, "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 1, "num_attention_heads": 2},
              "image_token_index": 49151},
}


def random_target(kind: str, out: Path) -> Path:
    """A random ``kind`` model saved with SmolLM2's tokenizer (its chat template included)."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )

    from eaglewire.target import WRAPPERS, smollm2_gguf_path

    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, **RANDOM_CONFIGS[kind])
    auto = AutoModelForImageTextToText if kind in WRAPPERS else AutoModelForCausalLM
    auto.from_config(config).save_pretrained(out)
    gguf = smollm2_gguf_path()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--data", default="sharegpt")
    parser.add_argument("--samples", type=int, default=16, help="conversations per round")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--random", choices=sorted(RANDOM_CONFIGS), help="a random model of this family instead")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/extract.json"))
    args = parser.parse_args()

    if args.random is not None:
        args.target = str(random_target(args.random, Path(tempfile.mkdtemp(prefix=f"random-{args.random}-"))))
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
        "target": f"random {args.random}" if args.random else args.target,
        "config": RANDOM_CONFIGS[args.random] if args.random else None,
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
