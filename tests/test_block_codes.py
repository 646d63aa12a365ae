"""Exact block codes (block_codes.py): found only where they give back every weight bit for bit, and the rowwise
kernel multiplying from them gives the fp32 product's bits, for every row count."""

from __future__ import annotations

import pytest
import torch

from eaglewire.engine import block_codes, rowwise_kernel
from eaglewire.engine.projection import Projection

pytestmark = pytest.mark.skipif(not rowwise_kernel.available(), reason="the rowwise kernel needs AVX2 and g++")


def decode(codes, scale, offset, bits):
    return rowwise_kernel.extension().dequantize_blocks(codes, scale, offset, bits)


def find(weight):
    return block_codes.find(weight, rowwise_kernel.extension())


def quantized(rows: int, cols: int, bits: int, seed: int = 0) -> torch.Tensor:
    """An fp32 weight as a GGUF loader de-quantizes one: per 32 weights an fp16 scale (and for 4 bits an fp16
    offset), times small integers (Q4_1: d * q + m, q in 0..15; Q8_0: d * q, q in -127..127). As GGUF's
    quantizer makes them, each block holds the ends of its range: codes 0 and 15, or -127 or 127. 16 bits:
    fp16 values, as a checkpoint saved in fp16 loads."""
    g = torch.Generator().manual_seed(seed)
    blocks = (rows, cols // block_codes.BLOCK, 1)
    scale = (torch.rand(blocks, generator=g) * 0.01 + 1e-4).half().float()
    if bits == 4:
        offset = (-torch.rand(blocks, generator=g) * 0.08).half().float()
        q = torch.randint(0, 16, (*blocks[:2], block_codes.BLOCK), generator=g).float()
        q[..., 3], q[..., 20] = 0, 15
        return (scale * q + offset).reshape(rows, cols)
    if bits == 16:
        return torch.randn(rows, cols, generator=g).half().float()
    q = torch.randint(-127, 128, (*blocks[:2], block_codes.BLOCK), generator=g).float()
    q[..., 9] = 127
    return (scale * q).reshape(rows, cols)


@pytest.mark.parametrize("bits, nbytes_per_weight", [(4, 0.75), (8, 1.25), (16, 2.25)])
def test_codes_give_back_every_weight_bit_for_bit(bits, nbytes_per_weight):
    weight = quantized(64, 96, bits)
    codes = find(weight)
    assert codes is not None and codes.bits == bits and codes.shape == (64, 96)
    assert codes.nbytes == weight.numel() * nbytes_per_weight
    assert torch.equal(decode(codes.codes, codes.scale, codes.offset, bits).view(torch.int32), weight.view(torch.int32))


def test_no_codes_for_weights_that_have_none():
    """Trained weights, rows not a whole number of blocks, other dtypes, and a single weight an ulp off."""
    assert find(torch.randn(64, 96)) is None
    assert find(quantized(64, 96, 4)[:, :80]) is None
    assert find(quantized(64, 96, 4).bfloat16()) is None
    nudged = quantized(64, 96, 4)
    nudged[37, 50] = torch.nextafter(nudged[37, 50], torch.tensor(1.0))
    codes = find(nudged)
    assert codes is None or codes.bits == 8 and torch.equal(  # 8-bit codes may still hold it exactly
        decode(codes.codes, codes.scale, codes.offset, 8).view(torch.int32), nudged.view(torch.int32))
    assert find(nudged + torch.randn(64, 96) * 1e-7) is None
    half = quantized(64, 96, 16)
    half[5, 7] = torch.nextafter(half[5, 7], torch.tensor(9.0))  # no longer an fp16
    assert find(half) is None


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_negative_zero_is_not_silently_made_positive(bits):
    """A -0.0 weight (the shipped drafter's lm_head has one) stays -0.0, or the matrix gets no codes."""
    weight = quantized(8, 32, bits)
    weight[3, 5] = -0.0
    codes = find(weight)
    assert codes is None or torch.equal(
        decode(codes.codes, codes.scale, codes.offset, codes.bits).view(torch.int32), weight.view(torch.int32))
    if bits == 16:
        assert codes is not None and codes.bits == 16


def test_16_bit_codes_must_be_the_weights_themselves():
    """The kernel reads 16-bit codes as the fp16 weights, ignoring scale and offset: other values are refused."""
    codes = find(quantized(8, 64, 16))
    assert codes is not None and codes.bits == 16
    for scale, offset in ((codes.scale * 2, codes.offset), (codes.scale, torch.zeros_like(codes.offset))):
        with pytest.raises(ValueError, match="scale 1 and offset -0.0"):
            block_codes.BlockCodes(16, codes.codes, scale, offset)


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(96, 64), (101, 32)], ids=["panels", "tails"])
def test_projection_from_codes_is_the_fp32_product_bit_for_bit(bits, bias, shape):
    """Row counts 0..19, weight rows not a whole number of 8-row panels (``tails``), with and without a bias;
    and each row's result is the same whatever rows share the product."""
    weight = quantized(*shape, bits, seed=bits)
    b = torch.randn(shape[0]) if bias else None
    from_codes = Projection(weight, b, packed=True, rowwise=True)
    from_fp32 = Projection(weight, b, packed=True, rowwise=True, exact_codes=False)
    assert from_codes.codes is not None and from_codes.codes.bits == bits and from_fp32.codes is None
    x = torch.randn(19, shape[1])
    alone = torch.cat([from_codes(x[i: i + 1]) for i in range(19)])
    for rows in range(20):
        got = from_codes(x[:rows])
        assert got.shape == (rows, shape[0])
        assert torch.equal(got.view(torch.int32), from_fp32(x[:rows]).view(torch.int32)), rows
        assert torch.equal(got, alone[:rows])
    torch.testing.assert_close(from_codes(x), x @ weight.T + (0 if b is None else b), atol=1e-5, rtol=1e-5)


def test_projection_from_codes_is_a_snapshot():
    weight = quantized(32, 64, 4)
    projection = Projection(weight, None, packed=True, rowwise=True)
    x = torch.randn(3, 64)
    before = projection(x)
    weight.mul_(2)
    assert torch.equal(projection(x), before)


def test_the_embedded_target_is_read_as_codes(smollm2):
    """SmolLM2's GGUF is Q4_1 with a Q8_0 embedding: every layer matrix has 4-bit codes and the tied lm_head
    8-bit ones, so a decode step reads 0.11 GB of weights instead of 0.54."""
    from eaglewire.engine.lean import LeanModel

    lean = LeanModel.from_hf(smollm2.model, 64, packed=True, rowwise=True)
    assert lean.weight_formats == {"4-bit codes": 210, "8-bit codes": 1}
    fp32 = LeanModel.from_hf(smollm2.model, 64, packed=True, rowwise=True, exact_codes=False)
    assert fp32.weight_formats == {"fp32": 211}
    ids = torch.tensor([[1, 504, 3303, 314, 253, 1345, 30, 2]])
    with torch.inference_mode():
        a = lean.forward(lean.new_cache(), ids, torch.arange(ids.shape[1]))[0]
        b = fp32.forward(fp32.new_cache(), ids, torch.arange(ids.shape[1]))[0]
    assert torch.equal(a, b)
