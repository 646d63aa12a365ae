#!/usr/bin/env bash
# A long CPU run that continues a drafter (by default the shipped one) in the background.
# It checkpoints every 20 steps; after a kill, the same command resumes it (it adds --resume itself).
#   DATA=data/sg1280 nohup scripts/train_drafter_long.sh > runs/long.log 2>&1 &
#   OMP_NUM_THREADS=1 ... leaves a core for other work; kill it and rerun with more threads later.
#   python -m eaglewire.drafter.shipped install runs/long [BENCH_JSON]    # ship it once it beats the shipped drafter
# DATA: an extracted dataset of the drafter's target (scripts/train_shipped_drafter.sh makes one).
# TTT: how many steps the drafter is unrolled on its own outputs (default 3).
# REPLAY: more extracted datasets, space-separated, trained on alongside DATA (e.g. ones earlier rows used).
# Continuing at 1e-3 cost the shipped drafter ~0.04 of held-out accuracy for ~100 steps before it recovered;
# 5e-4 with a long linear decay (wsd) is the schedule the second continuation used (drafters/*/REPORT.md).
set -euo pipefail
DATA=${DATA:-data/sg1280}
RUN=${RUN:-runs/long}
INIT=${INIT:-src/eaglewire/drafters/smollm2-135m}
STEPS=${STEPS:-600}
LR=${LR:-5e-4}
TTT=${TTT:-3}  # training-time-test unroll depth
resume=()
if [ -f "$RUN/train_state.pt" ]; then resume=(--resume); fi
replay=()
for folder in ${REPLAY:-}; do replay+=(--replay "$folder"); done
eaglewire train --data "$DATA" "${replay[@]}" --out "$RUN" --init-from "$INIT" "${resume[@]}" --steps "$STEPS" \
    --draft-vocab 8192 --ttt-steps "$TTT" --batch-tokens 2048 --lr "$LR" --schedule wsd --decay-fraction 0.6 \
    --warmup-steps 10 --eval-every 40 --save-every 20 --save-dtype fp16 --no-progress
