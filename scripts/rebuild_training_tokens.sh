#!/usr/bin/env bash
# Rebuilds the CPU rows' tokens files in OUT (default /work/data) from the target's answers kept in
# data/regenerated/smollm2-135m, since a machine's /work/data does not outlive its session:
#   regen.xz      first turns (answers_a-o) and second turns a-e: rows 19 and since
#   regen_fj.xz   second turns f-j: rows 20 and since
#   regen3.xz     third turns a-c: rows 22 and since (its held-out records are the ledger's)
#   regen3dg.xz   third turns d-g: no shipped row yet
# Each prints its sample and token counts; the data README gives the counts and hashes to expect (a tokens
# file records its source's path, so the hashes match only with the default OUT).
# Usage: scripts/rebuild_training_tokens.sh [OUT]    (~3 minutes of one thread)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/work/data}
ANSWERS=data/regenerated/smollm2-135m
mkdir -p "$OUT"

joined() {  # joined NAME SLICE... : the named answer files, decompressed and concatenated into OUT/NAME
    local name=$1; shift
    for slice in "$@"; do xz -dc "$ANSWERS/$slice.jsonl.xz"; done > "$OUT/$name"
}
tokenize() {  # tokenize JSONL XZ
    python scripts/tokenize_conversations.py --data "$OUT/$1" --max-samples 20000 --max-length 2048 --out "$OUT/$2"
    sha256sum "$OUT/$2"
}

joined all_regen.jsonl answers_{a,b,c,d,e,f,g,h,i,j,k,l,m,n,o} answers2_{a,b,c,d,e}
tokenize all_regen.jsonl regen.xz
joined second_fj.jsonl answers2_{f,g,h,i,j}
tokenize second_fj.jsonl regen_fj.xz
joined third_ac.jsonl answers3_{a,b,c}
tokenize third_ac.jsonl regen3.xz
joined third_dg.jsonl answers3_{d,e,f,g}
tokenize third_dg.jsonl regen3dg.xz
