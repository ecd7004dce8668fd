"""The chunked loss on Hugging Face causal LMs (`use_chunked_loss`): the same loss and gradients
as the model's own full-logits loss (fp32: 1e-6 of the norm), padded and packed rows, tied
embeddings (GPT-2), LoRA on ``lm_head`` (peft); a micro-batch with no target still reaches
every parameter; the families it does not know, and logit softcapping, keep the model's own."""

from __future__ import annotations

import copy

import pytest
import torch

from ray_trainer._worker.model.chunked_loss import IGNORE_INDEX, chunked_body, use_chunked_loss

transformers = pytest.importorskip("transformers")
VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def _model(kind: str, **extra):
    torch.manual_seed(0)
    if kind == "gpt2":  # tied embeddings: lm_head is the input embedding
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                         n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, **extra)  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    return model_cls(config_cls(**COMMON, attn_implementation="sdpa", **extra))


def _rows(seed=0):
    """Two padded rows (the second shorter), and the same samples packed in one row."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(0, VOCAB, (20,), generator=g), torch.randint(0, VOCAB, (13,), generator=g)
    la, lb = a.clone(), b.clone()
    la[:8] = IGNORE_INDEX  # a prompt that takes no loss
    lb[:5] = IGNORE_INDEX
    pad = torch.zeros(7, dtype=torch.long)
    padded = {
        "input_ids": torch.stack([a, torch.cat([b, pad])]),
        "attention_mask": torch.stack([torch.ones(20), torch.cat([torch.ones(13), pad])]).long(),
        "labels": torch.stack([la, torch.cat([lb, pad + IGNORE_INDEX])]),
    }
    packed = {
        "input_ids": torch.cat([a, b])[None],
        "position_ids": torch.cat([torch.arange(20), torch.arange(13)])[None],
        "labels": torch.cat([la, lb])[None],
        # transformers keeps packed samples apart by their position_ids only without a cache
        # (the config's use_cache=True mixes them); the chunked path never makes one.
        "use_cache": False,
    }
    return padded, packed


def _loss_and_grads(model, batch):
    model.zero_grad()
    targets = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())  # as the loader counts
    out = model(**batch, num_items_in_batch=float(max(targets, 1)))
    loss = out["loss"] if isinstance(out, dict) else out.loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _within(got, want, tol=1e-6):
    return (got - want).norm() <= tol * want.norm() + 1e-12


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_loss_and_every_gradient_equal_the_models_own(kind, layout):
    own = _model(kind)
    chunked = copy.deepcopy(own)
    assert use_chunked_loss(chunked, 5) is None
    padded, packed = _rows()
    batch = padded if layout == "padded" else packed
    if kind == "gpt2" and layout == "packed":  # GPT-2's attention keeps no packed rows apart
        batch = {k: v for k, v in batch.items() if k not in ("position_ids", "use_cache")}
    want_loss, want = _loss_and_grads(own, batch)
    got_loss, got = _loss_and_grads(chunked, batch)
    assert _within(got_loss, want_loss)
    assert set(got) == set(want)
    for name in want:
        assert _within(got[name], want[name]), name
    # Without labels (generation, the packing check) it is the model's own forward: logits.
    assert chunked(input_ids=batch["input_ids"]).logits.shape[-1] == VOCAB


def test_lora_on_the_head_trains_the_same():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    own = peft.get_peft_model(_model("llama"), config)
    chunked = copy.deepcopy(own)
    assert use_chunked_loss(chunked, 7) is None
    batch = _rows(seed=1)[0]
    want_loss, want = _loss_and_grads(own, batch)
    got_loss, got = _loss_and_grads(chunked, batch)
    assert _within(got_loss, want_loss)
    assert any("lm_head.lora_A" in n for n in want)  # the head's adapter has a gradient
    assert set(got) == set(want)
    for name in want:
        assert _within(got[name], want[name]), name


def test_a_micro_batch_with_no_target_reaches_every_parameter_with_zero():
    model = _model("qwen2")
    assert use_chunked_loss(model, 4) is None
    batch = _rows()[0]
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)  # a rank's filler
    loss, grads = _loss_and_grads(model, batch)
    assert loss.item() == 0.0
    assert set(grads) == {n for n, _ in model.named_parameters()}
    assert not any(g.any() for g in grads.values())


def test_models_it_does_not_know_keep_their_own_loss():
    capped = _model("llama")
    capped.config.final_logit_softcapping = 30.0  # as Gemma 2 sets it
    assert "final_logit_softcapping" in use_chunked_loss(capped, 4)
    torch.manual_seed(0)
    neox_config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4,
    )  # fmt: skip
    neox = transformers.GPTNeoXForCausalLM(neox_config)
    reason = use_chunked_loss(neox, 4)
    assert "'gpt_neox' is not one checked" in reason and "llama" in reason
    assert "forward" not in vars(neox) and chunked_body(neox) is None  # left as it was


def test_compile_takes_the_body_of_a_chunked_model():
    model = _model("llama")
    assert chunked_body(model) is None
    use_chunked_loss(model, None)
    assert chunked_body(model) is model.model
    assert model._ray_trainer_chunk_size is None  # the default, sized on the device at each call
    # A copy of the model computes with its own weights, not the original's.
    copied = copy.deepcopy(model)
    assert copied.forward.__self__ is copied
    with torch.no_grad():
        copied.lm_head.weight.mul_(2.0)
    batch = _rows()[0]
    assert copied(**batch)["loss"] != model(**batch)["loss"]


def test_a_compiled_body_gives_the_eager_loss_and_gradients():
    """What `compile=True` does under DDP with the chunked loss (`parallel._compile`): the body
    compiled (dynamo's tracing; the eager backend keeps the test fast), the chunk loop eager."""
    eager = _model("llama")
    assert use_chunked_loss(eager, 5) is None
    compiled = copy.deepcopy(eager)
    chunked_body(compiled).compile(backend="eager", dynamic=False)
    batch = _rows(seed=2)[0]
    want_loss, want = _loss_and_grads(eager, batch)
    got_loss, got = _loss_and_grads(compiled, batch)
    assert _within(got_loss, want_loss)
    for name in want:
        assert _within(got[name], want[name]), name
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "name",
    ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
     "Phi3ForCausalLM", "GPT2LMHeadModel"],
)  # fmt: skip
def test_each_listed_family_still_computes_its_logits_as_the_heads_projection(name):
    """The allow-list holds against the installed transformers: the forward of each family
    calls its head on the hidden states and changes the logits no further."""
    import inspect

    from ray_trainer._worker.model.chunked_loss import CHUNKED_FAMILIES

    cls = getattr(transformers, name)
    assert cls.config_class.model_type in CHUNKED_FAMILIES
    source = inspect.getsource(cls.forward)
    body = source[source.rindex('"""') :]  # after the docstring
    assert "self.lm_head(hidden_states" in body
    for word in ("softcap", "logit_scale", "logits_scaling", "aux_loss", "router"):
        assert word not in body, word
