"""The serving-time drafter (DraftRunner) computes what training unrolls, packed or not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eaglewire.drafter.model import Drafter, DrafterConfig
from eaglewire.engine import rowwise_kernel
from eaglewire.engine.drafting import DraftRunner, TreeShape, default_matmul_dtype
from eaglewire.engine.projection import native_bf16
from eaglewire.errors import ConfigError
from eaglewire.train.ttt import unroll

VOCAB, DRAFT_VOCAB, HIDDEN = 300, 200, 64


def random_drafter(seed: int = 0, layers: int = 1) -> Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, num_aux=3, num_layers=layers)
    drafter = Drafter(config, nn.Embedding(VOCAB, HIDDEN), torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values)
    with torch.no_grad():  # a wide init, so every term moves the drafts
        for param in drafter.parameters():
            param.normal_(0, 0.3)
    return drafter.eval()


ROW_KERNEL_MODES = [False, pytest.param(True, marks=pytest.mark.skipif(
    not rowwise_kernel.available(), reason="the row kernels need AVX2 and g++"))]


@pytest.mark.parametrize("layers", [1, 2], ids=["one-layer", "two-layer"])
@pytest.mark.parametrize("row_kernels", ROW_KERNEL_MODES, ids=["torch-ops", "row-kernels"])
@pytest.mark.parametrize("packed", [False, True], ids=["shared", "packed"])
def test_chain_equals_the_training_unroll(packed, row_kernels, layers):
    """A deeper drafter's later layers each keep their own cache, as training's unroll gives each its own keys."""
    drafter = random_drafter(layers=layers)
    runner = DraftRunner(drafter, context=64, packed=packed, matmul_dtype=torch.float32, row_kernels=row_kernels)
    assert runner.projections.layers[0].q.packed is packed and runner.row_kernels is row_kernels
    steps, committed = 4, 11
    torch.manual_seed(1)
    prefix = torch.randint(0, VOCAB, (committed,))
    aux = torch.randn(committed + steps, 3 * HIDDEN)
    # Serving: step-1 entries for base positions 0..n-2, then a greedy chain below the root.
    root = runner.extend(prefix[1:], aux[: committed - 1], 0)
    chain = runner.chain(root, committed - 2, steps)
    assert chain.size == steps
    # Training: unroll over the prefix followed by the chain's own drafts; base n-2 is the chain.
    with torch.no_grad():
        logits = unroll(drafter, torch.cat([prefix, chain.tokens]), aux, steps)
    total = 0.0
    for step, token in enumerate(chain.tokens.tolist()):
        log_probs = logits[step][committed - 2].log_softmax(-1)
        best = int(log_probs.argmax())
        assert int(drafter.draft_to_target(torch.tensor(best))) == token, step
        total += float(log_probs[best])
        assert float(chain.scores[step]) == pytest.approx(total, abs=1e-4), step


def test_the_drafter_multiplies_fp32_where_the_rowwise_kernel_is_the_default_else_bf16_where_native():
    weight = random_drafter().fc.weight
    rowwise = rowwise_kernel.multiplies_by_default()
    expected = torch.bfloat16 if native_bf16() and not rowwise else torch.float32
    assert default_matmul_dtype(weight) is expected


@pytest.mark.skipif(not native_bf16(), reason="bf16 drafter matmuls need a CPU with native bf16")
def test_bf16_matmuls_stay_close():
    """Drafts need not be exact; bf16 matmuls only have to stay close to the fp32 drafter."""
    drafter = random_drafter(3)
    default = DraftRunner(drafter, context=64, matmul_dtype=torch.bfloat16)
    exact = DraftRunner(drafter, context=64, matmul_dtype=torch.float32)
    torch.manual_seed(4)
    prefix, aux = torch.randint(0, VOCAB, (9,)), torch.randn(8, 3 * HIDDEN)
    roots = [runner.extend(prefix[1:], aux, 0) for runner in (default, exact)]
    assert not torch.equal(*roots), "the bf16 runner multiplies in bf16"
    assert float((roots[0] - roots[1]).norm() / roots[1].norm()) < 0.02  # bf16 keeps ~3 significant digits


def test_extension_after_a_rejected_chain_reads_nothing_stale():
    """Accepting fewer drafts than were drafted: the next root equals a runner that never drafted."""
    drafter = random_drafter(1)
    torch.manual_seed(2)
    prefix, aux = torch.randint(0, VOCAB, (9,)), torch.randn(12, 3 * HIDDEN)
    drafted, fresh = DraftRunner(drafter, context=64), DraftRunner(drafter, context=64)
    root = drafted.extend(prefix[1:], aux[:8], 0)
    fresh.extend(prefix[1:], aux[:8], 0)
    drafted.chain(root, 7, 4)  # writes drafter cache slots 8..10
    accepted = torch.randint(0, VOCAB, (2,))  # one draft kept plus the bonus, both unlike the drafts
    after_draft = drafted.extend(accepted, aux[8:10], 8)
    torch.testing.assert_close(after_draft, fresh.extend(accepted, aux[8:10], 8), atol=0, rtol=0)


@pytest.mark.skipif(not rowwise_kernel.available(), reason="the row kernels need AVX2 and g++")
@pytest.mark.parametrize("layers", [1, 2], ids=["one-layer", "two-layer"])
def test_row_kernel_steps_draft_what_the_torch_ops_draft(layers):
    """The same prompt entries (a 40-token step: listed causally), chain and tree (rows that see their
    ancestors, listed through a mask) through the row kernels and through torch's ops: roots within fp32
    rounding, the same drafts."""
    drafter = random_drafter(5, layers)
    runners = [DraftRunner(drafter, context=96, packed=True, matmul_dtype=torch.float32, row_kernels=mode)
               for mode in (True, False)]
    torch.manual_seed(6)
    prefix, aux = torch.randint(0, VOCAB, (41,)), torch.randn(40, 3 * HIDDEN)
    roots = [runner.extend(prefix[1:], aux, 0) for runner in runners]
    torch.testing.assert_close(roots[0], roots[1], rtol=1e-5, atol=1e-5)
    chains = [runner.chain(root, 39, 5) for runner, root in zip(runners, roots)]
    assert torch.equal(chains[0].tokens, chains[1].tokens)
    torch.testing.assert_close(chains[0].scores, chains[1].scores, rtol=1e-4, atol=1e-4)
    trees = [runner.tree(root, 39, TreeShape(depth=4, top_k=3, total_tokens=10)) for runner, root in zip(runners, roots)]
    for field in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(trees[0], field), getattr(trees[1], field)), field
    torch.testing.assert_close(trees[0].scores, trees[1].scores, rtol=1e-4, atol=1e-4)


def test_row_kernels_are_refused_for_a_drafter_they_cannot_run():
    with pytest.raises(ConfigError, match="row kernels run an fp32 CPU drafter"):
        DraftRunner(random_drafter().half(), context=16, packed=False, row_kernels=True)


def test_fc_input_of_the_wrong_width_is_refused():
    runner = DraftRunner(random_drafter(), context=16)
    with pytest.raises(ValueError, match="never a single hidden state"):
        runner.extend(torch.tensor([1, 2]), torch.randn(2, HIDDEN), 0)


def test_a_torch_without_the_onednn_packing_ops_drafts_unpacked_and_says_so(monkeypatch, caplog):
    from eaglewire.engine import projection

    drafter = random_drafter()
    expected = DraftRunner(drafter, context=64, packed=False)
    monkeypatch.setattr(projection, "PACKING_OPS", (*projection.PACKING_OPS, "_op_this_torch_lacks"))
    with caplog.at_level("WARNING", logger=projection.__name__):
        runner = DraftRunner(drafter, context=64)  # packed=None: wherever packing applies
    assert not any(p.packed for p in runner.projections.all())
    assert "lacks torch.ops.mkldnn._op_this_torch_lacks" in caplog.text and "unpacked" in caplog.text
    torch.manual_seed(1)
    prefix, aux = torch.randint(0, VOCAB, (8,)), torch.randn(7, 3 * HIDDEN)
    chains = [r.chain(r.extend(prefix[1:], aux, 0), 6, 4).tokens for r in (runner, expected)]
    assert torch.equal(*chains)
