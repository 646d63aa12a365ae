"""Tokenize conversations once, on this machine, for a training run on another one.

Writes the token ids, loss masks and record indices that ``eaglewire train --online``
would build up front, xz-compressed (uint16 ids when the vocabulary fits), plus the
source identity and skip counts, so a GPU machine that has the target but not the
dataset package can train on exactly these samples (see train_on_tokens.py).

    python scripts/tokenize_conversations.py --data sharegpt --max-samples 16000 --out tokens.xz
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import time

import numpy as np
import torch

from eaglewire.data.samples import OnlineSamples
from eaglewire.target import DEFAULT_TARGET, load_target
from eaglewire.wiring import Wiring


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="sharegpt")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--max-samples", type=int, required=True)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    target = load_target(args.target)
    start = time.perf_counter()
    samples = OnlineSamples(target, Wiring.resolve(None, target.num_layers), args.data, args.max_samples,
                            args.max_length)
    ids = torch.cat([r.input_ids for r in samples.refs]).numpy()
    if ids.max() >= 1 << 16:
        raise SystemExit("token ids do not fit uint16")
    arrays = {
        "input_ids": ids.astype(np.uint16),
        "loss_mask": np.packbits(torch.cat([r.loss_mask for r in samples.refs]).numpy()),
        "lengths": np.array([r.length for r in samples.refs], dtype=np.int32),
        "record_index": np.array([r.record_index for r in samples.refs], dtype=np.int64),
        "meta": np.frombuffer(json.dumps({"source": samples.source.identity(), "skipped": samples.skipped,
                                          "target": target.fingerprint, "max_samples": args.max_samples,
                                          "max_length": args.max_length}).encode(), dtype=np.uint8),
    }
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    with lzma.open(args.out, "wb", preset=6) as handle:
        handle.write(buffer.getvalue())
    print(f"{len(samples.refs)} samples, {len(ids)} tokens, skipped {samples.skipped}, "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
