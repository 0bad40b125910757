#!/usr/bin/env bash
# Runs the gpu-marked tests on the GPU machine in JOBS parallel pytest processes (default 4).
#
#   bash tools/gpu_tests.sh [pytest selection args...]     e.g.  bash tools/gpu_tests.sh tests/gpu -k routing
#
# Why parallel: a test's time there is mostly compiling (each Mosaic GPU kernel at a new shape takes seconds of CPU),
# and the machine has 16 cores and one GPU. Each process allocates GPU memory on demand so that they fit side by side.
# Memory: each full-size GLU MLP test holds several GB; on an 80 GB H100, JOBS=8 ran out of memory in
# tests/gpu/test_glu_mlp_gpu.py and JOBS=3 did not; over all of tests/gpu, JOBS=6 left two full-size grouped-matmul
# tests out of memory (2026-11-25), and JOBS=4 one GLU MLP test (2026-11-27). So the tests that failed in the shards
# run once more, one after the other in a single process, with the whole card to themselves: a test that fails again
# fails the run; one that passes then is named in the output (rerun.log), not hidden.
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
  pids[shard]=$!
done
# pytest's -rfE summary names each failed or erroring test as "FAILED <id>" / "ERROR <id>[ - message]".
failed_ids() { sed -n 's/^\(FAILED\|ERROR\) \([^ ]*\).*/\2/p' "$@"; }
status=0
for shard in "${!pids[@]}"; do
  wait "${pids[$shard]}" && continue
  status=1
  # A shard that failed without naming a test (a crash) cannot be mended by re-running tests.
  [ -z "$(failed_ids "$logs/shard$shard.log")" ] && crashed=1
done
tail -n 4 "$logs"/shard*.log
mapfile -t failed < <(failed_ids "$logs"/shard*.log | sort -u)
if [ $status -ne 0 ] && [ -z "${crashed:-}" ]; then
  echo "re-running the ${#failed[@]} test(s) that failed in the shards, alone on the card: ${failed[*]}"
  python3 -m pytest -m gpu -q -rfE -p no:cacheprovider "${failed[@]}" >"$logs/rerun.log" 2>&1 && status=0
  tail -n 4 "$logs/rerun.log"
  [ $status -eq 0 ] && echo "passed when re-run alone (failed beside other shards): ${failed[*]}"
fi
exit $status
