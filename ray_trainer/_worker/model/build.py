"""Training worker: the run's model, a pretrained one built without memory and filled once placed.

Runs in each training worker at setup. A pretrained Hugging Face model whose weights are
safetensors files (a local folder, a bucket, the Hugging Face cache) is built on the meta
device; ``parallel.prepare`` then places it (FSDP: shards it; DDP: nothing to do) and calls
the returned `Materialize`, which gives the parameters memory on the worker's device (under
FSDP only this rank's shards) and reads the weights in, tensor by tensor, each rank only the
rows it holds. So no worker holds the whole model on the host: under FSDP it holds its shards
plus one tensor's rows being read; under DDP the model on its device plus one tensor.

Each rank reads its own slices rather than rank 0 reading and broadcasting: a rank's dim-0
shard of a tensor is one contiguous byte range of the file, so the ranks read in parallel,
together read the files once, need no collective (nothing to deadlock on), and a model on a
bucket is read by ranged GETs from every node without a copy on local disk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ray_trainer._model.spec import ModelSpec

#: Fills a placed model with its weights: ``materialize(model, device)``.
Materialize = Callable[[nn.Module, torch.device], None]


def build_model(spec: ModelSpec) -> tuple[nn.Module, Materialize | None]:
    """The run's model, and how to fill it once placed: for a pretrained model with safetensors
    weights, a model on the meta device and its `Materialize`; for any other model (the demo,
    a factory, a checkpoint without safetensors), the model built whole here and None."""
    folder = spec.pretrained_folder()
    if folder is None:
        return spec.build_model(), None
    from ray_trainer._model.pretrained import SafetensorsFiles, empty_model, materialize

    model = empty_model(spec.hf_config())

    def fill(module: nn.Module, device: torch.device) -> None:
        with SafetensorsFiles(folder) as files:
            materialize(module, files, device)

    return model, fill
