"""Exact block codes: a weight matrix that came from a quantized checkpoint, stored as its codes again.

Why: with fp32 weights a decode step on this CPU is bound by the bytes of weights it reads, not by
arithmetic (SmolLM2's fp32 matrices are 540 MB a step). The embedded target comes from a GGUF whose matrices are Q4_1 (and its
tied embedding Q8_0): every run of 32 weights along a row is ``d * q + m`` for one scale ``d``, one offset
``m`` and small integers ``q``. HF de-quantizes them to fp32 on load. Found again from those fp32 values, the
codes take 0.75 (4-bit) or 1.25 (8-bit) bytes a weight instead of 4, and the rowwise kernel decodes them
back into the very same fp32 values before it multiplies (``rowwise_linear.cpp``): the product is bit for
bit the fp32 one, so the target is the same model, only read faster. A matrix saved in fp16 (a drafter
checkpoint) is read as its fp16 values (16 bits: 2.25 bytes a weight with the unit scales).

Nothing here trusts the checkpoint's format: ``find`` searches codes for the fp32 values themselves and
keeps them only if the kernel's own decoder gives back every weight bit for bit. It looks for blocks as
GGUF's quantizer makes them, which span their code range (a Q4_1 block's least weight has code 0 and its
greatest 15; a Q8_0 block's largest magnitude is 127). A matrix without such
codes (any trained fp32 or bf16 weight) multiplies from fp32 as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per code block along a row (GGUF's Q4_0/Q4_1/Q8_0 blocks)
CODE_BITS = (4, 8, 16)  # tried in this order: the fewer bytes first; 16: the weight's fp16 values


@dataclass(frozen=True)
class BlockCodes:
    """``W[n, 32 b + i] = scale[n, b] * q + offset[n, b]``, ``q`` the ``i``-th code of block ``b`` of row ``n``.

    ``codes``: uint8 [N, K / 32, 16] for 4 bits (byte ``i`` holds ``q[i]`` in its low nibble and ``q[i + 16]``
    in its high one), [N, K / 32, 32] for 8 bits (signed bytes) or [N, K / 32, 64] for 16 (fp16, with scale 1
    and offset -0.0)."""

    bits: int
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def __post_init__(self) -> None:
        # the kernel reads 16-bit codes as the weights themselves, without their scale and offset
        if self.bits == 16 and not (bool((self.scale == 1).all()) and bool((self.offset == 0).all())
                                    and bool(torch.signbit(self.offset).all())):
            raise ValueError("16-bit block codes are fp16 weights as they are: scale 1 and offset -0.0")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))


def find(weight: torch.Tensor, kernel) -> BlockCodes | None:
    """Codes that ``kernel`` (the compiled rowwise kernel: ``encode_blocks``, ``decodes_to``) decodes back into
    ``weight`` bit for bit, with as few bits as possible; None where there are none."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or not weight.numel():
        return None
    weight = weight.detach().contiguous()
    for bits in CODE_BITS:
        codes = _codes(weight, bits, kernel)
        # the search checks each block as it goes; the decoder the products use checks the whole again
        if codes is not None and kernel.decodes_to(weight, codes.codes, codes.scale, codes.offset, bits):
            return codes
    return None


def _codes(weight: torch.Tensor, bits: int, kernel) -> BlockCodes | None:
    """16 bits: the weight's fp16 values, if it has them. 4 and 8 bits, per block (``encode_blocks``): the
    offset (4 bits: the block's least value; 8 bits: 0), then the first fp16 scale within 2 ulps of the
    estimate (max - min) / 15 or max |w| / 127 for which ``scale * q + offset``, q rounded into the code
    range, gives back every value (the checkpoint rounded its scale to fp16, and the estimate from the
    de-quantized values can land an ulp or two from it)."""
    if bits == 16:
        half = weight.half()
        if not _same_bits(half.float(), weight):
            return None
        blocks = (weight.shape[0], weight.shape[1] // BLOCK)
        # offset -0.0, not 0.0: x + (-0.0) is x for every x, where x + 0.0 would turn a -0.0 weight into +0.0
        return BlockCodes(16, half.view(torch.uint8).reshape(*blocks, 2 * BLOCK).contiguous(),
                          torch.ones(blocks), torch.full(blocks, -0.0))
    # the first row decides cheaply for most matrices that have no codes (every trained one)
    if not kernel.encode_blocks(weight[:1], bits):
        return None
    found = kernel.encode_blocks(weight, bits)
    return BlockCodes(bits, *found) if found else None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (so -0.0 differs from 0.0, as it would in a product's sign)."""
    return bool((a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)).all())
