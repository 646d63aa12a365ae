"""What the doctor's checks share: settings, results, the state they fill in, statuses."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..drafter.checkpoint import (
    CheckpointMeta,
)
from ..drafter.model import Drafter
from ..data.manifest import Manifest
from ..data.samples import DatasetSamples
from ..target import Target
from ..wiring import Wiring

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
ENGINES = ("eaglewire", "vllm", "sglang")
# SGLang's rule for explicit ids depends on the model file of the build (engine_ids.py): PR #25454
# (merged 2026-05-18 as f504970) made the +1 shift conditional on ids[0] == 1, in deepseek_v2.py.
SGLANG_VERSIONS = {"pre-25454": "sglang-pre-25454", "post-25454": "sglang-post-25454"}
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
# acceptance.live: an alternative "beats" the declared wiring when McNemar's z over the positions where
# exactly one of them agrees with the target reaches LIVE_Z (about 1 in 700 by chance, one-sided; there
# are ~15 alternatives) and it wins at least LIVE_MIN_WINS more positions.
LIVE_Z = 3.0
LIVE_MIN_WINS = 4
LIVE_MIN_ACCURACY = 0.05  # below this for every wiring the live check cannot rank wirings
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


class DoctorError(ValueError):
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


# ---- state shared by the checks ------------------------------------------------------------


@dataclass
class CheckState:
    cfg: DoctorConfig
    folder: Path
    raw: dict | None = None  # config.json
    meta: CheckpointMeta | None = None
    target: Target | None = None
    drafter: Drafter | None = None
    manifest: Manifest | None = None
    samples: DatasetSamples | None = None
    config_error: str | None = None  # why config.json or its eaglewire section cannot be read
    engine_wiring: Wiring | None = None  # what the declared engine captures from config.json, when known
    engine_reading: str = ""  # how it reads them, for messages
    live: object | None = None  # doctor_evidence.LiveRun: acceptance.live's continuations, for acceptance.observed


def result_pass(name: str, detail: str, **data) -> CheckResult:
    return CheckResult(name, PASS, detail, "", data)


def result_fail(name: str, detail: str, fix: str, **data) -> CheckResult:
    return CheckResult(name, FAIL, detail, fix, data)


def result_skip(name: str, reason: str, **data) -> CheckResult:
    return CheckResult(name, SKIPPED, reason, "", data)


