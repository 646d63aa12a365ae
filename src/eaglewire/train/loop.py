"""``eaglewire train``: fit an EAGLE-3 drafter with training-time test.

The run folder ``--out`` holds:
  checkpoint/       the native drafter checkpoint (loads in SGLang / vLLM as is)
  train_state.pt    fp32 weights, optimizer state and step, for --resume
  metrics.jsonl     one line per logged step and per evaluation
  curves.png        loss and held-out per-position accuracy
  run.json          the settings the run was started with

Batches are built from a seeded permutation of the training samples, packed
to ``batch_tokens``; under torchrun sample i of a batch goes to rank
i % world_size, and the loss is normalised by the global count of trained
positions, so any number of processes computes the same update.
"""

from __future__ import annotations

import io
import json
import math
import re
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ..data.conversations import open_source
from ..data.manifest import load_manifest
from ..data.probe import check_probe, probe_for
from ..data.samples import (
    DatasetSamples,
    OnlineSamples,
    SampleRef,
    draft_vocabulary,
    first_answer_tokens,
)
from ..distributed import World, init_world
from ..drafter.checkpoint import (
    CheckpointMeta,
    engine_layer_ids,
    read_checkpoint_config,
    save_checkpoint,
)
from ..drafter.model import Drafter, DrafterConfig
from ..dtypes import parse_dtype
from ..engine.projection import cpu_features, native_bf16
from ..errors import ConfigError, EaglewireError
from ..files import atomic_write_bytes, atomic_write_json, sha256_file
from ..stacks import SGLANG_ID_RULES, sglang_rules
from ..target import (
    DEFAULT_TARGET,
    LEAN_FAMILIES,
    Target,
    fingerprint_mismatches,
    load_target,
)
from ..wiring import Wiring, WiringError
from .draft_vocab_change import with_draft_vocabulary
from .drafter_growth import with_mlp_width, with_num_layers
from .drafter_init import DrafterInit, initialize, trainable_parameters
from .fc_scale import SCALES, feature_rms, raw_input_copy, to_scaled_inputs
from .ttt import step_sums, step_weights, teacher_targets, unroll

CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "train_state.pt"
RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
PRECISIONS = ("auto", "bf16", "fp32")
SCHEDULES = ("cosine", "wsd", "constant")


class TrainingError(EaglewireError):
    """Bad training input, or a run that had to stop (its last good checkpoint is kept)."""


@dataclass
class TrainConfig:
    out: Path
    data: str  # dataset folder, or with online=True a conversation source ('sharegpt' or a file)
    replay: tuple[str, ...] = ()  # offline: more dataset folders trained on alongside data, e.g. ones seen before
    online: bool = False
    target: str = DEFAULT_TARGET
    wiring: str | None = None  # offline: must equal the data's wiring if given
    draft_vocab: int = 8192
    ttt_steps: int = 3
    steps: int | None = None  # optimizer steps; None: --epochs; 0 (with init_from): evaluate it, train nothing
    epochs: float = 1.0
    lr: float = 3e-3  # measured best for a new drafter (README: drafter recipe); continuing one, 5e-4 did better
    warmup_steps: int = 20
    schedule: str = "cosine"  # after warmup: cosine decay, warmup-stable-decay, or constant (see lr_at)
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    batch_tokens: int = 2048  # small batches: more steps per token, measured better than 8192 at equal budget
    pack_tokens: int = 0  # >0: a forward takes several samples, right-padded, up to this many tokens (for GPUs)
    max_length: int = 2048  # online tokenization
    max_samples: int | None = None
    skip_samples: int = 0  # leave out source records below this index (train on records added since)
    answer_tokens: int | None = None  # train on the first N tokens of each answer only (held-out evaluation: all)
    strict: bool = False  # online: refuse malformed conversations instead of skipping them
    precision: str = "auto"  # drafter step matmuls: bf16 autocast where the device multiplies bf16 natively, else fp32
    device: str = "cpu"  # where the target and drafter run: cpu, cuda or cuda:N
    eval_every: int = 100
    eval_samples: int = 32
    save_every: int = 200
    log_every: int = 1
    seed: int = 0
    save_dtype: str = "fp32"
    convention: str = "vllm"
    resume: bool = False
    init_from: str | None = None  # a checkpoint whose weights and draft vocabulary a new run starts from
    rebuild_draft_vocab: bool = False  # with init_from: the --draft-vocab ids most trained on here instead of its own
    mlp_width: int | None = None  # the drafter MLP's units; None: the target's (new) or the checkpoint's (init_from)
    draft_layers: int | None = None  # the drafter's decoder layers; None: 1 (new) or the checkpoint's (init_from)
    new_layer_lr_scale: float = 1.0  # the layers --draft-layers adds to an --init-from drafter train at this x --lr
    init_head: str = "random"  # lm_head + norm from the target (drafter_init.py); new runs only
    init_fc: str = "random"
    init_midlayer: str = "random"
    freeze_lm_head: bool = False
    teacher_temperature: float = 1.0  # trains towards the target's distribution at this temperature; 0: its argmax
    fc_input_scale: str = "none"  # rms: train fc on aux / per-feature RMS, folded back on save (fc_scale.py)
    progress: bool = True

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.replay = tuple(str(folder) for folder in self.replay)
        if self.replay and self.online:
            raise TrainingError("--replay adds extracted datasets; --online reads conversations. Extract the "
                                "conversations first (`eaglewire extract`), or drop --replay")
        folders = [Path(f).resolve() for f in (self.data, *self.replay)]
        if len(set(folders)) != len(folders):
            raise TrainingError("--replay names --data or one dataset twice; each dataset is read once per epoch, "
                                "so give each folder once")
        positive = ["draft_vocab", "ttt_steps", "batch_tokens", "max_length", "eval_every", "save_every", "log_every"]
        positive += [name for name in ("answer_tokens", "mlp_width", "draft_layers") if getattr(self, name) is not None]
        for name in positive:
            if getattr(self, name) < 1:
                raise TrainingError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_samples", "skip_samples", "pack_tokens"):
            if getattr(self, name) < 0:
                raise TrainingError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        try:
            init = self.drafter_init
        except ConfigError as exc:
            raise TrainingError(str(exc)) from exc
        if self.init_from is not None and not init.is_random:
            raise TrainingError("--init-from starts from that checkpoint's weights; drop the --init-head/--init-fc/"
                                "--init-midlayer options, which set weights of a new drafter")
        if not self.teacher_temperature >= 0:
            raise TrainingError(f"--teacher-temperature must be >= 0 (0: the target's top-1 as a hard label), got "
                                f"{self.teacher_temperature}")
        if not self.new_layer_lr_scale > 0:
            raise TrainingError(f"--new-layer-lr-scale must be > 0, got {self.new_layer_lr_scale}")
        if self.new_layer_lr_scale != 1.0 and (self.init_from is None or self.draft_layers is None):
            raise TrainingError("--new-layer-lr-scale sets the rate of the layers --draft-layers adds to an --init-from "
                                "drafter; give both, or drop it")
        if self.rebuild_draft_vocab and self.init_from is None:
            raise TrainingError("--rebuild-draft-vocab changes the draft vocabulary of an --init-from checkpoint; a "
                                "new drafter takes its vocabulary from its training data anyway, so drop the option")
        if self.freeze_lm_head and self.init_from is None and init.head != "target":
            raise TrainingError("--freeze-lm-head keeps lm_head as it starts; a random head could never learn. "
                                "Add --init-head target (or --init-from a checkpoint)")
        if self.fc_input_scale not in SCALES:
            raise TrainingError(f"--fc-input-scale must be one of {', '.join(SCALES)}, got {self.fc_input_scale!r}")
        if self.schedule not in SCHEDULES:
            raise TrainingError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not 0 < self.decay_fraction <= 1:
            raise TrainingError(f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise TrainingError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        check_steps(self.steps, self.init_from)
        if self.max_samples is not None and self.max_samples < 1:
            raise TrainingError(f"--max-samples must be >= 1, got {self.max_samples}")
        for name in ("epochs", "lr", "clip_grad"):
            if not getattr(self, name) > 0:
                raise TrainingError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.precision not in PRECISIONS:
            raise TrainingError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        step_precision(self.precision, self.device)
        parse_dtype(self.save_dtype, "--save-dtype")
        if self.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", self.device):
            raise TrainingError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.device != "cpu" and not torch.cuda.is_available():
            raise TrainingError(f"--device {self.device}: this machine has no CUDA device; use --device cpu")

    @property
    def drafter_init(self) -> DrafterInit:
        return DrafterInit(self.init_head, self.freeze_lm_head, self.init_fc, self.init_midlayer)

    def settings(self) -> dict:
        """What a resumed run must share with the original (everything but bookkeeping)."""
        data = asdict(self)
        for key in ("out", "resume", "progress", "eval_every", "save_every", "log_every", "device", "pack_tokens"):
            data.pop(key)
        return data


def check_steps(steps: int | None, init_from: str | None) -> None:
    """--steps is >= 1, or 0 with --init-from: evaluate that drafter on the held-out records, train nothing."""
    if steps is not None and steps < (0 if init_from is not None else 1):
        raise TrainingError(f"--steps must be >= 1 (or 0 with --init-from, to evaluate that drafter on the held-out "
                            f"records without training it), got {steps}")


def step_precision(precision: str, device: str) -> str:
    """The drafter step's matmul precision: ``auto`` is bf16 on CUDA and on CPUs that multiply bf16 in hardware.

    Elsewhere oneDNN emulates bf16; measured on an AVX2-only CPU, a training step took 18x as long as in fp32
    (``benchmarks/train.py``), so an explicit ``bf16`` there is refused rather than run slowly.
    """
    native = device != "cpu" or native_bf16()
    if precision == "auto":
        return "bf16" if native else "fp32"
    if precision == "bf16" and not native:
        raise TrainingError("--precision bf16 needs a CPU that multiplies bf16 in hardware (AVX512-BF16 or AMX); this "
                            "one would emulate it, ~18x slower than fp32: use --precision fp32 (or auto)")
    return precision


class TTTModule(nn.Module):
    """The drafter unrolled K steps: the module DDP wraps, so gradients sync on backward."""

    def __init__(self, drafter: Drafter, steps: int, precision: str, aux_scale: torch.Tensor | None = None):
        """``aux_scale``: fc reads ``aux / aux_scale`` (its weight is then W' of fc_scale.py)."""
        super().__init__()
        self.drafter, self.steps, self.precision = drafter, steps, precision
        self.register_buffer("aux_scale", aux_scale, persistent=False)

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor) -> list[torch.Tensor]:
        device = input_ids.device.type
        if self.aux_scale is not None:
            aux = aux / self.aux_scale
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            return unroll(self.drafter, input_ids, aux, self.steps)


@dataclass
class Totals:
    """Per-step sums of loss, correct and counted positions; they add across samples and ranks."""

    steps: int
    loss: torch.Tensor = field(init=False)
    correct: torch.Tensor = field(init=False)
    count: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.loss, self.correct, self.count = (torch.zeros(self.steps, dtype=torch.float64) for _ in range(3))

    def add(self, losses: list[torch.Tensor], correct: list[float], count: list[float]) -> None:
        self.loss += torch.tensor([float(l.detach()) for l in losses], dtype=torch.float64)
        self.correct += torch.tensor(correct, dtype=torch.float64)
        self.count += torch.tensor(count, dtype=torch.float64)

    def all_reduce(self, world: World) -> None:
        if world.size > 1:
            for t in (self.loss, self.correct, self.count):
                torch.distributed.all_reduce(t)

    def accuracy(self) -> list[float]:
        return (self.correct / self.count.clamp(min=1)).tolist()

    def mean_loss(self, weights: list[float]) -> float:
        w = torch.tensor(weights, dtype=torch.float64)
        return float((w * self.loss / self.count.clamp(min=1)).sum())


def masked_counts(ref: SampleRef, steps: int) -> torch.Tensor:
    """Positions trained at each unrolled step k: loss-masked tokens x[t+k+1] that exist."""
    return torch.tensor([float(ref.loss_mask[k + 1:].sum()) for k in range(1, steps + 1)], dtype=torch.float64)


def make_batches(refs: list[SampleRef], batch_tokens: int, seed: int, epoch: int) -> list[list[SampleRef]]:
    order = torch.randperm(len(refs), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    batches, current, tokens = [], [], 0
    for i in order:
        ref = refs[i]
        if current and tokens + ref.length > batch_tokens:
            batches.append(current)
            current, tokens = [], 0
        current.append(ref)
        tokens += ref.length
    if current:
        batches.append(current)
    return batches


def forward_groups(refs: list[SampleRef], pack_tokens: int) -> list[list[SampleRef]]:
    """The samples each forward takes: one each with ``pack_tokens`` 0, else samples of similar length
    together while the padded group (count x longest) stays within ``pack_tokens`` (one at least)."""
    if pack_tokens == 0:
        return [[ref] for ref in refs]
    groups: list[list[SampleRef]] = []
    for ref in sorted(refs, key=lambda r: r.length, reverse=True):
        if groups and (len(groups[-1]) + 1) * groups[-1][0].length <= pack_tokens:
            groups[-1].append(ref)
        else:
            groups.append([ref])
    return groups


class BatchSchedule:
    """Global step -> batch. Each epoch packs its own permutation, so epochs differ in batch count."""

    def __init__(self, refs: list[SampleRef], batch_tokens: int, seed: int):
        self.refs, self.batch_tokens, self.seed = refs, batch_tokens, seed
        self._epochs: list[list[list[SampleRef]]] = []

    def epoch(self, index: int) -> list[list[SampleRef]]:
        while len(self._epochs) <= index:
            self._epochs.append(make_batches(self.refs, self.batch_tokens, self.seed, len(self._epochs)))
        return self._epochs[index]

    def total_steps(self, epochs: float) -> int:
        whole, fraction = int(epochs), epochs - int(epochs)
        total = sum(len(self.epoch(e)) for e in range(whole))
        return max(1, total + math.ceil(fraction * len(self.epoch(whole))) if fraction else total)

    def batch(self, step: int) -> list[SampleRef]:
        epoch = 0
        while step >= len(self.epoch(epoch)):
            step -= len(self.epoch(epoch))
            epoch += 1
        return self.epoch(epoch)[step]


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warmup, then per --schedule:

    cosine    decays to min_lr_ratio * lr at the last step
    wsd       holds lr, then decays linearly to min_lr_ratio * lr over the last decay_fraction of the steps;
              a run meant to be continued can stop before its decay (its stable phase resumes cleanly)
    constant  holds lr
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        decay_start = max(cfg.warmup_steps, total - math.ceil(cfg.decay_fraction * total))
        progress = (step - decay_start + 1) / max(total - decay_start, 1)
        return cfg.lr * (1 - (1 - cfg.min_lr_ratio) * min(max(progress, 0.0), 1.0))
    progress = (step - cfg.warmup_steps) / max(total - cfg.warmup_steps, 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def divergence_limit(draft_vocab: int, weights: list[float], first_loss: float) -> float:
    """3x the loss of a uniform guess, or 3x the run's first loss if it started higher (a head started from the
    target's is confident, and confidently wrong at first): far above any healthy run, reached only by an explosion."""
    return 3.0 * max(math.log(draft_vocab) * sum(weights), first_loss)


# ---- setup -------------------------------------------------------------------------------


def _check_family_applies(cfg: TrainConfig, layout) -> None:
    """Initialisations that copy target weights into the drafter's Llama modules need Llama-like ones; the
    teacher reads lm_head(final), which is the target's distribution only without Gemma's logit softcap."""
    text = layout.text_config
    model_type = layout.wrapper or layout.family
    if cfg.convention.startswith("sglang-"):  # SGLang reads ids by the target's own model file (stacks.py)
        try:
            rules = sglang_rules(model_type)
        except WiringError as exc:
            raise TrainingError(f"--convention {cfg.convention}: {exc}") from exc
        if cfg.convention not in rules:
            raise TrainingError(f"--convention {cfg.convention} is not how SGLang reads ids for a {model_type!r} "
                                f"target ({SGLANG_ID_RULES[model_type][1]}): use {' or '.join(rules)}")
    if layout.family == "gemma3_text" and text.final_logit_softcapping is not None:
        raise TrainingError(f"this Gemma 3 target caps its logits (final_logit_softcapping "
                            f"{text.final_logit_softcapping}); the teacher reads lm_head(final) uncapped, which would "
                            "train on another distribution than the target's")
    if cfg.init_head == "target" and layout.family == "gemma3_text":
        raise TrainingError("--init-head target copies the target's final norm weight, but Gemma 3's RMSNorm "
                            "scales by (1 + weight) and the drafter's by weight; use --init-head random")
    if cfg.init_midlayer != "random" and (layout.wrapper is not None or layout.family not in LEAN_FAMILIES):
        raise TrainingError(f"--init-midlayer {cfg.init_midlayer} copies a Llama decoder layer; this target's "
                            f"layers are {layout.family}'s ({', '.join(LEAN_FAMILIES)} only); use --init-midlayer random")


def _open_samples(cfg: TrainConfig, target: Target):
    """The sample source, its wiring, and the identity of the data (recorded in the checkpoint)."""
    if cfg.online:
        wiring = Wiring.resolve(cfg.wiring, target.num_layers)
        samples = OnlineSamples(target, wiring, cfg.data, cfg.max_samples, cfg.max_length, cfg.strict, cfg.skip_samples)
        if samples.skipped:  # also in run.json; said here so a skip is never silent
            reasons = ", ".join(f"{k}: {v}" for k, v in samples.skipped.items() if k != "first")
            tqdm.write(f"skipped conversations ({reasons}); first: {samples.skipped['first']}")
        return samples, wiring, {"online": samples.source.identity(), "skipped": samples.skipped}
    samples = _open_dataset(Path(cfg.data), cfg, target)
    identity = {"manifest_sha256": sha256_file(Path(cfg.data) / "manifest.json")}
    for folder in map(Path, cfg.replay):
        try:
            samples.add_replay(_open_dataset(folder, cfg, target, replayed=True))
        except ConfigError as exc:
            raise TrainingError(f"--replay: {exc}") from exc
    if cfg.replay:  # the checkpoint names --data as its data; the run and --resume know the replayed ones too
        identity["replay_manifest_sha256"] = [sha256_file(Path(f) / "manifest.json") for f in cfg.replay]
    return samples, samples.wiring, identity


def _open_dataset(folder: Path, cfg: TrainConfig, target: Target, replayed: bool = False) -> DatasetSamples:
    """An extracted dataset, refused unless it comes from ``target`` and has the wiring asked for.
    --max-samples and --skip-samples select from --data only; a replayed dataset is used whole."""
    samples = DatasetSamples(folder) if replayed else DatasetSamples(folder, cfg.max_samples, cfg.skip_samples)
    data_target = samples.manifest.settings.target
    diffs = fingerprint_mismatches(data_target, target.fingerprint)
    if diffs:
        raise TrainingError(
            f"dataset {folder} was extracted from target {data_target['name']!r}, which differs from --target "
            f"{cfg.target!r} ({'; '.join(diffs)}); train with the target the data came from, or re-extract"
        )
    if cfg.wiring and Wiring.parse(cfg.wiring) != samples.wiring:
        raise TrainingError(
            f"--wiring {cfg.wiring} differs from the dataset's wiring {samples.wiring}; drop --wiring to use the "
            "data's, or extract new data with the wiring you want"
        )
    check_probe(samples.manifest.probe, probe_for(target, samples.wiring), f"dataset {folder}")
    return samples


def _initial_drafter(cfg: TrainConfig, config: DrafterConfig, target: Target, wiring: Wiring,
                     train_refs: list[SampleRef]) -> tuple[Drafter, dict]:
    """The --init-from checkpoint's drafter, in fp32, refused unless it fits this target, wiring and size, and the
    record of how it began. With --rebuild-draft-vocab its draft vocabulary becomes the one a new drafter would
    take from ``train_refs`` (draft_vocab_change.py)."""
    from ..drafter.checkpoint import CheckpointError, load_checkpoint

    checkpoint = load_checkpoint(Path(cfg.init_from), target.layout.embed)
    try:
        checkpoint.meta.check_target(target.fingerprint)
    except CheckpointError as exc:
        raise TrainingError(f"--init-from {cfg.init_from}: {exc}") from exc
    if checkpoint.meta.wiring != wiring:
        raise TrainingError(f"--init-from {cfg.init_from} was trained on wiring {checkpoint.meta.wiring}, this run "
                            f"uses {wiring}; its fc would read other tensors")
    theirs = checkpoint.drafter.config
    if cfg.rebuild_draft_vocab:  # its vocabulary may have any size: the rebuilt one takes --draft-vocab's
        theirs = replace(theirs, draft_vocab_size=config.draft_vocab_size)
    # Its MLP width and its layers carry over, or grow to --mlp-width and --draft-layers (drafter_growth.py).
    width = cfg.mlp_width or theirs.intermediate_size
    layers = cfg.draft_layers or theirs.num_layers
    if replace(theirs, intermediate_size=config.intermediate_size, num_layers=config.num_layers) != config:
        raise TrainingError(f"--init-from {cfg.init_from} has another shape ({checkpoint.drafter.config}) than this "
                            f"run ({config}); match --draft-vocab to its draft_vocab_size, or pass "
                            "--rebuild-draft-vocab to give it a new one")
    record = {"from": cfg.init_from}
    drafter = checkpoint.drafter.float()
    if width != theirs.intermediate_size:
        try:
            drafter, record["mlp_width"] = with_mlp_width(drafter, width, target.layout.embed)
        except ConfigError as exc:
            raise TrainingError(f"--mlp-width {width}: {exc}") from exc
    if layers != drafter.config.num_layers:
        try:
            drafter, record["draft_layers"] = with_num_layers(drafter, layers, target.layout.embed)
        except ConfigError as exc:
            raise TrainingError(f"--draft-layers {layers}: {exc}") from exc
    if cfg.rebuild_draft_vocab:
        ids = draft_vocabulary(train_refs, config.vocab_size, config.draft_vocab_size)
        drafter, record["draft_vocab"] = with_draft_vocabulary(drafter, ids, target.layout.lm_head.weight,
                                                               target.layout.embed)
    return drafter, record


def _parameter_groups(drafter: Drafter, init_record: dict, new_layer_lr_scale: float) -> list[dict]:
    """The optimizer's groups, each with the factor on the schedule's rate it trains at: the layers this run added
    (``init_record["draft_layers"]``) at ``new_layer_lr_scale``, since they start from zero output weights, which
    Adam moves by at most about the rate a step; everything else at 1."""
    grown, added = init_record.get("draft_layers"), set()
    if grown is not None and new_layer_lr_scale != 1.0:  # else one group, as in runs saved before groups existed
        added = {id(p) for i in range(grown["from"], grown["to"]) for p in drafter.layers[str(i)].parameters()}
    groups = [{"params": [p for p in trainable_parameters(drafter) if id(p) not in added], "lr_scale": 1.0}]
    if added:
        groups.append({"params": [p for p in trainable_parameters(drafter) if id(p) in added],
                       "lr_scale": new_layer_lr_scale})
    return groups


def _check_out(cfg: TrainConfig) -> None:
    """Refuse an --out that holds something other than this run (rank 0, before anything is written)."""
    out, state_path = cfg.out, cfg.out / STATE_FILE
    if cfg.resume:
        if not state_path.is_file():
            raise TrainingError(f"--resume: {out} holds no {STATE_FILE}; start without --resume")
    elif out.exists() and any(out.iterdir()):
        what = "a training run; pass --resume to continue it" if state_path.is_file() else "files that are not a training run"
        raise TrainingError(f"--out {out} already holds {what}, or choose a new folder (nothing was changed)")


# Settings added after runs had been saved, each with the value that reproduces how such a run trained: a run
# saved without one resumes only when this run asks for that behaviour. A new setting joins here.
SETTINGS_ADDED = {"rebuild_draft_vocab": False, "answer_tokens": None, "mlp_width": None, "draft_layers": None,
                  "new_layer_lr_scale": 1.0, "teacher_temperature": 1.0}


def _load_state(cfg: TrainConfig, identity: dict) -> dict:
    state = torch.load(cfg.out / STATE_FILE, weights_only=False, map_location="cpu")
    ours = {"settings": _jsonable(cfg.settings()), **_jsonable(identity)}
    theirs = {key: state[key] for key in ours}
    theirs["settings"] = {**_jsonable(SETTINGS_ADDED), **theirs["settings"]}
    if theirs != ours:
        diffs = [f"{k}" for k in ours if ours[k] != theirs[k]]
        if theirs["settings"] != ours["settings"]:
            keys = [*ours["settings"], *(k for k in theirs["settings"] if k not in ours["settings"])]
            diffs = [f"{k}: {theirs['settings'].get(k)!r} vs {ours['settings'].get(k)!r}" for k in keys
                     if theirs["settings"].get(k) != ours["settings"].get(k)] + [d for d in diffs if d != "settings"]
        raise TrainingError(f"--resume: {cfg.out} was trained with other settings or data ({'; '.join(diffs)})")
    return state


def _jsonable(data: dict) -> dict:
    return json.loads(json.dumps(data, default=str))


# ---- the loop ----------------------------------------------------------------------------


def run_train(cfg: TrainConfig, target: Target | None = None, world: World | None = None, prepared=None) -> dict:
    """Train as ``cfg`` says. ``prepared`` is an opened sample source (samples, wiring, data identity) for
    callers that tokenized elsewhere (scripts/train_on_tokens.py); by default ``cfg.data`` is opened."""
    world = world or init_world()
    if world.is_main:
        _check_out(cfg)
    world.barrier()
    if prepared is None and cfg.online:  # cheap checks first: a wrong --data fails before the target loads
        open_source(cfg.data)
    elif prepared is None:
        for folder in (cfg.data, *cfg.replay):
            if load_manifest(Path(folder)).settings.held_out_only:
                raise TrainingError(f"dataset {folder} was extracted with --held-out-only: it holds only the records "
                                    "training keeps out, for `doctor`; extract the source without it to train")
    target = target or load_target(cfg.target)
    target.model.to(cfg.device)
    vocab_size = target.fingerprint["vocab_size"]
    if cfg.draft_vocab > vocab_size:
        raise TrainingError(f"--draft-vocab {cfg.draft_vocab} exceeds the target vocabulary ({vocab_size} tokens)")
    samples, wiring, data_identity = prepared or _open_samples(cfg, target)
    identity = {"target": target.fingerprint, "data": data_identity}
    meta = CheckpointMeta(wiring, target.fingerprint, cfg.convention, data_identity.get("manifest_sha256"), {})
    engine_layer_ids(meta)  # a wiring the convention cannot express fails now, not at the first save
    # The draft vocabulary and the fc input scale come from whole answers, as the drafter serves them.
    whole_refs = train_refs = [r for r in samples.refs if not r.held_out]
    if cfg.answer_tokens is not None:
        train_refs = [ref for r in train_refs if (ref := first_answer_tokens(r, cfg.answer_tokens)).length]
    eval_refs = [r for r in samples.refs if r.held_out and not r.replayed][: cfg.eval_samples]
    if not train_refs:
        raise TrainingError("no training samples: the data is empty or every sample was held out")
    if cfg.steps == 0 and not eval_refs:
        raise TrainingError("--steps 0 evaluates --init-from on the held-out records, but there are none to read "
                            "(every 50th record of the data is held out; --eval-samples must be >= 1): give more "
                            "data or a larger --eval-samples")

    torch.manual_seed(cfg.seed)
    _check_family_applies(cfg, target.layout)
    config = DrafterConfig.from_target(target.text_config, wiring, cfg.draft_vocab)
    if cfg.mlp_width is not None:
        config = replace(config, intermediate_size=cfg.mlp_width)
    if cfg.draft_layers is not None:
        config = replace(config, num_layers=cfg.draft_layers)
    if cfg.init_from is not None:
        drafter, init_record = _initial_drafter(cfg, config, target, wiring, whole_refs)
        drafter.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
    else:
        init_record = cfg.drafter_init.to_json()
        drafter = Drafter(config, target.layout.embed, draft_vocabulary(whole_refs, vocab_size, cfg.draft_vocab))
        layout = target.layout
        initialize(drafter, cfg.drafter_init, layout.lm_head, layout.norm, layout.layers[-1])
    aux_scale = None
    if cfg.fc_input_scale == "rms" and not cfg.resume:  # a resumed run reads its scale from its state below
        aux_scale = feature_rms(samples, whole_refs)
        if cfg.init_from is not None or cfg.init_fc != "random":  # weights with a meaning: keep their function
            to_scaled_inputs(drafter, aux_scale)
    drafter.to(cfg.device)
    optimizer = torch.optim.AdamW(_parameter_groups(drafter, init_record, cfg.new_layer_lr_scale), lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    schedule = BatchSchedule(train_refs, cfg.batch_tokens, cfg.seed)
    total = cfg.steps if cfg.steps is not None else schedule.total_steps(cfg.epochs)
    step = 0
    if cfg.resume:
        state = _load_state(cfg, identity)
        aux_scale = state["fc_input_scale"]  # the weights below are over this run's scaled inputs
        drafter.load_state_dict(state["drafter"], strict=True)
        scales = [group["lr_scale"] for group in optimizer.param_groups]
        optimizer.load_state_dict(state["optimizer"])
        for group, scale in zip(optimizer.param_groups, scales):  # states saved before the factor existed lack it
            group["lr_scale"] = scale
        step = state["step"]
        if step >= total:
            return read_checkpoint_config(cfg.out / CHECKPOINT_DIR)[1].metrics
    elif world.is_main:
        cfg.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cfg.out / RUN_FILE, {"settings": _jsonable(cfg.settings()), "wiring": str(wiring),
                                               "data": _jsonable(data_identity), "train_samples": len(train_refs),
                                               "eval_samples": len(eval_refs), "total_steps": total,
                                               "step_precision": step_precision(cfg.precision, cfg.device),
                                               "hardware": {"device": cfg.device, "processes": world.size,
                                                            "threads": torch.get_num_threads(),
                                                            "cpu": cpu_features()}})
    # How the weights began, kept in the checkpoint's metrics: a shipped drafter says what it grew from.
    init_record["freeze_lm_head"] = cfg.freeze_lm_head
    if aux_scale is not None:
        aux_scale = aux_scale.to(cfg.device)
    model = TTTModule(drafter, cfg.ttt_steps, step_precision(cfg.precision, cfg.device), aux_scale)
    ddp = DistributedDataParallel(model) if world.size > 1 else model
    weights = step_weights(cfg.ttt_steps)
    limit = None  # set from this process's first loss
    lm_head = target.layout.lm_head.weight
    metrics = _Metrics(cfg.out / METRICS_FILE, step, world.is_main)
    if step == 0 and total:  # a run stopped before its first save can still be resumed
        meta.metrics = {"step": 0, "total_steps": total, "init": init_record}
        _save(cfg, world, drafter, optimizer, 0, meta, identity, aux_scale)
    if total == 0:  # evaluation only: the starting drafter's figures, measured exactly as a trained step's are
        last_eval = _evaluate(model, drafter, samples, eval_refs, world, cfg, lm_head)
        metrics.write({"step": 0, "eval_loss": last_eval.mean_loss(weights), "eval_acc": last_eval.accuracy()})
        meta.metrics = _summary(0, 0, metrics, last_eval, weights, init_record)
        _save(cfg, world, drafter, optimizer, 0, meta, identity, aux_scale)
        return meta.metrics
    bar = tqdm(total=total, initial=step, disable=not (cfg.progress and world.is_main), desc="train", dynamic_ncols=True)
    start, tokens_done, last_eval = time.perf_counter(), 0, None
    tokens_before = sum(sum(r.length for r in schedule.batch(s)) for s in range(step))  # a resumed run counts on
    try:
        while step < total:
            batch = schedule.batch(step)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg, total) * group["lr_scale"]
            totals = _train_step(ddp, drafter, samples, batch, world, cfg, weights, lm_head)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable_parameters(drafter), cfg.clip_grad))
            loss = totals.mean_loss(weights)
            if limit is None and math.isfinite(loss):
                limit = divergence_limit(cfg.draft_vocab, weights, loss)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)) or loss > limit:
                raise TrainingError(
                    f"training diverged at step {step + 1}: loss {loss:.4g} (limit {limit:.3g}), gradient norm "
                    f"{grad_norm:.4g}. The last good checkpoint (step {metrics.last_saved}) is kept in {cfg.out}; "
                    "lower --lr or --clip-grad and continue with --resume"
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_done += sum(r.length for r in batch)
            rate = tokens_done / (time.perf_counter() - start)
            acc = totals.accuracy()
            if step % cfg.log_every == 0 or step == total:
                metrics.write({"step": step, "lr": lr_at(step - 1, cfg, total), "loss": loss, "acc": acc,
                               "grad_norm": grad_norm, "tokens_per_s": rate, "tokens": tokens_before + tokens_done,
                               "elapsed_s": metrics.elapsed_before + time.perf_counter() - start})
            if eval_refs and (step % cfg.eval_every == 0 or step == total):
                last_eval = _evaluate(model, drafter, samples, eval_refs, world, cfg, lm_head)
                metrics.write({"step": step, "eval_loss": last_eval.mean_loss(weights), "eval_acc": last_eval.accuracy()})
            if step % cfg.save_every == 0 or step == total:
                meta.metrics = _summary(step, total, metrics, last_eval, weights, init_record)
                _save(cfg, world, drafter, optimizer, step, meta, identity, aux_scale)
                metrics.last_saved = step
            bar.set_postfix(loss=f"{loss:.3f}", acc1=f"{acc[0]:.2f}", tok_s=f"{rate:.0f}", refresh=False)
            bar.update(1)
    finally:
        bar.close()
    if world.is_main:
        from ..plots import plot_training_curves

        plot_training_curves(cfg.out / METRICS_FILE, cfg.out / "curves.png")
    return meta.metrics


def _train_step(ddp, drafter, samples, batch, world, cfg, weights, lm_head) -> Totals:
    """Forward and backward over this rank's share of ``batch``; gradients are global sums / count."""
    counts = sum(masked_counts(r, cfg.ttt_steps) for r in batch)  # the same on every rank: no communication
    mine = batch[world.rank:: world.size]
    totals = Totals(cfg.ttt_steps)
    # DDP syncs gradients on the last backward; a rank without a sample still runs one (scaled by 0).
    work = forward_groups(mine, cfg.pack_tokens) if mine else [None]
    for i, group in enumerate(work):
        sample = samples.load_batch(group if group is not None else batch[:1]).to(cfg.device)
        # Training needs only the draft vocabulary's logits; the logged accuracy compares with the target's
        # top-1 within it (held-out evaluation below uses the full vocabulary, and the target's distribution at
        # temperature 1 whatever --teacher-temperature trains towards, so eval losses compare across runs).
        teacher = teacher_targets(sample.final, lm_head, drafter.t2d, full_vocab=False,
                                  temperature=cfg.teacher_temperature)
        context = ddp.no_sync() if (world.size > 1 and i < len(work) - 1) else nullcontext()
        with context:
            logits = ddp(sample.input_ids, sample.aux)
            losses, correct, count = step_sums(drafter, logits, sample.loss_mask, teacher)
            loss = sum(w * l / max(float(c), 1.0) for w, l, c in zip(weights, losses, counts))
            scale = 0.0 if group is None else float(world.size)  # DDP averages over ranks; we want the sum
            (loss * scale).backward()
        if group is not None:
            totals.add(losses, correct, count)
    totals.all_reduce(world)
    return totals


@torch.no_grad()
def _evaluate(model, drafter, samples, refs, world, cfg, lm_head) -> Totals:
    totals = Totals(cfg.ttt_steps)
    for ref in refs[world.rank:: world.size]:
        sample = samples.load(ref).to(cfg.device)
        teacher = teacher_targets(sample.final, lm_head, drafter.t2d)
        totals.add(*step_sums(drafter, model(sample.input_ids, sample.aux), sample.loss_mask, teacher))
    totals.all_reduce(world)
    return totals


def _summary(step, total, metrics, last_eval: Totals | None, weights, init: dict) -> dict:
    summary = {"step": step, "total_steps": total, "train_loss": metrics.last_loss, "init": init}
    if last_eval is not None:
        summary.update(eval_loss=last_eval.mean_loss(weights), eval_acc_per_position=last_eval.accuracy(),
                       eval_positions=int(last_eval.count[0]))
    return summary


def _save(cfg, world, drafter, optimizer, step, meta, identity, aux_scale) -> None:
    """The checkpoint holds the drafter engines run (fc over raw aux); the state holds what training optimizes."""
    if world.is_main:
        save_checkpoint(cfg.out / CHECKPOINT_DIR, raw_input_copy(drafter, aux_scale), meta,
                        parse_dtype(cfg.save_dtype, "--save-dtype"))
        buffer = io.BytesIO()
        torch.save({"step": step, "drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(),
                    "fc_input_scale": None if aux_scale is None else aux_scale.cpu(),
                    "settings": _jsonable(cfg.settings()), **_jsonable(identity)}, buffer)
        atomic_write_bytes(cfg.out / STATE_FILE, buffer.getvalue())
    world.barrier()


class _Metrics:
    """metrics.jsonl: on resume, lines past the resumed step are dropped so the file matches an uninterrupted run,
    and the run's wall time goes on from the last kept line (tokens come from the batch schedule)."""

    def __init__(self, path: Path, step: int, enabled: bool):
        self.path, self.enabled, self.last_saved, self.last_loss = path, enabled, step, None
        self.elapsed_before = 0.0
        if enabled and path.is_file():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
            atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())
            trained = [row for row in map(json.loads, kept) if "loss" in row]
            self.elapsed_before = trained[-1]["elapsed_s"] if trained else 0.0

    def write(self, record: dict) -> None:
        if "loss" in record:
            self.last_loss = record["loss"]
        if self.enabled:
            with self.path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
