"""The tiny chat model: saved as Hugging Face writes it, deterministic, and it learns chat data."""

from __future__ import annotations

import pytest
import torch

from ray_trainer._data.encode import Encoder
from ray_trainer._demo.chat import chat_conversations, make_tiny_chat_model
from ray_trainer._worker.step.micro_batches import collate_batch

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("style", "cls", "eos"),
    [
        ("chatml", "Qwen2ForCausalLM", "<|im_end|>"),
        ("llama3", "LlamaForCausalLM", "<|end_of_text|>"),
    ],
)
def test_saved_model_loads_with_its_template_and_tokens(tmp_path, style, cls, eos):
    path = make_tiny_chat_model(tmp_path / "m", style, generation_markers=True)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == cls and model.config.hidden_size == 64
    assert "{% generation %}" in tok.chat_template
    assert tok.eos_token == eos and tok.pad_token is not None and tok.pad_token != eos
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.vocab_size == len(tok)
    # A real BPE: any text encodes and decodes back.
    text = "Zebras eat 42 kiwis, naïvely!"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_the_same_seed_builds_the_same_files(tmp_path):
    a = make_tiny_chat_model(tmp_path / "a", "llama3")
    b = make_tiny_chat_model(tmp_path / "b", "llama3")
    for name in ("tokenizer.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_loss_on_assistant_tokens_falls(tmp_path):
    path = make_tiny_chat_model(tmp_path / "m", "chatml")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    enc = Encoder(tok, max_length=256)
    items = [
        {"input_ids": torch.tensor(e.input_ids), "labels": torch.tensor(e.labels)}
        for e in (enc.encode({"messages": c}, "messages") for c in chat_conversations(64, seed=3))
    ]
    batches = [collate_batch(items[i : i + 8], tok.pad_token_id) for i in range(0, 64, 8)]
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and steady on a busy machine
    try:
        for step in range(40):
            loss = model(**batches[step % len(batches)]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4  # from about ln(vocab) = 6.4
    assert last < 0.6 * first, (first, last)
