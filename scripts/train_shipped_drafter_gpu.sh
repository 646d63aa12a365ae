#!/usr/bin/env bash
# The shipped SmolLM2 drafter's recipe on one CUDA GPU (the budget is wall-clock seconds of training).
#   here:  python scripts/tokenize_conversations.py --data sharegpt --max-samples 30000 --out tokens.xz
#   there: scripts/train_shipped_drafter_gpu.sh tokens.xz RUN [BUDGET_S]
#   here:  python -m eaglewire.drafter.shipped install RUN
set -euo pipefail
tokens=$1 out=$2 budget=${3:-420}
python3 scripts/train_on_tokens.py --tokens "$tokens" --out "$out" --device cuda --budget-s "$budget" \
    --ttt-steps 5 --draft-vocab 8192 --batch-tokens 16384 --lr 1e-3 --warmup-steps 50 \
    --eval-every 250 --eval-samples 64 --save-every 500
