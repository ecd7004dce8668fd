"""What a worker trains, built from `TrainingArgs` (`_worker/workload.py`): model, data, loss."""

from __future__ import annotations

import torch


def test_workload_batches_variable_length_jsonl_for_any_model(tmp_path):
    from data_support import encode_here
    from torch.utils.data import DataLoader

    from ray_trainer import TrainingArgs
    from ray_trainer._worker.objectives import worker_objective
    from ray_trainer._worker.workload import build_workload

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "short"}\n{"text": "a much longer line of text"}\n' * 10)
    for model in (None, lambda: torch.nn.Linear(2, 2)):
        args = TrainingArgs(
            model=model, data=str(data), eval_every_steps=5, storage_path=str(tmp_path / "s")
        )
        wl = build_workload(args, worker_objective(args), encode_here(args))
        batch = next(iter(DataLoader(wl.train_dataset, batch_size=4, collate_fn=wl.collate_fn)))
        assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
        assert wl.val_dataset is not None and len(wl.val_dataset) == 1  # 5% held out
        assert len(wl.train_dataset) == 19 and wl.train_dataset.lengths.max() == 27  # + EOS
