"""Every process: LoRA fine-tuning with peft (``TrainingArgs.lora``), see docs/lora.md.

``config.py`` turns the run's ``lora`` field into a ``peft.LoraConfig`` and wraps a model;
``quantize_base`` stores the frozen base in 4 bits (QLoRA, ``_model/nf4.py``);
``fingerprint.py`` names the base model a LoRA checkpoint belongs to; in the driver,
``_driver/lora_checks.py`` refuses what would fail in the workers. What LoRA changes inside a
training worker (the trainable parameters, the checkpoints, the merged and adapter exports, the
adapters switched off) is one object built at setup: ``_worker/model/adaptation.py``.
"""

from ray_trainer._lora.config import (
    LORA_STATE,
    LoraSetupError,
    adapter_names,
    lora_config,
    normalise_lora,
    quantize_base,
    trainable_names,
    wrap,
)

__all__ = [
    "LORA_STATE",
    "LoraSetupError",
    "adapter_names",
    "lora_config",
    "normalise_lora",
    "quantize_base",
    "trainable_names",
    "wrap",
]
