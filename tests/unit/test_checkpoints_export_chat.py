"""After chat training, the generation config exported into `hf/` stops at the end of an
assistant turn: its end-of-sequence ids are the base's plus the template's end-of-turn token
(Llama 3 base checkpoints end sequences with <|end_of_text|>, turns with <|eot_id|>)."""

from __future__ import annotations

import pytest

from ray_trainer._data.template import end_of_turn_ids
from ray_trainer._demo.chat import make_tiny_chat_model
from ray_trainer._worker.checkpoints.export import generation_config as _generation_config


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    import transformers

    path = make_tiny_chat_model(tmp_path_factory.mktemp("llama") / "m", style="llama3")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return model, transformers.AutoTokenizer.from_pretrained(path)


def test_the_generation_config_adds_the_end_of_turn_token(llama, tmp_path):
    from transformers import GenerationConfig

    model, tok = llama
    eos, eot = tok.convert_tokens_to_ids("<|end_of_text|>"), tok.convert_tokens_to_ids("<|eot_id|>")
    assert model.generation_config.eos_token_id == eos  # the base stops at the end of text only
    config = _generation_config(model, end_of_turn_ids(tok, tok.chat_template))
    config.save_pretrained(tmp_path)
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == [eos, eot]
    assert model.generation_config.eos_token_id == eos  # the live model's config is untouched


def test_without_chat_data_the_generation_config_is_the_models(llama):
    model, _ = llama
    config = _generation_config(model, None)
    assert config.eos_token_id == model.generation_config.eos_token_id
    assert config is not model.generation_config
