"""The mean of several drafter checkpoints' weights, as one checkpoint to measure.

Consecutive rows of one lineage share a draft vocabulary and lie close together; their mean is a free
stand-in for a longer learning-rate decay. The result records what it averaged (its metrics name the
sources), so it cannot pass for a trained row. Measure it beside its sources with
``benchmarks/drafter_agreement.py``:

    python benchmarks/drafter_average.py --out runs/avg_27_28_29 runs/r27/checkpoint runs/r28/checkpoint \\
        runs/r29/checkpoint
    python benchmarks/drafter_agreement.py --drafter avg=runs/avg_27_28_29 --out runs/agree80_avg.json

Rows 27-29 averaged replayed τ 2.233 against row 29's 2.237 (README, drafter recipe).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from eaglewire.drafter.checkpoint import (
    CheckpointError,
    drafter_from_state,
    read_checkpoint_state,
    save_checkpoint,
)

VOCAB_MAPS = ("d2t", "t2d")  # integer maps between draft and target ids: equal in every source, never averaged


def averaged_state(states: list[dict[str, torch.Tensor]], sources: list[str]) -> dict[str, torch.Tensor]:
    mean = {}
    for key, first in states[0].items():
        tensors = [state[key] for state in states]
        if key in VOCAB_MAPS:
            for source, tensor in zip(sources[1:], tensors[1:]):
                if not torch.equal(first, tensor):
                    raise CheckpointError(f"{source} has another draft vocabulary ({key}) than {sources[0]}; "
                                          "only rows of one lineage (one vocabulary) can be averaged")
            mean[key] = first
        else:
            mean[key] = torch.stack([t.float() for t in tensors]).mean(dim=0)
    return mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", type=Path, help="checkpoint folders (two or more)")
    parser.add_argument("--out", type=Path, required=True, help="the averaged checkpoint's folder")
    args = parser.parse_args()
    if len(args.sources) < 2:
        parser.error("give two or more checkpoints to average")
    read = [read_checkpoint_state(source) for source in args.sources]
    config, meta, _ = read[0]
    for source, (other_config, other_meta, _) in zip(args.sources[1:], read[1:]):
        if other_config != config or other_meta.wiring != meta.wiring or other_meta.target != meta.target:
            raise CheckpointError(f"{source} differs from {args.sources[0]} in its config, wiring or target "
                                  "fingerprint; cannot average")
    names = [str(source) for source in args.sources]
    mean = averaged_state([state for _, _, state in read], names)
    # The drafter uses the target's embedding, which a checkpoint does not store: a stand-in of the right shape
    # lets it be built and saved (the embedding is not saved).
    drafter = drafter_from_state(config, nn.Embedding(config.vocab_size, config.hidden_size), mean, "average")
    save_checkpoint(args.out, drafter, replace(meta, metrics={"averaged_from": names}), dtype=torch.float16)
    print(f"wrote {args.out}: the mean of {len(names)} checkpoints")


if __name__ == "__main__":
    main()
