"""The row-wise steps of ``regenerate``'s model: torch ops against ``row_attention.cpp``.

``regenerate`` decodes many conversations together with oneDNN's packed matrices (``batched_lm_head``).
Between the matrices, a batch's decode rows each attend in their own SDPA call per layer (so that a row's
bits do not depend on its neighbours), plus torch's RMSNorm and RoPE; the rowwise kernel's row steps do the
same work per row in one call per layer. This times both on the same prompts, in one process: each round
prefills ``--prompts`` conversations from ``--data`` (the target's own multi-turn answers, a context of
``--min-tokens``-``--max-tokens`` tokens each) in one forward, then decodes ``--steps`` greedy steps of all of
them together; the modes alternate order by round, and the report gives each mode's median decode step and
prefill, and whether both modes gave the same greedy tokens.

    OMP_NUM_THREADS=1 python benchmarks/regenerate_rows.py --data answers3_a.jsonl   # ~10 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eaglewire.engine.batching import Batch
from eaglewire.engine.lean import LeanModel
from eaglewire.engine.sampling import SamplingParams
from eaglewire.engine.speculative import Engine, Finished, GenerationConfig
from eaglewire.target import load_target

MODES = ("torch_ops", "row_kernels")


def long_prompts(engine: Engine, data: Path, count: int, low: int, high: int) -> list[list[int]]:
    """Prompts for each record's last answer, whose context is ``low``-``high`` tokens."""
    prompts = []
    with data.open() as handle:
        for line in handle:
            messages = json.loads(line)["messages"]
            ids = engine.chat_prompt(messages[:-1])
            if low <= len(ids) <= high:
                prompts.append(ids)
            if len(prompts) == count:
                return prompts
    raise SystemExit(f"{data} has only {len(prompts)} prompts of {low}-{high} tokens; {count} asked")


def one_round(engine: Engine, prompts: list[list[int]], steps: int) -> dict:
    """Prefill all prompts in one step, then time each of ``steps`` decode steps of all of them together."""
    batch = Batch(engine, len(prompts), draft_up_to=None)
    config = GenerationConfig(max_new_tokens=steps + 1, sampling=SamplingParams(0.0), strategy="none")
    for key, ids in enumerate(prompts):
        batch.add(key, ids, config)
    start = time.perf_counter()
    batch.step()
    prefill = time.perf_counter() - start
    decode, texts = [], {}
    while batch.running:
        start = time.perf_counter()
        events = batch.step()
        decode.append(time.perf_counter() - start)
        texts.update({key: event.text for key, event in events if isinstance(event, Finished)})
    return {"prefill_s": prefill, "decode_step_s": statistics.median(decode), "texts": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="a regenerated .jsonl (e.g. third-turn answers)")
    parser.add_argument("--prompts", type=int, default=32, help="conversations decoded together (regenerate's --batch)")
    parser.add_argument("--min-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=900)
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating order")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/regenerate_rows.json"))
    args = parser.parse_args()

    target = load_target("smollm2-135m")
    engine = Engine(target, None, None, args.max_len, batched_lm_head=True)  # as run_regenerate builds it
    if not engine.lean.row_kernels:
        raise SystemExit("regenerate's model runs no row kernels on this CPU (they need x86 with AVX2 where "
                         "rowwise_kernel.py compiles): there is nothing to compare")
    # the engine's own model against the same one with its row steps as torch ops
    models = {"torch_ops": LeanModel.from_hf(target.model, args.max_len, batched_lm_head=True, row_kernels=False),
              "row_kernels": engine.lean}
    prompts = long_prompts(engine, args.data, args.prompts, args.min_tokens, args.max_tokens)
    rounds = {mode: [] for mode in MODES}
    with torch.inference_mode():
        for r in range(args.rounds):
            for mode in (list(MODES) if r % 2 == 0 else list(reversed(MODES))):
                engine.lean = models[mode]  # the same engine and caches, only the forward differs
                rounds[mode].append(one_round(engine, prompts, args.steps))
                print(f"round {r} {mode}: prefill {rounds[mode][-1]['prefill_s']:.1f} s, median decode step "
                      f"{rounds[mode][-1]['decode_step_s'] * 1000:.1f} ms", flush=True)
    texts = {mode: rounds[mode][-1]["texts"] for mode in MODES}
    same = sum(texts["torch_ops"][k] == texts["row_kernels"][k] for k in texts["torch_ops"])
    result = {
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "threads": torch.get_num_threads(), "cpu": torch.backends.cpu.get_cpu_capability()},
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        **{mode: {"decode_step_ms_median": 1000 * statistics.median(x["decode_step_s"] for x in rounds[mode]),
                  "prefill_s_median": statistics.median(x["prefill_s"] for x in rounds[mode]),
                  "rounds": [{k: v for k, v in x.items() if k != "texts"} for x in rounds[mode]]} for mode in MODES},
        "same_greedy_answers": f"{same} of {len(texts['torch_ops'])}",
    }
    result["decode_speedup"] = result["torch_ops"]["decode_step_ms_median"] / result["row_kernels"]["decode_step_ms_median"]
    print(f"decode step: torch ops {result['torch_ops']['decode_step_ms_median']:.1f} ms, row kernels "
          f"{result['row_kernels']['decode_step_ms_median']:.1f} ms ({result['decode_speedup']:.2f}x); same greedy "
          f"answers: {result['same_greedy_answers']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
