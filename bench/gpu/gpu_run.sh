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
# Again when a wheel carried since (liger-kernel's, for liger_kernel=True) is not installed yet.
if [ ! -d /tmp/site/ray ] || { compgen -G '.whl/liger_kernel-*.whl' > /dev/null && [ ! -d /tmp/site/liger_kernel ]; }; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for table in "$@"; do
  started=$(date +%s)
  extra=()
  [ "$table" = 1 ] && extra=(--steps "${STEPS:-150}" --skip 50)  # about 6 minutes, not 10
  [ "$table" = 1 ] && [ -n "${CONFIGS:-}" ] && extra+=(--configs "$CONFIGS")
  [ "$table" = 1 ] && [ "${BASELINE:-1}" = 0 ] && extra+=(--no-baseline)
  timeout "$limit" python3 bench/gpu/bench_gpu.py --table "$table" "${extra[@]}" \
    --json "$out/gpu-$table.json" > "$out/gpu-$table.log" 2>&1
  echo "== table $table: exit $?, $(( $(date +%s) - started )) s"
  grep -v -e '^\s*$' -e 'Warning' -e 'warn(' "$out/gpu-$table.log" | tail -25
done
