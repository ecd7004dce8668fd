"""Honest throughput and MFU (issue 15): tokens that are not padding, FLOPs per token, the peak
of known GPUs, the log window; and the agreement that carries them, read once."""

from __future__ import annotations

import pytest
import torch

from callbacks import TrainerControl
from ray_trainer._worker.assemble import optimizer_options
from ray_trainer._worker.step import throughput as tp
from ray_trainer._worker.step.agreement import Agreement


def test_tokens_exclude_padding_by_mask_pad_id_or_labels():
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    labels = torch.tensor([[-100, 6, 7, -100], [-100, 6, -100, -100]])
    n, positions = tp.count_tokens({"input_ids": ids, "attention_mask": mask, "labels": labels})
    assert (int(n), positions) == (5, 8)
    n, _ = tp.count_tokens({"input_ids": ids, "labels": labels}, pad_id=0)  # the demo's way
    assert int(n) == 5
    n, _ = tp.count_tokens({"input_ids": ids, "labels": labels})  # only labels: loss tokens
    assert int(n) == 3
    assert tp.count_tokens({"input_ids": ids}) == (8, 8)  # nothing says what padding is
    assert tp.count_tokens({"x": torch.zeros(3, 2)}) == (0, 0)  # not text


def test_flops_per_token_is_six_times_parameters_plus_attention():
    shape = tp.ModelShape(params=124_000_000, layers=12, width=768)
    assert tp.flops_per_token(shape, 1024) == 6 * 124e6 + 12 * 12 * 768 * 1024
    assert tp.flops_per_token(tp.ModelShape(params=10), 1024) == 60  # no config: 6N only


def test_model_shape_reads_hugging_face_and_demo_configs():
    pytest.importorskip("transformers")
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=3, n_head=2)
    )
    shape = tp.model_shape(gpt2)
    assert (shape.layers, shape.width) == (3, 32)
    assert shape.params == sum(p.numel() for p in gpt2.parameters())
    assert tp.model_shape(torch.nn.Linear(3, 2)) == tp.ModelShape(params=8)


def test_mfu_divides_by_the_peak_of_every_device():
    assert tp.mfu(1000.0, 1e9, 1e12, devices=2) == pytest.approx(0.5)
    assert tp.mfu(1000.0, 1e9, None, devices=2) is None


def test_peak_flops_from_the_table_or_the_override(monkeypatch):
    cpu = torch.device("cpu")
    assert tp.peak_flops(cpu) is None  # absent on CPU...
    assert tp.peak_flops(cpu, override=5e12) == 5e12  # ...unless given
    gpu = torch.device("cuda", 0)
    for name, expected in (
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10G", 70e12),
        ("NVIDIA L40S", 362e12),
        ("Some Future GPU", None),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d, n=name: n)
        assert tp.peak_flops(gpu) == expected, name


def test_the_window_gives_tokens_per_s_padding_share_and_mfu_then_resets():
    window = tp.Window()
    window.add_step(0.5, samples=4)
    window.add_step(0.5, samples=4)
    window.add_agreed(tokens=600.0, positions=800.0)
    shape = tp.ModelShape(params=1000, layers=2, width=10)
    metrics = window.close(shape, peak=1e9, devices=2)
    assert metrics["tokens_per_s"] == 600.0
    assert metrics["padding_share"] == pytest.approx(0.25)
    per_token = 6 * 1000 + 12 * 2 * 10 * 100  # 800 positions over 8 samples: length 100
    assert metrics["mfu"] == pytest.approx(600.0 * per_token / 2e9)
    assert window.close(shape, peak=1e9, devices=2) == {}  # reset
    assert "mfu" not in _filled(window).close(shape, peak=None, devices=2)


def _filled(window):
    window.add_step(1.0, 1)
    window.add_agreed(10.0, 10.0)
    return window


def test_fused_adamw_on_cuda_only():
    assert optimizer_options(torch.device("cuda", 0)) == {"fused": True}
    assert optimizer_options(torch.device("cpu")) == {}


def test_a_missing_compiler_is_named_with_the_fix(monkeypatch):
    import shutil

    from ray_trainer._model.compile_probe import missing_compile_toolchain

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    problem = missing_compile_toolchain(use_gpu=False)
    assert "C++ compiler" in problem and "compile=False" in problem
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/g++" if name == "g++" else None)
    assert missing_compile_toolchain(use_gpu=False) is None


def test_an_agreement_is_read_once_and_decodes_the_control():
    requested = TrainerControl(should_save=True)
    agreement = Agreement(torch.tensor(1.5), [5, 7, 9], requested, "cpu", world=1)
    agreed = agreement.result()
    assert (agreed.loss_sum, agreed.targets, agreed.tokens, agreed.positions) == (1.5, 5, 7, 9)
    # The gradients' scale: norm x world / the step's targets, a tensor (no host sync).
    assert float(agreement.scale(10.0)) == 2.0
    assert agreed.control == TrainerControl(should_save=True)
    assert agreement.result() is agreed  # read once, then kept
    assert agreement.requested is requested and not agreement.recorded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a host-device sync needs a GPU")
def test_starting_an_agreement_and_its_scale_never_wait_for_the_gpu():
    loss = torch.ones((), device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        agreement = Agreement(loss, [4, 6, 8], TrainerControl(), "cuda", 1, torch.cuda.Stream())
        scale = agreement.scale(8.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert agreement.result().targets == 4 and float(scale) == 2.0
