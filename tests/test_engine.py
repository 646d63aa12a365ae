"""The engine: exact greedy output, tau of an oracle, stops inside accepted blocks, refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eaglewire.drafter.checkpoint import load_checkpoint
from eaglewire.drafter.model import Drafter
from eaglewire.drafter.shipped import shipped_drafter
from eaglewire.engine.context_lookup import LookupShape
from eaglewire.engine.draft_tree import DraftTree
from eaglewire.engine.drafting import TreeShape
from eaglewire.engine.sampling import SamplingParams
from eaglewire.engine.speculative import (
    Chunk,
    Engine,
    EngineError,
    Finished,
    GenerationConfig,
)
from eaglewire.wiring import Wiring

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain recursion to a child.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your steps.",
    "Give me a haiku about autumn leaves.",
    "Why do cats purr?",
]
NEW_TOKENS = 40
SMALL_TREE = TreeShape(depth=4, top_k=4, total_tokens=12)


@pytest.fixture(scope="module")
def engine(smollm2):
    checkpoint = load_checkpoint(shipped_drafter("smollm2-135m"), smollm2.layout.embed)
    checkpoint.meta.check_target(smollm2.fingerprint)
    return Engine(smollm2, checkpoint.drafter.float(), checkpoint.meta.wiring, max_len=1024)


@pytest.fixture(scope="module")
def greedy_refs(engine):
    """The target's own greedy continuations, from HF generate."""
    refs = {}
    for prompt in PROMPTS:
        ids = engine.chat_prompt(prompt)
        with torch.no_grad():
            out = engine.target.model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        refs[prompt] = out[0, len(ids):].tolist()
    return refs


def run(engine, prompt, **kw) -> Finished:
    events = list(engine.generate(prompt, GenerationConfig(**kw)))
    assert isinstance(events[-1], Finished)
    streamed = "".join(e.text for e in events[:-1] if isinstance(e, Chunk))
    assert streamed == events[-1].text  # the stream adds up to the answer, nothing retracted
    return events[-1]


# "chain" is the default (stopped at the first doubted draft); "full chain" always drafts chain_length tokens.
DRAFTING = {"none": dict(strategy="none"), "chain": dict(strategy="chain"),
            "full chain": dict(strategy="chain", min_confidence=0.0), "tree": dict(strategy="tree", tree=SMALL_TREE)}


@pytest.mark.parametrize("drafting", DRAFTING)
def test_greedy_output_is_the_targets_own(engine, greedy_refs, drafting):
    accepted = 0
    for prompt, ref in greedy_refs.items():
        out = run(engine, prompt, max_new_tokens=NEW_TOKENS, **DRAFTING[drafting])
        assert out.token_ids == ref, prompt
        assert out.metrics.new_tokens == len(ref)
        accepted += out.metrics.accepted
        if drafting == "full chain":  # every step drafts the whole chain (but the last few, near the token limit)
            attempted, length = out.metrics.attempted_at, GenerationConfig.chain_length
            assert len(attempted) == length and attempted[-1] >= attempted[0] - (length - 1), attempted
    if drafting != "none":
        assert accepted > 0  # the shipped drafter does get tokens accepted


class OracleRunner:
    """Proposes the target's own greedy continuation: every draft must be accepted."""

    def __init__(self, prompt_len: int, continuation: list[int], wrong_from: int | None = None):
        self.prompt_len, self.continuation, self.wrong_from = prompt_len, continuation, wrong_from

    def extend(self, next_tokens, aux, start):
        return torch.zeros(1)

    def chain(self, root, base, length, min_confidence=0.0):
        done = base + 2 - self.prompt_len  # tokens generated so far
        tokens = list(self.continuation[done: done + length])
        tokens += [0] * (length - len(tokens))
        if self.wrong_from is not None:
            tokens = [t if done + i < self.wrong_from else (t + 1) % 1000 for i, t in enumerate(tokens)]
        return DraftTree.chain(torch.tensor(tokens, dtype=torch.long))

    def tree(self, root, base, shape):
        chain = self.chain(root, base, shape.depth)
        # a decoy sibling ranked first at depth 1: acceptance must skip it and take the right child
        decoy = (int(chain.tokens[0]) + 7) % 1000
        tokens = torch.cat([torch.tensor([decoy]), chain.tokens])
        parents = torch.cat([torch.tensor([-1]), torch.where(chain.parents < 0, -1, chain.parents + 1)])
        depths = torch.cat([torch.tensor([1]), chain.depths])
        return DraftTree(tokens, parents, depths, torch.zeros(len(tokens)))


def with_runner(engine, runner):
    clone = object.__new__(Engine)
    clone.__dict__.update(engine.__dict__, runner=runner)
    return clone


class RecordingRunner:
    """The engine's own runner, keeping every chain it drafts."""

    def __init__(self, runner):
        self.runner, self.chains = runner, []

    def extend(self, next_tokens, aux, start):
        return self.runner.extend(next_tokens, aux, start)

    def chain(self, root, base, length, min_confidence=0.0):
        drafted = self.runner.chain(root, base, length, min_confidence)
        self.chains.append((length, drafted))
        return drafted


@pytest.mark.parametrize("min_confidence", [0.0, 0.4, 0.9])
def test_a_chain_stops_after_its_first_doubted_draft(engine, greedy_refs, min_confidence):
    """Every draft but the last has probability >= min_confidence; the last is below it or the chain is full."""
    prompt = PROMPTS[0]
    recording = RecordingRunner(engine.runner)
    out = run(with_runner(engine, recording), prompt, max_new_tokens=NEW_TOKENS, chain_length=6,
              min_confidence=min_confidence)
    assert out.token_ids == greedy_refs[prompt]
    lengths = []
    for length, drafted in recording.chains:
        probs = torch.diff(drafted.scores, prepend=torch.zeros(1)).exp()
        assert bool((probs[:-1] >= min_confidence).all()), probs
        assert drafted.size == length or float(probs[-1]) < min_confidence, (length, probs)
        lengths.append(drafted.size)
    assert len(recording.chains) == out.metrics.verify_steps
    if min_confidence == 0.0:
        assert all(n == length for n, (length, _) in zip(lengths, recording.chains))
    else:  # the threshold did cut chains short, and (0.4) let confident ones run on
        assert min(lengths) == 1 and (min_confidence > 0.5 or max(lengths) > 1), lengths


@pytest.mark.parametrize("strategy", ["chain", "tree"])
def test_oracle_drafter_gives_tau_of_k_plus_one(engine, greedy_refs, strategy):
    prompt = PROMPTS[1]
    ref = greedy_refs[prompt]
    oracle = with_runner(engine, OracleRunner(len(engine.chat_prompt(prompt)), ref))
    k = 4
    out = run(oracle, prompt, max_new_tokens=1 + 5 * k + 5, strategy=strategy, chain_length=k,
              tree=TreeShape(depth=k, top_k=2, total_tokens=k + 1))
    assert out.token_ids == ref[: 1 + 5 * k + 5]
    assert out.metrics.tau == k + 1
    assert out.metrics.acceptance_at == [1.0] * k


def test_partly_wrong_oracle_still_gives_the_targets_output(engine, greedy_refs):
    prompt = PROMPTS[2]
    ref = greedy_refs[prompt]
    runner = OracleRunner(len(engine.chat_prompt(prompt)), ref, wrong_from=6)
    out = run(with_runner(engine, runner), prompt, max_new_tokens=NEW_TOKENS, chain_length=4)
    assert out.token_ids == ref
    assert out.metrics.verify_steps > 2


def test_random_drafter_gives_the_targets_output(engine, greedy_refs):
    torch.manual_seed(0)
    config = engine.drafter.config
    random_drafter = Drafter(config, engine.target.layout.embed, torch.randperm(config.vocab_size)[: config.draft_vocab_size])
    random = Engine(engine.target, random_drafter, engine.wiring, max_len=1024)
    for prompt in PROMPTS[:3]:
        for strategy in ("chain", "tree"):  # min_confidence 0: a random drafter doubts every draft, draft whole chains
            assert run(random, prompt, max_new_tokens=NEW_TOKENS, strategy=strategy, tree=SMALL_TREE,
                       min_confidence=0.0).token_ids == greedy_refs[prompt]


def test_a_deepened_drafter_drafts_in_the_engine_what_its_parent_drafts(engine, greedy_refs):
    """The shipped drafter with a second layer added as training adds it (zero output weights): the engine runs
    the new layer over its own cache and drafts exactly the parent's drafts, chain and tree."""
    from eaglewire.train.drafter_growth import with_num_layers

    deeper, _ = with_num_layers(engine.drafter, 2, engine.target.layout.embed)
    deep = Engine(engine.target, deeper, engine.wiring, max_len=1024)
    for strategy in ("chain", "tree"):
        ours, theirs = (run(e, PROMPTS[0], max_new_tokens=NEW_TOKENS, strategy=strategy, tree=SMALL_TREE)
                        for e in (deep, engine))
        assert ours.token_ids == theirs.token_ids == greedy_refs[PROMPTS[0]]
        assert (ours.metrics.accepted_at, ours.metrics.drafted) == (theirs.metrics.accepted_at, theirs.metrics.drafted)


def test_stops_inside_an_accepted_block(engine, greedy_refs):
    prompt = PROMPTS[1]
    ref = greedy_refs[prompt]
    oracle = with_runner(engine, OracleRunner(len(engine.chat_prompt(prompt)), ref))
    # drafts never run past max_new_tokens (the second step drafts one token), and the count is exact
    out = run(oracle, prompt, max_new_tokens=8, chain_length=4)
    assert (out.token_ids, out.finish_reason) == (ref[:8], "length")
    # a stop string that only appears once a later block lands
    full = engine.target.tokenizer.decode(ref, skip_special_tokens=True)
    stop = full[25:31]
    assert full.find(stop) == 25
    out = run(oracle, prompt, max_new_tokens=NEW_TOKENS, chain_length=4, stop=(stop,))
    assert out.text == full[:25] and out.finish_reason == "stop"
    assert len(out.token_ids) < len(ref)


def test_eos_inside_an_accepted_block(engine, greedy_refs):
    prompt = PROMPTS[0]
    ref = greedy_refs[prompt]
    assert ref[-1] in engine.eos_ids and len(ref) < NEW_TOKENS and len(ref) % 5 != 1  # EOS mid-block
    oracle = with_runner(engine, OracleRunner(len(engine.chat_prompt(prompt)), ref + [0] * 10))
    out = run(oracle, prompt, max_new_tokens=NEW_TOKENS, chain_length=4)
    assert out.token_ids == ref and out.finish_reason == "stop"


def test_context_limit_ends_the_answer(engine, smollm2):
    prompt_len = len(engine.chat_prompt(PROMPTS[1]))
    small = Engine(smollm2, engine.drafter, engine.wiring, max_len=prompt_len + 9)
    out = run(small, PROMPTS[1], max_new_tokens=NEW_TOKENS, chain_length=4)
    assert len(out.token_ids) == 9 and out.finish_reason == "length"
    too_small = Engine(smollm2, None, None, max_len=prompt_len)
    with pytest.raises(EngineError, match=f"the prompt has {prompt_len} tokens"):
        too_small.generate(PROMPTS[1])
    limit = smollm2.model.config.max_position_embeddings
    for bad in (0, limit + 1):  # never silently replaced by a default or capped
        with pytest.raises(EngineError, match=f"max_len must be in 2..{limit}"):
            Engine(smollm2, None, None, max_len=bad)


@pytest.mark.parametrize("strategy", ["chain", "tree"])
def test_looked_up_drafts_keep_the_output_the_targets_own(engine, greedy_refs, strategy):
    """Drafts from the context instead of the drafter where it repeated itself: still HF greedy's tokens, and
    the steps that looked up are counted apart, so the drafter's own tau stays readable."""
    shape = LookupShape(min_match=1, max_drafts=4)  # every step after a token seen before looks up
    looked_up = kept = 0
    for prompt, ref in greedy_refs.items():
        out = run(engine, prompt, max_new_tokens=NEW_TOKENS, strategy=strategy, tree=SMALL_TREE, lookup=shape)
        assert out.token_ids == ref, prompt
        m = out.metrics
        assert 0 <= m.lookup_steps <= m.verify_steps and m.lookup_accepted <= m.lookup_drafted
        drafter_steps = m.verify_steps - m.lookup_steps
        # the drafter's figures leave the looked-up steps out: its drafting steps, its drafts, its acceptances
        assert (m.attempted_at[0] if m.attempted_at else 0) <= drafter_steps and m.accepted <= m.drafted
        assert sum(m.accepted_at) == m.accepted and m.step_tokens == m.verify_steps + m.accepted + m.lookup_accepted
        assert m.drafter_tau * drafter_steps == pytest.approx(m.step_tokens - m.lookup_steps - m.lookup_accepted)
        looked_up, kept = looked_up + m.lookup_steps, kept + m.lookup_accepted
    assert looked_up > 0 and kept > 0  # the lookup did draft, and some of its drafts were right
    sampled = run(engine, PROMPTS[3], max_new_tokens=24, lookup=shape,
                  sampling=SamplingParams(temperature=0.8, seed=3))  # exactness at T > 0: test_sampling.py
    assert sampled.token_ids == run(engine, PROMPTS[3], max_new_tokens=24, lookup=shape,
                                    sampling=SamplingParams(temperature=0.8, seed=3)).token_ids


def test_sampling_is_seeded_and_runs_with_drafts(engine):
    sampling = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3)
    a = run(engine, PROMPTS[3], max_new_tokens=24, sampling=sampling)
    b = run(engine, PROMPTS[3], max_new_tokens=24, sampling=sampling)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0
    assert a.metrics.drafted > 0


def test_penalties_bias_and_logprobs_are_those_of_plain_decoding(engine):
    """Greedy under logit_bias and penalties, with logprobs: chain, tree and an oracle whose drafts are all
    accepted (so every row must count the drafted tokens above it) give plain decoding's tokens and logprobs."""
    prompt = PROMPTS[0]
    kw = {"max_new_tokens": NEW_TOKENS, "tree": SMALL_TREE, "logprobs": 2,
          "sampling": SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, logit_bias=((28, 3.0),))}
    plain = run(engine, prompt, strategy="none", **kw)
    assert plain.token_ids != run(engine, prompt, max_new_tokens=NEW_TOKENS, strategy="none").token_ids
    oracle = with_runner(engine, OracleRunner(len(engine.chat_prompt(prompt)), plain.token_ids))
    for speculating, strategy in ((engine, "chain"), (engine, "tree"), (oracle, "chain")):
        out = run(speculating, prompt, strategy=strategy, **kw)
        assert out.token_ids == plain.token_ids, strategy
        assert [e.token_id for e in out.logprobs] == out.token_ids
        assert [e.logprob for e in out.logprobs] == pytest.approx([e.logprob for e in plain.logprobs], abs=1e-3)
        assert [[t for t, _ in e.top] for e in out.logprobs] == [[t for t, _ in e.top] for e in plain.logprobs]
    assert out.metrics.tau > 4  # the oracle's drafts were accepted, penalties and all


def test_refuses_a_drafter_of_another_target_or_wiring(engine, smollm2, tmp_path):
    from eaglewire.drafter.checkpoint import save_checkpoint

    checkpoint = load_checkpoint(shipped_drafter("smollm2-135m"), smollm2.layout.embed)
    meta = dataclasses.replace(checkpoint.meta, target={**checkpoint.meta.target, "weights_sha256": "0" * 64})
    save_checkpoint(tmp_path / "other", checkpoint.drafter, meta)
    with pytest.raises(EngineError, match="does not belong to target .*weights_sha256"):
        Engine.load("smollm2-135m", tmp_path / "other")
    with pytest.raises(EngineError, match="cannot be captured from this target"):
        Engine(smollm2, engine.drafter, Wiring.parse("layer1.out,layer14.out,layer31.out"))
    with pytest.raises(EngineError, match="gives 2 x 576"):
        Engine(smollm2, engine.drafter, Wiring.parse("layer1.out,layer14.out"))
    with pytest.raises(EngineError, match="needs a drafter"):
        list(Engine(smollm2, None, None, max_len=256).generate("hi", GenerationConfig(strategy="chain")))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_every_supported_family_decodes_exactly(tiny_target_dir, family):
    """A tiny random target of each family with a random drafter: tree and chain output = HF greedy."""
    from eaglewire.drafter.model import DrafterConfig
    from eaglewire.target import load_target

    target = load_target(str(tiny_target_dir(family)))
    wiring = Wiring.parse("layer0.out,layer2.out,layer4.out")
    torch.manual_seed(1)
    drafter = Drafter(DrafterConfig.from_target(target.model.config, wiring, 512), target.layout.embed,
                      torch.randperm(target.fingerprint["vocab_size"])[:512])
    engine = Engine(target, drafter, wiring, max_len=256)
    ids = engine.chat_prompt("Hello there")
    with torch.no_grad():
        ref = target.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
    for strategy in ("chain", "tree", "none"):  # min_confidence 0: the random drafter drafts whole chains
        config = GenerationConfig(max_new_tokens=20, strategy=strategy, tree=SMALL_TREE, min_confidence=0.0)
        events = list(engine.generate_ids(ids, config))
        assert events[-1].token_ids == ref, (family, strategy)


def test_bf16_target_speculates_exactly_its_own_plain_decoding(engine):
    """At bf16 products the reference is the engine's own plain decoding at bf16: chain and tree
    outputs equal it token for token (row-invariant products and attention), and every output
    records the dtype. bf16 is a different model from fp32, so its answers may differ from HF's."""
    from eaglewire.engine.projection import native_bf16

    if not native_bf16():
        with pytest.raises(ValueError, match="in hardware"):
            engine.with_dtype("bf16")
        return
    bf16 = engine.with_dtype("bf16")
    assert bf16.lean.product_dtype == torch.bfloat16 and engine.lean.product_dtype == torch.float32
    for prompt in PROMPTS[:2]:
        plain = run(bf16, prompt, max_new_tokens=24, strategy="none")
        # a 32-token tree verifies 33 rows: more than one bf16 product takes (BF16_ROW_BLOCK, projection.py)
        for strategy, tree in (("chain", SMALL_TREE), ("tree", SMALL_TREE), ("tree", TreeShape(5, 8, 32))):
            spec = run(bf16, prompt, max_new_tokens=24, strategy=strategy, tree=tree)
            assert spec.token_ids == plain.token_ids, (prompt, strategy, tree)
            assert spec.metrics.target_dtype == "bf16" and spec.metrics.tau > 1.0
    assert run(engine, PROMPTS[0], max_new_tokens=4).metrics.target_dtype == "fp32"
    with pytest.raises(ValueError, match="fp32, bf16"):
        engine.with_dtype("fp16")
