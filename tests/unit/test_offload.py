"""`ActivationOffload`'s hooks on CPU with host copies (unpinned): what forward saves moves out
and comes back for backward with the same gradients; parameters and small tensors stay; under
activation checkpointing only the checkpointed blocks' inputs move. Without a GPU the runner's
offloader is off and says so once; with compile it is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ray_trainer import TrainingArgs
from ray_trainer._worker.model.offload import ActivationOffload, build_offload

CPU = torch.device("cpu")


class Blocks(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)
        )
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x.square().sum()


def _grads(model, x, offload=None):
    model.zero_grad()
    if offload is None:
        loss = model(x)
    else:
        with offload:
            loss = model(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_saved_activations_move_out_and_back_with_the_same_gradients(checkpointed):
    model, x = Blocks(checkpointed), torch.randn(32, 64)
    want = _grads(model, x)
    offload = ActivationOffload(CPU, min_bytes=32 * 64 * 4, host_copies=True)
    got = _grads(model, x, offload)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    if checkpointed:  # each block's input, and the output the loss squares: [32, 64] fp32
        assert offload.offloaded == 4 and offload.offloaded_bytes == 4 * 32 * 64 * 4
    else:  # each block's input, hidden activations (before and after GELU) and output
        assert offload.offloaded > 3
        assert offload.offloaded_bytes >= 3 * (2 * 32 * 256 + 32 * 64) * 4


def test_parameters_and_small_tensors_stay():
    offload = ActivationOffload(CPU, min_bytes=1024, host_copies=True)
    weight = nn.Parameter(torch.randn(64, 64))
    assert offload.pack(weight) is weight
    small = torch.randn(8)
    assert offload.pack(small) is small
    large = torch.randn(64, 64)
    packed = offload.pack(large)
    assert packed is not large and torch.equal(offload.unpack(packed), large)
    assert offload.offloaded == 1 and offload.offloaded_bytes == 64 * 64 * 4


def test_without_a_gpu_nothing_is_offloaded_and_it_says_so_once(capsys):
    assert build_offload(False, CPU, 0) is None
    assert build_offload(True, CPU, 1) is None
    assert capsys.readouterr().out == ""  # rank 1 is silent
    assert build_offload(True, CPU, 0) is None
    assert "offload_activations=True has nothing to move without a GPU" in capsys.readouterr().out
    # On CPU without host_copies the hooks leave every tensor where it is.
    idle = ActivationOffload(CPU, min_bytes=0)
    tensor = torch.randn(256, 256)
    assert idle.pack(tensor) is tensor and not idle.active


def test_offloading_with_compile_is_refused_naming_both():
    with pytest.raises(ValueError, match="offload_activations=True with compile=True"):
        TrainingArgs(offload_activations=True, compile=True)
    with pytest.raises(ValueError, match="loss_chunk_size sizes the chunked loss"):
        TrainingArgs(chunked_loss=False, loss_chunk_size=64)
