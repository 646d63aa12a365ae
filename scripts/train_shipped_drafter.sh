#!/usr/bin/env bash
# Reproduces the first run behind the drafter shipped for the embedded smollm2-135m target (row 1 of its
# ledger, src/eaglewire/drafters/smollm2-135m/REPORT.md); later rows continue it with scripts/train_drafter_long.sh.
# Takes about 1.5 hours on a 2-core CPU (40 min extraction, 40 min training); both steps resume if interrupted (extract: rerun;
# train: add --resume). DATA and RUN may point anywhere with ~6 GB free.
set -euo pipefail
DATA=${DATA:-data/sg1280}
RUN=${RUN:-runs/shipped-smollm2}
eaglewire extract --data sharegpt --max-samples 1280 --max-length 1024 --out "$DATA"
eaglewire train --data "$DATA" --out "$RUN" --epochs 2 --draft-vocab 8192 --ttt-steps 3 \
    --lr 1e-3 --warmup-steps 15 --batch-tokens 8192 --eval-every 25 --save-every 25 --save-dtype fp16 --no-progress
python -m eaglewire.drafter.shipped install "$RUN"   # copies checkpoint + report into src/eaglewire/drafters/
