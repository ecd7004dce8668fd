"""Hugging Face loading, offline: a tiny random GPT-2 and a word-level tokenizer made on the spot."""

from __future__ import annotations

import sys

import pytest
import torch

from ray_trainer._data.encode import Encoder
from ray_trainer._model.spec import (
    ModelLoadError,
    check_model_ref,
    is_builtin,
    load_hf_causal_lm,
    load_hf_tokenizer,
)
from ray_trainer.demo import TINY_WORDS as WORDS
from ray_trainer.demo import make_tiny_causal_lm


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A directory holding a 1-layer GPT-2 and its tokenizer, as save_pretrained writes them."""
    pytest.importorskip("transformers")
    return make_tiny_causal_lm(tmp_path_factory.mktemp("tiny-gpt2"), n_layer=1, n_embd=32)


def test_builtin_names():
    assert is_builtin("tiny-lm") and is_builtin("demo") and is_builtin(None)
    assert not is_builtin("gpt2")


def test_loads_a_local_model_and_tokenizer_and_computes_a_loss(tiny_hf_dir):
    check_model_ref(str(tiny_hf_dir))  # passes: no exception
    model = load_hf_causal_lm(str(tiny_hf_dir))
    tok = load_hf_tokenizer(tiny_hf_dir)
    ids = torch.tensor([tok("the cat sat on the mat")["input_ids"]])
    assert ids.shape == (1, 6) and (ids > 2).all()  # every word is in the vocabulary
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss) and out.logits.shape == (1, 6, len(WORDS) + 3)
    out.loss.backward()


def test_records_encoded_with_an_hf_tokenizer_train_the_hf_model(tiny_hf_dir):
    from ray_trainer._worker.step.micro_batches import collate_batch

    tok = load_hf_tokenizer(str(tiny_hf_dir))
    enc = Encoder(tok, max_length=16)
    first = enc.encode({"text": "the cat sat on the mat"}, "text")
    second = enc.encode(
        {"prompt": "what did the cat do ?", "completion": "it sat"}, "prompt_completion"
    )
    assert first.input_ids == [*tok("the cat sat on the mat")["input_ids"], 1]
    assert first.labels == first.input_ids
    assert second.labels[:6] == [-100] * 6
    assert second.labels[6:] == [*tok("it sat")["input_ids"], tok.eos_token_id]
    items = [{"input_ids": e.input_ids, "labels": e.labels} for e in (first, second)]
    batch = collate_batch(items, pad_id=enc.pad_id)
    assert enc.pad_id == tok.pad_token_id == 0
    model = load_hf_causal_lm(str(tiny_hf_dir))
    loss = model(**batch).loss
    assert torch.isfinite(loss)


def test_loading_never_downloads_by_default(tiny_hf_dir, monkeypatch):
    transformers = pytest.importorskip("transformers")
    seen = {}

    def fake_from_pretrained(name, **kwargs):
        seen.update(kwargs)
        return "model"

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    assert load_hf_causal_lm("org/some-model") == "model"
    assert seen["local_files_only"] is True
    load_hf_causal_lm("org/some-model", allow_download=True)
    assert seen["local_files_only"] is False


@pytest.mark.parametrize("loader", [check_model_ref, load_hf_causal_lm, load_hf_tokenizer])
def test_an_unknown_name_is_a_clear_error(loader, monkeypatch):
    pytest.importorskip("transformers")
    # Hugging Face's offline mode, as on a machine without the hub: transformers' adapter probe
    # ignores local_files_only and would retry the hub for ~23 s before the same error.
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as err:
        loader("no-such-org/no-such-model-xyz")
    msg = str(err.value)
    assert "'no-such-org/no-such-model-xyz'" in msg
    assert "not a built-in model name" in msg and "local path or cached model" in msg
    assert isinstance(err.value, ModelLoadError)


def test_a_missing_directory_and_an_empty_one_are_explained(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(ModelLoadError, match="no such directory"):
        check_model_ref(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="exists but holds no loadable model"):
        load_hf_causal_lm(str(tmp_path))


def test_builtin_names_are_not_hf_models():
    check_model_ref("tiny-lm")  # the driver's check passes for the built-in model
    with pytest.raises(ModelLoadError, match="built-in demo transformer"):
        load_hf_causal_lm("tiny-lm")


def test_missing_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ValueError, match=r"'some/model'.*pip install 'ray-trainer\[hf\]'"):
        load_hf_causal_lm("some/model")
    with pytest.raises(ValueError, match=r"pip install 'ray-trainer\[hf\]'"):
        check_model_ref("some/model")
