#!/usr/bin/env bash
# Runs the gpu-marked tests on the GPU machine in JOBS parallel pytest processes (default 4).
#
#   bash tools/gpu_tests.sh [pytest selection args...]     e.g.  bash tools/gpu_tests.sh tests/gpu -k routing
#
# Why parallel: a test's time there is mostly compiling (each Mosaic GPU kernel at a new shape takes seconds of CPU),
# and the machine has 16 cores and one GPU. Each process allocates GPU memory on demand so that they fit side by side.
# Memory: each full-size GLU MLP test holds several GB; on an 80 GB H100, JOBS=8 ran out of memory in
# tests/gpu/test_glu_mlp_gpu.py and JOBS=3 did not; over all of tests/gpu, JOBS=6 left two full-size grouped-matmul
# tests out of memory, and JOBS=4 one GLU MLP test. So a test that ran out of memory in the shards (its failure text
# says so: tools/gpu_failure_kinds.py records each failure's kind) runs once more, with the others that did, one after
# the other in a single process with the whole card to itself; one that passes then is named in the output
# (rerun.log), one that fails again fails the run. Any other failure fails the run at once and is not re-run: a test
# that fails once and passes alone may be a race or another intermittent wrong answer.
# Time: the grouped-matmul and GLU MLP files (54 tests) need more than one 600-s device call even with JOBS=5 (48 done
# at 570 s, H100): split a selection over two calls.
# flax: the nn.MoE test needs flax >= 0.12.12 (the machine's may be older): carry its wheel (train/README.md).
# Logs go to $OUT (the device tool's folder) or ./gpu_test_logs; the exit status is non-zero if any shard failed, unless
# every failure was out of memory and passed when re-run alone.
set -uo pipefail
jobs=${JOBS:-4}
logs=${OUT:-gpu_test_logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"  # for -p gpu_failure_kinds
[ $# -eq 0 ] && set -- tests/gpu
mapfile -t node_ids < <(python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider "$@" | grep '::')
echo "${#node_ids[@]} tests in $jobs shards"
pids=()
for ((shard = 0; shard < jobs; shard++)); do
  shard_ids=()
  for ((i = shard; i < ${#node_ids[@]}; i += jobs)); do shard_ids+=("${node_ids[$i]}"); done
  [ ${#shard_ids[@]} -eq 0 ] && continue
  GPU_FAILURE_KINDS="$logs/shard$shard.failures" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    -p gpu_failure_kinds --durations=3 "${shard_ids[@]}" >"$logs/shard$shard.log" 2>&1 &
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
# Failed tests by kind (a test with any failure that is not out of memory counts as "other").
kind_ids() { cat "$logs"/shard*.failures 2>/dev/null | awk -v kind="$1" '$1 == kind { sub(/^[^ ]+ /, ""); print }' | sort -u; }
mapfile -t other < <(kind_ids other)
mapfile -t oom < <(comm -23 <(kind_ids oom) <(kind_ids other))
if [ $status -ne 0 ] && [ -z "${crashed:-}" ]; then
  [ ${#other[@]} -gt 0 ] && echo "failed, not out of memory (not re-run): ${other[*]}"
  if [ ${#oom[@]} -gt 0 ]; then
    echo "re-running the ${#oom[@]} test(s) that ran out of memory in the shards, alone on the card: ${oom[*]}"
    python3 -m pytest -m gpu -q -rfE -p no:cacheprovider "${oom[@]}" >"$logs/rerun.log" 2>&1
    rerun_status=$?
    tail -n 4 "$logs/rerun.log"
    if [ $rerun_status -eq 0 ]; then
      echo "passed when re-run alone (out of memory beside other shards): ${oom[*]}"
      [ ${#other[@]} -eq 0 ] && status=0
    fi
  fi
fi
exit $status
