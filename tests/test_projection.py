"""Packed projections compute x W^T + b like F.linear, for every row count a forward uses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eaglewire.engine.projection import (
    PACKED_FOR_ROWS,
    Projection,
    native_bf16,
    packing_available,
)


@pytest.mark.parametrize("rows", [0, 1, 2, 5, PACKED_FOR_ROWS, 33])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_packed_equals_linear(rows, bias, transposed):
    torch.manual_seed(rows)
    weight, b = torch.randn(96, 40), (torch.randn(96) if bias else None)
    x = torch.randn(1, rows, 40)
    packed = Projection(weight, b, packed=True, transposed_for_one_row=transposed)
    expected = F.linear(x, weight, b)
    got = packed(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # and a wrong weight is far outside that tolerance: the check has teeth
    assert not torch.allclose(Projection(weight.roll(1, 0), b, packed=True)(x), expected, atol=1e-3) or rows == 0


def test_packed_is_a_snapshot_and_unpacked_is_shared():
    weight = torch.randn(16, 8)
    x = torch.randn(1, 3, 8)
    packed, shared = Projection(weight, None, packed=True), Projection(weight, None, packed=False)
    before = packed(x)
    weight.mul_(2)
    torch.testing.assert_close(packed(x), before)
    torch.testing.assert_close(shared(x), F.linear(x, weight))


def test_packing_refuses_what_onednn_does_not_take():
    cpu = torch.device("cpu")
    assert packing_available(torch.float32, cpu)
    assert not packing_available(torch.float16, cpu)
    assert packing_available(torch.bfloat16, cpu) is native_bf16()
    with pytest.raises(ValueError, match="fp32"):
        Projection(torch.zeros(4, 4, dtype=torch.float16), None, packed=True)


_PRODUCT_DTYPES = [torch.float32] + ([torch.bfloat16] if native_bf16() else [])


@pytest.mark.parametrize("dtype", _PRODUCT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape, transposed", [
    ((576, 576), False),  # SmolLM2's q and o
    ((1536, 576), False),  # gate and up
    ((576, 1536), False),  # down: in fp32, oneDNN's one-row kernel rounds every row differently from M >= 2
    ((4096, 576), True),  # an lm_head, fp32 one row through MKL
], ids=["q", "gate", "down", "lm_head"])
def test_rows_do_not_depend_on_how_many_share_the_product(dtype, shape, transposed):
    """Each row of an M-row product equals, bit for bit, the product of that row alone, M = 1..72 (a tree
    verifies 33 rows; bf16 products go 32 rows at a time, so 33 and 65 start a block of one): what a verify
    step computes for a token is what plain decoding computes for it."""
    torch.manual_seed(0)
    weight = torch.randn(*shape) * 0.05
    projection = Projection(weight, None, packed=True, transposed_for_one_row=transposed, dtype=dtype)
    x = torch.randn(1, 72, shape[1])
    alone = torch.cat([projection(x[:, i: i + 1]) for i in range(72)], dim=1)
    for rows in range(1, 73):
        together = projection(x[:, :rows])
        differing = (together != alone[:, :rows]).any(-1).sum().item()
        assert differing == 0, f"{differing} of {rows} rows differ from their one-row product"


def test_bf16_products_need_native_bf16():
    from eaglewire.engine.projection import check_product_dtype

    check_product_dtype(torch.float32)
    if native_bf16():
        check_product_dtype(torch.bfloat16)
    else:
        with pytest.raises(ValueError, match="in hardware"):
            check_product_dtype(torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        check_product_dtype(torch.float16)
