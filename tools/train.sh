#!/usr/bin/env bash
# The main job: trains the toy MoE language model (`python -m train`; its default is the CPU-sized config "tiny").
# Arguments go to `python -m train`, e.g. `bash tools/train.sh --config gpu --backend pallas`.
source "$(dirname "$0")/env.sh" || exit 1
cd "$MOE_JAX_REPO" || exit 1
exec python -m train "$@"
