#!/usr/bin/env bash
# Ledger row 19's recipe on one CUDA GPU: continue a drafter (by default the shipped one) on tokenized
# conversations, samples packed per forward; the budget is wall-clock seconds of training.
#   here:  python scripts/tokenize_conversations.py --data FILE --max-samples N --out FILE.xz    (one per source)
#   there: scripts/train_shipped_drafter_gpu.sh RUN BUDGET_S tokens.xz [more.xz ...]
#   here:  python -m eaglewire.drafter.shipped install RUN [BENCH_JSON]
# A file named twice is trained on twice an epoch (row 19: the target's own answers 3x, ShareGPT once).
# INIT: the checkpoint to continue (a new drafter's first run is scripts/train_shipped_drafter.sh, on a CPU).
set -euo pipefail
out=$1 budget=$2
shift 2
tokens=()
for file in "$@"; do tokens+=(--tokens "$file"); done
python3 scripts/train_on_tokens.py "${tokens[@]}" --out "$out" --device cuda --budget-s "$budget" \
    --init-from "${INIT:-src/eaglewire/drafters/smollm2-135m}" --ttt-steps 3 --draft-vocab 8192 \
    --batch-tokens 16384 --pack-tokens 16384 --lr 5e-4 --warmup-steps 20 --schedule wsd --decay-fraction 0.4 \
    --eval-every 250 --eval-samples 64 --save-every 250
