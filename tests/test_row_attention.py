"""The row kernels (row_attention.cpp): attention, RMSNorm, RoPE and the cache write give torch's results within
fp32 rounding, and each row's bits are fixed by that row's inputs alone, whatever rows share the call (the
exactness of a verify step needs that)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eaglewire.engine import rowwise_kernel

pytestmark = pytest.mark.skipif(not rowwise_kernel.available(), reason="the row attention kernel needs AVX2 and g++")

PREFIX = torch.empty(0, dtype=torch.long)  # no listed slots: each row reads slots 0..length-1


def cache(kv_heads: int, slots: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(kv_heads, slots, dim, generator=g), torch.randn(kv_heads, slots, dim, generator=g)


def sdpa(q_row: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One row [H, D] over the given slots, as the lean forward's SDPA path computes it."""
    return F.scaled_dot_product_attention(q_row[None, :, None], k[None][:, :, slots], v[None][:, :, slots],
                                          enable_gqa=True)[0, :, 0]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (6, 2, 72), (2, 1, 8)])
def test_rows_equal_sdpa_within_rounding(heads, kv_heads, dim):
    k, v = cache(kv_heads, 700, dim)
    lengths = torch.tensor([1, 2, 7, 8, 9, 16, 63, 300, 700])
    q = torch.randn(len(lengths), heads, dim)
    out = rowwise_kernel.attend_rows(q, k, v, lengths, PREFIX, dim ** -0.5)
    assert out.shape == q.shape
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(out[row], sdpa(q[row], k, v, torch.arange(n)), atol=2e-6, rtol=1e-5)


def test_a_row_gets_the_same_bits_whatever_rows_share_the_call():
    k, v = cache(3, 512, 64)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(12, 9, 64, generator=g)
    lengths = torch.randint(1, 513, (12,), generator=g)
    together = rowwise_kernel.attend_rows(q, k, v, lengths, PREFIX, 0.125)
    for row in range(12):
        alone = rowwise_kernel.attend_rows(q[row:row + 1].clone(), k, v, lengths[row:row + 1].clone(), PREFIX, 0.125)
        assert torch.equal(alone[0], together[row]), f"row {row} ({int(lengths[row])} keys)"


def test_listed_slots_read_as_a_prefix_of_the_same_values_give_the_same_bits():
    """A tree row's slots are listed; once its keys sit contiguously (after ``keep``), a decode step reads them
    as a prefix: both must give the same result bit for bit."""
    k, v = cache(3, 64, 64)
    slots = torch.tensor([0, 1, 2, 3, 4, 9, 13, 20])  # the prefix 0..4, then a path through a tree
    q = torch.randn(1, 9, 64)
    listed = rowwise_kernel.attend_rows(q, k, v, torch.tensor([len(slots)]), slots, 0.125)
    contiguous_k, contiguous_v = k[:, slots].contiguous(), v[:, slots].contiguous()
    as_prefix = rowwise_kernel.attend_rows(q, contiguous_k, contiguous_v, torch.tensor([len(slots)]), PREFIX, 0.125)
    assert torch.equal(listed, as_prefix)
    torch.testing.assert_close(listed[0], sdpa(q[0], k, v, slots), atol=2e-6, rtol=1e-5)


def test_listed_rows_each_read_their_own_run_of_slots():
    k, v = cache(2, 40, 16)
    q = torch.randn(3, 4, 16)
    runs = [torch.tensor([0, 1, 2]), torch.arange(11), torch.tensor([5, 30, 39, 2])]
    out = rowwise_kernel.attend_rows(q, k, v, torch.tensor([len(r) for r in runs]), torch.cat(runs), 0.25)
    for row, slots in enumerate(runs):
        torch.testing.assert_close(out[row], sdpa(q[row], k, v, slots), atol=2e-6, rtol=1e-5, msg=f"row {row}")


def test_slots_past_a_rows_keys_are_never_read():
    """Keys are scored in blocks of 8; the padding of a row's last block must not see the cache beyond it."""
    k, v = cache(1, 32, 8)
    q = torch.randn(1, 2, 8)
    before = rowwise_kernel.attend_rows(q, k, v, torch.tensor([9]), PREFIX, 1.0)
    k[:, 9:], v[:, 9:] = 1e30, float("nan")
    assert torch.equal(rowwise_kernel.attend_rows(q, k, v, torch.tensor([9]), PREFIX, 1.0), before)


def test_a_dominant_key_and_underflowing_weights():
    """Scores ~1e4 apart: the others' weights underflow to 0, leaving the dominant key's value exactly."""
    k, v = cache(1, 20, 8)
    q = torch.ones(1, 1, 8)
    k[0, 13] = 1e3
    out = rowwise_kernel.attend_rows(q, k, v, torch.tensor([20]), PREFIX, 1.0)
    assert torch.equal(out[0, 0], v[0, 13])


@pytest.mark.parametrize(("case", "message"), [
    ("odd dim", "not a multiple of 8"),
    ("heads", "not a multiple of"),
    ("no keys", "attends over 0 keys"),
    ("too many keys", "attends over 17 keys"),
    ("index count", "index lists 3 slots"),
    ("slot range", "outside the cache"),
    ("dtype", "contiguous fp32"),
])
def test_malformed_calls_say_what_is_wrong(case, message):
    dim = 12 if case == "odd dim" else 8
    k, v = cache(2 if case != "heads" else 3, 16, dim)
    q = torch.randn(2, 4, dim, dtype=torch.float64 if case == "dtype" else torch.float32)
    lengths = {"no keys": torch.tensor([0, 4]), "too many keys": torch.tensor([17, 4])}.get(case, torch.tensor([2, 4]))
    index = {"index count": torch.tensor([0, 1, 2]), "slot range": torch.tensor([0, 1, 2, 3, 4, 16])}.get(case, PREFIX)
    with pytest.raises(RuntimeError, match=message):
        rowwise_kernel.attend_rows(q, k, v, lengths, index, 1.0)


def test_rms_norm_rows_is_rms_norm_row_by_row():
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(7, 1, 576, generator=g) * 3, torch.randn(576, generator=g)
    out = rowwise_kernel.rms_norm_rows(x, weight, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (576,), weight, 1e-5), atol=1e-6, rtol=1e-5)
    for row in range(7):
        assert torch.equal(rowwise_kernel.rms_norm_rows(x[row].clone(), weight, 1e-5), out[row])
    with pytest.raises(RuntimeError, match="multiple of 8"):
        rowwise_kernel.rms_norm_rows(torch.randn(2, 12), torch.randn(12), 1e-5)


def test_rope_and_store_rotates_and_writes_each_token_where_it_belongs():
    heads, kv_heads, dim, slots_total = 4, 2, 32, 10
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, n, dim, generator=g) for n in (heads, kv_heads, kv_heads))
    cos, sin_signed = torch.randn(3, dim, generator=g), torch.randn(3, dim, generator=g)
    slots = torch.tensor([7, 2, 5])
    k_cache, v_cache = torch.zeros(kv_heads, slots_total, dim), torch.zeros(kv_heads, slots_total, dim)

    def rope(x):  # as the lean forward's torch path computes it
        return x * cos[:, None] + x.roll(dim // 2, dims=-1) * sin_signed[:, None]

    rotated_q = q.clone()
    rowwise_kernel.rope_and_store(rotated_q, k, v, cos, sin_signed, k_cache, v_cache, slots)
    torch.testing.assert_close(rotated_q, rope(q), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_cache[:, slots].transpose(0, 1), rope(k), atol=1e-6, rtol=1e-6)
    assert torch.equal(v_cache[:, slots].transpose(0, 1), v)
    untouched = [s for s in range(slots_total) if s not in slots.tolist()]
    assert not k_cache[:, untouched].any() and not v_cache[:, untouched].any()
    with pytest.raises(RuntimeError, match="outside the cache"):
        rowwise_kernel.rope_and_store(q.clone(), k, v, cos, sin_signed, k_cache, v_cache, torch.tensor([1, 2, 10]))


def test_the_lean_forward_attends_short_forwards_in_the_kernel_where_it_multiplies(smollm2):
    """Where the rowwise kernel multiplies, decode and verify rows attend in it (a prefill through SDPA); the
    logits stay within the lean forward's HF tolerance (test_lean.py) of the SDPA path's."""
    from eaglewire.engine.lean import LeanModel

    kernel = LeanModel.from_hf(smollm2.model, max_len=48, rowwise=True)
    library = LeanModel.from_hf(smollm2.model, max_len=48, rowwise=False)
    assert kernel.row_kernels and not library.row_kernels
    ids = torch.randint(0, 49152, (1, 30), generator=torch.Generator().manual_seed(0))
    results = []
    for lean in (kernel, library):
        cache = lean.new_cache()
        lean.forward(cache, ids[:, :24], torch.arange(24), logits_rows=None)
        results.append(lean.forward(cache, ids[:, 24:], torch.arange(24, 30))[0])
    torch.testing.assert_close(results[0], results[1], atol=1e-4, rtol=1e-5)
    assert torch.equal(results[0].argmax(-1), results[1].argmax(-1))
