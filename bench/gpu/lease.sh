#!/usr/bin/env bash
# The next GPU lease, prepared: what issues 49, 51 and 52 still need measured, in their order, as
# calls that each fit one `run` command (at most 10 minutes; a session has 15 device-minutes in
# all, a machine's start included). Each step writes its report to $OUT before the next starts
# (tables: $OUT/gpu-<N>.json and .log; the others: $OUT/<step>.json or .log), so a call cut short
# keeps what it finished; a step that no longer fits in what is left of the call is skipped and
# says so, for the next call or lease to take up (`lease.sh STEP [SECONDS]` runs one step).
#
#   call 1: gpu-4     table 4, LoRA and QLoRA against a full fine-tune: the last figure of the
#                     QLoRA issue (52)
#           async_rl_loss  bench_async_rl.py's engine-loss run on the machine's 16 CPU cores,
#                     the GPU unused: every trainer and engine process on a core of its own,
#                     which this 2-core machine cannot give (`async_rl`, its settings so, ran
#                     on 2026-11-29: docs/benchmarks.md)
#   call 2: fsdp-host (FSDP2's host time per block on this host's CPU, the GPU hidden: 41 s on
#           the 2-core machine), probe-fsdp (why FSDP took 2.79x DDP's step, issue 49), gpu-5,
#           gpu-3
#   call 3: gpu-1-liger (table 1's Llama pair: chunked loss against liger-kernel, for
#           liger_kernel's default), gpu-6
#   call 4: gpu-7, gpu-8
#   call 5: gpu-2-1b (table 2 on table 4's 1.1B Llama shape, where each block's GPU time is
#           well above FSDP2's host time a block: the size FSDP is for)
#
# Usage (from the checkout's root, .whl/ carried: ../shared/gpu/prepare_wheels.sh, then
# `bash bench/gpu/lease.sh wheels` for liger-kernel's and torchao's wheels, on the CPU machine):
#   bash bench/gpu/lease.sh CALL|STEP [SECONDS]  (SECONDS: the call's budget, default 560)
#   SMOKE_CPU=1 bash bench/gpu/lease.sh CALL     (the same steps on this CPU machine, tiny
#                                                 shapes: checks the scripts; figures mean nothing)
set -uo pipefail
call=${1:?usage: bash bench/gpu/lease.sh CALL|STEP|wheels [SECONDS]}
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
  # a run stopped by SIGTERM saves and stops at its next step boundary; killed 15 s later (a
  # stopped table 4 held on for 60 s more, 2026-11-29)
  timeout -k 15 "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name: exit $?, $(($(date +%s) - started)) s (limit $limit s)"
  grep -v -e '^\s*$' -e 'Warning' -e 'warn(' "$out/$name.log" | tail -25
}

table() {  # table N NEEDS_S LIMIT_S [bench_gpu.py options]
  local n=$1 needs=$2 limit=$3
  shift 3
  step "gpu-$n" "$needs" "$limit" python3 bench/gpu/bench_gpu.py --table "$n" "$@" "${smoke[@]}" \
    --json "$out/gpu-$n.json"
}

# run_step NAME: one step, with what it needs (s) and the most it may take (s)
run_step() {
  case $1 in
    gpu-3) table 3 230 270 ;;  # its padded run alone took 80 s, Ray's start and the data 30
    gpu-6) table 6 200 280 ;;
    # table 4's three 1.1B runs took 77 s (full), 58 s (LoRA) and over 80 s (QLoRA) on an H200
    # (2026-11-29, cut at 220 s): a call's budget of its own but for the engine-loss run
    gpu-4) table 4 330 420 ;;
    gpu-2-1b) step gpu-2-1b 300 420 python3 bench/gpu/bench_gpu.py --table 2 \
      --table2-model llama1b "${smoke[@]}" --json "$out/gpu-2-1b.json" ;;
    gpu-[2-8]) table "${1#gpu-}" 120 220 ;;
    gpu-1-liger) table 1 300 330 --steps 100 --skip 40 --no-baseline \
      --configs runner_compiled_llama,runner_compiled_liger ;;
    fsdp-host)
      local sizes=(--rounds 2)
      [ "${SMOKE_CPU:-0}" = 1 ] && sizes=(--rounds 1 --steps 6 --layers 2)
      CUDA_VISIBLE_DEVICES= step fsdp-host 60 120 python3 bench/gpu/fsdp_host.py --optimizer fused \
        --compile aot_eager "${sizes[@]}" --json "$out/fsdp-host.json" ;;
    probe-fsdp) step probe-fsdp 90 170 python3 bench/gpu/gpu_probe.py --runner --compiled --fsdp \
      --checkpointing ;;
    async_rl | async_rl_loss)
      # no GPU for any process of it: generation and training on CPU cores, as on the 2-core
      # machine, but each on a core of its own. async_rl: every setting, two seeds of the
      # synchronous one; async_rl_loss: the engine-loss run and its twin (and the 2x1 setting)
      local sizes=(--settings 1x0,1x1,1x2,2x0,2x1 --seeds 2 --rounds 1 --loss-step 0) needs=200
      [ "$1" = async_rl_loss ] && sizes=(--settings 2x1 --seeds 1 --rounds 1 --steps 8 --skip 2) needs=120
      if [ "${SMOKE_CPU:-0}" = 1 ]; then  # --smoke runs no engine-loss run: smaller sizes by hand
        sizes=(--smoke)
        [ "$1" = async_rl_loss ] && sizes=(--settings 2x1 --seeds 1 --rounds 1 --steps 3 --skip 1
          --loss-step 3 --loss-steps 8 --hidden-size 32 --layers 1 --prompts 8 --batch-prompts 2
          --generations 2 --completion-length 4 --reward-window 1)
      fi
      step "$1" "$needs" 330 env CUDA_VISIBLE_DEVICES= python3 bench/runner/bench_async_rl.py \
        "${sizes[@]}" --json "$out/$1.json" ;;
    *) echo "unknown step $1" >&2; return 2 ;;
  esac
}

case $call in
  1) steps=(gpu-4 async_rl_loss) ;;  # async_rl: measured on 2026-11-29 (docs/benchmarks.md)
  2) steps=(fsdp-host probe-fsdp gpu-5 gpu-3) ;;
  3) steps=(gpu-1-liger gpu-6) ;;
  4) steps=(gpu-7 gpu-8) ;;
  5) steps=(gpu-2-1b) ;;
  *) steps=("$call") ;;
esac
for name in "${steps[@]}"; do
  run_step "$name" || exit 2
done
echo "lease call $call: $(($(date +%s) - began)) s of its $budget"
