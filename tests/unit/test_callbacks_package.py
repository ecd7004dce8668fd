"""The package surface: exports, and no dependency on Ray or torch."""

import subprocess
import sys
from pathlib import Path

import callbacks

REPO = Path(__file__).resolve().parents[2]

REQUIRED = {
    "TrainerCallback",
    "TrainingContext",
    "TrainerControl",
    "CallbackManager",
    "EVENTS",
    "ALIASES",
    "LOW_VALUE_EVENTS",
    "NEVER_DROPPED_EVENTS",
    "register_global_callback",
    "global_callbacks",
    "resolve_event",
    "runs_on_of",
    "CallbackError",
    "CallbackPicklingError",
    "dumps_callbacks",
    "loads_callbacks",
    "validate_picklable",
    # The built-in callbacks users name in their runs (DESIGN.md, docs/callbacks.md).
    "EvalOnSave",
    "EarlyStopping",
    "DivergenceDetector",
    "JsonlLogger",
    "TensorBoardLogger",
    "ProgressBar",
    "RayMetrics",
    "LmEval",
    "MLflowLogger",
    "WandbLogger",
}


def test_all_exports_the_public_api():
    assert set(callbacks.__all__) >= REQUIRED
    for name in callbacks.__all__:
        assert getattr(callbacks, name) is not None


def test_internal_modules_are_private():
    for path in (REPO / "callbacks").glob("*.py"):
        assert path.name == "__init__.py" or path.name.startswith("_"), path.name


def test_imports_without_ray_torch_or_the_trackers():
    script = (
        "import sys, callbacks\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "    ('ray', 'torch', 'lm_eval', 'mlflow', 'wandb', 'transformers', 'datasets'))\n"
        "print(heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
