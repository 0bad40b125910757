#!/usr/bin/env bash
# Runs the gpu-marked tests on the GPU machine in JOBS parallel pytest processes (default 4).
#
#   bash tools/gpu_tests.sh [pytest selection args...]     e.g.  bash tools/gpu_tests.sh tests/gpu -k routing
#
# Why parallel: a test's time there is mostly compiling (each Mosaic GPU kernel at a new shape takes seconds of CPU),
# and the machine has 16 cores and one GPU. Each process allocates GPU memory on demand so that they fit side by side.
# Memory: each full-size GLU MLP test holds several GB; on an 80 GB H100, JOBS=8 ran out of memory in
# tests/gpu/test_glu_mlp_gpu.py and JOBS=3 did not; over all of tests/gpu, JOBS=6 left two full-size grouped-matmul
# tests out of memory (2026-11-25): re-run what fails that way with fewer jobs.
# Time: the grouped-matmul and GLU MLP files (54 tests) need more than one 600-s device call even with JOBS=5 (48 done
# at 570 s, H100): split a selection over two calls.
# flax: the nn.MoE test needs flax >= 0.12.12 (the machine's may be older): carry its wheel (train/README.md).
# Logs go to $OUT (the device tool's folder) or ./gpu_test_logs; the exit status is non-zero if any shard failed.
set -uo pipefail
jobs=${JOBS:-4}
logs=${OUT:-gpu_test_logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ $# -eq 0 ] && set -- tests/gpu
mapfile -t node_ids < <(python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider "$@" | grep '::')
echo "${#node_ids[@]} tests in $jobs shards"
pids=()
for ((shard = 0; shard < jobs; shard++)); do
  shard_ids=()
  for ((i = shard; i < ${#node_ids[@]}; i += jobs)); do shard_ids+=("${node_ids[$i]}"); done
  [ ${#shard_ids[@]} -eq 0 ] && continue
  python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --durations=3 "${shard_ids[@]}" >"$logs/shard$shard.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
tail -n 4 "$logs"/shard*.log
exit $status
