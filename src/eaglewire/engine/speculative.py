"""The speculative decoding engine: load once, then ``generate`` streams text and metrics.

    engine = Engine.load()                      # smollm2-135m and its shipped drafter
    for event in engine.generate("Why is the sky blue?", GenerationConfig(max_new_tokens=64)):
        print(event.text, end="")               # Chunk events; the last event is Finished

One step: the drafter proposes a chain or a tree below the last committed
token (or, with ``GenerationConfig.lookup``, the context proposes the tokens
that followed where its last tokens occurred before: ``context_lookup.py``);
the target runs all of it in one forward (``lean.py``) and captures the
drafter's aux states on the way, using the same ``Wiring`` points extraction
stored; acceptance (``sampling.py``) keeps a path and adds one token of the
target's own; the target's KV cache keeps that path, and the drafter's cache is
extended with it (``drafting.py``). Without a drafter every step is an ordinary
decode step through the same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from ..drafter.checkpoint import CheckpointError, load_checkpoint
from ..drafter.model import Drafter
from ..dtypes import target_dtype
from ..errors import EaglewireError
from ..target import DEFAULT_TARGET, Target, load_target
from ..wiring import CapturePoint, Wiring, WiringError
from .context_lookup import LookupShape, lookup_drafts
from .draft_tree import DraftTree
from .drafting import DraftRunner, TreeShape
from .generation_metrics import GenerationMetrics
from .hf_forward import target_forward
from .kv_cache import KVCache
from .lean import SequenceCall, SequenceOutput
from .projection import check_product_dtype
from .sampling import SamplingParams, accept, tree_row_probs
from .stops import OutputTracker

STRATEGIES = ("chain", "tree", "none")
DEFAULT_MAX_LEN = 4096  # context this engine allocates for, capped by the target's own limit
MAX_TOP_LOGPROBS = 20  # alternatives reported per token (OpenAI's limit)
_EMPTY = DraftTree.chain(torch.zeros(0, dtype=torch.long))


class EngineError(EaglewireError):
    """The target and drafter do not belong together, or a request cannot be served."""


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    strategy: str = "chain"  # chain | tree | none (plain decoding)
    chain_length: int = 6  # at most: min_confidence ends a chain at its first doubted draft
    min_confidence: float = 0.5  # chain: stop drafting after a token the drafter gives less than this
    tree: TreeShape = field(default_factory=TreeShape)
    lookup: LookupShape | None = None  # drafts looked up in the context where it has repeated itself; None: off
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # report each token's log-probability and this many alternatives; None: off

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise EngineError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.chain_length < 1:
            raise EngineError(f"chain length must be >= 1, got {self.chain_length}")
        if self.max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise EngineError(f"min_confidence must be in [0, 1], got {self.min_confidence}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise EngineError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS} alternatives, got {self.logprobs}")


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the target's own distribution (its raw logits'
    log-softmax, before temperature, top_p, penalties and logit_bias), and the likeliest alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), likeliest first


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # one per token_ids entry when GenerationConfig.logprobs is set, else empty
    metrics: GenerationMetrics  # the generation's counters so far (live: read them before resuming it)


@dataclass(frozen=True)
class Finished:
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: GenerationMetrics
    logprobs: list[TokenLogprob] = field(default_factory=list)


class SequenceSlot(NamedTuple):
    """What one sequence in flight owns: the target's KV cache and a draft runner with its own cache."""

    cache: KVCache
    runner: DraftRunner | None


Generation = Generator["Chunk | Finished | SequenceCall", SequenceOutput, None]


class Engine:
    def __init__(self, target: Target, drafter: Drafter | None, wiring: Wiring | None, max_len: int | None = None,
                 dtype: str = "fp32", batched_lm_head: bool = False):
        """Prefer ``Engine.load``. ``wiring`` names the aux states ``drafter`` was trained on. ``dtype``: what the
        target's matrix products multiply in (``dtypes.TARGET_DTYPES``); at bf16 the exact reference is this
        engine's own plain decoding at bf16, which speculation reproduces bit for bit (``lean.py``).
        ``batched_lm_head``: the target's lm_head kernel for workloads that decode many sequences together
        (``regenerate``); the default suits a single stream (``LeanModel.from_hf``)."""
        product_dtype = target_dtype(dtype)
        if (drafter is None) != (wiring is None):
            raise EngineError("a drafter needs its wiring, and a wiring needs a drafter")
        limit = target.text_config.max_position_embeddings
        if max_len is None:
            max_len = min(DEFAULT_MAX_LEN, limit)
        if not 2 <= max_len <= limit:
            raise EngineError(f"max_len must be in 2..{limit} (the target's context), got {max_len}")
        self.max_len = max_len
        if wiring is not None:
            try:
                wiring.check_reachable(target.num_layers)
            except WiringError as exc:
                raise EngineError(f"the drafter's wiring {wiring} cannot be captured from this target: {exc}") from exc
            if drafter.config.fc_in_features != len(wiring.aux) * target.hidden_size:
                raise EngineError(
                    f"the drafter's fc takes {drafter.config.fc_in_features} features, but its wiring {wiring} "
                    f"gives {len(wiring.aux)} x {target.hidden_size}"
                )
        self.target, self.drafter, self.wiring = target, drafter, wiring
        # The target's forward: lean.py's where it applies, else the family's own HF forward (hf_forward.py).
        self.dtype = dtype
        self.batched_lm_head = batched_lm_head
        self.lean, self.forward_reason = target_forward(target, self.max_len, product_dtype, batched_lm_head)
        self.cache = self.lean.new_cache()
        self.runner = DraftRunner(drafter, self.max_len) if drafter is not None else None
        eos = target.model.generation_config.eos_token_id
        self.eos_ids = frozenset(([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
                                 + ([target.tokenizer.eos_token_id] if target.tokenizer.eos_token_id is not None else []))

    @classmethod
    def load(cls, target: str = DEFAULT_TARGET, drafter: str | Path | None = "shipped",
             max_len: int | None = None, dtype: str = "fp32") -> Engine:
        """``drafter``: a checkpoint folder, 'shipped' (the one packaged for ``target``) or None (no speculation).
        ``dtype``: the target's product dtype, as for ``Engine``."""
        check_product_dtype(target_dtype(dtype))  # before the target's load
        if drafter is not None:
            check_drafter_path(drafter)  # before the target's load (seconds to minutes)
        loaded = load_target(target)
        if drafter is None:
            return cls(loaded, None, None, max_len, dtype)
        if drafter == "shipped":
            from ..drafter.shipped import shipped_drafter

            drafter = shipped_drafter(target)
        checkpoint = load_checkpoint(Path(drafter), loaded.layout.embed)
        try:
            checkpoint.meta.check_target(loaded.fingerprint)
        except CheckpointError as exc:
            raise EngineError(
                f"drafter {drafter} does not belong to target {target!r}: {exc}. Serve it with the target it was "
                "trained on, or train a drafter for this target (`eaglewire train --target ...`)"
            ) from exc
        return cls(loaded, checkpoint.drafter.float(), checkpoint.meta.wiring, max_len, dtype)

    def with_dtype(self, dtype: str) -> Engine:
        """The same target and drafter, the target's products in ``dtype`` (one more packed copy of its matrices).

        A drafter trained on fp32 aux states is not refused at bf16, because it does not measurably hurt:
        on 10 MT-bench questions (``benchmarks/target_dtype.py``) the bf16 aux states differ from the fp32
        ones by 0.0035-0.0075 (the doctor's tensor-match error; a different tensor is >= 0.22, the match
        tolerance 0.02), and the shipped drafter's chain tau is 1.41 at bf16 against 1.40 at fp32."""
        return Engine(self.target, self.drafter, self.wiring, self.max_len, dtype, self.batched_lm_head)

    # -- prompts --------------------------------------------------------------------

    def chat_prompt(self, prompt: str | list[dict]) -> list[int]:
        """Token ids of a user prompt (or a message list) under the target's chat template."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return list(self.target.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                              tokenize=True, return_dict=False))

    def generate(self, prompt: str | list[dict], config: GenerationConfig | None = None) -> Iterator[Chunk | Finished]:
        return self.generate_ids(self.chat_prompt(prompt), config)

    # -- driving a generation -------------------------------------------------------------------

    def generate_ids(self, prompt_ids: list[int], config: GenerationConfig | None = None) -> Iterator[Chunk | Finished]:
        return self._drive(self.start(prompt_ids, config, SequenceSlot(self.cache, self.runner)))

    def complete_ids(self, prompt_ids: list[int], config: GenerationConfig | None = None) -> Finished:
        """Run ``generate_ids`` to the end and return its ``Finished`` event (no streaming)."""
        *_, finished = self.generate_ids(prompt_ids, config)
        return finished

    def new_slot(self) -> SequenceSlot:
        """Caches for one more sequence in flight (the drafter's weights are shared)."""
        return SequenceSlot(self.lean.new_cache(), self.runner.with_own_cache() if self.runner is not None else None)

    @property
    def capture(self) -> tuple[CapturePoint, ...]:
        """What every forward captures: the drafter's aux states, or nothing without a drafter."""
        return self.wiring.aux if self.wiring is not None else ()

    def start(self, prompt_ids: list[int], config: GenerationConfig | None, slot: SequenceSlot,
              may_draft: Callable[[], bool] = lambda: True) -> Generation:
        """A generation to drive step by step; ``generate_ids`` drives one, ``batching.py`` several at once.

        The generator yields ``Chunk`` and ``Finished`` events, and a ``SequenceCall`` whenever it
        needs the target: send it that call's ``SequenceOutput`` (from ``lean.forward_batch`` with
        ``capture=self.capture``). It uses ``slot``'s caches, which nothing else may touch until it ends.
        ``may_draft`` is asked before each step: False makes it a plain decode step (the drafter still
        reads the accepted token, so drafting can resume); the output is the same either way.
        """
        config = config or GenerationConfig()
        length = len(prompt_ids)
        if length < 1:
            raise EngineError("the prompt is empty")
        if length + 1 > self.max_len:
            raise EngineError(f"the prompt has {length} tokens; this engine's context holds {self.max_len} "
                              f"(prompt plus at least one new token)")
        if config.strategy != "none" and slot.runner is None:
            raise EngineError(f"strategy {config.strategy!r} needs a drafter; load one, or use strategy 'none'")
        return self._steps(prompt_ids, config, config.strategy != "none", slot, may_draft)

    def _drive(self, steps: Generation) -> Iterator[Chunk | Finished]:
        item = next(steps)
        while True:
            if isinstance(item, SequenceCall):
                item = steps.send(self.lean.forward_batch([item], self.capture)[0])
                continue
            yield item
            if isinstance(item, Finished):
                return
            item = next(steps)

    # -- the loop -------------------------------------------------------------------

    def _steps(self, prompt_ids: list[int], config: GenerationConfig, speculate: bool, slot: SequenceSlot,
               may_draft: Callable[[], bool]) -> Generation:
        sampling, generator = config.sampling, config.sampling.generator()
        output = OutputTracker(self.target.tokenizer, self.eos_ids, config.stop, config.max_new_tokens)
        counts = torch.zeros(self.lean.config.vocab_size) if sampling.penalized else None  # tokens generated so far
        logprobs: list[TokenLogprob] = []  # one per output.token_ids entry, when asked for

        def push(token: int, logits: torch.Tensor) -> bool:
            """Commit one token (sampled from the target's ``logits`` [V]); True once the output is finished."""
            if counts is not None:
                counts[token] += 1
            if config.logprobs is not None:
                logprobs.append(_logprob(logits, token, config.logprobs))
            return output.push(token)

        metrics = GenerationMetrics(prompt_tokens=len(prompt_ids), target_dtype=self.dtype)
        aux_points = self.wiring.aux if speculate else ()
        start = time.perf_counter()

        # 0. Prefill: the target reads the prompt and picks the first token; the drafter reads the prompt's aux states.
        length = len(prompt_ids)
        with metrics.timing("prefill_s"):
            prefill = yield SequenceCall(slot.cache, torch.tensor(prompt_ids), torch.arange(length),
                                         logits_rows=(length - 1,))
            first = accept(_EMPTY, tree_row_probs(_EMPTY, lambda row: prefill.logits[0], sampling, counts),
                           generator).bonus
            root = None
            if speculate:
                root = slot.runner.extend(torch.tensor(prompt_ids[1:] + [first]),
                                          _aux(prefill.captured, aux_points, None), 0)
        committed = length + 1  # n: tokens in the sequence; the target has run all but the last
        last = first
        push(first, prefill.logits[0])
        if committed >= self.max_len:
            output.end_for_context()

        while not output.finished:
            text = output.stream()
            if text:
                yield Chunk(text, list(output.token_ids), list(logprobs), metrics)
            room = self.max_len - committed  # verify slots n-1 .. n-1+N must stay below max_len
            remaining = config.max_new_tokens - len(output.token_ids) - 1  # drafts worth checking; the bonus is free
            # 1. Draft: a chain or tree of guesses from the drafter (none without speculation); with
            # config.lookup, where the context has repeated itself, the tokens that followed (no drafter step).
            with metrics.timing("draft_s"):
                drafting = speculate and remaining > 0 and may_draft()
                drafts = (lookup_drafts([*prompt_ids, *output.token_ids], config.lookup, min(room, remaining))
                          if drafting and config.lookup is not None else [])
                if drafts:
                    tree = DraftTree.chain(torch.tensor(drafts, dtype=torch.long))
                else:
                    tree = self._draft(slot.runner, root, committed, config, room, remaining) if drafting else _EMPTY
            with metrics.timing("verify_s"):
                # 2. Verify: one target forward over the last token and every draft token (batched with other
                # sequences, so this includes waiting for them).
                call = _verify_call(slot.cache, tree, last, committed)
                verified = yield call
                # 3. Accept: the longest draft path the target agrees with, plus one token of the target's own.
                path, bonus, rows, row_logits = self._accept(tree, verified, sampling, generator, counts)
                slot.cache.keep(call.slots[rows], committed - 1)
            metrics.record_step(int(tree.depths.max()) if tree.size else 0, len(path), tree.size, bool(drafts))
            # 4. Commit: emit the new tokens, then let the drafter read them with their aux states.
            new_tokens = [int(tree.tokens[node]) for node in path] + [bonus]
            for token, row in zip(new_tokens, rows):
                if push(token, row_logits(row)):
                    break
            committed += len(new_tokens)
            last = bonus
            if not output.finished and committed >= self.max_len:
                output.end_for_context()
            if speculate and not output.finished:
                with metrics.timing("draft_s"):
                    root = slot.runner.extend(torch.tensor(new_tokens), _aux(verified.captured, aux_points, rows),
                                              committed - len(new_tokens) - 1)

        metrics.new_tokens = len(output.token_ids)
        metrics.total_s = time.perf_counter() - start
        text = output.stream()
        if text:
            yield Chunk(text, list(output.token_ids), list(logprobs), metrics)
        yield Finished(output.text, list(output.token_ids), output.finish_reason, metrics, logprobs)

    def _draft(self, runner: DraftRunner, root: torch.Tensor, committed: int, config: GenerationConfig, room: int,
               remaining: int) -> DraftTree:
        """A tree when the context has room for all of it, else a chain that fits the room and the answer."""
        base = committed - 2
        if config.strategy == "tree" and room >= config.tree.total_tokens:
            return runner.tree(root, base, config.tree)
        length = min(config.chain_length, room, remaining)
        return runner.chain(root, base, length, config.min_confidence) if length > 0 else _EMPTY

    def _accept(self, tree: DraftTree, verified: SequenceOutput, sampling: SamplingParams, generator: torch.Generator,
                counts: torch.Tensor | None) -> tuple[list[int], int, list[int], Callable[[int], torch.Tensor]]:
        """Acceptance over the verified tree: (accepted path, bonus token, rows of the kept tokens,
        the target's logits [V] at a row). Row k of the kept rows is the one its k-th new token was sampled from."""
        computed: dict[int, torch.Tensor] = {}

        def row_logits(row: int) -> torch.Tensor:  # row 0's logits came with the forward; the rest only if reached
            if row not in computed:
                computed[row] = (verified.logits if row == 0 else self.lean.logits(verified.hidden[row: row + 1]))[0]
            return computed[row]

        result = accept(tree, tree_row_probs(tree, row_logits, sampling, counts), generator)
        return result.path, result.bonus, [0] + [node + 1 for node in result.path], row_logits


def check_drafter_path(drafter: str | Path) -> None:
    """Refuse a drafter folder that is not there, before anything slow loads."""
    if drafter != "shipped" and not Path(drafter).is_dir():
        what = "is a file, not a checkpoint folder" if Path(drafter).exists() else "does not exist"
        raise EngineError(f"--drafter {drafter} {what}; give a checkpoint folder (e.g. RUN/checkpoint) or 'shipped'")


def _verify_call(cache: KVCache, tree: DraftTree, last: int, committed: int) -> SequenceCall:
    """[last] + tree through the target, at slots n-1.. and positions by tree depth."""
    start = committed - 1
    count = tree.size + 1
    ids = torch.cat([torch.tensor([last]), tree.tokens])
    positions = start + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])
    mask = None
    if not tree.is_chain:
        mask = torch.cat([torch.ones(count, start, dtype=torch.bool), tree.ancestor_mask()], dim=1)
    return SequenceCall(cache, ids, positions, torch.arange(start, start + count), mask, logits_rows=(0,))


def _logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    log_probs = logits.float().log_softmax(-1)
    best = log_probs.topk(top) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    return TokenLogprob(token, float(log_probs[token]), alternatives)


def _aux(captured: dict, points, rows: list[int] | None) -> torch.Tensor:
    """The drafter's fc input [T, num_aux*H]: captured aux states in wiring order, at ``rows``."""
    states = [captured[p] if rows is None else captured[p][rows] for p in points]
    return torch.cat(states, dim=-1)
