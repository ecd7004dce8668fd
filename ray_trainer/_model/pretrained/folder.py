"""Every process: where a pretrained Hugging Face model's files are (a local folder, a bucket, the cache).

Runs in the driver (checking a model reference before Ray starts), in each training worker
(loading), and in ``load_model``. ``from_pretrained`` cannot read ``s3://``: for a model on a
bucket, its small files (config, generation config, tokenizer) are copied once per process into
a local folder that ``AutoConfig``/``AutoTokenizer`` read, and its weights are read in place,
by range (``safetensors.py``).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

from ray_trainer._model.pretrained.safetensors import weight_files
from ray_trainer._storage import Location, is_uri, locate

#: Files of a model folder that are weights, never copied for their config or tokenizer.
WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".gguf", ".onnx",
)  # fmt: skip


def pretrained_folder(name_or_path: str) -> Location | None:
    """The folder of a pretrained model whose weights are safetensors files: a bucket URI, a
    local folder, or a model already in the Hugging Face cache; None when there is no such
    folder (``from_pretrained`` then loads the model its own way). Never downloads."""
    if is_uri(name_or_path):
        return locate(name_or_path)
    path = os.path.expanduser(name_or_path)
    if not os.path.isdir(path):
        path = _cached_snapshot(name_or_path)
        if path is None:
            return None
    folder = locate(path)
    return folder if weight_files(folder) else None


def _cached_snapshot(name: str) -> str | None:
    """The folder of `name`'s snapshot in the Hugging Face cache, if one is there."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:  # not a repo name, not cached, no huggingface_hub: from_pretrained's turn
        return None


@functools.lru_cache(maxsize=8)
def local_files(uri: str) -> str:
    """A local folder with every file of the model folder at `uri` except its weights (its
    config and tokenizer), copied once per process and removed when the process exits."""
    source = locate(uri)
    names = [n for n in source.listdir() if not n.endswith(WEIGHT_SUFFIXES)]
    if "config.json" not in names:
        raise FileNotFoundError(f"{source.name}/config.json: no such file")
    target = tempfile.mkdtemp(prefix="ray_trainer_model_")
    atexit.register(shutil.rmtree, target, True)
    for name in names:
        child = source.child(name)
        if child.size() is None:  # a subfolder: not part of a model's config or tokenizer
            continue
        with open(os.path.join(target, name), "wb") as f:
            f.write(child.read_bytes())
    return target


def config_source(name_or_path: str) -> str:
    """What ``AutoConfig``/``AutoTokenizer.from_pretrained`` can open for this reference: a
    local copy of a bucket folder's small files, else the reference itself."""
    return local_files(name_or_path.rstrip("/")) if is_uri(name_or_path) else name_or_path
