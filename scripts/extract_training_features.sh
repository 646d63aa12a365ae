#!/usr/bin/env bash
# Hidden states for offline training, extracted once from the four answer files that
# scripts/rebuild_training_tokens.sh joins (all_regen, second_fj, third_ac, third_dg .jsonl in DATA), so that
# later rows train on them for several epochs at offline speed (~2.6x the online rows' tokens/s on this CPU:
# README, drafter recipe). Each source's first records, about the same share of each (1,630,142 tokens, 7.5 GB
# in bf16 with the defaults below); both cores under torchrun, each process filling its own shards.
# A kill loses nothing: rerun the same command and each extraction resumes from its finished shards.
# Usage: scripts/extract_training_features.sh [DATA]        (default /work/data; ~40 min on both cores)
# Then, e.g. (x_third_ac as --data: its held-out records, every 50th, are among the 47 of regen3.xz that the
# online rows evaluate):
#   OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 $(which eaglewire) train --data DATA/x_third_ac \
#       --replay DATA/x_all_regen --replay DATA/x_second_fj --replay DATA/x_third_dg --init-from ... --out ...
set -euo pipefail
DATA=${1:-/work/data}
THIRD_AC=${THIRD_AC:-400} ALL_REGEN=${ALL_REGEN:-2400} SECOND_FJ=${SECOND_FJ:-500} THIRD_DG=${THIRD_DG:-400}
export OMP_NUM_THREADS=1
EAGLEWIRE=$(command -v eaglewire) || { echo "eaglewire is not on PATH: run make install, then PATH=\$PWD/.venv/bin:\$PATH" >&2; exit 1; }
extract() {  # extract SOURCE RECORDS
    torchrun --nproc-per-node 2 "$EAGLEWIRE" extract --data "$DATA/$1.jsonl" --max-samples "$2" \
        --out "$DATA/x_$1" --no-progress
}
extract third_ac "$THIRD_AC"
extract all_regen "$ALL_REGEN"
extract second_fj "$SECOND_FJ"
extract third_dg "$THIRD_DG"
