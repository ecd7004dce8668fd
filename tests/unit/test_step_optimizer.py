"""The loop's optimizer step and mixed-precision tools (`loop._optimizer_step`, `amp_tools`):
past the first step, torch's optimizer is stepped under accelerate's wrapper, to the same
parameters, without the scheduler's order warning; with a scaler the wrapper always steps."""

from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace

import torch
from accelerate import Accelerator

from ray_trainer._worker.step import loop


def _wrapped(acc: Accelerator) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))


def _backward(model: torch.nn.Module, step: int) -> None:
    x = torch.arange(8.0).reshape(2, 4) + step
    model(x).square().sum().backward()


def test_past_the_first_step_the_torch_optimizer_steps_to_the_same_parameters(monkeypatch):
    import accelerate.optimizer

    acc = Accelerator(cpu=True)
    ours, ours_opt = _wrapped(acc)
    theirs, theirs_opt = _wrapped(acc)
    assert isinstance(ours_opt, accelerate.optimizer.AcceleratedOptimizer)
    lookups = []  # the wrapper's step looks for the LOMO package (twice) on every call
    found = accelerate.optimizer.is_lomo_available
    monkeypatch.setattr(
        accelerate.optimizer, "is_lomo_available", lambda: (lookups.append(1), found())[1]
    )
    s = SimpleNamespace(
        optimizer=ours_opt,
        scheduler=torch.optim.lr_scheduler.LambdaLR(ours_opt, lambda _: 0.5),
        progress=SimpleNamespace(global_step=0),
    )
    their_scheduler = torch.optim.lr_scheduler.LambdaLR(theirs_opt, lambda _: 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scheduler's "step before optimizer.step()" warning
        for step in range(3):
            _backward(ours, step)
            loop._optimizer_step(s)
            s.progress.global_step += 1
            _backward(theirs, step)
            ours_lookups = len(lookups)
            theirs_opt.step()
            lookups[ours_lookups:] = []  # the reference's own
            their_scheduler.step()
            theirs_opt.zero_grad(set_to_none=True)
    assert len(lookups) == 2  # the first step only went through the wrapper
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
        assert a.grad is None  # zeroed (set to None)
    assert s.scheduler.get_last_lr() == their_scheduler.get_last_lr()


def test_a_wrapper_with_a_scaler_always_steps_itself():
    calls = []
    inner = SimpleNamespace(step=lambda: calls.append("inner"), zero_grad=lambda **k: None)
    wrapper = SimpleNamespace(
        optimizer=inner,
        scaler=object(),  # fp16: the wrapper unscales and skips steps that overflowed
        step=lambda: calls.append("wrapper"),
        zero_grad=lambda **k: calls.append("wrapper zero"),
    )
    s = SimpleNamespace(
        optimizer=wrapper,
        scheduler=SimpleNamespace(step=lambda: None),
        progress=SimpleNamespace(global_step=5),
    )
    loop._optimizer_step(s)
    assert calls == ["wrapper", "wrapper zero"]


def test_amp_tools_are_accelerates_only_under_mixed_precision():
    plain = Accelerator(cpu=True)
    assert loop.amp_tools(plain) == (contextlib.nullcontext, loop._backward)
    bf16 = SimpleNamespace(native_amp=True, scaler=None, autocast=object(), backward=object())
    assert loop.amp_tools(bf16) == (bf16.autocast, loop._backward)
    fp16 = SimpleNamespace(native_amp=True, scaler=object(), autocast=object(), backward=object())
    assert loop.amp_tools(fp16) == (fp16.autocast, fp16.backward)
