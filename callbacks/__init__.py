"""The callback system of ray-trainer: events, callbacks, contexts, dispatch, serialization.

Importable and testable without Ray or torch. The public API is what ``__all__`` lists: what a
user subclasses, builds, registers or catches. The modules starting with ``_`` are internal
(the serialization plumbing, event resolution, placement helpers stay importable from them);
the built-in callbacks live in ``callbacks.builtin``, one module each. See docs/callbacks.md.
"""

from callbacks._callback import TrainerCallback
from callbacks._context import TrainingContext
from callbacks._control import TrainerControl
from callbacks._errors import CallbackError
from callbacks._events import ALIASES, EVENTS
from callbacks._manager import CallbackManager
from callbacks._registry import global_callbacks, register_global_callback
from callbacks._serialize import CallbackPicklingError
from callbacks.builtin.divergence import DivergenceDetector
from callbacks.builtin.early_stopping import EarlyStopping
from callbacks.builtin.eval_on_save import EvalOnSave
from callbacks.builtin.generation.eval import GenerationEval
from callbacks.builtin.jsonl import JsonlLogger
from callbacks.builtin.lm_eval import LmEval
from callbacks.builtin.mlflow import MLflowLogger
from callbacks.builtin.progress import ProgressBar
from callbacks.builtin.ray_metrics import RayMetrics
from callbacks.builtin.tensorboard import TensorBoardLogger
from callbacks.builtin.wandb import WandbLogger

__all__ = [
    "ALIASES",
    "EVENTS",
    "CallbackError",
    "CallbackManager",
    "CallbackPicklingError",
    "DivergenceDetector",
    "EarlyStopping",
    "EvalOnSave",
    "GenerationEval",
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
    "global_callbacks",
    "register_global_callback",
]
