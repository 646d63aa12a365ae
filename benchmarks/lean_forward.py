"""Target forward over 1..K tokens after a prompt: HF vs the lean forward, shared, packed and rowwise.

Every round times, in a rotating order so machine noise hits all of them:
  hf{K}      HF forward of K tokens on a DynamicCache holding the prompt (then cropped back)
  shared{K}  lean forward of K tokens, F.linear on the HF weights (LeanModel packed=False)
  packed{K}  lean forward of K tokens, oneDNN-packed weights (projection.py; the default on CPUs with AVX-512)
  rowwise{K} lean forward of K tokens, the rowwise AVX2 kernel on fp32 weights (rowwise_kernel.py; timed where
             it compiles)
  codes{K}   the same kernel reading the matrices as exact block codes where the target has them (block_codes.py;
             the default on AVX2 CPUs; the same logits bit for bit as rowwise)
K = 1 is a decode step; K > 1 a chain verify step. Logits for all K rows are computed,
and checked against HF's before timing. Medians are reported, and each K's cost
relative to one decode step of the same variant.

    python benchmarks/lean_forward.py --rounds 30 --threads 1

Pass --threads 1 while another process keeps the cores busy: with more threads than
free cores, OpenMP's spinning threads make every op tens of times slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

from eaglewire.engine import rowwise_kernel
from eaglewire.engine.lean import LeanModel
from eaglewire.engine.projection import cpu_features
from eaglewire.target import load_target

PROMPT = "Explain in two sentences why a smaller model can speed up a larger one without changing its output."


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sizes", default="1,2,3,5,8,16", help="token counts to time (1 = a decode step)")
    parser.add_argument("--hf-sizes", default="1,5", help="token counts to time through HF too")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lean_forward.json"))
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = [int(k) for k in args.sizes.split(",")]
    hf_sizes = [int(k) for k in args.hf_sizes.split(",")]

    target = load_target(args.target)
    model, tokenizer = target.model, target.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, return_tensors="pt").input_ids
    plen = prompt.shape[1]
    max_len = plen + max(sizes + hf_sizes) + 1
    leans = {"shared": LeanModel.from_hf(model, max_len, packed=False),
             "packed": LeanModel.from_hf(model, max_len, packed=True, rowwise=False)}
    if rowwise_kernel.available():
        leans["rowwise"] = LeanModel.from_hf(model, max_len, packed=True, rowwise=True, exact_codes=False)
        leans["codes"] = LeanModel.from_hf(model, max_len, packed=True, rowwise=True)
        print("codes: matrices read as", leans["codes"].weight_formats)
    ids = torch.cat([prompt, prompt.flip(1)], 1)[:, plen: plen + max(sizes + hf_sizes)]  # any tokens will do

    with torch.inference_mode():
        hf_cache = DynamicCache(config=model.config)
        model(prompt, cache=hf_cache, use_cache=True)
        caches = {}
        for name, lean in leans.items():
            caches[name] = lean.new_cache()
            lean.forward(caches[name], prompt, torch.arange(plen), logits_rows=slice(-1, None))

        def hf(k: int):
            def run():
                out = model(ids[:, :k], cache=hf_cache, use_cache=True).logits
                hf_cache.crop(-k)  # transformers 5: a negative count removes that many tokens
                return out
            return run

        def lean_run(name: str, k: int):
            positions = torch.arange(plen, plen + k)
            return lambda: leans[name].forward(caches[name], ids[:, :k], positions)[0]

        tokens = {f"hf{k}": k for k in hf_sizes} | {f"{name}{k}": k for name in leans for k in sizes}
        variants = {name: hf(k) if name.startswith("hf") else lean_run(name.removesuffix(str(k)), k)
                    for name, k in tokens.items()}
        reference = model(torch.cat([prompt, ids], 1)).logits[:, plen:]
        max_diff = {name: float((fn() - reference[:, : tokens[name]]).abs().max()) for name, fn in variants.items()}
        print("max |logits - HF full forward|:", {name: f"{d:.1e}" for name, d in max_diff.items()})
        identical = {k: bool(torch.equal(variants[f"codes{k}"](), variants[f"rowwise{k}"]())) for k in sizes
                     if "codes" in leans}
        print("codes logits bit for bit those of rowwise:", identical)

        names = list(variants)
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(args.warmup + args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                ms = timed(variants[name])
                if round_index >= args.warmup:
                    times[name].append(ms)
        assert hf_cache.get_seq_length() == plen, "every HF variant must crop its cache back to the prompt"

    medians = {name: statistics.median(values) for name, values in times.items()}
    relative = {name: {k: medians[f"{name}{k}"] / medians[f"{name}1"] for k in sizes} for name in leans}
    result = {
        "target": args.target,
        "prompt_tokens": plen,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "max_abs_logit_diff_vs_hf": max_diff,
        "median_ms": medians,
        "p10_p90_ms": {name: statistics.quantiles(values, n=10)[::8] for name, values in times.items()},
        "cost_relative_to_own_step": relative,
        "packed_speedup": {k: medians[f"shared{k}"] / medians[f"packed{k}"] for k in sizes},
        "cpu": cpu_features(),
    }
    if "rowwise" in leans:
        result["rowwise_speedup_over_packed"] = {k: medians[f"packed{k}"] / medians[f"rowwise{k}"] for k in sizes}
        result["codes_speedup_over_rowwise"] = {k: medians[f"rowwise{k}"] / medians[f"codes{k}"] for k in sizes}
        result["codes_weight_formats"] = leans["codes"].weight_formats
        result["codes_logits_identical_to_rowwise"] = identical
    print(f"{'tokens':>6} {'hf ms':>16} " + " ".join(f"{name + ' ms (rel)':>16}" for name in leans))
    for k in sizes:
        hf_ms = f"{medians[f'hf{k}']:.1f}" if k in hf_sizes else "-"
        print(f"{k:>6} {hf_ms:>16} " + " ".join(f"{medians[f'{n}{k}']:>9.1f} ({relative[n][k]:.2f})" for n in leans))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
