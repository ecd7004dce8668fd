"""ray-trainer's public API, imported in the driver (and anywhere a checkpoint is read).

The public API, imported in the driver (and anywhere a checkpoint is read). Everything else
lives in ``_``-prefixed rooms, laid out by the process that runs them: ``_driver`` (a run's
driver), ``_worker`` (the training processes), ``_actor`` (the callback actor and evaluation
tasks), ``_client`` (the user's terminal: status, submit, save/stop, Grafana, plot). Beneath
them what several processes share: packages (``_config``, ``_checkpoint``, ``_model``, ``_lora``,
``_data``, ``_demo``, ``_monitoring``) and a few modules (``_contract``, ``_storage``,
``_errors``, ``_cluster``, ``_placement``); no two folders import each other. The callback API
is re-exported here too, for users whose own project has a ``callbacks.py`` that shadows the
``callbacks`` package.
"""

from callbacks import *  # noqa: F403  (re-export the callback API; see callbacks.__all__)
from callbacks import __all__ as _callbacks_all
from ray_trainer._checkpoint import latest_checkpoint, load_model, load_model_state
from ray_trainer._client.control import RunEnded, save, stop
from ray_trainer._client.status import NoLiveRun
from ray_trainer._config.args import TrainingArgs
from ray_trainer._driver.checks.resources import ResourceRequestError
from ray_trainer._driver.launch import RunFailedError, run_training
from ray_trainer._driver.result import TrainingResult
from ray_trainer._errors import CheckpointError, TrainingArgsError

__all__ = [
    "CheckpointError",
    "NoLiveRun",
    "ResourceRequestError",
    "RunEnded",
    "RunFailedError",
    "TrainingArgs",
    "TrainingArgsError",
    "TrainingResult",
    "latest_checkpoint",
    "load_model",
    "load_model_state",
    "run_training",
    "save",
    "stop",
    *_callbacks_all,
]
