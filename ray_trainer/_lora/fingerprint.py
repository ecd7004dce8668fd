"""Every process: the fingerprint of a LoRA run's base model, recorded in each of its checkpoints.

Runs in the driver (refusing a resume on another base before any worker starts) and on rank 0
of the training workers (recording it at each save). An adapter means nothing on another base,
so a LoRA checkpoint names the base it was trained on by a SHA-256 of:

- a Hugging Face model: its config (without the fields that name where it was loaded from or by
  which transformers), and for safetensors weights each file's name, size and the bytes of the
  first row of its first and last tensors (a few KiB read, in place on a bucket). So the same
  base found under another path or bucket passes; another base of the same architecture (a
  different fine-tune) is told apart unless it differs nowhere in those rows;
- any other model (a factory, the demo): its class and the names, shapes and dtypes of its
  parameters (built on the meta device); its weights are not known before training.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

#: Config fields that say where or how a model was loaded, not what it is.
_VOLATILE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash")


def base_fingerprint(spec: Any) -> str:
    """The fingerprint of the base model `spec` (a ``ModelSpec``) builds: ``sha256:<hex>``."""
    digest = hashlib.sha256()
    if isinstance(spec.model, str) and not spec.is_demo:
        config = spec.hf_config().to_dict()
        for key in _VOLATILE:
            config.pop(key, None)
        digest.update(json.dumps(config, sort_keys=True, default=str).encode())
        folder = spec.pretrained_folder()
        if folder is not None:
            _weights(folder, digest)
    else:
        model = spec.build_meta_model()
        digest.update(f"{type(model).__module__}.{type(model).__qualname__}".encode())
        for name, p in model.named_parameters():
            digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return f"sha256:{digest.hexdigest()}"


def _weights(folder: Any, digest: Any) -> None:
    """File names and sizes, and the first row of each file's first and last tensors."""
    import torch

    from ray_trainer._model.pretrained import SafetensorsFiles

    with SafetensorsFiles(folder) as files:
        by_file: dict[str, list[tuple[int, str]]] = {}
        for name, entry in files.entries.items():
            by_file.setdefault(entry.file, []).append((entry.start, name))
        for file in sorted(by_file):
            digest.update(f"{file}:{folder.child(file).size()};".encode())
            ordered = sorted(by_file[file])
            # In order, once each (a set's order follows the per-process string hash).
            for _, name in dict.fromkeys((ordered[0], ordered[-1])):
                entry = files.entries[name]
                rows = (
                    files.read(name, 0, min(1, entry.shape[0])) if entry.shape else files.read(name)
                )
                digest.update(name.encode())
                digest.update(rows.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def lora_state(spec: Any, fields: dict[str, Any], fingerprint: str) -> dict[str, Any]:
    """What a LoRA checkpoint's trainer state records (``extra["lora"]``): the base model as
    the run named it, its fingerprint and the adapter config."""
    model = spec.model if isinstance(spec.model, str) or spec.model is None else repr(spec.model)
    return {"base_model": model, "base_fingerprint": fingerprint, "config": dict(fields)}
