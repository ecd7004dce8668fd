"""The package surface: exports, and no dependency on Ray or torch."""

import importlib
import subprocess
import sys
from pathlib import Path

import callbacks

REPO = Path(__file__).resolve().parents[2]

# The design card's public contract (DESIGN.md "Public contract", docs/api.md).
CONTRACT = {
    "TrainerCallback",
    "TrainingContext",
    "TrainerControl",
    "CallbackManager",
    "EVENTS",
    "register_global_callback",
}
# The built-in callbacks users name in their runs (DESIGN.md, docs/callbacks.md).
BUILTINS = {
    "EvalOnSave",
    "EarlyStopping",
    "DivergenceDetector",
    "JsonlLogger",
    "TensorBoardLogger",
    "ProgressBar",
    "RayMetrics",
    "LmEval",
    "GenerationEval",
    "MLflowLogger",
    "WandbLogger",
}
# What else a user meets in docs/callbacks.md: the aliases a hook may be named by, the errors a
# run records or raises (manager.errors, run_training's pickling check), the global registry.
MET_BY_USERS = {"ALIASES", "CallbackError", "CallbackPicklingError", "global_callbacks"}
# Plumbing: importable from its own module, not exported.
INTERNAL = {
    "callbacks._serialize": ("dumps_callbacks", "loads_callbacks", "validate_picklable"),
    "callbacks._events": ("LOW_VALUE_EVENTS", "NEVER_DROPPED_EVENTS", "resolve_event"),
    "callbacks._hooks": ("runs_on_of",),
    "callbacks._registry": ("GlobalCallbackHandle",),
    "callbacks._manager_async": ("AsyncCallbackManager",),
}


def test_all_is_the_public_api_and_nothing_else():
    assert set(callbacks.__all__) == CONTRACT | BUILTINS | MET_BY_USERS
    assert len(callbacks.__all__) == len(set(callbacks.__all__))
    for name in callbacks.__all__:
        assert getattr(callbacks, name) is not None


def test_the_plumbing_stays_importable_from_its_module_but_is_not_exported():
    for module, names in INTERNAL.items():
        imported = importlib.import_module(module)
        for name in names:
            assert getattr(imported, name) is not None
            assert name not in callbacks.__all__


def test_internal_modules_are_private():
    for path in (REPO / "callbacks").glob("*.py"):
        assert path.name == "__init__.py" or path.name.startswith("_"), path.name


def test_each_builtin_lives_in_callbacks_builtin():
    for name in BUILTINS:
        assert getattr(callbacks, name).__module__.startswith("callbacks.builtin."), name


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
