"""Bad sharding input is refused in the driver, before any worker starts (issue 14, point 6):
the model is built on the meta device (no memory, no weights read) to find its blocks."""

from __future__ import annotations

import pytest
from torch import nn

from ray_trainer import TrainingArgs, TrainingArgsError, run_training
from ray_trainer._model.blocks import ShardingError, find_blocks
from ray_trainer.demo import make_tiny_causal_lm


class Flat(nn.Module):
    """No ModuleList, no _no_split_modules: nothing to shard block by block."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, labels):
        return {"loss": (self.net(x).squeeze(-1) - labels).pow(2).mean()}


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    pytest.importorskip("transformers")
    return str(make_tiny_causal_lm(tmp_path_factory.mktemp("m"), n_layer=2, n_embd=32))


def test_blocks_of_a_hugging_face_model_are_its_no_split_modules(tiny_gpt2):
    from ray_trainer._model.spec import ModelSpec

    model = ModelSpec.of(TrainingArgs(model=tiny_gpt2)).build_meta_model()
    assert next(model.parameters()).device.type == "meta"  # nothing allocated
    blocks = find_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["GPT2Block", "GPT2Block"]
    assert find_blocks(model, ["GPT2MLP"])[0].__class__.__name__ == "GPT2MLP"


def test_fsdp_on_a_model_without_blocks_is_refused_naming_candidates(tmp_path):
    with pytest.raises(ShardingError) as info:
        run_training(model=Flat, strategy="fsdp", storage_path=str(tmp_path / "s"))
    msg = str(info.value)
    assert "strategy='fsdp'" in msg and "Flat has no blocks to shard" in msg
    assert "fsdp_shard_modules" in msg and "candidate block classes: Linear" in msg
    assert isinstance(info.value, TrainingArgsError) and not (tmp_path / "s").exists()


def test_fsdp_shard_modules_naming_a_class_the_model_lacks(tiny_gpt2, tmp_path):
    with pytest.raises(ShardingError) as info:
        run_training(
            model=tiny_gpt2,
            strategy="fsdp",
            fsdp_shard_modules=["LlamaDecoderLayer"],
            storage_path=str(tmp_path / "s"),
        )
    msg = str(info.value)
    assert "'LlamaDecoderLayer'" in msg and "GPT2LMHeadModel does not contain" in msg
    assert "GPT2Block" in msg  # the candidates include the real block class


def test_activation_checkpointing_without_blocks_is_refused(tmp_path):
    with pytest.raises(ShardingError, match="activation_checkpointing: Flat has no blocks"):
        run_training(model=Flat, activation_checkpointing=True, storage_path=str(tmp_path))


def test_fp16_with_fsdp_is_refused_with_the_fix():
    with pytest.raises(TrainingArgsError, match="mixed_precision='bf16'"):
        TrainingArgs.coerce(strategy="fsdp", mixed_precision="fp16")
