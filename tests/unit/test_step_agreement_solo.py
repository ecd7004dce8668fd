"""One CPU rank's agreement (`SoloAgreement`): the same `Agreed` values and gradient scale as
the all-reduce's `Agreement` on world size 1, for any loss, counts, flags, loop numbers and
objective sums; `agree` picks it for one CPU rank only."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from callbacks import TrainerControl
from ray_trainer._worker.step.agreement import FLAGS, Agreement, SoloAgreement, agree

finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(
    loss=finite,
    counts=st.lists(st.integers(0, 10**7), min_size=3, max_size=3),
    flags=st.lists(st.booleans(), min_size=len(FLAGS), max_size=len(FLAGS)),
    extra=st.lists(st.integers(0, 100).map(float), max_size=3),
    sums=st.none() | st.lists(finite, min_size=1, max_size=4),
    norm=st.floats(1, 1e4, allow_nan=False),
)
def test_solo_agreement_gives_what_the_all_reduce_gives(loss, counts, flags, extra, sums, norm):
    requested = TrainerControl(**dict(zip(FLAGS, flags, strict=True)))
    sums_t = None if sums is None else torch.tensor(sums, dtype=torch.float32)
    summed = Agreement(torch.tensor(loss), counts, requested, "cpu", 1, None, tuple(extra), sums_t)
    solo = agree(torch.tensor(loss), counts, requested, "cpu", 1, None, tuple(extra), sums_t)
    assert type(solo) is SoloAgreement
    assert solo.result() == summed.result()
    assert solo.result() is solo.result()  # read once
    # A host float that multiplies as the all-reduce's float32 tensor does.
    assert torch.equal(torch.tensor(solo.scale(norm), dtype=torch.float32), summed.scale(norm))
    assert solo.requested is requested and solo.recorded is False


def test_more_ranks_or_a_gpu_keep_the_all_reduce(monkeypatch):
    import ray_trainer._worker.step.agreement as module

    loss, control, picked = torch.tensor(1.0), TrainerControl(), []

    class Marker(Agreement):  # records the choice: no process group or GPU is needed here
        def __init__(self, *args, **kwargs):
            picked.append(args[3:5])

    assert type(agree(loss, [1, 1, 1], control, "cpu", 1)) is SoloAgreement
    monkeypatch.setattr(module, "Agreement", Marker)
    agree(loss, [1, 1, 1], control, "cpu", 2)
    agree(loss, [1, 1, 1], control, "cuda:0", 1)
    assert picked == [("cpu", 2), ("cuda:0", 1)]


@settings(max_examples=60, deadline=None)
@given(
    scale=st.sampled_from([1.0, 0.5, 1.0 / 3, 7.25]),
    max_norm=st.none() | st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_a_host_float_scale_gives_the_tensor_scales_gradients_and_norm(scale, max_norm, seed):
    """`scale_and_clip_` with SoloAgreement's float (1.0: nothing multiplied) gives bit for bit
    the gradients and norm of the all-reduce's float32 tensor scale."""
    from ray_trainer._worker.model.parallel import scale_and_clip_

    def params() -> list[torch.nn.Parameter]:
        out = []
        for shape in ((4, 3), (3,), (2, 5)):
            p = torch.nn.Parameter(torch.zeros(shape))
            p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(seed + len(out)))
            out.append(p)
        return out

    by_float, by_tensor = params(), params()
    norm_f = scale_and_clip_(by_float, scale, max_norm, sharded=False)
    norm_t = scale_and_clip_(by_tensor, torch.tensor(scale, dtype=torch.float32), max_norm, False)
    for a, b in zip(by_float, by_tensor, strict=True):
        assert torch.equal(a.grad, b.grad)
    assert (norm_f is None) == (norm_t is None) == (max_norm is None)
    if norm_f is not None:
        assert torch.equal(norm_f, norm_t)
