"""A plain PyTorch toy, as docs/api.md's "your model and data" describes: no labels, no tokens.

Imported by the test process and, through PYTHONPATH, by Ray workers and the callback actor.
`PlainPairs` is a torch ``Dataset`` of ``{"x": [4], "y": []}`` items (a learnable linear
regression); `LossModel.forward(x, y)` returns the loss as a plain scalar tensor,
`PredictModel.forward(x, y)` the predictions, for ``loss_fn=mse``. `PlainRecorder` writes, on
every rank, each micro-batch's loss sum and size (from the outputs the step computed), rank 0's
logged losses, and each rank's final parameters.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from rt_support import _FileLog
from torch import nn
from torch.nn import functional as F

from callbacks import TrainerCallback

WEIGHTS = (0.5, -0.5, 0.25, 0.0)


class PlainPairs(torch.utils.data.Dataset):
    """`n` items ``{"x": x, "y": x . WEIGHTS + 0.1}``, the same for every seed of a run."""

    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, len(WEIGHTS), generator=g)
        self.y = self.x @ torch.tensor(WEIGHTS) + 0.1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class LossModel(nn.Module):
    """Returns its loss, the mean squared error over the micro-batch, as a 0-dim tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(len(WEIGHTS), 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.linear(x).squeeze(-1), y)


class PredictModel(LossModel):
    """Returns its predictions ``[batch]``; `mse` is its ``loss_fn``."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        del y  # every key of the batch reaches forward; the loss_fn reads y
        return self.linear(x).squeeze(-1)


def mse(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`PredictModel`'s loss: the mean over the micro-batch's samples."""
    return F.mse_loss(outputs, batch["y"])


def loss_sum(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> float:
    """The squared errors of a micro-batch, summed, from either model's outputs."""
    if outputs.ndim == 0:
        return float(outputs) * len(batch["y"])
    return float(((outputs - batch["y"]) ** 2).sum())


class PlainRecorder(TrainerCallback):
    """Every rank, in the training process: each micro-batch's loss sum and samples, rank 0's
    logged loss, and at the end this rank's parameters (``params-<rank>.pt`` in `folder`)."""

    runs_on = "all_ranks"

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.log = _FileLog(folder, "plain")

    def on_train_begin(self, context, **kwargs):
        if context.rank == 0:  # the run's live controller: has it loaded torch's library?
            self.log.write(event="controller", torch_loaded=controller_has_torch())

    def on_after_forward(self, context, batch=None, outputs=None, micro_step=None, **kwargs):
        with torch.no_grad():
            total = loss_sum(outputs, batch)
        self.log.write(
            event="micro", rank=context.rank, step=context.global_step + 1, sum=total,
            samples=len(batch["y"]), micro=micro_step,
        )  # fmt: skip

    def on_log(self, context, **kwargs):
        if context.rank == 0:
            self.log.write(event="log", step=context.global_step, loss=context.loss)

    def on_train_end(self, context, **kwargs):
        model = getattr(context.model, "module", context.model)  # DDP's wrapper, if any
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        torch.save(state, os.path.join(self.folder, f"params-{context.rank}.pt"))


def controller_has_torch() -> bool:
    """In a training process: whether the live Ray Train controller's process (on this machine,
    the GCS's actor table gives its pid) has torch's library mapped."""
    import ray

    alive = [
        a["Pid"]
        for a in ray._private.state.actors().values()
        if a["ActorClassName"] == "TrainController" and a["State"] == "ALIVE"
    ]
    assert len(alive) == 1, alive
    with open(f"/proc/{alive[0]}/maps") as f:
        return "libtorch" in f.read()


def read_params(folder: str, rank: int) -> dict[str, Any]:
    return torch.load(os.path.join(folder, f"params-{rank}.pt"), weights_only=True)
