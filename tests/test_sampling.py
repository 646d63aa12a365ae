"""Acceptance with hand-set target distributions: accept-all, reject-all, partial, and losslessness."""

from __future__ import annotations

import pytest
import torch

from eaglewire.engine.draft_tree import DraftTree
from eaglewire.engine.sampling import (
    SamplingError,
    SamplingParams,
    accept,
    adjust_logits,
    target_probs,
    tree_row_probs,
)
from eaglewire.engine.stops import OutputTracker, StopError

V = 5


def one_hot(*tokens: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def rows(probs: torch.Tensor):
    """The row lookup acceptance asks for, over a stacked [rows, V] tensor."""
    return lambda row: probs[row]


def gen(seed=0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_accept_all_reject_all_and_partial():
    chain = DraftTree.chain(torch.tensor([1, 2, 3]))
    # rows: root, then after each drafted token; the target's greedy token at each row
    assert accept(chain, rows(one_hot(1, 2, 3, 4)), gen()).__dict__ == {"path": [0, 1, 2], "bonus": 4}
    assert accept(chain, rows(one_hot(0, 2, 3, 4)), gen()).__dict__ == {"path": [], "bonus": 0}
    assert accept(chain, rows(one_hot(1, 2, 0, 4)), gen()).__dict__ == {"path": [0, 1], "bonus": 0}


def test_greedy_tree_takes_the_matching_sibling():
    # root children: node0=3, node1=1; node1's child node2=2; node0's child node3=4
    tree = DraftTree(torch.tensor([3, 1, 2, 4]), torch.tensor([-1, -1, 1, 0]), torch.tensor([1, 1, 2, 2]),
                     torch.zeros(4))
    probs = torch.stack([one_hot(1)[0], one_hot(4)[0], one_hot(2)[0], one_hot(0)[0], one_hot(0)[0]])
    assert accept(tree, rows(probs), gen()).__dict__ == {"path": [1, 2], "bonus": 0}


def test_tree_must_list_parents_first():
    with pytest.raises(ValueError, match="after their parents"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]), torch.tensor([2, 1]), torch.zeros(2))


def test_ancestor_mask():
    tree = DraftTree(torch.tensor([3, 1, 2]), torch.tensor([-1, -1, 1]), torch.tensor([1, 1, 2]), torch.zeros(3))
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)


def _two_token_draws(p0, p1, tree, n, seed):
    """Generate two tokens n times: one acceptance walk, then (if only one token came out) a second
    walk for the next token with a drafted child, as the engine's next step would. Returns counts."""
    generator = gen(seed)
    counts = torch.zeros(V, V)
    for _ in range(n):
        rows = [p0] + [p1[int(t)] for t in tree.tokens]  # row of node i: the target's p after its token
        result = accept(tree, torch.stack(rows).__getitem__, generator)
        tokens = [int(tree.tokens[i]) for i in result.path] + [result.bonus]
        if len(tokens) == 1:
            follow = DraftTree.chain(torch.tensor([(tokens[0] + 1) % V]))
            nxt = accept(follow, torch.stack([p1[tokens[0]], p1[0]]).__getitem__, generator)
            tokens += [int(follow.tokens[i]) for i in nxt.path] + [nxt.bonus]
        counts[tokens[0], tokens[1]] += 1
    return counts / n


def test_sampling_reproduces_the_target_distribution():
    """Total-variation distance to the target's joint of two tokens shrinks with samples; the
    distance to a perturbed joint does not."""
    torch.manual_seed(0)
    p0 = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    p1 = torch.softmax(torch.randn(V, V) * 1.5, dim=-1)  # p(x2 | x1)
    joint = p0[:, None] * p1
    perturbed = joint.clone()
    perturbed[0, :] *= 0.7
    perturbed[1, :] *= 1.3
    perturbed /= perturbed.sum()
    # drafts that are often wrong: root children 3 then 0; node for 0 has child 2
    tree = DraftTree(torch.tensor([3, 0, 2]), torch.tensor([-1, -1, 1]), torch.tensor([1, 1, 2]), torch.zeros(3))
    tv_small, tv_large = [], []
    for n, store in ((2_000, tv_small), (32_000, tv_large)):
        empirical = _two_token_draws(p0, p1, tree, n, seed=n)
        store.append(0.5 * float((empirical - joint).abs().sum()))
        store.append(0.5 * float((empirical - perturbed).abs().sum()))
    true_tv = 0.5 * float((joint - perturbed).abs().sum())
    assert tv_large[0] < tv_small[0] and tv_large[0] < 0.02  # ~sqrt(V*V/n) noise: 0.028 at 32k
    assert tv_large[1] > 0.7 * true_tv  # the perturbed target stays as far as it really is


def test_penalized_and_biased_sampling_reproduces_the_target_distribution():
    """The same check through the engine's row function, for a target whose logits are shifted by logit_bias
    and by frequency / presence penalties over the tokens generated so far: each tree row must count the
    drafted tokens on its own path, or the emitted pairs drift from plain sampling's."""
    torch.manual_seed(1)
    l0, l1 = torch.randn(V) * 1.5, torch.randn(V, V) * 1.5  # the target's raw logits: at the root, after token x
    params = SamplingParams(temperature=0.9, logit_bias=((4, 1.5), (1, -0.7)), frequency_penalty=0.6,
                            presence_penalty=0.8)
    before = torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0])  # tokens generated before this step

    def plain(logits, counts):
        return target_probs(adjust_logits(logits[None], params, counts), params)[0]

    p0 = plain(l0, before)
    joint = torch.stack([p0[x] * plain(l1[x], before + one_hot(x)[0]) for x in range(V)])
    unpenalized = SamplingParams(temperature=0.9, logit_bias=params.logit_bias)
    ignores_path = torch.stack([p0[x] * target_probs(adjust_logits(l1[x][None], params, before), params)[0]
                                for x in range(V)])
    assert 0.5 * float((joint - ignores_path).abs().sum()) > 0.05  # counting the path matters here
    assert not torch.allclose(p0, target_probs(l0[None], unpenalized)[0])

    tree = DraftTree(torch.tensor([3, 0, 2]), torch.tensor([-1, -1, 1]), torch.tensor([1, 1, 2]), torch.zeros(3))
    # the rows the engine would compute, once: this step's tree, and the next step's one-token draft after x
    row_probs = tree_row_probs(tree, ([l0] + [l1[int(t)] for t in tree.tokens]).__getitem__, params, before)
    rows = torch.stack([row_probs(row) for row in range(tree.size + 1)])
    follows = [DraftTree.chain(torch.tensor([(x + 1) % V])) for x in range(V)]
    follow_rows = [torch.stack([tree_row_probs(follows[x], [l1[x], l1[(x + 1) % V]].__getitem__, params,
                                               before + one_hot(x)[0])(row) for row in (0, 1)]) for x in range(V)]
    n, generator = 32_000, gen(5)
    counts = torch.zeros(V, V)
    for _ in range(n):
        result = accept(tree, rows.__getitem__, generator)
        tokens = [int(tree.tokens[i]) for i in result.path] + [result.bonus]
        if len(tokens) == 1:
            nxt = accept(follows[tokens[0]], follow_rows[tokens[0]].__getitem__, generator)
            tokens += [int(follows[tokens[0]].tokens[i]) for i in nxt.path] + [nxt.bonus]
        counts[tokens[0], tokens[1]] += 1
    empirical = counts / n
    assert 0.5 * float((empirical - joint).abs().sum()) < 0.02
    assert 0.5 * float((empirical - ignores_path).abs().sum()) > 0.04


def test_logit_bias_and_penalties_at_temperature_0():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    forced = SamplingParams(logit_bias=((3, 100.0),))
    assert int(target_probs(adjust_logits(logits, forced, None), forced).argmax()) == 3
    banned = SamplingParams(logit_bias=((0, -100.0),))
    assert int(target_probs(adjust_logits(logits, banned, None), banned).argmax()) == 1
    repeat = SamplingParams(presence_penalty=1.5)
    assert int(target_probs(adjust_logits(logits, repeat, one_hot(0)), repeat).argmax()) == 1
    with pytest.raises(SamplingError, match="vocabulary has 5"):
        adjust_logits(logits, SamplingParams(logit_bias=((7, 1.0),)), None)


def test_tiny_temperature_and_top_p_are_the_greedy_limit():
    logits = torch.tensor([[2.0, 1.0, 2.0, -1.0]])
    for temperature in (1e-38, 1e-45, 1e-320):
        assert torch.equal(target_probs(logits, SamplingParams(temperature=temperature)),
                           torch.tensor([[0.5, 0.0, 0.5, 0.0]]))  # the limit: ties share the mass
    for top_p in (1e-46, 1e-320):
        assert torch.equal(target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p)),
                           torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_target_probs_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert torch.equal(target_probs(logits, SamplingParams()), torch.tensor([[1.0, 0, 0, 0]]))
    full = target_probs(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(full, logits.softmax(-1))
    top2 = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[0.7311, 0.2689, 0, 0]]), atol=1e-4)
    nucleus = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))  # 0.64 < 0.7: two tokens kept
    assert (nucleus[0, :2] > 0).all() and (nucleus[0, 2:] == 0).all()
    hot = target_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, (logits / 2).softmax(-1))


@pytest.mark.parametrize("kw, message", [({"temperature": -0.1}, "temperature"), ({"temperature": 1e9}, "temperature"),
                                          ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
                                          ({"seed": 2**64}, "seed"), ({"frequency_penalty": 2.5}, "frequency_penalty"),
                                          ({"logit_bias": ((3, 101.0),)}, "logit_bias")])
def test_sampling_settings_out_of_range(kw, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**kw)


class CharTokenizer:
    """Token i decodes to chr(ord('a') + i); token 25 is EOS (decodes to nothing)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i == 25 else chr(ord("a") + i) for i in ids)


def tokens_of(text: str) -> list[int]:
    return [ord(c) - ord("a") for c in text]


@pytest.mark.parametrize("chunking", [1, 3, 100])
def test_output_tracker_stops_mid_block_and_streams_safely(chunking):
    out = OutputTracker(CharTokenizer(), eos_ids=[25], stop=["cde"], max_new_tokens=50)
    streamed = ""
    ids = tokens_of("abxcdcdefg")
    for block in (ids[i: i + chunking] for i in range(0, len(ids), chunking)):
        for token in block:
            if out.push(token):
                break
        streamed += out.stream()
        if out.finished:
            break
    assert out.text == "abxcd" and out.finish_reason == "stop" and streamed == "abxcd"
    assert out.token_ids == tokens_of("abxcdcde")  # tokens up to the one completing the stop string


def test_output_tracker_eos_and_length():
    out = OutputTracker(CharTokenizer(), eos_ids=[25], stop=(), max_new_tokens=3)
    assert not out.push(0) and not out.push(1) and out.push(2)
    assert (out.text, out.finish_reason) == ("abc", "length")
    out = OutputTracker(CharTokenizer(), eos_ids=[25], stop=(), max_new_tokens=9)
    assert not out.push(0) and out.push(25)
    assert (out.token_ids, out.text, out.finish_reason) == ([0, 25], "a", "stop")
    with pytest.raises(StopError, match="empty"):
        OutputTracker(CharTokenizer(), eos_ids=[], stop=[""], max_new_tokens=3)


class CountingTokenizer:
    """A real tokenizer that records how many tokens each decode call was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_incremental_text_equals_decoding_the_whole_output_at_every_token(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "Zürich: 5 €, 日本語 und 🦅🦅 emoji; <|im_end|> is special.\n  Indented  spaces, 'quotes' and l'apostrophe."
    ids = tokenizer(text)["input_ids"] * 8  # multi-byte characters split across byte-level tokens, a special token
    generator = torch.Generator().manual_seed(0)
    ids += torch.randint(0, tokenizer.vocab_size, (300,), generator=generator).tolist()  # arbitrary byte soup
    counting = CountingTokenizer(tokenizer)
    out = OutputTracker(counting, eos_ids=[], stop=(), max_new_tokens=len(ids) + 1)
    streamed = ""
    for i, token in enumerate(ids):
        out.push(token)
        assert out.text == tokenizer.decode(ids[: i + 1], skip_special_tokens=True), i
        streamed += out.stream()
        assert out.text.startswith(streamed)
    # Each decode saw a few tokens, not the whole output (which made long answers quadratic).
    assert max(counting.lengths) < 20 and len(ids) > 500
