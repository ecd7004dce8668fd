# Sourced by gpu_run.sh and lease.sh on the lent GPU machine (see ../shared/gpu/README.md): installs
# the carried wheels (.whl/) into /tmp/site once, and again when a wheel carried since is not
# installed yet (liger-kernel's for liger_kernel=True, torchao's for QLoRA), then puts them and the
# checkout on PYTHONPATH. With SMOKE_CPU=1 (a smoke run of the scripts on the CPU machine) it
# installs nothing: the project's virtualenv has everything.
if [ "${SMOKE_CPU:-0}" != 1 ]; then
  missing=0
  [ -d /tmp/site/ray ] || missing=1
  for pkg in liger_kernel torchao; do  # a wheel's name starts with its package's
    if compgen -G ".whl/$pkg-*.whl" > /dev/null && [ ! -d "/tmp/site/$pkg" ]; then
      missing=1
    fi
  done
  if [ "$missing" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  fi
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
