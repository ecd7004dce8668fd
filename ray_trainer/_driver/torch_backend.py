"""Driver and Ray Train controller: the workers' torch process group, set up as Ray Train's
`TorchConfig` sets it up, from a module that does not import torch.

Ray Train's controller unpickles the run's backend config and calls its backend's `on_start`
and `on_shutdown`, which only send functions to the workers. `TorchConfig`'s module imports
torch at its top, so each run's controller imported torch for nothing: 1.2 CPU-seconds and
about a second of every run's start on the 2-core test machine (docs/benchmarks.md,
"Start-up, 2026-11-29: Ray Train's controller without torch"). `LeanTorchConfig` is the same configuration, whose backend sends
Ray Train's own worker-side functions (`_setup_torch_process_group`,
`_set_torch_distributed_env_vars`, `_shutdown_torch`) by name, so that only the workers, which
train with torch anyway, import their module.

The config is built in the driver (`_driver/trainer.py`); `LeanTorchBackend`'s methods run in
the controller; the functions below them (`_set_master`, `_prepare_worker`, `_on_worker`) run in
the workers. `_prepare_worker` also has the workers send `torch.__version__` as a plain `str`,
so that Ray Train's state tracking, which asks rank 0 for it, does not make the controller
import torch to unpickle it.

`lean_torch_config` gives one only where this Ray Train has those functions as this module
calls them, and not for TPUs (whose multi-slice setup is not repeated here); anywhere else the
run takes Ray Train's `TorchConfig` unchanged.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.train.backend import Backend, BackendConfig

# Ray Train's functions the workers run, and the keyword arguments this module passes each.
WORKER_FUNCTIONS = {
    "_setup_torch_process_group": {
        "backend",
        "world_rank",
        "world_size",
        "init_method",
        "timeout_s",
    },
    "_set_torch_distributed_env_vars": set(),
    "_shutdown_torch": {"destroy_process_group"},
}


@dataclass
class LeanTorchConfig(BackendConfig):
    """Ray Train's `TorchConfig` (the same fields and defaults), without torch in the controller.

    Built in the driver; unpickled in Ray Train's controller, which imports only this module.
    """

    backend: str | None = None
    init_method: str = "env"
    timeout_s: int = 1800

    @property
    def backend_cls(self) -> type[Backend]:
        return LeanTorchBackend

    @property
    def train_func_context(self) -> Any:
        """Read in the driver, where torch is imported already: the workers' CUDA device."""
        from ray.train.torch.config import TorchConfigContextManager

        return TorchConfigContextManager

    @property
    def framework(self) -> Any:
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "init_method": self.init_method,
            "timeout_s": self.timeout_s,
        }


class LeanTorchBackend(Backend):
    """Ray Train's torch backend's start and shutdown for GPUs and CPUs. Runs in the controller."""

    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group: Any, backend_config: LeanTorchConfig) -> None:
        from ray.train._internal.utils import get_address_and_port

        backend = backend_config.backend
        if backend is None:  # TorchTrainer sets it; as Ray Train decides where it did not
            backend = "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) else "gloo"
        addr, port = worker_group.execute_single(0, get_address_and_port)
        if backend_config.init_method == "env":
            worker_group.execute(_set_master, addr=addr, port=port)
            url = "env://"
        elif backend_config.init_method == "tcp":
            url = f"tcp://[{addr}]:{port}" if ":" in addr else f"tcp://{addr}:{port}"
        else:
            raise ValueError(
                f"LeanTorchConfig.init_method={backend_config.init_method!r} is not supported: "
                "use 'env' or 'tcp'."
            )
        # torch.distributed's backends read LOCAL_RANK and the others before the group starts
        worker_group.execute(_prepare_worker)
        ray.get(
            [
                worker_group.execute_single_async(
                    rank,
                    _on_worker,
                    "_setup_torch_process_group",
                    backend=backend,
                    world_rank=rank,
                    world_size=len(worker_group),
                    init_method=url,
                    timeout_s=backend_config.timeout_s,
                )
                for rank in range(len(worker_group))
            ]
        )

    def on_shutdown(self, worker_group: Any, backend_config: LeanTorchConfig) -> None:
        from ray._private import ray_constants
        from ray.exceptions import GetTimeoutError
        from ray.train.constants import (
            DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        )

        futures = worker_group.execute_async(
            _on_worker, "_shutdown_torch", destroy_process_group=len(worker_group) > 1
        )
        timeout_s = ray_constants.env_integer(
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
        )
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            import logging

            logging.getLogger(__name__).warning(
                "the torch process group's shutdown timed out after %s s", timeout_s
            )


def _set_master(addr: str, port: int) -> None:
    """Runs in each worker: where rank 0's process group listens (init_method 'env')."""
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


def _prepare_worker() -> None:
    """Runs in each worker, before its process group starts: the environment variables
    torch.distributed reads (Ray Train's `_set_torch_distributed_env_vars`); and torch's version
    sent through Ray as a plain `str`. Ray Train's state tracking (on where the cluster has a
    dashboard) asks rank 0 for `torch.__version__`, a `TorchVersion`, before the run's function
    starts; unpickling one imports torch, so the controller imported it there (1.3 s, each
    run's start held up by it) and the state actor too."""
    from ray.train.torch import config
    from ray.util import register_serializer
    from torch.torch_version import TorchVersion

    config._set_torch_distributed_env_vars()
    register_serializer(TorchVersion, serializer=str, deserializer=str)


def _on_worker(name: str, **kwargs: Any) -> Any:
    """Runs in each worker: Ray Train's worker-side torch function `name`."""
    from ray.train.torch import config

    return getattr(config, name)(**kwargs)


def lean_torch_config(scaling_config: Any) -> LeanTorchConfig | None:
    """Runs in the driver: a `LeanTorchConfig` where this Ray Train's torch module has the
    functions `LeanTorchBackend` sends, with the arguments it passes; None (Ray Train's own
    `TorchConfig`) elsewhere, and for TPU workers."""
    if scaling_config is not None and getattr(scaling_config, "use_tpu", False):
        return None
    try:
        from ray.train._internal.utils import get_address_and_port  # noqa: F401
        from ray.train.torch import config

        for name, kwargs in WORKER_FUNCTIONS.items():
            if not kwargs <= set(inspect.signature(getattr(config, name)).parameters):
                return None
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return LeanTorchConfig()
