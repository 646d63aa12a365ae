"""A row-invariant fp32 product for a few rows, compiled on first use for x86 CPUs with AVX2 (AVX-512 too).

Why: on an AVX2 CPU (the AMD EPYC this project runs on) neither library kernel makes a verify step
cheap. oneDNN's packed product (``projection.py``) costs 1.4-1.8 decode steps for 4-5 rows and is slow
for one; MKL's ``F.linear`` is fast for one row but not row-invariant across row counts, and its cost
grows with each row. ``rowwise_linear.cpp`` streams each weight row once per call and multiplies it by
every input row from L1 cache, summing each output element in one fixed order, so a row's result does
not depend on how many rows share the call (the exactness of verification needs that: ``projection.py``,
"Row invariance"). SmolLM2's lean forward on the AMD EPYC, one thread, fp32, logits for every row
(``benchmarks/results/lean_forward_avx2_rowwise.json``): 1/3/5/8 tokens take 59.9/68.3/82.1/102.2 ms,
against oneDNN's 85.5/100.8/123.5/151.8 and HF's 77.6 ms for one token.

A matrix that came from a quantized checkpoint multiplies from its exact block codes instead of fp32
(``block_codes.py``): the same tiles over the same decoded values, so the same bits, from 1.8-5.3x fewer
bytes.

Where it multiplies, the row-wise steps between the matrices run beside it (``row_attention.cpp``): the
attention of a decode or verify step's rows, RMSNorm, and RoPE with the cache write; as torch ops they cost
a third of a decode step once the matrices were read from codes.

The sources compile once per machine with torch's extension builder (g++ and ninja; ~1 minute) into
torch's extension cache. Where that fails, the engine says so once and multiplies with oneDNN instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import subprocess
import time
from pathlib import Path

import torch

from .block_codes import BlockCodes

log = logging.getLogger(__name__)

NAME = "eaglewire_rowwise_linear"
SOURCES = [Path(__file__).with_name(name) for name in ("rowwise_linear.cpp", "row_attention.cpp")]
HEADERS = [Path(__file__).with_name("lane_sum.h")]
COMPILE_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c"]
AVX512_REGISTER_FLAGS = ["-mavx512f", "-mavx512vl"]
# The CPU capabilities torch reports where this kernel is the default fp32 product: measured on both. On an
# AMD EPYC with AVX-512 (Zen 4), reading the codes made a decode step 20.6 ms against oneDNN's 76.9 and an
# 8-token verify 58.3 against 131.1 (benchmarks/results/lean_forward_avx512_zen4.json): oneDNN's packed
# product reads fp32 weights, and a decode step is bound by the bytes it reads.
DEFAULT_ON = ("AVX2", "AVX512")
COMPILED_IF_SLOWER_S = 5.0  # loading the cached build takes well under a second; compiling about a minute


def default_here() -> bool:
    """The rowwise kernel is this CPU's default fp32 product (``DEFAULT_ON``)."""
    return torch.backends.cpu.get_cpu_capability() in DEFAULT_ON


def multiplies_by_default() -> bool:
    """The kernel is this CPU's default fp32 product and compiled here."""
    return default_here() and available()


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """RoPE sine rows [..., D] with rotate_half folded in, as ``rope_and_store`` takes them:
    ``rotate_half(x) * sin == roll(x, D / 2) * signed_sin(sin)``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def build_directory() -> Path:
    """torch's extension folder, one per ninja version on PATH. Ninja 1.12 changed how its log hashes a command,
    so where two ninjas take turns (a venv's pip ninja when the venv is on PATH, the system's when it is not)
    each reads the other's builds as stale and recompiles, a minute every time, in one shared folder."""
    from torch.utils.cpp_extension import get_default_build_root

    try:
        version = subprocess.run(["ninja", "--version"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        version = "none"  # torch's own build reports the missing ninja
    tag = re.sub(r"[^0-9A-Za-z.]+", "-", f"torch{torch.__version__}-ninja{version}")
    folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / f"{NAME}-{tag}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def build_flags() -> list[str]:
    """The compile flags, with the headers' hash as a define: torch's builder rebuilds when the sources or
    the flags change, and hashes no header itself, so a header edit must reach the flags to count. On an
    AVX-512 CPU the same AVX2 instructions may use its 32 vector registers, where a verify step of 5-8 rows
    multiplies from registers (``rowwise_linear.cpp``, ``kRegisterRows``), and a decode step's 4-bit codes are
    decoded by an AVX-512VL table lookup (``decode_block_by_table``); each element is summed in the same
    order, so the bits are the same."""
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in HEADERS)).hexdigest()[:16]
    registers = AVX512_REGISTER_FLAGS if torch.backends.cpu.get_cpu_capability() == "AVX512" else []
    return [*COMPILE_FLAGS, *registers, f"-DEAGLEWIRE_HEADERS_SHA256={digest}"]


@functools.cache
def extension():
    """The compiled kernel module, or None (said once in the log) where it cannot be built here."""
    # imported here, not at the top: it pulls in setuptools machinery, needed only when first built
    from torch.utils.cpp_extension import load

    start = time.perf_counter()
    try:
        module = load(NAME, [str(path) for path in SOURCES], extra_cflags=build_flags(), build_directory=str(build_directory()),
                      verbose=False)
    except (OSError, RuntimeError, ImportError) as error:  # no compiler, no ninja, or a failed build
        log.warning("could not compile %s (%s): fp32 products run through oneDNN instead, so verifying several "
                    "tokens costs more", " and ".join(path.name for path in SOURCES), str(error).splitlines()[0] if str(error) else type(error).__name__)
        return None
    seconds = time.perf_counter() - start
    if seconds > COMPILED_IF_SLOWER_S:  # a warning, so the CLI shows why the first run after install paused
        log.warning("compiled eaglewire's AVX2 product kernel for this machine in %.0f s (once: it is cached)", seconds)
    return module


def available() -> bool:
    """The kernel runs here: an x86 CPU with AVX2 or more, and it compiled."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and extension() is not None


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` for a contiguous fp32 ``x`` [M, K] and ``weight`` [N, K] -> [M, N], row-invariant."""
    return extension().rowwise_linear(x, weight, bias)


def rowwise_linear_blocks(x: torch.Tensor, codes: BlockCodes, bias: torch.Tensor | None) -> torch.Tensor:
    """``rowwise_linear`` with ``weight`` given as exact block codes: the same result bit for bit."""
    return extension().rowwise_linear_blocks(x, codes.codes, codes.scale, codes.offset, codes.bits, bias)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, index: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Attention of query rows ``q`` [T, H, D] over a cache layer's ``k``, ``v`` [KVH, S, D], each row on its own
    (``row_attention.cpp``): row t over slots ``0..lengths[t]-1``, or over its run of ``index`` where that is
    not empty. Bit for bit the same for a row whatever rows share the call."""
    return extension().attend_rows(q, k, v, lengths, index, scale)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of a contiguous fp32 ``x`` [..., H] (H a multiple of 8), each row on its own."""
    return extension().rms_norm_rows(x, weight, eps)


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """RoPE on ``q`` [T, H, D] in place and on ``k`` [T, KVH, D], with each token's ``cos`` and ``sin_signed`` rows
    [T, D]; then ``k`` and ``v`` into ``slots`` [T] of a cache layer's ``k_cache``, ``v_cache`` [KVH, S, D]."""
    extension().rope_and_store(q, k, v, cos, sin_signed, k_cache, v_cache, slots)
