"""Driver: LoRA's checks before any worker starts (the model peft wraps, the checkpoint resumed).

Runs in the driver, on the model built on the meta device (no memory, no weights read) and on
the trainer state of the checkpoint the run would resume from.
"""

from __future__ import annotations

from ray_trainer._checkpoint import check_complete
from ray_trainer._config.args import TrainingArgs
from ray_trainer._errors import TrainingArgsError
from ray_trainer._lora.config import LORA_STATE, quantize_base, wrap
from ray_trainer._lora.fingerprint import base_fingerprint
from ray_trainer._storage import Location


def check_lora_model(args: TrainingArgs) -> None:
    """peft wraps the run's model with its ``lora`` config (target modules found, layers it
    can adapt), tried on the model built on the meta device; under ``quantize_base`` its
    blocks' linear layers are quantized first, as every worker will (under FSDP, checked for
    every number of workers an elastic run may take). Raises `LoraSetupError` or
    `QuantizeError`."""
    from ray_trainer._model.spec import ModelSpec

    model = ModelSpec.of(args).build_meta_model()
    low, high = (args.num_workers,) * 2 if isinstance(args.num_workers, int) else args.num_workers
    worlds = range(low, high + 1) if args.strategy == "fsdp" else [1]
    if args.lora.get("quantize_base") is not None:  # every size an elastic run may take
        from ray_trainer._model.nf4 import check_quantizable, quantized_layers

        layers = quantized_layers(model, args.fsdp_shard_modules)
        for world in worlds:
            check_quantizable(model, layers, world)
    quantize_base(model, args.lora, args.fsdp_shard_modules, max(worlds))
    wrap(model, args.lora, args.fsdp_shard_modules, on_meta=True)


def check_lora_resume(args: TrainingArgs, location: Location | None) -> None:
    """The checkpoint a run resumes from (at `location`) matches it: LoRA on both sides or on
    neither, the same adapter config, and the same base model (its fingerprint,
    ``fingerprint.py``)."""
    if location is None:
        return
    checkpoint = location.name
    record = check_complete(location).extra.get(LORA_STATE)
    if record is None and args.lora is None:
        return
    if record is None:
        raise TrainingArgsError(
            f"lora: {checkpoint} was written without LoRA (a full fine-tune); continue it "
            "without lora, or start a new run_name (resume_from=None) to train adapters"
        )
    if args.lora is None:
        raise TrainingArgsError(
            f"lora: {checkpoint} holds LoRA adapters (lora={record['config']}); continue it "
            "with the same lora, or load_model(it) and fine-tune the merged model in a new run"
        )
    if record["config"] != args.lora:
        raise TrainingArgsError(
            f"lora: {checkpoint} was trained with lora={record['config']}, this run has "
            f"lora={args.lora}; continue with the same LoRA config, or pick a new run_name"
        )
    from ray_trainer._model.spec import ModelSpec

    if base_fingerprint(ModelSpec.of(args)) != record["base_fingerprint"]:
        raise TrainingArgsError(
            f"model: {checkpoint} holds adapters of another base model ({record['base_model']}, "
            f"{record['base_fingerprint'][:19]}...), not of {args.model!r}: an adapter means "
            "nothing on another base; give the base it was trained on"
        )
