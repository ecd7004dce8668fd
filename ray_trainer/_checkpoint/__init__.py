"""Every process: the checkpoint format (``format.py``) and reading checkpoints (``reading.py``).

Written by the training workers; read by the workers (resume), the callback actor (its state),
the driver (``resume_from``), and evaluation tasks and notebooks (``load_model``).
"""

from ray_trainer._checkpoint.format import (
    HF_ADAPTER_DIR,
    HF_DIR,
    MODEL_FILE,
    MODEL_SPEC_FILE,
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    SHARDS_DIR,
    STATE_FILE,
    TIED_WEIGHTS,
    TrainerState,
    check_complete,
    complete_checkpoints,
    latest_checkpoint,
    manifest,
    manifest_name,
    rng_state,
    set_rng_state,
    shared_storage_aliases,
    verify,
    write_rank_part,
)
from ray_trainer._checkpoint.reading import (
    LoadedCheckpoint,
    LocalCheckpoint,
    load,
    load_model,
    load_model_state,
    open_checkpoint,
)
from ray_trainer._errors import CheckpointError
from ray_trainer._model.ties import tied_aliases

__all__ = [
    "HF_ADAPTER_DIR",
    "HF_DIR",
    "MODEL_FILE",
    "MODEL_SPEC_FILE",
    "OPTIMIZER_FILE",
    "SCHEDULER_FILE",
    "SHARDS_DIR",
    "STATE_FILE",
    "TIED_WEIGHTS",
    "CheckpointError",
    "LoadedCheckpoint",
    "LocalCheckpoint",
    "TrainerState",
    "check_complete",
    "complete_checkpoints",
    "latest_checkpoint",
    "load",
    "load_model",
    "load_model_state",
    "manifest",
    "manifest_name",
    "open_checkpoint",
    "rng_state",
    "set_rng_state",
    "shared_storage_aliases",
    "tied_aliases",
    "verify",
    "write_rank_part",
]
