"""One frozen linear layer (``x W^T + b``) at inference, through the CPU's fastest row-invariant kernel.

Why: a verify step multiplies every target matrix by a handful of rows (the
last token plus the drafts). ``F.linear`` (MKL) on 2-8 rows costs 1.6-2x one row,
so checking drafts cost more than the decode steps they saved. Two kernels do better:

- oneDNN with the weight reordered once into its blocked layout runs 3-8 rows in about
  the time of one on an AVX-512 CPU: on SmolLM2 (1 thread, logits for every row), a
  forward over 1/3/5 tokens takes 51.6/102.6/82.5 ms with ``F.linear`` and 48.0/45.1/42.5 ms
  packed (``benchmarks/results/lean_forward.json``). On an AVX2 CPU it does not: a 5-token
  forward costs 1.44 of its own decode step, and that step is slower than ``F.linear``'s.
- the rowwise kernel (``rowwise_kernel.py``), the default for fp32 on x86 CPUs with AVX2 or AVX-512:
  on an AVX2 AMD EPYC, 1/3/5 tokens take 59.9/68.3/82.1 ms against oneDNN's 85.5/100.8/123.5 and HF's
  77.6 ms for one (``benchmarks/results/lean_forward_avx2_rowwise.json``); reading the codes on an
  AVX-512 AMD EPYC (Zen 4), 1/5/8 take 20.6/50.1/58.3 ms against oneDNN's 76.9/97.5/131.1
  (``benchmarks/results/lean_forward_avx512_zen4.json``). It reads a matrix as its exact block codes where it has them (a target de-quantized from a
  GGUF, a drafter saved in fp16: ``block_codes.py``), with the same result bit for bit.

The lean forward and the serving-time drafter (``drafting.py``) use them.

The packed copy is a snapshot (one extra copy of the weights in memory): the
HF module stays the source of truth for everything else, and its weights are
frozen at inference. A packed product sums in another order than ``F.linear``;
both are fp32, and the engine's tests check the greedy output still equals HF's.

Row invariance: a row's result does not depend on how many rows share the
product, so a token verified among drafts gets bit for bit the logits plain
decoding would give it (``tests/test_projection.py`` checks every row of an
M-row product against the one-row product, M = 1..48). oneDNN multiplies a
single row with another kernel than two or more: measured on SmolLM2's shapes,
fp32 rows of the down projection (K = 1536) differ in their last bits between
M = 1 and M >= 2 (bf16 rows rarely), while M = 2..48 all agree. So one row is
multiplied as two (a zero row added), which costs no more than one (fp32: 30
layers 14.9 ms as two rows vs 18.3 as one). The transposed one-row path (MKL)
multiplies several rows one at a time for the same reason. In bf16 on a CPU with AMX
(Xeon, measured on SmolLM2's shapes) oneDNN multiplies more than 32 rows with yet another
kernel, whose rows differ from those of 32 or fewer (from M = 33; M = 48 for q), while fp32
rows agree up to 160; so a bf16 product takes at most ``BF16_ROW_BLOCK`` rows at a time.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from . import block_codes, rowwise_kernel

log = logging.getLogger(__name__)

# The private oneDNN ops the packed path calls (torch.ops.mkldnn; not public API, so a torch build may lack them).
PACKING_OPS = ("_reorder_linear_weight", "_linear_pointwise")
PACKED_FOR_ROWS = 8  # oneDNN picks the blocked layout for this many rows; 3..32 rows all run near their best with it
BF16_ROW_BLOCK = 32  # the most rows one bf16 product takes: see "Row invariance" above


def native_bf16() -> bool:
    """This CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); elsewhere oneDNN emulates it, slowly."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_features() -> dict:
    """What decides this CPU's kernels (recorded with benchmark and training results: figures from an AVX2
    machine and from one with AMX are not the same kind)."""
    return {"capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16(),
            "amx": torch.cpu._is_amx_tile_supported()}


def check_product_dtype(dtype: torch.dtype) -> None:
    """Refuse bf16 products where the CPU would emulate them (slower than fp32, so never what was asked)."""
    if dtype == torch.bfloat16 and not native_bf16():
        raise ConfigError("bf16 target products need a CPU that multiplies bf16 in hardware (AVX512-BF16 or AMX); "
                          "this one does not, so oneDNN would emulate them slower than fp32: use --dtype fp32")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"target products run in fp32 or bf16, not {dtype}")


@functools.cache
def missing_packing_ops(ops: tuple[str, ...] = PACKING_OPS) -> tuple[str, ...]:
    """The ops of ``ops`` this torch build lacks; said once in the log, since the engine then runs unpacked."""
    missing = []
    for name in ops:
        try:
            getattr(torch.ops.mkldnn, name)
        except (AttributeError, RuntimeError):  # torch.ops namespaces raise either for an unknown op
            missing.append(name)
    if missing:
        log.warning("this torch build (%s) lacks torch.ops.mkldnn.%s: target and drafter products run unpacked "
                    "(F.linear), so verifying several tokens costs more than one", torch.__version__,
                    ", ".join(missing))
    return tuple(missing)


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packing applies on the CPU of a build with oneDNN and its packing ops, to fp32 matrices, and
    to bf16 ones where the CPU multiplies bf16 in hardware."""
    dtypes = (torch.float32, torch.bfloat16) if native_bf16() else (torch.float32,)
    return (device.type == "cpu" and dtype in dtypes and torch.backends.mkldnn.is_available()
            and not missing_packing_ops(PACKING_OPS))


class Projection:
    """``x W^T + b`` over the last dimension of ``x``.

    ``packed``: multiply with a row-invariant kernel laid out for this CPU: a oneDNN-packed
    copy of ``weight``, or in fp32 on an x86 CPU the rowwise kernel (``rowwise_kernel.py``)
    on ``weight`` itself; otherwise ``F.linear`` on ``weight`` itself (no copy).
    ``transposed_for_one_row``: also keep ``W^T`` contiguous, which MKL multiplies by a
    single row fastest (worth it for the large lm_head, which a decode step applies to one
    row: 4.4 ms instead of 7.3 packed); the rowwise kernel needs no such copy.
    """

    __slots__ = ("weight", "bias", "packed", "kernel", "codes", "_packed_weight", "_packed_bias", "_transposed",
                 "_dtype")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool,
                 transposed_for_one_row: bool = False, dtype: torch.dtype | None = None,
                 rowwise: bool | None = None, exact_codes: bool = True):
        """``dtype``: multiply in this dtype (packed only; e.g. bf16 for a drafter, whose output need not be
        exact); inputs are cast to it and outputs back to the input's dtype. Default: the weight's.
        ``rowwise``: with ``packed``, multiply fp32 with the rowwise kernel instead of oneDNN; None: where it is
        this CPU's default and compiles (``rowwise_kernel.py``).
        ``exact_codes``: with the rowwise kernel, multiply from the weight's exact block codes where it has them
        (``block_codes.py``: the same result, fewer bytes read); ``codes`` holds them, or None."""
        dtype = weight.dtype if dtype is None else dtype
        if rowwise is None:
            rowwise = packed and dtype == torch.float32 and rowwise_kernel.multiplies_by_default()
        if rowwise and not (packed and dtype == torch.float32 == weight.dtype and rowwise_kernel.available()):
            raise ValueError(f"the rowwise kernel multiplies fp32 weights (packed=True) on an x86 CPU with AVX2 where "
                             f"it compiles; got {dtype} weights, packed={packed}, available: {rowwise_kernel.available()}")
        self.kernel = "rowwise" if rowwise else "onednn" if packed else "linear"
        self.codes = block_codes.find(weight, rowwise_kernel.extension()) if rowwise and exact_codes else None
        if rowwise:
            packed = False  # no oneDNN copy: the kernel reads a plain one or the codes (snapshots, like the packed copy)
            weight = weight.detach() if self.codes is not None else weight.detach().clone(memory_format=torch.contiguous_format)
            bias = None if bias is None else bias.detach().clone(memory_format=torch.contiguous_format)
        if packed and not packing_available(dtype, weight.device):
            raise ValueError(f"oneDNN packing needs fp32 (or, on a CPU with native bf16, bf16) weights on a CPU build "
                             f"with oneDNN; got {dtype} on {weight.device}, oneDNN available: "
                             f"{torch.backends.mkldnn.is_available()}, native bf16: {native_bf16()}")
        if not packed and dtype != weight.dtype:
            raise ValueError("a dtype other than the weight's needs packed=True")
        self.weight, self.bias, self.packed, self._dtype = weight, bias, packed or rowwise, dtype
        # MKL multiplies one fp32 row fastest by a contiguous W^T; in bf16 oneDNN's packed layout is faster.
        transposed = packed and transposed_for_one_row and dtype == torch.float32
        with torch.no_grad():
            self._packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), PACKED_FOR_ROWS) if packed else None
            self._packed_bias = None if bias is None or not packed else bias.detach().to(dtype)
            self._transposed = weight.detach().t().contiguous() if transposed else None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype this projection multiplies in."""
        return self._dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "rowwise":
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            out = (rowwise_kernel.rowwise_linear(flat, self.weight, self.bias) if self.codes is None
                   else rowwise_kernel.rowwise_linear_blocks(flat, self.codes, self.bias))
            return out.reshape(*x.shape[:-1], self.weight.shape[0])
        if self._packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self._transposed is not None and rows >= 1:
            flat = x.reshape(rows, 1, x.shape[-1])
            out = flat[0] @ self._transposed if rows == 1 else torch.cat([row @ self._transposed for row in flat])
            out = out.reshape(*x.shape[:-1], out.shape[-1])
            return out if self.bias is None else out + self.bias
        if self._dtype == torch.bfloat16 and rows > BF16_ROW_BLOCK:  # see "Row invariance" above
            flat = x.reshape(rows, x.shape[-1])
            out = torch.cat([self(block) for block in flat.split(BF16_ROW_BLOCK)])
            return out.reshape(*x.shape[:-1], out.shape[-1])
        if rows == 1:  # never a one-row product: see "Row invariance" above
            flat = x.reshape(1, x.shape[-1]).to(self._dtype)
            out = self._packed_product(torch.cat((flat, torch.zeros_like(flat))))[:1]
            return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)
        # .to is a no-op when x is already in the multiply dtype
        return self._packed_product(x.to(self._dtype)).to(x.dtype)

    def _packed_product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight, self._packed_bias, "none", [], "")
