"""The dtype names eaglewire accepts on the command line."""

from __future__ import annotations

import torch

from .errors import ConfigError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_dtype(name: str, option: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"{option} must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


# What the target's matrix products may multiply in at inference (``--dtype`` of generate, bench, serve, demo).
# bf16 products run over the fp32 residual stream (engine/lean.py) and only where the CPU multiplies bf16 in hardware.
TARGET_DTYPES = ("fp32", "bf16")


def target_dtype(name: str) -> torch.dtype:
    if name not in TARGET_DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(TARGET_DTYPES)}, got {name!r}")
    return DTYPES[name]
