# The README's commands. Each target installs what it needs into a project virtualenv (.venv/)
# first, so a fresh clone works, also where the system Python is externally managed (Debian 12,
# Ubuntu 24.04 refuse `pip install` into it). A stamp file per install makes the next run skip it;
# editing pyproject.toml makes it install again.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# torch is installed first and pinned: the project's torch requirement is a range, and what a
# plain install gets depends on the index (see docs/getting-started.md). TORCH_INDEX_URL picks
# another index, e.g. TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for PyTorch's CPU-only wheels.
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX_URL ?=
TORCH_FLAGS := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)
# The venv's commands first on PATH, for the recipes and every process they start: the tests
# run `ray`, `mlflow` and `ray-trainer`, as a user of the activated venv would.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install install-dev test test-unit demo bench bench-quick bench-smoke lint clean-venv

$(VPY):
	@$(PYTHON) -c "import ensurepip, venv" 2>/dev/null || { \
	  echo "error: '$(PYTHON) -m venv' is unavailable (no ensurepip). On Debian or Ubuntu install it with:"; \
	  echo "  sudo apt install python3-venv   (or python3.$$($(PYTHON) -c 'import sys; print(sys.version_info[1])')-venv)"; \
	  exit 1; }
	$(PYTHON) -m venv $(VENV)
	@$(VPY) -m pip install -q --upgrade pip || true  # an old pip still works

# The core and what the demo needs (nothing more: the demo downloads nothing).
$(VENV)/.installed-core: pyproject.toml | $(VPY)
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q $(TORCH_FLAGS) "$(TORCH_PIN)"
	$(VPY) -m pip install -q -e .
	@touch $@

# The core, and what the tests, the benchmarks and lint need (trackers, lm-eval, moto, ...).
$(VENV)/.installed-dev: pyproject.toml | $(VPY)
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q $(TORCH_FLAGS) "$(TORCH_PIN)"
	$(VPY) -m pip install -q -e ".[dev]"
	@touch $@ $(VENV)/.installed-core

install: $(VENV)/.installed-core

install-dev: $(VENV)/.installed-dev

# Every Ray process of a test run (workers, actors, tasks, drivers: hundreds) imports the
# project from source: its bytecode is compiled once here, as `pip install` does for a wheel,
# so that none of them compiles it again where PYTHONDONTWRITEBYTECODE is set (~0.2-0.6 s each).
BYTECODE := ray_trainer callbacks tests/support
# CI's measure of each tier (.ci/run sets CPU_TIME=.ci/cpu_seconds): the CPU-seconds of its whole
# process tree against its wall time, printed after it. Empty: the commands run as they are.
CPU_TIME ?=
cpu_time = $(if $(CPU_TIME),$(CPU_TIME) $(1))
# The unit tests' processes: one per core, at most 4 (`make test UNIT_PROCESSES=1` runs them in one).
UNIT_PROCESSES ?= $(shell $(PYTHON) -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))" 2>/dev/null || echo 2)

test: install-dev
	@$(VPY) -m compileall -q $(BYTECODE)
	@# The unit tests first, on one process per core (pytest-xdist: each unit test keeps one core
	@# busy, and they share nothing), then the integration tests in one process (real Ray and
	@# local clusters, which already fill every core, and share one Ray session).
	$(call cpu_time,unit-tier) $(VPY) -m pytest -n $(UNIT_PROCESSES) tests/unit
	$(call cpu_time,integration-tier) $(VPY) -m pytest tests/integration -m "not faults"

test-unit: install-dev
	$(VPY) -m pytest -n $(UNIT_PROCESSES) tests/unit -m "not integration"

# The long fault runs (tests marked `faults`: GRPO's engine node lost and back, its trainer node
# drained for preemption, on a local cluster of their own): not part of `make test`; about five
# minutes on an idle 2-core machine (docs/testing.md).
.PHONY: test-faults
test-faults: install-dev
	@$(VPY) -m compileall -q $(BYTECODE)
	$(VPY) -m pytest tests/integration -m faults

# The real-vLLM tests (tests/vllm, not part of `make test`): build or reuse the vLLM env
# (.venv-vllm/, by bench/eval/vllm_env.sh; minutes the first time), then run the generation child
# under its python. Each GenerationEval engine start costs about a minute on an idle 2-core machine
# (three under load), a rollout engine's about 12 s (its engine core in the child's process); the
# rollout engine's tests (tests/vllm/test_rollout_engine.py) make four. All of it: about 8 minutes.
.PHONY: test-vllm
test-vllm: install-dev
	RAY_TRAINER_VLLM_PYTHON="$$(bash bench/eval/vllm_env.sh)" && export RAY_TRAINER_VLLM_PYTHON && \
	  $(VPY) -m pytest tests/vllm -q -p no:cacheprovider

demo: install
	$(VPY) -m ray_trainer.cli demo --num-workers 2

# Every benchmark, full settings, into bench/results.{md,json,png}: 52-73 minutes on 2 cores.
bench: install-dev
	$(VPY) bench/run_all.py

# The three headline figures only (loop, HF Trainer, packing), replacing their sections.
bench-quick: install-dev
	$(VPY) bench/run_all.py --only loop,hf_trainer,packing

# Every benchmark at its smallest settings into a temporary folder (CI, after `make test`), two
# at a time; the project's and the benchmarks' bytecode compiled first (see BYTECODE above).
# About 410 CPU-seconds in 229 s on the idle 2-core machine (docs/benchmarks.md, "The smoke
# run"); under CPU_TIME it prints the CPU-seconds of the run and of each benchmark.
bench-smoke: install-dev
	@$(VPY) -m compileall -q $(BYTECODE) bench
	$(call cpu_time,bench-smoke) $(VPY) bench/run_all.py --smoke

lint: install-dev
	$(VPY) -m ruff check . && $(VPY) -m ruff format --check .

clean-venv:
	rm -rf $(VENV)
