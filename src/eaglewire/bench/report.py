"""``eaglewire bench``: speculative decoding against its baselines, interleaved on the same prompts.

Systems, each run once per prompt in a rotating order so that machine noise
falls on all of them alike:
  hf-greedy          transformers ``generate``, greedy (the reference output)
  hf-prompt-lookup   transformers ``generate`` with prompt-lookup decoding
  eaglewire-none     the eaglewire engine without speculation
  eaglewire-chain    chain drafts of ``--chain-length``
  eaglewire-tree     an EAGLE-2 dynamic tree
  eaglewire-chain+lookup, eaglewire-tree+lookup
                     the same, drafting from the context where it repeated itself
                     (``--lookup-min``, ``context_lookup.py``); not run unless named
Every system is greedy, so every output must equal hf-greedy's token for token;
the report counts any that do not. The cost model measures, on this machine,
what verifying k tokens costs relative to one decode step and what a draft step
costs, and from those the ceiling on speedup for the chosen draft budget.

``--dtype fp32,bf16`` runs the eaglewire systems once per target product dtype
(``eaglewire-chain@bf16``; fp32 keeps the plain names). A bf16 target is another
model than HF's fp32 one: its reference is its own plain decoding
(``eaglewire-none@bf16``), which every bf16 output must equal; the cost model is
measured for each dtype, its decode step also relative to fp32's.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..dtypes import target_dtype
from ..engine.context_lookup import LookupShape
from ..engine.drafting import TreeShape
from ..engine.generation_metrics import GenerationMetrics
from ..engine.projection import cpu_features
from ..engine.speculative import Engine, GenerationConfig
from ..errors import ConfigError
from ..files import atomic_write_json
from .prompts import load_prompts

DEFAULT_SYSTEMS = ("hf-greedy", "hf-prompt-lookup", "eaglewire-none", "eaglewire-chain", "eaglewire-tree")
SYSTEMS = DEFAULT_SYSTEMS + ("eaglewire-chain+lookup", "eaglewire-tree+lookup")
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value
VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48)


@dataclass
class BenchConfig:
    dataset: str = "mtbench"
    limit: int | None = None
    max_new_tokens: int = 256
    out: Path | None = None
    target: str = "smollm2-135m"
    drafter: str | None = "shipped"
    chain_length: int = GenerationConfig.chain_length
    min_confidence: float = GenerationConfig.min_confidence
    tree: TreeShape = field(default_factory=TreeShape)
    lookup: LookupShape = field(default_factory=LookupShape)  # the +lookup systems' (--lookup-min, --lookup-drafts)
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    dtypes: tuple[str, ...] = ("fp32",)  # target product dtypes the eaglewire systems run at
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown:
            raise ConfigError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
        if self.max_new_tokens < 1 or (self.limit is not None and self.limit < 1):
            raise ConfigError("--max-new-tokens and --limit must be >= 1")
        if not self.dtypes or len(set(self.dtypes)) != len(self.dtypes):
            raise ConfigError(f"--dtype needs distinct dtypes, got {list(self.dtypes)}")
        for name in self.dtypes:
            target_dtype(name)  # an unknown name fails here, not after the target has loaded
        self.generation("chain")  # bad draft settings fail here, not after the target has loaded

    def generation(self, drafting: str) -> GenerationConfig:
        """``drafting``: a system's name after 'eaglewire-' (and its dtype): none, chain, tree, chain+lookup, ..."""
        strategy, _, lookup = drafting.partition("+")
        return GenerationConfig(max_new_tokens=self.max_new_tokens, strategy=strategy, chain_length=self.chain_length,
                                min_confidence=self.min_confidence, tree=self.tree,
                                lookup=self.lookup if lookup == "lookup" else None)


@dataclass
class Run:
    prompt_id: str
    tokens: list[int]
    seconds: float
    metrics: GenerationMetrics | None = None


def _hf(engine: Engine, ids: list[int], cfg: BenchConfig, lookup: bool) -> Run:
    extra = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS} if lookup else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = engine.target.model.generate(torch.tensor([ids]), max_new_tokens=cfg.max_new_tokens, do_sample=False,
                                           **extra)
    return Run("", out[0, len(ids):].tolist(), time.perf_counter() - start)


def _eaglewire(engine: Engine, ids: list[int], cfg: BenchConfig, strategy: str) -> Run:
    config = cfg.generation(strategy)
    start = time.perf_counter()
    finished = engine.complete_ids(ids, config)
    return Run("", finished.token_ids, time.perf_counter() - start, finished.metrics)


def _run_system(engines: dict[str, Engine], system: str, ids: list[int], cfg: BenchConfig) -> Run:
    if system.startswith("hf-"):
        return _hf(engines["fp32"], ids, cfg, lookup=system == "hf-prompt-lookup")
    name, _, dtype = system.partition("@")
    return _eaglewire(engines[dtype or "fp32"], ids, cfg, name.removeprefix("eaglewire-"))


def system_names(cfg: BenchConfig) -> tuple[str, ...]:
    """The runs per prompt: HF's once (fp32), each eaglewire system per dtype (``eaglewire-chain@bf16``)."""
    names = [s for s in cfg.systems if s.startswith("hf-")]
    for dtype in cfg.dtypes:
        names += [s if dtype == "fp32" else f"{s}@{dtype}" for s in cfg.systems if s.startswith("eaglewire-")]
    return tuple(names)


# ---- cost model ----------------------------------------------------------------------


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_costs(engine: Engine, context: int, tree: TreeShape, repeats: int = 7) -> dict:
    """Seconds of one decode step, and verify / draft costs relative to it, at ``context`` tokens."""
    lean, cache = engine.lean, engine.cache
    ids = torch.randint(0, lean.config.vocab_size, (1, context + max(VERIFY_SIZES)))
    lean(cache, ids[:, :context], torch.arange(context), logits_rows=slice(context - 1, context))

    def verify(k: int):
        positions = torch.arange(context, context + k)
        return lambda: lean(cache, ids[:, context: context + k], positions)

    step = median_time(verify(1), repeats)
    costs = {"context": context, "decode_step_s": step,
             "verify_relative": {k: 1.0 if k == 1 else median_time(verify(k), repeats) / step for k in VERIFY_SIZES}}
    if engine.runner is not None:
        runner, hidden = engine.runner, engine.target.hidden_size
        num_aux = engine.drafter.config.num_aux
        runner.extend(ids[0, 1: context + 1], torch.randn(context, num_aux * hidden), 0)
        root = torch.randn(hidden)
        costs["draft_step_relative"] = median_time(lambda: runner.chain(root, context - 1, 2), repeats) / 2 / step
        costs["tree_draft_relative"] = median_time(lambda: runner.tree(root, context - 1, tree), repeats) / step
    return costs


def verify_cost(costs: dict, n: int) -> float:
    """Decode steps a verify of ``n`` tokens costs: the smallest measured size that holds them."""
    relative = {int(k): v for k, v in costs["verify_relative"].items()}
    sizes = sorted(relative)
    return relative[min((s for s in sizes if s >= n), default=sizes[-1])]


def chain_step_cost(costs: dict, chain_length: int, attempted_at: list[int] | None = None, steps: int = 0) -> float:
    """Decode steps one chain step costs on average: verify(d + 1) + d draft steps for the d tokens it drafted.

    ``attempted_at`` and ``steps`` (a run's metrics) say how deep its steps drafted: a chain stopped by
    ``min_confidence`` drafts fewer than ``chain_length``, and costing it at full length would understate its
    speedup. Without them every step drafts the whole chain."""
    if not steps:
        counts = {chain_length: 1}
    else:
        deeper = list(attempted_at or []) + [0]  # deeper[d - 1]: steps that drafted d tokens or more
        counts = {d: (steps if d == 0 else deeper[d - 1]) - deeper[d] for d in range(len(deeper))}
    return sum(n * (verify_cost(costs, d + 1) + d * costs["draft_step_relative"])
               for d, n in counts.items()) / sum(counts.values())


def speedup_model(costs: dict, chain_length: int, tree: TreeShape, ran: dict[str, dict]) -> dict:
    """Speedup over plain decoding implied by the costs: the ceiling (every draft accepted, full shapes) and,
    for the shapes that ran (``ran``: system -> its report entry), the prediction at the measured tau with
    steps as deep as they drafted. One step costs verify(N+1) + the draft's own time."""
    out = {}
    if "draft_step_relative" in costs:
        chain_cost = chain_step_cost(costs, chain_length)
        tree_cost = verify_cost(costs, tree.total_tokens + 1) + costs["tree_draft_relative"]
        out["chain"] = {"step_cost": chain_cost, "ceiling": (chain_length + 1) / chain_cost}
        out["tree"] = {"step_cost": tree_cost, "ceiling": (tree.depth + 1) / tree_cost}
        chain = ran.get("eaglewire-chain")
        if chain is not None:
            as_run = chain_step_cost(costs, chain_length, chain["attempted_at"], chain["verify_steps"])
            out["chain"].update(step_cost_as_run=as_run, predicted=chain["tau"] / as_run)
        if "eaglewire-tree" in ran:
            out["tree"].update(step_cost_as_run=tree_cost, predicted=ran["eaglewire-tree"]["tau"] / tree_cost)
    return out


# ---- the run -------------------------------------------------------------------------


def run_bench(cfg: BenchConfig, engine: Engine | None = None) -> dict:
    prompts = load_prompts(cfg.dataset, cfg.limit)  # before the target loads: a bad --dataset fails at once
    needs_drafter = any(s in ("eaglewire-chain", "eaglewire-tree") for s in cfg.systems)
    engine = engine or Engine.load(cfg.target, cfg.drafter if needs_drafter else None)
    if engine.dtype != "fp32":
        raise ValueError("run_bench takes an fp32 engine (HF's reference is fp32); other dtypes come from cfg.dtypes")
    engines = {"fp32": engine, **{d: engine.with_dtype(d) for d in cfg.dtypes if d != "fp32"}}
    names = system_names(cfg)
    runs: dict[str, list[Run]] = {s: [] for s in names}
    lengths = []
    for index, prompt in enumerate(tqdm(prompts, desc="bench", disable=not cfg.progress, dynamic_ncols=True)):
        ids = engine.chat_prompt(prompt.text)
        lengths.append(len(ids))
        shift = index % len(names)
        for system in names[shift:] + names[:shift]:
            run = _run_system(engines, system, ids, cfg)
            run.prompt_id = prompt.id
            runs[system].append(run)
        if not cfg.progress:  # without the bar, a long run still shows that it is alive and how it goes
            print(_prompt_line(index, len(prompts), prompt.id, {s: r[-1] for s, r in runs.items()}),
                  file=sys.stderr, flush=True)
    report = _report(cfg, runs)
    context = int(statistics.median(lengths)) + cfg.max_new_tokens // 2
    by_dtype = {}
    for dtype in cfg.dtypes:
        suffix = "" if dtype == "fp32" else f"@{dtype}"
        ran = {s.removesuffix(suffix): r for s, r in report["systems"].items()
               if "tau" in r and s.endswith(suffix) and ("@" in s) == bool(suffix)}
        costs = measure_costs(engines[dtype], context, cfg.tree)
        by_dtype[dtype] = {**costs, "speedup": speedup_model(costs, cfg.chain_length, cfg.tree, ran)}
    first = cfg.dtypes[0]
    report["cost_model"] = {**by_dtype[first], "dtype": first}
    if len(cfg.dtypes) > 1:
        step = by_dtype[first]["decode_step_s"]
        report["cost_model"]["by_dtype"] = {d: {**c, f"decode_step_relative_to_{first}": c["decode_step_s"] / step}
                                            for d, c in by_dtype.items()}
    report["settings"] = {**asdict(cfg), "out": str(cfg.out) if cfg.out else None, "prompts": len(prompts),
                          "threads": torch.get_num_threads(), "cpu": cpu_features(),
                          "packed_weights": engine.lean.packed, "product_kernel": engine.lean.kernel,
                          "weight_formats": engine.lean.weight_formats, "target_dtypes": list(cfg.dtypes)}
    if cfg.out is not None:
        cfg.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cfg.out / "bench.json", report)
        from ..plots import plot_bench

        plot_bench(report, cfg.out / "bench.png")
    return report


def _prompt_line(index: int, total: int, prompt_id: str, latest: dict[str, Run]) -> str:
    """One prompt's figures: each system's tokens/s, and tau where it speculated."""
    parts = []
    for system, run in latest.items():
        tau = f" tau {run.metrics.tau:.2f}" if run.metrics is not None and run.metrics.drafted else ""
        parts.append(f"{system} {len(run.tokens) / run.seconds:.1f} tok/s{tau}")
    return f"bench prompt {index + 1}/{total} ({prompt_id}): " + ", ".join(parts)


def _report(cfg: BenchConfig, runs: dict[str, list[Run]]) -> dict:
    reference = runs.get("hf-greedy")
    systems = {}
    for system, rs in runs.items():
        tokens, seconds = sum(len(r.tokens) for r in rs), sum(r.seconds for r in rs)
        entry = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                 "median_tokens_per_s": statistics.median(len(r.tokens) / r.seconds for r in rs)}
        _, _, dtype = system.partition("@")
        if reference is not None and not dtype:  # HF's greedy is the fp32 model's reference only
            entry["outputs_differing_from_hf_greedy"] = [r.prompt_id for r, ref in zip(rs, reference)
                                                         if r.tokens != ref.tokens]
        plain = runs.get("eaglewire-none" + (f"@{dtype}" if dtype else ""))
        if plain is not None and system.startswith("eaglewire-"):  # the engine's own plain decoding at this dtype
            entry["outputs_differing_from_plain_decoding"] = [r.prompt_id for r, ref in zip(rs, plain)
                                                              if r.tokens != ref.tokens]
        if rs[0].metrics is not None:
            entry["target_dtype"] = rs[0].metrics.target_dtype
        if rs[0].metrics is not None:
            merged = rs[0].metrics
            for r in rs[1:]:
                merged = merged.merge(r.metrics)
            if merged.lookup_steps:  # the drafter's own tau, apart from the steps drafted from the context
                entry.update(drafter_tau=merged.drafter_tau, lookup_steps=merged.lookup_steps,
                             lookup_drafted=merged.lookup_drafted, lookup_accepted=merged.lookup_accepted)
            entry.update(tau=merged.tau, acceptance_at=merged.acceptance_at, acceptance_rate=merged.acceptance_rate,
                         attempted_at=merged.attempted_at, verify_steps=merged.verify_steps,
                         draft_s=merged.draft_s, verify_s=merged.verify_s, prefill_s=merged.prefill_s)
        systems[system] = entry
    for base in ("hf-greedy", "eaglewire-none"):
        if base not in runs:
            continue
        for system, rs in runs.items():
            # per-prompt time ratios, so a long answer does not outweigh the rest
            ratios = [b.seconds / len(b.tokens) / (r.seconds / len(r.tokens)) for r, b in zip(rs, runs[base])]
            systems[system][f"speedup_vs_{base}"] = systems[system]["tokens_per_s"] / systems[base]["tokens_per_s"]
            systems[system][f"median_speedup_vs_{base}"] = statistics.median(ratios)
    return {"systems": systems}


def format_report(report: dict) -> str:
    lines = [f"{'system':20s} {'tok/s':>7s} {'tau':>5s} {'vs HF':>6s} {'vs none':>7s}  acceptance per position"]
    for system, r in report["systems"].items():
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        per_position = " ".join(f"{a:.2f}" for a in r.get("acceptance_at", [])[:8])
        vs_hf = f"{r['median_speedup_vs_hf-greedy']:.2f}x" if "median_speedup_vs_hf-greedy" in r else "-"
        vs_none = f"{r['median_speedup_vs_eaglewire-none']:.2f}x" if "median_speedup_vs_eaglewire-none" in r else "-"
        lines.append(f"{system:20s} {r['tokens_per_s']:7.1f} {tau:>5s} {vs_hf:>6s} {vs_none:>7s}  {per_position}")
        if "lookup_steps" in r:
            lines.append(f"  {r['lookup_steps']} of {r['verify_steps']} steps drafted from the context "
                         f"({r['lookup_accepted']} of {r['lookup_drafted']} drafts kept); the drafter's own tau "
                         f"{r['drafter_tau']:.2f}, acceptance per position its own")
        if r.get("outputs_differing_from_hf_greedy"):
            lines.append(f"  WARNING: outputs differ from hf-greedy on prompts {r['outputs_differing_from_hf_greedy']}")
        if r.get("outputs_differing_from_plain_decoding"):
            lines.append(f"  WARNING: outputs differ from the same-dtype plain decoding on prompts "
                         f"{r['outputs_differing_from_plain_decoding']}")
    costs = report.get("cost_model")
    for dtype, c in (costs or {}).get("by_dtype", {}).items():
        rel, step_ms, first = c["verify_relative"], c["decode_step_s"] * 1000, costs["dtype"]
        verify = ", ".join(f"k={k}: {rel[k] * step_ms:.1f} ms" for k in (2, 5, 8, 16, 32) if k in rel)
        lines.append(f"target {dtype}: decode step {step_ms:.1f} ms ({c[f'decode_step_relative_to_{first}']:.2f} of "
                     f"{first}'s); verify {verify}")
    if costs:
        rel = costs["verify_relative"]
        lines.append(f"cost model at {costs['context']} tokens of context: decode step {costs['decode_step_s'] * 1000:.1f} ms; "
                     "verify k tokens / one step: " + ", ".join(f"k={k}: {v:.2f}" for k, v in rel.items()))
        if "draft_step_relative" in costs:
            lines.append(f"  draft step {costs['draft_step_relative']:.2f} of a decode step; whole tree draft "
                         f"{costs['tree_draft_relative']:.2f}")
        for name, s in costs.get("speedup", {}).items():
            line = f"  {name}: full step costs {s['step_cost']:.2f} decode steps; speedup ceiling {s['ceiling']:.2f}x"
            if "predicted" in s:
                line += (f"; its steps as run cost {s['step_cost_as_run']:.2f}, predicted at measured tau "
                         f"{s['predicted']:.2f}x")
            lines.append(line)
    return "\n".join(lines)
