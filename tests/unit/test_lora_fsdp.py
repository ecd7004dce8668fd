"""LoRA under FSDP2 on two real gloo ranks (no Ray): every rank's part of every adapter is saved
and found back, the adapters start identical on every rank from a base built on the meta
device, and the merged and adapter exports (gathered tensor by tensor) compute what the
sharded model computes. The three checks run in one pair of spawned ranks (`ranks`: the
processes' start and imports paid once, not three times), each read by its own test.
"""

from __future__ import annotations

import os

import pytest
import torch
from gloo_support import run_ranks

LORA = {"r": 4, "lora_alpha": 8}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from ray_trainer._demo.tiny_hf import make_tiny_causal_lm

    return str(make_tiny_causal_lm(tmp_path_factory.mktemp("lora") / "base", n_layer=2))


def _sharded_lora(model_path: str, export: str = "both"):
    """The run's model as a worker builds it: on meta, wrapped, sharded, then filled."""
    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._worker.model.adaptation import apply_lora
    from ray_trainer._worker.model.build import build_model
    from ray_trainer._worker.model.parallel import _shard

    args = TrainingArgs(model=model_path, lora=LORA, strategy="fsdp", lora_export=export)
    spec = ModelSpec.of(args)
    model, fill = build_model(spec)
    model, fill, record = apply_lora(model, fill, spec, args)
    assert fill is not None  # the meta-device path
    _shard(model, args, torch.device("cpu"), "no")
    fill(model, torch.device("cpu"))
    return args, model, record


def _optimizer(args, model):
    from ray_trainer._worker.assemble import _optimizer

    return _optimizer(model, args, torch.device("cpu"))


def save_zero_load(rank: int, world: int, model_path: str, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from ray_trainer._worker.checkpoints.resume import load_shards
    from ray_trainer._worker.checkpoints.saving import sharded_state
    from ray_trainer._worker.model.adaptation import LoraAdapters

    args, model, record = _sharded_lora(model_path)
    optimizer = _optimizer(args, model)
    adapted = LoraAdapters(record, args.lora_export, args.model)
    # One step, so that the optimizer has state to save.
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for i, p in enumerate(adapters.values()):  # a value of this rank's own, per adapter
            p.to_local().fill_(1000 * rank + i)
    expected = {n: p.to_local().clone() for n, p in adapters.items()}
    state = sharded_state(model, optimizer, adapted)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder))
    with torch.no_grad():
        for p in adapters.values():
            p.to_local().zero_()
    load_shards(model, optimizer, adapted, folder)
    found = {n: torch.equal(p.to_local(), expected[n]) for n, p in adapters.items()}
    keys = sorted(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)
    local_rows = {n: p.to_local().shape[0] for n, p in adapters.items()}
    return {"found": found, "keys": keys, "rows": local_rows, "frozen": len(state["model"])}


def every_check(rank: int, world: int, model_path: str, folder: str) -> dict:
    """Each check of this module on this rank, in turn (a check that raises fails the spawn,
    as it failed its own before: a rank left in a collective would hang the next check)."""
    return {
        "saved": save_zero_load(rank, world, model_path, os.path.join(folder, "shards")),
        "exported": export_and_compare(rank, world, model_path, os.path.join(folder, "ckpt")),
        "chunked": chunked_against_own(rank, world, model_path),
    }


@pytest.fixture(scope="module")
def ranks(base, tmp_path_factory):
    """(the checks' folder, each rank's results)"""
    folder = str(tmp_path_factory.mktemp("lora_fsdp_ranks"))
    return folder, run_ranks(every_check, 2, base, folder)


def _results(ranks, check: str) -> list:
    return [r[check] for r in ranks[1]]


def test_every_ranks_part_of_every_adapter_is_saved_and_found_back(ranks):
    results = _results(ranks, "saved")
    for rank, r in enumerate(results):
        assert r["found"] and all(r["found"].values()), (rank, r["found"])
    # Both ranks hold rows of the adapters (their values differ by rank: each one came back).
    assert any(rows > 0 for rows in results[1]["rows"].values())
    model_keys = [k for k in results[0]["keys"] if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)  # no frozen base weight
    assert all(".lora_" in k for k in results[0]["keys"] if k.startswith("optim.state."))


def export_and_compare(rank: int, world: int, model_path: str, folder: str) -> dict:
    from ray_trainer._worker.checkpoints.export import full_tensor as _full
    from ray_trainer._worker.model.adaptation import lora_export

    args, model, _ = _sharded_lora(model_path)
    with torch.no_grad():  # non-zero B: the merge must add something
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.to_local().normal_(0, 0.05, generator=torch.Generator().manual_seed(rank))
    a_full = {n: _full(p) for n, p in model.named_parameters() if ".lora_A." in n}
    lora_export(model, args.lora_export, args.model).write(folder, _full, rank == 0)
    if rank == 0:  # what write_hf_files adds: the config
        model.config.save_pretrained(os.path.join(folder, "hf"))
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # a collective: both ranks
    return {"logits": logits, "a": a_full}


def test_merged_and_adapter_exports_of_a_sharded_model_compute_what_it_computes(base, ranks):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = os.path.join(ranks[0], "ckpt")
    r0, r1 = _results(ranks, "exported")
    assert torch.equal(r0["logits"], r1["logits"])
    for name in r0["a"]:  # the adapters started identical on both ranks (seeded, whole)
        assert torch.equal(r0["a"][name], r1["a"][name]), name
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "hf"))
    assert set(os.listdir(os.path.join(folder, "hf_adapter"))) >= {
        "adapter_config.json", "adapter_model.safetensors",
    }  # fmt: skip
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), os.path.join(folder, "hf_adapter")
    )
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, r0["logits"], atol=1e-5, rtol=0)
        torch.testing.assert_close(peft(input_ids=ids).logits, r0["logits"], atol=1e-5, rtol=0)
    base_logits = AutoModelForCausalLM.from_pretrained(base)(input_ids=ids).logits
    assert (base_logits - r0["logits"]).abs().max() > 1e-3  # the adapters changed something


def chunked_against_own(rank: int, world: int, model_path: str) -> dict:
    """The same sharded LoRA model, with its own loss and with the chunked loss: each rank's
    loss and every adapter's whole gradient (gathered)."""
    from ray_trainer._worker.model.chunked_loss import use_chunked_loss

    generator = torch.Generator().manual_seed(rank)  # each rank its own rows
    ids = torch.randint(3, 16, (2, 12), generator=generator)  # the tiny vocabulary
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt that takes no loss
    out = {}
    for name in ("own", "chunked"):
        torch.manual_seed(0)  # the same adapters both times
        _, model, _ = _sharded_lora(model_path)
        if name == "chunked":
            assert use_chunked_loss(model, 5) is None
        result = model(input_ids=ids, labels=labels, num_items_in_batch=20.0)
        loss = result["loss"] if isinstance(result, dict) else result.loss
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
        out[name] = {"loss": loss.item(), "grads": grads}
    return out


def test_the_chunked_loss_under_fsdp2_equals_the_models_own(ranks):
    """FSDP2's root unit holds the head: the chunked loss runs inside the model's forward and
    recomputes the head's chunks in backward with the root's parameters still gathered."""
    for rank in _results(ranks, "chunked"):
        own, chunked = rank["own"], rank["chunked"]
        assert chunked["loss"] == pytest.approx(own["loss"], rel=1e-6)
        assert set(chunked["grads"]) == set(own["grads"]) and own["grads"]
        for name, grad in own["grads"].items():
            assert (chunked["grads"][name] - grad).norm() <= 1e-6 * grad.norm() + 1e-12, name
