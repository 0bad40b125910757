#!/usr/bin/env bash
# The main job: trains the toy MoE language model. Defaults to the CPU-sized config; arguments go to `python -m train`,
# e.g. `bash tools/train.sh --config gpu --backend pallas`.
source "$(dirname "$0")/env.sh"
exec python -m train "${@:---config=tiny}"
