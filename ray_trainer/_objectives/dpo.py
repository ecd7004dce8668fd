"""Every process: the description of DPO, preference tuning against a reference (TRL 1.16's losses).

Trains on preference pairs ``{prompt, chosen, rejected}`` (files or a ``datasets.Dataset``);
owns ``dpo_beta``, ``dpo_loss``, ``label_smoothing`` and ``precompute_reference``; needs the
reference's log-probs (computed once before training unless ``precompute_reference=False``);
logs TRL's metrics (:data:`METRICS`). Its worker side: ``ray_trainer/_worker/objectives/dpo.py``.
"""

from __future__ import annotations

from typing import Any

from ray_trainer._objectives.base import Objective

#: The DPO losses, each as TRL 1.16 computes it (``DPOConfig.loss_type``).
DPO_LOSSES = ("sigmoid", "ipo")

#: The metrics of a DPO step, with TRL's names (so dashboards carry over), in the order of the
#: worker's metric sums.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def check_args(args: Any) -> None:
    """What DPO refuses in the other fields, named with the fix."""
    if args.train_on != "assistant":
        raise ValueError(
            f"train_on={args.train_on!r} with objective='dpo': DPO takes its loss on each "
            "answer's tokens (chosen and rejected), never on the prompt; drop train_on"
        )
    if args.loss_fn is not None:
        raise ValueError(
            "loss_fn with objective='dpo': the DPO loss is computed from each answer's summed "
            "log-probabilities (dpo_loss picks TRL's sigmoid or ipo); drop loss_fn"
        )
    if args.data is None:
        raise ValueError(
            'objective=\'dpo\' needs data: preference pairs such as {"prompt": ..., "chosen": '
            '..., "rejected": ...} (docs/preference.md)'
        )
    if not args.precompute_reference and args.lora is None and args.strategy == "fsdp":
        raise ValueError(
            "precompute_reference=False without lora under strategy='fsdp': the reference "
            "would be a second sharded copy of the model in every step; keep "
            "precompute_reference=True (the reference's log-probs are computed once, before "
            "training), or train LoRA adapters (the reference is then the base, adapters off)"
        )
    if args.label_smoothing and args.dpo_loss != "sigmoid":
        raise ValueError(
            f"label_smoothing={args.label_smoothing!r} with dpo_loss={args.dpo_loss!r}: "
            "label_smoothing makes the sigmoid loss conservative DPO (cDPO), it has no meaning "
            "for IPO; set label_smoothing=0, or use "
            "dpo_loss='sigmoid'"
        )


def _precomputed(args: Any) -> bool:
    return bool(args.precompute_reference)


DPO = Objective(
    name="dpo",
    summary="preference tuning",
    worker="ray_trainer._worker.objectives.dpo",
    data_formats=("preference",),
    data_noun="preference pairs",
    data_example='{"prompt": "...", "chosen": "...", "rejected": "..."} (docs/preference.md)',
    fields=("dpo_beta", "dpo_loss", "label_smoothing", "precompute_reference"),
    check=check_args,
    needs_reference=_precomputed,
    metrics=METRICS,
)
