"""The loss of a step is the mean over every target token of the global batch: the gradients and
the logged loss do not depend on how the samples are split into batch_size, grad_accum_steps
and num_workers, nor on packing, nor on an elastic run's size (fewer workers than its max take
more micro-batches each), nor on the chunked loss. Real gloo ranks (no Ray), the loop's own
`train_step`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gloo_support import run_ranks
from step_state import write_token_cache

from ray_trainer._storage import locate

MAX_LENGTH = 24
# name: (batch_size, grad_accum_steps, workers, packing, the elastic max (None: fixed),
#        the chunked loss's chunk (None: the model's own full-logits loss))
SPLITS = {
    "4x1x1": (4, 1, 1, False, None, None),
    "1x4x1": (1, 4, 1, False, None, None),
    "2x1x2": (2, 1, 2, False, None, None),
    "4x1x1 packed": (4, 1, 1, True, None, None),
    "1x4x1 packed": (1, 4, 1, True, None, None),
    "2x1x2 packed": (2, 1, 2, True, None, None),
    # Elastic: the global batch of the max, on fewer workers.
    "2x1 of max 2 on 1": (2, 1, 1, False, 2, None),
    "1x1 of max 4 on 2": (1, 1, 2, False, 4, None),
    "1x1 of max 4 on 2 packed": (1, 1, 2, True, 4, None),
    # The chunked loss (docs/large-models.md): the same sums, whatever the split.
    "4x1x1 chunked": (4, 1, 1, False, None, 5),
    "2x1x2 chunked": (2, 1, 2, False, None, 5),
    "1x4x1 packed chunked": (1, 4, 1, True, None, 3),
    "1x1 of max 4 on 2 packed chunked": (1, 1, 2, True, 4, 7),  # with a filler micro-batch
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from ray_trainer._demo.tiny_hf import make_tiny_causal_lm

    root = tmp_path_factory.mktemp("split")
    model = make_tiny_causal_lm(root / "model", n_positions=64)
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(12):  # variable lengths, masked prompts: short and long samples mixed
        n = int(rng.integers(3, MAX_LENGTH))
        ids = rng.integers(3, 16, n).tolist()
        cut = int(rng.integers(1, n))
        samples.append((ids, [-100] * cut + ids[cut:]))
    return str(model), write_token_cache(str(root), "split", samples)


def one_step(rank: int, world: int, model_path: str, cache: str) -> dict:
    """Every split's first step on this rank: the gradients before the optimizer step and the
    logged loss (W=1 splits run on rank 0 alone, without DDP)."""
    out = {}
    for name, (batch, accum, workers, packing, elastic_max, chunk) in SPLITS.items():
        if rank < workers:
            out[name] = _step(
                rank, workers, batch, accum, packing, model_path, cache, elastic_max, chunk
            )
    return out


def _step(rank, world, batch, accum, packing, model_path, cache, elastic_max=None, chunk=None):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from callbacks import CallbackManager, TrainerCallback, TrainingContext
    from ray_trainer import TrainingArgs
    from ray_trainer._worker.model.packed_attention import use_packed_attention
    from ray_trainer._worker.model.parallel import Replicated, prepare
    from ray_trainer._worker.objectives.sft import SftObjective
    from ray_trainer._worker.state import WorkerState
    from ray_trainer._worker.step.hooks import Hooks
    from ray_trainer._worker.step.loop import train_step
    from ray_trainer._worker.step.micro_batches import CachedDataset, StepLoader
    from ray_trainer._worker.workload import Workload, model_loss

    class Grads(TrainerCallback):
        runs_on = "all_ranks"

        def on_before_optimizer_step(self, context, **kwargs):
            self.grads = {n: p.grad.detach().clone() for n, p in context.model.named_parameters()}

    args = TrainingArgs(
        model=model_path, batch_size=batch, grad_accum_steps=accum,
        num_workers=(min(world, elastic_max - 1), elastic_max) if elastic_max else world,
        max_length=MAX_LENGTH, max_grad_norm=None, packing=packing,
        max_tokens_per_batch=64 if packing else None,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_path)
    layout = packing and use_packed_attention(model)  # as build_workload does
    if chunk is not None:
        from ray_trainer._worker.model.chunked_loss import use_chunked_loss

        assert use_chunked_loss(model, chunk) is None
    acc = Accelerator(cpu=True)

    def make_optimizer(m):
        return torch.optim.SGD(m.parameters(), lr=0.0)

    if world == 1:  # this rank alone, no DDP (and no KV cache, as `prepare` sets)
        model.config.use_cache = False
        parallel = Replicated(acc, model, make_optimizer(model))
    else:
        parallel = prepare(model, args, acc, make_optimizer, "no")
    data = CachedDataset.open(locate(cache), pad_id=0)
    norm = float(batch * accum * MAX_LENGTH)
    workload = Workload(
        model, data, None, data.collate, model_loss, sums_itself=True, norm=norm,
        objective=SftObjective(),
    )  # fmt: skip
    loader = StepLoader(data, world=world, rank=rank, batch_size=batch, grad_accum=accum,
                        seed=0, pad_id=0, max_tokens=args.tokens_per_micro_batch,
                        layout=layout, logical_world=args.max_workers)  # fmt: skip
    grads = Grads()
    manager = CallbackManager()
    manager.add(grads)
    ctx = TrainingContext(rank=rank, world_size=world, model=parallel.module())
    s = WorkerState(
        spec=None, args=args, rank=rank, world_size=world, accelerator=acc, parallel=parallel,
        model=parallel.model, optimizer=parallel.optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(parallel.optimizer, lambda _: 1.0),
        workload=workload, loader=loader, hooks=Hooks(manager, ctx), ctx=ctx, total_steps=1,
        steps_per_epoch=loader.steps_per_epoch,
    )  # fmt: skip
    micro_batches = next(loader.steps(0))
    agreed = train_step(s, micro_batches).result()
    return {
        "loss": agreed.loss_sum * norm / agreed.targets,
        "targets": agreed.targets,
        "micro_batches": len(micro_batches),
        "grads": grads.grads,
    }


def test_gradients_and_loss_do_not_depend_on_the_split_or_on_packing(setup):
    model_path, cache = setup
    ranks = run_ranks(one_step, 2, model_path, cache)
    results = ranks[0]
    assert set(results) == set(SPLITS)
    base = results["4x1x1"]
    assert base["targets"] > 0 and base["micro_batches"] == 1
    assert results["1x4x1"]["micro_batches"] == 4
    assert results["2x1 of max 2 on 1"]["micro_batches"] == 2  # the absent worker's too
    assert results["1x1 of max 4 on 2"]["micro_batches"] == 2
    for name, result in results.items():
        assert result["targets"] == base["targets"], name
        assert result["loss"] == pytest.approx(base["loss"], abs=1e-5), name
        for param, grad in base["grads"].items():
            torch.testing.assert_close(result["grads"][param], grad, atol=1e-5, rtol=0, msg=name)
    # Rank 1 of the 2-worker splits ends with the same gradients (DDP averaged them).
    two = ("2x1x2", "2x1x2 packed", "1x1 of max 4 on 2", "1x1 of max 4 on 2 packed",
           "2x1x2 chunked", "1x1 of max 4 on 2 packed chunked")  # fmt: skip
    for name in two:
        for param, grad in results[name]["grads"].items():
            torch.testing.assert_close(ranks[1][name]["grads"][param], grad, atol=1e-6, rtol=0)


def test_the_worker_check_accepts_a_model_that_keeps_packed_samples_apart(setup):
    from contextlib import nullcontext

    from transformers import AutoModelForCausalLM

    from ray_trainer._worker.model.packed_attention import use_packed_attention
    from ray_trainer._worker.model.packing_check import PackingError, check_packed_attention

    model = AutoModelForCausalLM.from_pretrained(setup[0]).train()
    model.config.use_cache = False  # as training runs it
    check_packed_attention(model, "cpu", nullcontext, pad_to=16)
    assert model.training  # its mode is given back
    # Through ray-trainer's packed attention (each sample on its own) too.
    assert use_packed_attention(model)
    check_packed_attention(model, "cpu", nullcontext, layout=True)
    # Without the layout it would be plain causal attention: the check sees the mixing.
    with pytest.raises(PackingError, match="lets a packed sample attend to the one before it"):
        check_packed_attention(model, "cpu", nullcontext, layout=False)
    model.set_attn_implementation("sdpa")
    # With a KV cache transformers does not build the packed mask: the check sees that too.
    model.config.use_cache = True
    with pytest.raises(PackingError, match="lets a packed sample attend to the one before it"):
        check_packed_attention(model, "cpu", nullcontext, pad_to=16)


def test_the_worker_check_refuses_a_model_without_position_ids():
    from contextlib import nullcontext

    from ray_trainer._demo.model import TinyCausalLM, TinyLMConfig
    from ray_trainer._worker.model.packing_check import PackingError, check_packed_attention

    with pytest.raises(PackingError, match="does not take position_ids"):
        check_packed_attention(TinyCausalLM(TinyLMConfig(vocab_size=20)), "cpu", nullcontext, 12)
