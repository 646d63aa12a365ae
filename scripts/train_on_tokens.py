"""Train a drafter on conversations tokenized elsewhere (scripts/tokenize_conversations.py).

For a GPU machine that has the target but not the dataset: the samples are exactly
those ``eaglewire train --online`` would build, hidden states come from running the
target as online training does, and the run folder is a normal ``eaglewire train``
run. With ``--budget-s`` the step count is set from a short timed calibration run
so that training (learning-rate schedule included) ends within the budget.

    python scripts/train_on_tokens.py --tokens tokens.xz [--tokens more.xz] --out RUN --device cuda --budget-s 420 \
        [--pack-tokens 16384] [train options]

On a CPU, ``OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/train_on_tokens.py ...`` trains on both cores
data-parallel (each process loads the target and the tokens; a batch's samples alternate between them, so a step
is the one-process step, its first loss identical): a continuation of row 22 ran 324 tokens/s over 90 steps this
way, with a benchmark process sharing the cores for part of them, where row 22 ran 216 on one thread. Two
one-thread runs side by side ran ~250 tokens/s each: two candidates cost no more than one run on both cores.

The calibration run includes the first steps' warm-up, so a run tends to end before its budget (row 19:
758 steps in 319 s of a 430 s budget).

``--profile-steps N`` trains N steps (no evaluation, nothing kept) under torch's profiler instead, prints the
ops that took the most device (or CPU) time, and writes a gzipped Chrome trace to ``OUT/profile_trace.json.gz``: a
minute of device time that says where a packed step's time goes before a long run is sized.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eaglewire.data.samples import OnlineSamples, SampleRef
from eaglewire.target import DEFAULT_TARGET, fingerprint_mismatches, load_target
from eaglewire.train.loop import (
    SCHEDULES,
    TrainConfig,
    TrainingError,
    check_steps,
    run_train,
)
from eaglewire.wiring import Wiring

RECORDS_PER_FILE = 10_000_000


class TokenizedSamples:
    """Samples read from a tokens file; ``load`` runs the target exactly as online training does."""

    load = OnlineSamples.load
    load_batch = OnlineSamples.load_batch

    def __init__(self, target, wiring: Wiring, refs: list[SampleRef]):
        self.target, self.wiring, self.refs = target, wiring, refs


def read_tokens(path: Path) -> tuple[list[SampleRef], dict, str]:
    raw = lzma.decompress(path.read_bytes())
    arrays = np.load(io.BytesIO(raw))
    lengths = arrays["lengths"].tolist()
    ids = torch.from_numpy(arrays["input_ids"].astype(np.int32))
    mask = torch.from_numpy(np.unpackbits(arrays["loss_mask"])[: len(ids)].astype(bool))
    meta = json.loads(bytes(arrays["meta"]))
    refs, start = [], 0
    for record, length in zip(arrays["record_index"].tolist(), lengths):
        refs.append(SampleRef(record, ids[start: start + length], mask[start: start + length]))
        start += length
    return refs, meta, hashlib.sha256(raw).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=Path, required=True, action="append",
                        help="a tokens file; repeat it to train on several (held-out evaluation reads the first)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=None, help="fit the run into this many seconds")
    parser.add_argument("--calibration-steps", type=int, default=30)
    parser.add_argument("--steps", type=int, default=None,
                        help="train this many optimizer steps (no calibration run; default: --epochs decides); "
                             "0 with --init-from evaluates that drafter on the first file's held-out records")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--pack-tokens", type=int, default=16384, help="padded tokens per forward (0: one sample)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="cosine")
    parser.add_argument("--decay-fraction", type=float, default=0.2)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--save-every", type=int, default=500)
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its last checkpoint: the same command plus --resume (a run sized by "
                             "--budget-s: its calibrated --steps instead of --budget-s)")
    parser.add_argument("--init-from", default=None, help="start from this checkpoint (eaglewire train --init-from)")
    parser.add_argument("--rebuild-draft-vocab", action="store_true",
                        help="with --init-from: the --draft-vocab ids most trained on in these files instead of its own "
                             "(eaglewire train --rebuild-draft-vocab)")
    parser.add_argument("--mlp-width", type=int, default=TrainConfig.mlp_width, metavar="N",
                        help="the drafter MLP's intermediate size; with --init-from, a larger one widens it "
                             "(eaglewire train --mlp-width)")
    parser.add_argument("--draft-layers", type=int, default=TrainConfig.draft_layers, metavar="N",
                        help="the drafter's decoder layers; with --init-from, a larger N adds layers "
                             "(eaglewire train --draft-layers)")
    parser.add_argument("--new-layer-lr-scale", type=float, default=TrainConfig.new_layer_lr_scale, metavar="K",
                        help="the added layers train at K times --lr (eaglewire train --new-layer-lr-scale)")
    parser.add_argument("--teacher-temperature", type=float, default=TrainConfig.teacher_temperature, metavar="T",
                        help="train towards the target's distribution at temperature T; 0: its top-1 "
                             "(eaglewire train --teacher-temperature)")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed,
                        help="orders the batches; a run continuing one on the same files wants another seed, or it "
                             "retraces the same batches first")
    parser.add_argument("--answer-tokens", type=int, default=TrainConfig.answer_tokens, metavar="N",
                        help="train on the first N tokens of each answer only (eaglewire train --answer-tokens)")
    parser.add_argument("--skip-samples", type=int, default=TrainConfig.skip_samples, help="leave out records below this index")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="profile this many steps (the first includes warm-up), report, and stop")
    args = parser.parse_args()
    if args.profile_steps < 0:
        parser.error(f"--profile-steps must be 0 (no profiling) or more, got {args.profile_steps}")
    if args.profile_steps and args.budget_s is not None:
        parser.error("--profile-steps trains only the steps it profiles, so --budget-s would be ignored: pass one of them")
    try:
        check_steps(args.steps, args.init_from)  # before the target loads
    except TrainingError as exc:
        parser.error(str(exc))
    if args.steps is not None and args.budget_s is not None:
        parser.error(f"--steps sets the run's length itself, so it excludes --budget-s (got --steps {args.steps} "
                     "and --budget-s)")
    if args.resume and (args.budget_s is not None or args.profile_steps):
        parser.error("--resume continues a run of a fixed length: give the run's --steps, not --budget-s or "
                     "--profile-steps")
    torch.backends.cuda.matmul.allow_tf32 = True  # target and teacher matmuls; the drafter runs under bf16 autocast
    torch.backends.cudnn.allow_tf32 = True

    start = time.perf_counter()
    target = load_target(args.target)
    refs, sources = [], []
    for n, path in enumerate(args.tokens):
        file_refs, meta, tokens_sha = read_tokens(path)
        diffs = fingerprint_mismatches(meta["target"], target.fingerprint)
        if diffs:
            raise SystemExit(f"{path} was tokenized for another target: {'; '.join(diffs)}")
        if file_refs and max(r.record_index for r in file_refs) >= RECORDS_PER_FILE:
            raise SystemExit(f"{path} has record indices of {RECORDS_PER_FILE:,} or more, which would collide with "
                             "the next file's; split the source into smaller tokens files")
        # Records of file n are numbered from n * RECORDS_PER_FILE: unique, and each file keeps its own held-out
        # records (every 50th), since the offset is a multiple of 50. Files after the first are trained on like
        # `train --replay` datasets: their held-out records stay out of training and out of evaluation, which reads
        # the first file alone (else a first file with fewer than --eval-samples held-out records would be topped
        # up from the next).
        refs += [SampleRef(r.record_index + n * RECORDS_PER_FILE, r.input_ids, r.loss_mask, replayed=n > 0)
                 for r in file_refs if r.record_index >= args.skip_samples]
        tokenized = {"sha256": tokens_sha, "max_samples": meta["max_samples"], "max_length": meta["max_length"]}
        sources.append({"online": meta["source"], "tokenized": tokenized, "skipped": meta["skipped"]})
    wiring = Wiring.resolve(None, target.num_layers)
    samples = TokenizedSamples(target, wiring, refs)
    identity = sources[0] if len(sources) == 1 else {"sources": sources}
    print(f"{len(refs)} samples, {sum(r.length for r in refs)} tokens, loaded in {time.perf_counter() - start:.0f} s",
          flush=True)

    max_length = max(source["tokenized"]["max_length"] for source in sources)

    def config(out: Path, steps: int | None, eval_samples: int, resume: bool = False) -> TrainConfig:
        return TrainConfig(out=out, data=",".join(map(str, args.tokens)), online=True, target=args.target,
                           device=args.device,
                           draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps, steps=steps, epochs=args.epochs,
                           lr=args.lr, warmup_steps=args.warmup_steps, batch_tokens=args.batch_tokens,
                           pack_tokens=args.pack_tokens, schedule=args.schedule, decay_fraction=args.decay_fraction,
                           max_length=max_length, eval_every=args.eval_every, eval_samples=eval_samples,
                           save_every=args.save_every, save_dtype="fp16", progress=False, init_from=args.init_from,
                           rebuild_draft_vocab=args.rebuild_draft_vocab, mlp_width=args.mlp_width,
                           draft_layers=args.draft_layers,
                           new_layer_lr_scale=args.new_layer_lr_scale, resume=resume,
                           teacher_temperature=args.teacher_temperature,
                           skip_samples=args.skip_samples, seed=args.seed,
                           answer_tokens=args.answer_tokens)

    if args.profile_steps > 0:
        profile_steps(args, lambda out: config(out, args.profile_steps, 0), target, (samples, wiring, identity))
        return
    steps = args.steps
    if args.budget_s is not None:
        scratch = Path(tempfile.mkdtemp())
        begin = time.perf_counter()
        run_train(config(scratch / "run", args.calibration_steps, 0), target, prepared=(samples, wiring, identity))
        per_step = (time.perf_counter() - begin) / args.calibration_steps
        shutil.rmtree(scratch)
        eval_cost = 0.15  # evaluation and checkpoints, as a fraction of the step time (measured on CPU runs)
        steps = max(1, int(args.budget_s / (per_step * (1 + eval_cost))))
        print(f"calibration: {per_step * 1000:.0f} ms a step -> {steps} steps in {args.budget_s:.0f} s", flush=True)
    begin = time.perf_counter()
    summary = run_train(config(args.out, steps, args.eval_samples, args.resume), target, prepared=(samples, wiring, identity))
    print(f"{'evaluated' if steps == 0 else 'trained'} in {time.perf_counter() - begin:.0f} s: {summary}", flush=True)


def profile_steps(args, config, target, prepared) -> None:
    """Train ``args.profile_steps`` steps in a scratch folder under torch's profiler; print and save what it saw."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(args.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch, profile(activities=activities) as profiler:
        run_train(config(Path(scratch) / "run"), target, prepared=prepared)
    seconds = time.perf_counter() - begin
    print(f"{args.profile_steps} steps profiled in {seconds:.1f} s (the profiler's own cost included)")
    print(profiler.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30))
    args.out.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(args.out / "profile_trace.json.gz"))
    print(f"wrote {args.out / 'profile_trace.json.gz'}")


if __name__ == "__main__":
    main()
