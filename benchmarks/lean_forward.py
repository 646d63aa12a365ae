"""One decode step of the target: HF with its DynamicCache vs the lean forward, interleaved.

Every round times, in a rotating order so machine noise hits all of them:
  hf_step          HF forward of 1 token on a DynamicCache holding the prompt (then cropped back)
  lean_step        lean forward of 1 token at the slot after the prompt, full-vocabulary logits
  lean_step_hidden the same without the lm_head (final hidden only)
  hf_verify{K}     HF forward of K tokens after the prompt (a chain verify step)
  lean_verify{K}   lean forward of K tokens after the prompt, logits for all K rows
Medians are reported; the step's logits are checked against HF's before timing.

    python benchmarks/lean_forward.py --rounds 40 --threads 1

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

from eaglewire.lean import LeanModel
from eaglewire.target import load_target

PROMPT = "Explain in two sentences why a smaller model can speed up a larger one without changing its output."


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--verify-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lean_forward.json"))
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    target = load_target(args.target)
    model, tokenizer = target.model, target.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, return_tensors="pt").input_ids
    plen, k = prompt.shape[1], args.verify_tokens
    lean = LeanModel.from_hf(model, max_len=plen + k + 1)
    step_ids = prompt[:, -1:]  # any token will do; this one keeps the logits meaningful
    verify_ids = prompt[:, -k:]
    step_pos, verify_pos = torch.tensor([plen]), torch.arange(plen, plen + k)

    with torch.inference_mode():
        hf_cache = DynamicCache(config=model.config)
        model(prompt, cache=hf_cache, use_cache=True)
        cache = lean.new_cache()
        lean.forward(cache, prompt, torch.arange(plen), logits_rows=slice(-1, None))

        def hf_step():
            out = model(step_ids, cache=hf_cache, use_cache=True).logits
            hf_cache.crop(-1)  # transformers 5: a negative count removes that many tokens
            return out

        def hf_verify():
            out = model(verify_ids, cache=hf_cache, use_cache=True).logits
            hf_cache.crop(-k)
            return out

        variants = {
            "hf_step": hf_step,
            "lean_step": lambda: lean.forward(cache, step_ids, step_pos)[0],
            "lean_step_hidden": lambda: lean.forward(cache, step_ids, step_pos, logits_rows=None)[0],
            f"hf_verify{k}": hf_verify,
            f"lean_verify{k}": lambda: lean.forward(cache, verify_ids, verify_pos)[0],
        }
        step_diff = float((variants["lean_step"]() - hf_step()).abs().max())
        verify_diff = float((variants[f"lean_verify{k}"]() - hf_verify()).abs().max())
        print(f"max |lean - HF| logits: step {step_diff:.2e}, verify{k} {verify_diff:.2e}")

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
    result = {
        "target": args.target,
        "prompt_tokens": plen,
        "verify_tokens": k,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "max_abs_logit_diff": {"step": step_diff, f"verify{k}": verify_diff},
        "median_ms": medians,
        "p10_p90_ms": {name: statistics.quantiles(values, n=10)[::8] for name, values in times.items()},
        "speedup_step": medians["hf_step"] / medians["lean_step"],
        "speedup_verify": medians[f"hf_verify{k}"] / medians[f"lean_verify{k}"],
        "lm_head_ms_in_lean_step": medians["lean_step"] - medians["lean_step_hidden"],
        "lean_verify_over_step": medians[f"lean_verify{k}"] / medians["lean_step"],
    }
    for name, ms in medians.items():
        print(f"{name:>18}: {ms:7.2f} ms")
    print(f"speedup step {result['speedup_step']:.2f}x, verify{k} {result['speedup_verify']:.2f}x; "
          f"lean verify{k}/step {result['lean_verify_over_step']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
