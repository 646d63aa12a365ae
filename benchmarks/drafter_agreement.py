"""Does a drafter agree with the target on MT-bench as it does on its own held-out records?

Training reports teacher-forced top-1 agreement per draft position on held-out records of its own
data, and the engine reports what it accepts on MT-bench. This measures the first on the target's own
greedy answers to the MT-bench questions, the tokens the engine is benchmarked on, so a gap between the
two splits in two:

  agreement   per draft position k, the share of answer positions where the k-th draft (unrolled on the
              true tokens, as training evaluates it) equals the target's greedy token: training's metric
  conditional the same share among positions whose drafts 1..k-1 all matched: what a chain accepts at
              position k
  chain_tau   the doctor's walk of a greedy chain server over each answer (--chain-length drafts a step,
              ending after a draft less probable than --min-confidence, as the engine's chain does): the
              τ the engine measures on these answers when it feeds the drafter what training did

Agreement here as low as on held-out records is high says the drafter meets text unlike its training
data; chain_tau apart from the engine's measured τ says the engine feeds the drafter something else.

    python benchmarks/drafter_agreement.py --drafter shipped=src/eaglewire/drafters/smollm2-135m \\
        --out benchmarks/results/drafter_agreement/NAME.json      # the engine's default chain, 80 questions

The ledger bench's chain is --chain-length 4 --min-confidence 0 (row22.json and the row24 files in that
folder were measured so); --limit 20 takes the ledger's questions.

The answers are generated once (plain greedy decoding, --max-new-tokens each; with --limit, only those
questions') and kept in --answers (default runs/mtbench_greedy_answers.json), for this target and length.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from eaglewire.bench.prompts import load_prompts
from eaglewire.bench.report import BenchConfig
from eaglewire.data.capture import capture
from eaglewire.doctor.evidence import chain_hits, served_steps
from eaglewire.doctor.state import LiveSample
from eaglewire.drafter.checkpoint import load_checkpoint
from eaglewire.engine.speculative import Engine, GenerationConfig
from eaglewire.errors import ConfigError
from eaglewire.target import DEFAULT_TARGET
from eaglewire.train.ttt import teacher_targets

BUCKET_TOKENS, BUCKETS = 64, 4  # first-draft agreement by answer offset: 0-63, 64-127, ..., the last open-ended


def greedy_answers(engine: Engine, bench: BenchConfig, path: Path) -> list[dict]:
    """The target's plain greedy answers to the first ``bench.limit`` MT-bench questions (all when None).
    Answers ``path`` holds for this target, length and question set are reused; the rest are generated and added."""
    prompts = load_prompts(bench.dataset)
    questions = hashlib.sha256(json.dumps([[p.id, p.text] for p in prompts]).encode()).hexdigest()
    identity = {"target": engine.target.fingerprint, "max_new_tokens": bench.max_new_tokens, "questions": questions}
    kept: dict[str, dict] = {}
    if path.exists():
        cached = json.loads(path.read_text())
        if {k: cached.get(k) for k in identity} == identity:
            kept = {str(answer["id"]): answer for answer in cached["answers"]}
        else:
            print(f"{path} holds answers of another target, length or question set: generating them again")
    wanted = prompts[: bench.limit]
    missing = [prompt for prompt in wanted if str(prompt.id) not in kept]
    if missing:
        config = bench.generation("none")
        for prompt in tqdm(missing, desc="answers", dynamic_ncols=True):
            ids = engine.chat_prompt(prompt.text)
            kept[str(prompt.id)] = {"id": prompt.id, "category": prompt.category, "prompt": ids,
                                    "answer": engine.complete_ids(ids, config).token_ids}
        path.parent.mkdir(parents=True, exist_ok=True)
        # Kept in question order, so a later run without --limit finds the first ones already there.
        ordered = [kept[str(prompt.id)] for prompt in prompts if str(prompt.id) in kept]
        path.write_text(json.dumps({**identity, "answers": ordered}))
    return [kept[str(prompt.id)] for prompt in wanted]


@torch.no_grad()
def live_sample(engine: Engine, drafter, wiring, record: dict) -> tuple[LiveSample, torch.Tensor]:
    """One answer as the doctor's live checks hold it, and step 1's hidden input (fc over the aux states)."""
    ids = torch.tensor(record["prompt"] + record["answer"])
    captured = {p: t[0] for p, t in capture(engine.target.layout, wiring.points, ids[None]).items()}
    top1 = teacher_targets(captured[wiring.teacher], engine.target.layout.lm_head.weight, drafter.t2d).top1
    fused = drafter.fuse(torch.cat([captured[p] for p in wiring.aux], dim=-1)[:-1])
    return LiveSample(ids, len(record["prompt"]), captured, top1), fused


def measure(engine: Engine, folder: Path, answers: list[dict], steps: int, chain_length: int,
            min_confidence: float, max_new_tokens: int) -> dict:
    checkpoint = load_checkpoint(folder, engine.target.layout.embed)
    drafter = checkpoint.drafter.float().eval()
    matched, reached, chained, count = (torch.zeros(steps) for _ in range(4))
    walks = []
    by_offset = torch.zeros(2, BUCKETS)  # first drafts matched / made, by where in the answer they land
    by_category: dict[str, list] = {}
    for record in tqdm(answers, desc=folder.name, dynamic_ncols=True):
        sample, fused = live_sample(engine, drafter, checkpoint.meta.wiring, record)
        with torch.no_grad():
            hits = chain_hits(drafter, fused, sample, steps)  # [T-1, steps], every draft made
            served = chain_hits(drafter, fused, sample, chain_length, min_confidence)
        # rows whose first draft is an answer token after the prefill's; draft k is inside the answer there
        rows = torch.arange(sample.prompt_len - 1, hits.shape[0])
        valid = torch.stack([rows <= hits.shape[0] - 1 - k for k in range(1, steps + 1)], dim=1)
        hits = hits[rows]
        prefix = hits.int().cumprod(1).bool()  # drafts 1..k all matched
        matched += (hits & valid).sum(0)
        count += valid.sum(0)
        reached += torch.cat([valid[:, :1], prefix[:, :-1] & valid[:, 1:]], dim=1).sum(0)  # drafts 1..k-1 matched
        chained += (prefix & valid).sum(0)
        walk, _ = served_steps(served, sample.ids, sample.prompt_len, max_new_tokens)
        walks.append(walk)
        bucket = (torch.arange(len(rows)) + 1).div(BUCKET_TOKENS, rounding_mode="floor").clamp(max=BUCKETS - 1)
        by_offset[0].index_add_(0, bucket, (hits[:, 0] & valid[:, 0]).float())
        by_offset[1].index_add_(0, bucket, valid[:, 0].float())
        by_category.setdefault(record["category"], []).append((hits[:, 0][valid[:, 0]], walk))
    accepted = torch.cat(walks)
    categories = {}
    for name, parts in sorted(by_category.items()):
        first = torch.cat([p[0] for p in parts])
        categories[name] = {"first_agreement": float(first.float().mean()),
                            "chain_tau": 1 + float(torch.cat([p[1] for p in parts]).mean())}
    return {"drafter": str(folder), "answers": len(answers), "positions": int(count[0]),
            "agreement": (matched / count).tolist(), "conditional": (chained / reached).tolist(),
            "chain_tau": 1 + float(accepted.mean()), "verify_steps": len(accepted), "categories": categories,
            "first_agreement_by_offset": {_span(i): hit / made for i, (hit, made) in enumerate(by_offset.T.tolist())
                                          if made}}


def _span(bucket: int) -> str:
    start = bucket * BUCKET_TOKENS
    return f"{start}-" if bucket == BUCKETS - 1 else f"{start}-{start + BUCKET_TOKENS - 1}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", required=True, metavar="[NAME=]DIR",
                        help="a drafter checkpoint; repeat it to compare several")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="draft positions measured (default %(default)s)")
    parser.add_argument("--chain-length", type=int, default=GenerationConfig.chain_length,
                        help="drafts per step of the replayed chain (default: the engine's, %(default)s)")
    parser.add_argument("--min-confidence", type=float, default=GenerationConfig.min_confidence,
                        help="the replayed chain stops after a draft less probable than this, as the engine's does "
                             "(default: the engine's, %(default)s; the ledger's bench uses a chain of 4 at 0)")
    parser.add_argument("--answers", type=Path, default=Path("runs/mtbench_greedy_answers.json"),
                        help="where the target's greedy answers are kept (generated when absent)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N questions (as bench --limit)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/drafter_agreement.json"))
    args = parser.parse_args()
    if args.chain_length < 1:
        parser.error(f"--chain-length must be at least 1, got {args.chain_length}")
    try:  # bench's own rules for --max-new-tokens and --limit, before the target loads
        bench = BenchConfig(dataset="mtbench", max_new_tokens=args.max_new_tokens, limit=args.limit)
    except ConfigError as error:
        parser.error(str(error))
    engine = Engine.load(args.target, None)
    answers = greedy_answers(engine, bench, args.answers)
    rows = {}
    for spec in args.drafter:
        name, _, folder = spec.rpartition("=")
        rows[name or folder] = measure(engine, Path(folder), answers, args.steps, args.chain_length,
                                         args.min_confidence, args.max_new_tokens)
    for name, row in rows.items():
        print(f"{name}: agreement {' / '.join(f'{a:.3f}' for a in row['agreement'])}; conditional "
              f"{' / '.join(f'{a:.3f}' for a in row['conditional'])}; chain of {args.chain_length} τ "
              f"{row['chain_tau']:.3f} ({row['positions']} positions)")
        print("  first-draft agreement by answer offset: " + ", ".join(
            f"{span} {value:.3f}" for span, value in row["first_agreement_by_offset"].items()))
        for category, figures in row["categories"].items():
            print(f"  {category:<12} first-draft agreement {figures['first_agreement']:.3f}, chain τ {figures['chain_tau']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "drafters": rows},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
