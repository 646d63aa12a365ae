#!/usr/bin/env bash
# Load eaglewire's `--to speculators` export in speculators itself, as a speculators user would, and
# compare its drafter logits with eaglewire's on real SmolLM2 hidden states (3 TTT steps).
#
#   scripts/interop/speculators_check.sh
#   DRAFTER=runs/NAME/checkpoint INTEROP_OUT=benchmarks/results/NAME.json scripts/interop/speculators_check.sh
#   ADD_RANDOM_LAYER=1 INTEROP_OUT=benchmarks/results/interop_speculators_two_layers.json scripts/interop/speculators_check.sh
#
# Environment: INTEROP_VENV (default /work/interop-venv, built on first use), INTEROP_WORK (a folder to keep
# the verifier copy and exports in; default a temporary one, removed afterwards), INTEROP_OUT (the JSON),
# EAGLEWIRE_PY (default .venv/bin/python), DRAFTER (a native checkpoint; default the shipped drafter),
# ADD_RANDOM_LAYER (non-empty: check the drafter grown by one decoder layer filled at random). Exit status 1 when speculators disagrees with eaglewire.
#
# Two Python environments: eaglewire's .venv writes the verifier folder, the exports and eaglewire's
# own logits; a separate venv with speculators==0.9.0 (CPU torch 2.13.0, a transformers it accepts,
# no torchvision/torchaudio) loads the export and runs it. Writes benchmarks/results/interop_speculators.json.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${INTEROP_VENV:-/work/interop-venv}"
if [ -n "${INTEROP_WORK:-}" ]; then
    WORK="$INTEROP_WORK"  # kept afterwards
else
    WORK="$(mktemp -d /tmp/eaglewire-interop.XXXXXX)"
    trap 'rm -rf "$WORK"' EXIT  # the verifier copy alone is ~540 MB
fi
EAGLEWIRE_PY="${EAGLEWIRE_PY:-$ROOT/.venv/bin/python}"
OUT_JSON="${INTEROP_OUT:-$ROOT/benchmarks/results/interop_speculators.json}"
SPECULATORS_VERSION=0.9.0
TRANSFORMERS_VERSION=5.19.0  # speculators 0.9.0 requires transformers>=5.0,<=5.19.0

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
installed() { "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }
if [ "$(installed speculators)" != "$SPECULATORS_VERSION" ] || [ "$(installed transformers)" != "$TRANSFORMERS_VERSION" ]; then
    # The CPU build of torch (an unpinned torch pulls a multi-GB CUDA build).
    "$VENV/bin/python" -m pip install -q torch==2.13.0
    "$VENV/bin/python" -m pip install -q "transformers==$TRANSFORMERS_VERSION"
    # --no-deps: speculators lists torchvision and torchaudio, which loading an EAGLE-3 drafter does not use.
    "$VENV/bin/python" -m pip install -q --no-deps "speculators==$SPECULATORS_VERSION" "hs-connectors==$SPECULATORS_VERSION"
    "$VENV/bin/python" -m pip install -q aiohttp click "datasets>=4.0,<=5.1.0" httpx huggingface-hub \
        "loguru>=0.7.2,<=0.7.3" "numpy>=2.0,<=2.5.4" "openai>=2.0" protobuf psutil "pydantic>=2" pydantic-settings \
        rich safetensors "tqdm>=4.66.3,<=4.70.1" "typer>=0.12"
fi
echo "speculators venv: $VENV (speculators $(installed speculators), transformers $(installed transformers), torch $(installed torch))"
echo "work folder: $WORK"

# 1. eaglewire: the target as a Hugging Face folder, the exports, eaglewire's logits on real hidden states.
"$EAGLEWIRE_PY" "$ROOT/scripts/interop/eaglewire_side.py" --work "$WORK" ${DRAFTER:+--drafter "$DRAFTER"} ${ADD_RANDOM_LAYER:+--add-random-layer}
# 2. speculators: load the export as a user would, run it, compare; convert the --to eagle export.
HF_HUB_OFFLINE=1 "$VENV/bin/python" "$ROOT/scripts/interop/speculators_side.py" --work "$WORK" --out "$OUT_JSON"
