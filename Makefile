# The README's commands. Each target installs what it needs first, so a fresh clone works.
PYTHON ?= python3
TORCH_PIN ?= torch==2.13.0

.PHONY: install test test-unit demo bench lint

install:
	@# Install torch first: a bare `torch` requirement on a machine without torch pulls a multi-GB CUDA build.
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_PIN)"
	@$(PYTHON) -m pip install -q -e ".[dev]"

test: install
	@# Fast unit tests first, then the integration tests (real Ray, local clusters).
	$(PYTHON) -m pytest tests/unit tests/integration

test-unit: install
	$(PYTHON) -m pytest tests/unit -m "not integration"

demo: install
	$(PYTHON) -m ray_trainer.cli demo --num-workers 2

bench: install
	$(PYTHON) bench/run_all.py

lint: install
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .
