"""Packed projections (oneDNN, or the rowwise AVX2 kernel) compute x W^T + b like F.linear, for every row
count a forward uses, and each row's result does not depend on the rows beside it."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import is_ninja_available

from eaglewire.engine import rowwise_kernel
from eaglewire.engine.projection import (
    PACKED_FOR_ROWS,
    Projection,
    native_bf16,
    packing_available,
)

# Both row-invariant kernels, each named: oneDNN everywhere, the rowwise kernel where it compiles (x86, AVX2).
KERNELS = [pytest.param(False, id="onednn"),
           pytest.param(True, id="rowwise", marks=pytest.mark.skipif(not rowwise_kernel.available(),
                                                                      reason="the rowwise kernel needs AVX2 and g++"))]


@pytest.mark.parametrize("rows", [0, 1, 2, 5, PACKED_FOR_ROWS, 33])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rowwise", KERNELS)
@pytest.mark.parametrize("out_features, in_features", [(96, 40), (99, 43)], ids=["even", "tails"])
def test_packed_equals_linear(rows, bias, transposed, rowwise, out_features, in_features):
    """``tails``: widths that are not whole 8-lane vectors (in) or 4-row tiles (out) for the rowwise kernel."""
    torch.manual_seed(rows)
    weight, b = torch.randn(out_features, in_features), (torch.randn(out_features) if bias else None)
    x = torch.randn(1, rows, in_features)
    packed = Projection(weight, b, packed=True, transposed_for_one_row=transposed, rowwise=rowwise)
    assert packed.kernel == ("rowwise" if rowwise else "onednn")
    expected = F.linear(x, weight, b)
    got = packed(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # and a wrong weight is far outside that tolerance: the check has teeth
    wrong = Projection(weight.roll(1, 0), b, packed=True, rowwise=rowwise)(x)
    assert not torch.allclose(wrong, expected, atol=1e-3) or rows == 0


@pytest.mark.parametrize("rowwise", KERNELS)
def test_packed_is_a_snapshot_and_unpacked_is_shared(rowwise):
    weight = torch.randn(16, 8)
    x = torch.randn(1, 3, 8)
    packed, shared = Projection(weight, None, packed=True, rowwise=rowwise), Projection(weight, None, packed=False)
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
    with pytest.raises(ValueError, match="rowwise kernel multiplies fp32"):
        Projection(torch.zeros(4, 4), None, packed=False, rowwise=True)


def test_the_default_kernel_follows_the_cpu():
    """fp32 on an AVX2 CPU (where it compiles) multiplies with the rowwise kernel; elsewhere, and in bf16, oneDNN."""
    expected = "rowwise" if rowwise_kernel.multiplies_by_default() else "onednn"
    assert Projection(torch.zeros(8, 8), None, packed=True).kernel == expected
    assert Projection(torch.zeros(8, 8), None, packed=False).kernel == "linear"


@pytest.mark.skipif(not rowwise_kernel.default_here() or shutil.which("c++") is None or not is_ninja_available(),
                    reason="the kernel is not this CPU's default, or there is no compiler to build it")
def test_the_kernel_compiles_where_it_is_the_default():
    """A broken kernel source would otherwise pass unseen: the engine falls back to oneDNN (with a warning) and
    the kernel's own tests skip."""
    assert rowwise_kernel.extension() is not None


def test_every_included_header_is_in_the_build_hash(tmp_path, monkeypatch):
    """torch's builder hashes only the listed sources: a kernel header missing from ``HEADERS`` could be edited
    and leave a stale build running. Every header the sources include is listed, and an edit changes the flags."""
    included = {name for path in rowwise_kernel.SOURCES for name in re.findall(r'#include "([^"]+)"', path.read_text())}
    assert included and included == {path.name for path in rowwise_kernel.HEADERS}
    header = tmp_path / "lane_sum.h"
    header.write_text("inline int f() { return 1; }\n")
    monkeypatch.setattr(rowwise_kernel, "HEADERS", [header])
    before = rowwise_kernel.build_flags()
    header.write_text("inline int f() { return 2; }\n")
    assert rowwise_kernel.build_flags() != before
    assert rowwise_kernel.build_flags()[:len(rowwise_kernel.COMPILE_FLAGS)] == rowwise_kernel.COMPILE_FLAGS


def test_each_ninja_builds_in_its_own_folder(tmp_path, monkeypatch):
    """Ninja 1.12 hashes commands unlike 1.11: sharing a folder, a venv's ninja and the system's rebuilt each
    other's objects at every start (a minute each). The folder names the ninja, under TORCH_EXTENSIONS_DIR."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folders = []
    for version in ("1.11.1", "1.13.2"):
        monkeypatch.setattr(rowwise_kernel.subprocess, "run",
                            lambda *args, v=version, **kwargs: subprocess.CompletedProcess(args, 0, stdout=v + "\n"))
        folders.append(rowwise_kernel.build_directory())
    assert folders[0] != folders[1] and all(f.parent == tmp_path and f.is_dir() for f in folders)
    assert [f.name.endswith(f"ninja{v}") for f, v in zip(folders, ("1.11.1", "1.13.2"))] == [True, True]


_PRODUCT_DTYPES = [torch.float32] + ([torch.bfloat16] if native_bf16() else [])


@pytest.mark.parametrize("kernel", [(torch.float32, True)] + [(d, False) for d in _PRODUCT_DTYPES],
                         ids=lambda k: ("rowwise-" if k[1] else "onednn-") + str(k[0]).removeprefix("torch."))
@pytest.mark.parametrize("shape, transposed", [
    ((576, 576), False),  # SmolLM2's q and o
    ((1536, 576), False),  # gate and up
    ((576, 1536), False),  # down: in fp32, oneDNN's one-row kernel rounds every row differently from M >= 2
    ((4096, 576), True),  # an lm_head, fp32 one row through MKL
], ids=["q", "gate", "down", "lm_head"])
def test_rows_do_not_depend_on_how_many_share_the_product(kernel, shape, transposed):
    """Each row of an M-row product equals, bit for bit, the product of that row alone, M = 1..72 (a tree
    verifies 33 rows; bf16 products go 32 rows at a time, so 33 and 65 start a block of one): what a verify
    step computes for a token is what plain decoding computes for it."""
    dtype, rowwise = kernel
    if rowwise and not rowwise_kernel.available():
        pytest.skip("the rowwise kernel needs AVX2 and g++")
    torch.manual_seed(0)
    weight = torch.randn(*shape) * 0.05
    projection = Projection(weight, None, packed=True, transposed_for_one_row=transposed, dtype=dtype, rowwise=rowwise)
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


@pytest.mark.parametrize("capability", ["AVX2", "AVX512"])
def test_avx512_cpus_build_with_its_registers_only(monkeypatch, capability):
    """The 32-register build (5-8 verify rows from registers) is asked for only where the CPU has AVX-512: on an
    AVX2 CPU those flags would compile code it cannot run."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    flags = rowwise_kernel.build_flags()
    assert all((flag in flags) == (capability == "AVX512") for flag in rowwise_kernel.AVX512_REGISTER_FLAGS)
