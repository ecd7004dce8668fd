"""A sharded checkpoint writes a tied weight once (issue 21, point 3).

Two gloo processes without Ray prepare a GPT-2 with tied embeddings under FSDP (the runner's
`parallel.prepare`), take an AdamW step and write its DCP shards as a checkpoint does; rank 0
also writes what DDP would write (``torch.save`` of the model's and the optimizer's state
dicts, which keeps shared storage once). The sizes are compared, and the shards read back whole
give the tied head its weight again.
"""

from __future__ import annotations

import os

import pytest
import torch
from gloo_support import run_ranks

transformers = pytest.importorskip("transformers")

# Large enough that DCP's own overhead (a few hundred bytes per tensor, and its .metadata) is
# well under 1% (5M parameters, 60 MB with AdamW); the tied embedding is 80% of the weights.
CONFIG = {
    "vocab_size": 16000, "n_embd": 256, "n_layer": 1, "n_head": 4, "n_positions": 64,
    "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}  # fmt: skip


def _save_both(rank, world, folder):
    from accelerate import Accelerator

    from ray_trainer import _checkpoint as ckpt
    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._worker.checkpoints.saving import sharded_state, write_state
    from ray_trainer._worker.model.adaptation import WholeModel
    from ray_trainer._worker.model.parallel import prepare

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    whole = None
    if rank == 0:  # DDP's checkpoint of the same model after the same step
        reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
        reference.load_state_dict(model.state_dict())
        whole = reference
    args = TrainingArgs(strategy="fsdp", num_workers=world, mixed_precision="no")
    parallel = prepare(
        model, args, Accelerator(cpu=True), lambda m: torch.optim.AdamW(m.parameters()), "no"
    )
    ids = torch.arange(16).view(2, 8)
    parallel.model(input_ids=ids, labels=ids).loss.backward()
    parallel.optimizer.step()
    state = sharded_state(parallel.model, parallel.optimizer, WholeModel())
    aliases = ckpt.tied_aliases(parallel.model.named_parameters(remove_duplicate=False))
    files = write_state(os.path.join(folder, f"rank{rank}"), state, rank, sharded=True)
    sharded = sum(os.path.getsize(os.path.join(folder, f"rank{rank}", f)) for f in files)
    ddp = None
    if rank == 0:
        optimizer = torch.optim.AdamW(whole.parameters())
        whole(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        torch.save(whole.state_dict(), os.path.join(folder, "model.pt"))
        torch.save(optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))
        ddp = sum(os.path.getsize(os.path.join(folder, n)) for n in ("model.pt", "optimizer.pt"))
    return {"sharded": sharded, "ddp": ddp, "aliases": aliases}


def test_an_fsdp_checkpoint_of_tied_embeddings_is_no_larger_than_ddps(tmp_path):
    from ray_trainer._checkpoint import LocalCheckpoint, TrainerState

    ranks = run_ranks(_save_both, 2, str(tmp_path))
    ratio = sum(r["sharded"] for r in ranks) / ranks[0]["ddp"]
    assert ratio <= 1.01, ratio  # the tied embedding twice: ~1.27x
    assert ranks[0]["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    # Every rank's shards in one folder, as in storage; read back whole in one process.
    shards = tmp_path / "all" / "shards"
    shards.mkdir(parents=True)
    for rank in (0, 1):
        for name in os.listdir(tmp_path / f"rank{rank}" / "shards"):
            os.replace(tmp_path / f"rank{rank}" / "shards" / name, shards / name)
    state = TrainerState(strategy="fsdp", extra={"tied_weights": ranks[0]["aliases"]})
    listed = {f"shards/{name}": {} for name in os.listdir(shards)}  # what its manifests list
    checkpoint = LocalCheckpoint(str(tmp_path / "all"), "test", state, listed)
    weights = checkpoint.model_state()  # no template: the alias comes from the trainer state
    assert weights["lm_head.weight"] is weights["transformer.wte.weight"]
    expected = torch.load(tmp_path / "model.pt")
    assert set(weights) == set(expected)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    filled = checkpoint.model_state(model.state_dict())  # a template: filled in place
    for name, tensor in expected.items():
        assert torch.allclose(weights[name], tensor, atol=1e-6), name
        assert torch.equal(filled[name], weights[name]), name
