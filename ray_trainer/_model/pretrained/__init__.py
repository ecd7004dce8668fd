"""Every process: pretrained weights loaded without a whole copy per process (meta device, then fill).

Used by the training workers (``_worker/model/build.py``: build on the meta device, shard, fill
each rank's own rows), by the driver (a model on a bucket: its config), and by ``load_model``.
``folder.py`` finds a model's files (local, bucket, cache), ``safetensors.py`` reads tensors or
rows of them in place, ``fill.py`` builds an empty model and fills a module by parameter name.
"""

from ray_trainer._model.pretrained.fill import (
    WeightsError,
    check_materialized,
    empty_model,
    fill_from_safetensors,
    materialize,
)
from ray_trainer._model.pretrained.folder import config_source, local_files, pretrained_folder
from ray_trainer._model.pretrained.safetensors import (
    SafetensorsError,
    SafetensorsFiles,
    weight_files,
)

__all__ = [
    "SafetensorsError",
    "SafetensorsFiles",
    "WeightsError",
    "check_materialized",
    "config_source",
    "empty_model",
    "fill_from_safetensors",
    "local_files",
    "materialize",
    "pretrained_folder",
    "weight_files",
]
