"""The dtype names eaglewire accepts on the command line."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_dtype(name: str, option: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"{option} must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]
