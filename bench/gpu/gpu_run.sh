#!/usr/bin/env bash
# On the lent GPU machine (see ../shared/gpu/README.md): install the carried wheels once, then run
# bench/gpu/bench_gpu.py's tables one command each, so that a table that fails or runs out of time leaves
# the others' figures. Each table's report goes to $OUT/gpu-<N>.json and its output to
# $OUT/gpu-<N>.log; the last lines of each are printed.
#
# Usage (from the checkout's root, .whl/ carried):  bash bench/gpu/gpu_run.sh SECONDS TABLE...
#   e.g.  bash bench/gpu/gpu_run.sh 170 2 3 5      (at most 170 s a table)
#   STEPS=120 CONFIGS=runner_compiled,hf_compiled bash bench/gpu/gpu_run.sh 400 1   (part of table 1)
#   BASELINE=0 CONFIGS=runner_compiled,runner_compiled_cb bash bench/gpu/gpu_run.sh 300 1   (a pair alone)
set -uo pipefail
limit=$1
shift
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
source bench/gpu/_gpu_env.sh
for table in "$@"; do
  started=$(date +%s)
  extra=()
  [ "$table" = 1 ] && extra=(--steps "${STEPS:-150}" --skip 50)  # about 6 minutes, not 10
  [ "$table" = 1 ] && [ -n "${CONFIGS:-}" ] && extra+=(--configs "$CONFIGS")
  [ "$table" = 1 ] && [ "${BASELINE:-1}" = 0 ] && extra+=(--no-baseline)
  [ "${SMOKE_CPU:-0}" = 1 ] && extra+=(--smoke-cpu)
  timeout "$limit" python3 bench/gpu/bench_gpu.py --table "$table" "${extra[@]}" \
    --json "$out/gpu-$table.json" > "$out/gpu-$table.log" 2>&1
  echo "== table $table: exit $?, $(( $(date +%s) - started )) s"
  grep -v -e '^\s*$' -e 'Warning' -e 'warn(' "$out/gpu-$table.log" | tail -25
done
