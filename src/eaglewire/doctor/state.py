"""What the doctor's checks share: settings, results, the state they read, statuses."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..data.manifest import Manifest
from ..data.samples import DatasetSamples
from ..drafter.checkpoint import (
    CheckpointMeta,
)
from ..drafter.model import Drafter
from ..engine.context_lookup import LookupShape
from ..errors import EaglewireError
from ..interop.foreign_data import ForeignDataset
from ..stacks import STACKS
from ..target import Target
from ..wiring import Wiring

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
ENGINES = ("eaglewire", "vllm", "sglang")
# SGLang's rule for explicit ids depends on the model file of the build (engine_ids.py says which
# PR made the +1 shift conditional on ids[0] == 1, and where).
# --engine-version names one of the conventions stacks.py records for SGLang.
SGLANG_VERSIONS = {rule.removeprefix("sglang-"): rule for rule in STACKS["sglang"].conventions}
HEATMAP_FILE = "tensor_match.png"
# numbers.tensors reruns the target on the leading tokens of stored samples: every sample while the budget
# gives each at least MATCH_MIN_TOKENS of its own after the prefix all samples share (a chat template's
# system prompt, run once), else an even spread over every shard. Rerunning 4096 tokens costs SmolLM2-135M
# about 15 s on 2 idle CPU cores.
MATCH_BUDGET = 4096
MATCH_MIN_TOKENS = 32
REPORT_FILE = "doctor.json"
# acceptance.offline evaluates enough held-out positions to detect a drop of OFFLINE_DETECT_DROP in position-1
# accuracy (two-sided 5% level, 80% power: ~700 positions at 0.35, never more than 783), and fails when the
# accuracy falls below the recorded one by more than OFFLINE_Z standard errors of the difference.
OFFLINE_DETECT_DROP = 0.05
OFFLINE_Z = 1.96  # two-sided 5%
OFFLINE_POWER_Z = 0.84  # 80% power
# Positions of one conversation are not independent draws: one harder conversation moved a correctly wired
# drafter's accuracy 0.07 below the recorded figure (a third-turn record, 601 positions). So the check reads at
# least OFFLINE_MIN_SAMPLES held-out conversations where the data holds them, and its margin is the larger of
# the binomial one and the spread between the conversations' accuracies.
OFFLINE_MIN_SAMPLES = 4
# acceptance.live: an alternative "beats" the declared wiring when McNemar's z over the positions where
# exactly one of them agrees with the target reaches LIVE_Z (about 1 in 700 by chance, one-sided; there
# are ~15 alternatives) and it wins at least LIVE_MIN_WINS more positions.
LIVE_Z = 3.0
LIVE_MIN_WINS = 4
LIVE_MIN_ACCURACY = 0.05  # below this for every wiring the live check cannot rank wirings
# acceptance.observed on the doctor's own prompts, answered token for token as the live continuations: a
# wiring explains the served figure when its walk reproduces it to within this many accepted tokens (float
# noise between the server's forward and the doctor's flips the odd near-tie: the shipped drafter served
# under six wirings was reproduced to within 0 to 1.4 tokens over ~280 verify steps; benchmarks/doctor_served.py)
OBSERVED_EXACT_TOKENS = 3
LIVE_PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about a lighthouse.",
    "List three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how to make a cup of tea.",
    "Summarize the plot of Romeo and Juliet.",
)
FINGERPRINT_MEANING = {
    "weights_sha256": "weights (another checkpoint, fine-tune or quantization)",
    "chat_template_sha256": "chat template",
    "tokenizer_sha256": "tokenizer",
    "config_sha256": "architecture config",
    "model_type": "model family",
    "num_layers": "layer count",
    "hidden_size": "hidden size",
    "vocab_size": "vocabulary size",
}


class DoctorError(EaglewireError):
    """The doctor was asked for something it cannot do (a bad option or a missing folder)."""


@dataclass
class CheckResult:
    name: str
    status: str  # PASS, FAIL or SKIPPED
    detail: str  # what was measured, or why the check was skipped
    fix: str = ""  # what to do next (failures)
    data: dict = field(default_factory=dict)  # the numbers behind the verdict, for --json


@dataclass
class DoctorConfig:
    checkpoint: str  # a checkpoint folder, or 'shipped' (the drafter packaged for the target)
    data: Path | None = None
    target: str | None = None  # default: the target the checkpoint records
    engine: str = "eaglewire"
    engine_version: str | None = None
    out: Path | None = None
    match_samples: int | None = None  # at most this many stored samples rerun for numbers.tensors (None: budget decides)
    match_tokens: int = 512  # at most this many leading tokens of each
    match_budget: int = MATCH_BUDGET  # tokens the target reruns for numbers.tensors, shared by every sample checked
    eval_samples: int = 32  # held-out samples for acceptance.offline (training evaluates 32)
    live_prompts: int = 4
    live_tokens: int = 48
    observed_accept_len: float | None = None  # a served figure to explain (acceptance.observed)
    observed_accept_rate: float | None = None  # accepted / drafted tokens, as vLLM's metrics count it
    served_chain: int = 3  # draft tokens per step of the served engine (vLLM's num_speculative_tokens)
    server: str | None = None  # a running server whose /metrics give the observed figures (served.py)
    server_traffic: bool = True  # send the server the live prompts and read the figures over them alone
    # filled from --server's metrics (served.py), never given: where the figures came from, and the share
    # of verify steps that accepted the draft at each depth
    served_from: str | None = None
    observed_per_position: tuple[float, ...] | None = None
    served_texts: tuple[str, ...] | None = None  # the server's answers to the live prompts (its own traffic: None)
    # how an eaglewire server's chain drafts beyond its length (its eaglewire_drafting_info): the chain ends
    # after a draft the drafter gives less than served_min_confidence, and with served_lookup, steps where the
    # context repeated itself draft from it and are not the drafter's (its counters skip them)
    served_min_confidence: float = 0.0
    served_lookup: LookupShape | None = None
    served_lookup_steps: int | None = None  # the steps its counters say drafted from the context

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise DoctorError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine_version is not None and self.engine == "sglang" and self.engine_version not in SGLANG_VERSIONS:
            raise DoctorError(
                f"--engine-version for sglang must be one of {', '.join(SGLANG_VERSIONS)} (whether your build's "
                f"model file shifts explicit ids by +1 always, or only when the first id is 1; PR #25454), got "
                f"{self.engine_version!r}. eaglewire cannot tell from a release number: the PR changed "
                "deepseek_v2.py only, so look at set_eagle3_layers_to_capture in your build's model file"
            )
        if self.match_samples is not None and self.match_samples < 1:
            raise DoctorError(f"--match-samples must be >= 1, got {self.match_samples}")
        if self.match_budget < MATCH_MIN_TOKENS:
            raise DoctorError(f"--match-budget must be >= {MATCH_MIN_TOKENS} tokens, got {self.match_budget}")
        for name in ("match_tokens", "live_prompts", "live_tokens"):
            if getattr(self, name) < 1:
                raise DoctorError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.eval_samples < 0:
            raise DoctorError(f"--eval-samples must be >= 0, got {self.eval_samples}")
        if self.served_chain < 1:
            raise DoctorError(f"--served-chain must be >= 1, got {self.served_chain}")
        if self.observed_accept_len is not None and not 1 <= self.observed_accept_len <= self.served_chain + 1:
            raise DoctorError(f"--observed-accept-len must lie in [1, --served-chain + 1 = {self.served_chain + 1}], "
                              f"got {self.observed_accept_len}")
        if self.observed_accept_rate is not None and not 0 <= self.observed_accept_rate <= 1:
            raise DoctorError(f"--observed-accept-rate must lie in [0, 1], got {self.observed_accept_rate}")
        if self.live_prompts > len(LIVE_PROMPTS):
            raise DoctorError(f"--live-prompts must be at most {len(LIVE_PROMPTS)}, got {self.live_prompts}")
        if self.data is not None:
            self.data = Path(self.data)
        if self.out is not None:
            self.out = Path(self.out)


# ---- what the checks read ------------------------------------------------------------------
# loading.py builds the state once, from what the inputs allow, before any check runs; checks only read
# it, so the order of CHECKS does not matter. Whatever could not be loaded is None, and the state says
# why where a check reports it.

# What the checks that rerun the target say when its forward never produced a captured tensor.
CAPTURE_FIX = ("capture hooks sit on the decoder stack target.py declares for this model type; a wrapper must run "
               "its language model's decoder layers")


@dataclass(frozen=True)
class DrafterLoad:
    """The drafter built on the target's embedding: strictly, else without the engine-id check (so that
    the checks of its weights still run when only its config.json ids are wrong)."""

    drafter: Drafter | None  # in float32; None when the weights do not load at all
    dtype: str = ""  # the weights' dtype as stored (the drafter is converted)
    wiring: Wiring | None = None  # as the strict load read it
    strict_error: str | None = None  # why the strict load failed; None when it passed


@dataclass(frozen=True)
class EngineReading:
    """What the declared engine reads from config.json: the ids (None: none it can use), the fields it
    needs that are missing or wrong, and what the ids capture under each convention it may follow."""

    engine: str  # --engine
    ids: list[int] | None
    problems: list[str]
    captures: dict[str, Wiring | str]  # convention -> the wiring its ids capture, or why they capture nothing
    layers: int  # the target's layer count the ids were read against

    @property
    def wiring(self) -> Wiring | None:
        """What the engine captures, when every convention it may follow agrees (SGLang builds may not)."""
        values = list(self.captures.values())
        if values and all(isinstance(w, Wiring) for w in values) and len(set(values)) == 1:
            return values[0]
        return None

    @property
    def source(self) -> str:
        """Who names ``wiring``, for messages."""
        return f"{self.engine} reading config.json ids {self.ids}"


@dataclass(frozen=True)
class LiveSample:
    """One prompt with the target's greedy continuation, every point captured on it, and the target's
    greedy next token at each position (over the drafter's vocabulary map)."""

    ids: torch.Tensor
    prompt_len: int
    captured: dict
    top1: torch.Tensor


@dataclass(frozen=True)
class CheckState:
    """Everything the checks read, loaded once (loading.py); frozen, so no check can leave anything for another."""

    cfg: DoctorConfig
    folder: Path
    raw: dict | None = None  # config.json
    meta: CheckpointMeta | None = None
    config_error: str | None = None  # why config.json or its eaglewire section cannot be read
    target: Target | None = None
    drafter_load: DrafterLoad | None = None  # None: no target to build it on, or config.json unreadable
    samples: DatasetSamples | None = None
    data_error: str | None = None  # why --data did not open
    foreign_data: ForeignDataset | None = None  # --data in speculators' or SpecForge's layout (no manifest)
    engine_reading: EngineReading | None = None  # None: no eaglewire section to compare with
    live: tuple[LiveSample, ...] | None = None  # the live continuations, for acceptance.live and .observed
    live_error: str | None = None  # why they could not be computed

    @property
    def drafter(self) -> Drafter | None:
        return self.drafter_load.drafter if self.drafter_load is not None else None

    @property
    def manifest(self) -> Manifest | None:
        return self.samples.manifest if self.samples is not None else None

    @property
    def engine_wiring(self) -> Wiring | None:
        return self.engine_reading.wiring if self.engine_reading is not None else None


def result_pass(name: str, detail: str, **data) -> CheckResult:
    return CheckResult(name, PASS, detail, "", data)


def result_fail(name: str, detail: str, fix: str, **data) -> CheckResult:
    return CheckResult(name, FAIL, detail, fix, data)


def result_skip(name: str, reason: str, **data) -> CheckResult:
    return CheckResult(name, SKIPPED, reason, "", data)


