#!/usr/bin/env bash
# The next GPU lease, prepared: what issues 49 and 52 still need measured, in their order, as
# calls that each fit one `run` command (at most 10 minutes; a session has 15 device-minutes in
# all, a machine's start included). Each step writes its report to $OUT before the next starts
# (tables: $OUT/gpu-<N>.json and .log; the probe: $OUT/probe-fsdp.log), so a call cut short keeps
# what it finished; a step that no longer fits in what is left of the call is skipped and says so,
# for the next call or lease to take up.
#
#   call 1: table 4 (LoRA and QLoRA against a full fine-tune: the last figure issue 52 needs);
#           table 2's FSDP run profiled (why FSDP took 2.79x DDP's step, issue 49); table 5
#   call 2: table 3 (packed against padded); table 1's Llama pair, chunked loss against
#           liger-kernel (decides liger_kernel's default, issue 49)
#   call 3: tables 6, 7, 8
#
# Usage (from the checkout's root, .whl/ carried: ../shared/gpu/prepare_wheels.sh, then
# `bash bench/gpu/lease.sh wheels` for liger-kernel's and torchao's wheels, on the CPU machine):
#   bash bench/gpu/lease.sh CALL [SECONDS]     (SECONDS: the call's budget, default 560)
#   SMOKE_CPU=1 bash bench/gpu/lease.sh CALL   (the same steps on this CPU machine, tiny shapes:
#                                               checks the scripts, its figures mean nothing)
set -uo pipefail
call=${1:?usage: bash bench/gpu/lease.sh CALL|wheels [SECONDS]}
if [ "$call" = wheels ]; then  # on the CPU machine: the extras' wheels for Python 3.12
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
    "liger-kernel==0.8.5" "torchao>=0.18,<0.19"
  du -sh .whl
  exit 0
fi
budget=${2:-560}
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
began=$(date +%s)
source bench/gpu/_gpu_env.sh
smoke=()
[ "${SMOKE_CPU:-0}" = 1 ] && smoke=(--smoke-cpu)

# step NAME NEEDS_S LIMIT_S COMMAND...: runs COMMAND under LIMIT_S (less where less is left of the
# call), or skips it where under NEEDS_S is left.
step() {
  local name=$1 needs=$2 limit=$3
  shift 3
  local left=$((budget - ($(date +%s) - began)))
  if [ "$left" -lt "$needs" ]; then
    echo "== $name: skipped, ${left} s left of the call and it needs ${needs} s: take it up next"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local started
  started=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name: exit $?, $(($(date +%s) - started)) s (limit $limit s)"
  grep -v -e '^\s*$' -e 'Warning' -e 'warn(' "$out/$name.log" | tail -25
}

table() {  # table N NEEDS_S LIMIT_S [bench_gpu.py options]
  local n=$1 needs=$2 limit=$3
  shift 3
  step "gpu-$n" "$needs" "$limit" python3 bench/gpu/bench_gpu.py --table "$n" "$@" "${smoke[@]}" \
    --json "$out/gpu-$n.json"
}

case $call in
  1)
    table 4 150 220
    step probe-fsdp 90 170 python3 bench/gpu/gpu_probe.py --runner --compiled --fsdp --checkpointing
    table 5 100 170
    ;;
  2)
    table 3 230 270
    table 1 300 330 --steps 100 --skip 40 --no-baseline \
      --configs runner_compiled_llama,runner_compiled_liger
    ;;
  3)
    table 6 200 260
    table 7 120 170
    table 8 100 150
    ;;
  *)
    echo "unknown call $call: 1, 2, 3 or wheels" >&2
    exit 2
    ;;
esac
echo "lease call $call: $(($(date +%s) - began)) s of its $budget"
