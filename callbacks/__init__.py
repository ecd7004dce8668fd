"""The callback system of ray-trainer: events, callbacks, contexts, dispatch, serialization.

Importable and testable without Ray or torch. The public API is what ``__all__`` lists; the
modules starting with ``_`` are internal. See docs/callbacks.md.
"""

from callbacks._builtin_divergence import DivergenceDetector
from callbacks._builtin_early_stopping import EarlyStopping
from callbacks._builtin_jsonl import JsonlLogger
from callbacks._builtin_lm_eval import LmEval
from callbacks._builtin_mlflow import MLflowLogger
from callbacks._builtin_progress import ProgressBar
from callbacks._builtin_ray_metrics import RayMetrics
from callbacks._builtin_tensorboard import TensorBoardLogger
from callbacks._builtin_wandb import WandbLogger
from callbacks._callback import TrainerCallback
from callbacks._context import TrainingContext
from callbacks._control import TrainerControl
from callbacks._errors import CallbackError
from callbacks._eval_on_save import EvalOnSave
from callbacks._events import ALIASES, EVENTS, LOW_VALUE_EVENTS, NEVER_DROPPED_EVENTS, resolve_event
from callbacks._hooks import runs_on_of
from callbacks._manager import CallbackManager
from callbacks._registry import GlobalCallbackHandle, global_callbacks, register_global_callback
from callbacks._serialize import (
    CallbackPicklingError,
    dumps_callbacks,
    loads_callbacks,
    validate_picklable,
)

__all__ = [
    "ALIASES",
    "EVENTS",
    "LOW_VALUE_EVENTS",
    "NEVER_DROPPED_EVENTS",
    "CallbackError",
    "CallbackManager",
    "CallbackPicklingError",
    "DivergenceDetector",
    "EarlyStopping",
    "EvalOnSave",
    "GlobalCallbackHandle",
    "JsonlLogger",
    "LmEval",
    "MLflowLogger",
    "ProgressBar",
    "RayMetrics",
    "TensorBoardLogger",
    "TrainerCallback",
    "TrainerControl",
    "TrainingContext",
    "WandbLogger",
    "dumps_callbacks",
    "global_callbacks",
    "loads_callbacks",
    "register_global_callback",
    "resolve_event",
    "runs_on_of",
    "validate_picklable",
]
