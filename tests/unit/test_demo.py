"""The built-in demo: tokenizer, generated addition data, the tiny transformer and exact match."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ray_trainer._demo import DEMO_DEFAULTS, build_demo
from ray_trainer._demo.addition import AdditionDataset, CharTokenizer, exact_match
from ray_trainer._demo.model import CausalLMOutput, TinyCausalLM, TinyLMConfig, generate_greedy


def tiny_model(vocab_size: int = 14, max_len: int = 16, seed: int = 0, **kw) -> TinyCausalLM:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab_size, max_len=max_len, d_model=32, n_layers=1, n_heads=2)
    return TinyCausalLM(TinyLMConfig(**{**cfg, **kw}))


class AdditionOracle(nn.Module):
    """Knows every answer: reads 'a+b=' and the digits so far, puts all its mass on the next one.

    ``offset`` makes it answer a+b+offset; ``stop=False`` makes it never emit EOS.
    """

    def __init__(self, offset: int = 0, stop: bool = True) -> None:
        super().__init__()
        self.tok = CharTokenizer()
        self.offset, self.stop = offset, stop
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, labels=None, attention_mask=None):
        b, t = input_ids.shape
        logits = torch.zeros(b, t, self.tok.vocab_size)
        for i in range(b):
            for j in range(t):
                text = self.tok.decode(input_ids[i, : j + 1])
                if "=" not in text:
                    continue
                question, done = text.split("=")
                a, c = question.split("+")
                target = str(int(a) + int(c) + self.offset)
                if len(done) < len(target):
                    nxt = self.tok.encode(target[len(done)])[0]
                else:
                    nxt = self.tok.eos_id if self.stop else self.tok.encode("7")[0]
                logits[i, j, nxt] = 10.0
        return CausalLMOutput(loss=None, logits=logits)


# ---- tokenizer ---------------------------------------------------------------------------


def test_char_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    ids = tok.encode("907+15=922", add_eos=True)
    assert ids[-1] == tok.eos_id and tok.pad_id not in ids
    assert tok.decode(ids) == "907+15=922"
    assert tok.decode([tok.pad_id, *ids], skip_special_tokens=False) == "<pad>907+15=922<eos>"
    assert tok.vocab_size == 14
    assert max(tok.encode("0123456789+=")) == tok.vocab_size - 1
    assert len(set(tok.encode("0123456789+=")) | {tok.pad_id, tok.eos_id}) == tok.vocab_size


def test_char_tokenizer_rejects_unknown_characters():
    with pytest.raises(ValueError, match=r"cannot encode '-'"):
        CharTokenizer().encode("3-1=2")


# ---- dataset -----------------------------------------------------------------------------


def test_dataset_is_deterministic_and_seeded():
    a = AdditionDataset(300, digits=3, seed=5)
    b = AdditionDataset(300, digits=3, seed=5)
    c = AdditionDataset(300, digits=3, seed=6)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert a.pairs == b.pairs
    assert a.pairs != c.pairs


def test_train_and_val_share_no_pair_whatever_the_seeds():
    train = set(AdditionDataset(3000, digits=2, seed=0, split="train").pairs)
    val = set(AdditionDataset(500, digits=2, seed=1, split="val").pairs)
    assert len(val) > 50 and len(train) > 1000
    assert not train & val


def test_items_mask_prompt_and_padding_and_end_with_eos():
    ds = AdditionDataset(200, digits=3, seed=0, split="val")
    tok = ds.tokenizer
    assert ds.input_ids.shape == ds.labels.shape == (200, 3 * 3 + 4)
    for i in range(len(ds)):
        item = ds[i]
        ids, labels = item["input_ids"], item["labels"]
        n_prompt, n_answer = len(ds.prompt(i)), len(ds.answer(i)) + 1
        assert tok.decode(ids) == ds.prompt(i) + ds.answer(i)
        assert (labels[:n_prompt] == -100).all()
        assert torch.equal(
            labels[n_prompt : n_prompt + n_answer], ids[n_prompt : n_prompt + n_answer]
        )
        assert labels[n_prompt + n_answer - 1] == tok.eos_id
        assert (labels[n_prompt + n_answer :] == -100).all()
        assert (ids[n_prompt + n_answer :] == tok.pad_id).all()
        a, b = ds.pairs[i]
        assert int(ds.answer(i)) == a + b


def test_operand_lengths_vary_up_to_digits():
    ds = AdditionDataset(400, digits=3, seed=0)
    lengths = {len(str(a)) for a, _ in ds.pairs} | {len(str(b)) for _, b in ds.pairs}
    assert lengths == {1, 2, 3}


def test_dataset_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        AdditionDataset(10, split="test")
    with pytest.raises(ValueError, match="digits"):
        AdditionDataset(10, digits=0)


# ---- model -------------------------------------------------------------------------------


def test_forward_shapes_and_loss_only_with_labels():
    model = tiny_model()
    ids = torch.randint(2, 14, (3, 10))
    out = model(ids)
    assert out.logits.shape == (3, 10, 14) and out.loss is None
    out = model(ids, labels=ids)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    # A freshly initialised model is close to uniform: loss near log(vocab).
    assert abs(out.loss.item() - torch.log(torch.tensor(14.0)).item()) < 0.5


def test_loss_shifts_labels_like_hf():
    model = tiny_model()
    ids = torch.randint(2, 14, (2, 6))
    logits = model(ids).logits
    expected = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 14), ids[:, 1:].reshape(-1))
    assert torch.allclose(model(ids, labels=ids).loss, expected, atol=1e-6)


def test_all_masked_labels_give_zero_loss_not_nan():
    model = tiny_model()
    ids = torch.randint(2, 14, (2, 6))
    loss = model(ids, labels=torch.full_like(ids, -100)).loss
    assert loss.item() == 0.0
    loss.backward()  # still differentiable


def test_init_is_deterministic_from_torch_seed_and_head_is_tied():
    a, b, c = tiny_model(seed=1), tiny_model(seed=1), tiny_model(seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)
    assert a.head.weight is a.tok_emb.weight
    assert tiny_model(tie_weights=False).head.weight is not tiny_model().tok_emb.weight


def test_causal_attention_ignores_the_future_and_right_padding():
    model = tiny_model().eval()
    ids = torch.randint(2, 14, (1, 8))
    changed = ids.clone()
    changed[0, 5:] = 3
    assert torch.allclose(model(ids).logits[:, :5], model(changed).logits[:, :5], atol=1e-6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    assert torch.allclose(model(ids, attention_mask=mask).logits, model(ids).logits, atol=1e-6)


def test_attention_mask_hides_inner_padding():
    model = tiny_model().eval()
    ids = torch.randint(2, 14, (1, 6))
    other = ids.clone()
    other[0, 2] = 0 if ids[0, 2] != 0 else 1
    mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
    out_a = model(ids, attention_mask=mask).logits
    out_b = model(other, attention_mask=mask).logits
    assert torch.isfinite(out_a).all()
    assert torch.allclose(out_a[:, 3:], out_b[:, 3:], atol=1e-6)
    assert not torch.allclose(model(ids).logits[:, 3:], model(other).logits[:, 3:], atol=1e-6)


def test_too_long_input_names_max_len():
    with pytest.raises(ValueError, match="max_len=16"):
        tiny_model()(torch.zeros(1, 17, dtype=torch.long))


def test_config_validation_explains_the_fix():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        TinyLMConfig(d_model=30, n_heads=4)


UNTIED = {"tie_weights": False, "n_layers": 3, "mlp_ratio": 2, "d_model": 48, "n_heads": 3}


@pytest.mark.parametrize("shape", [{}, {**UNTIED, "vocab_size": 300, "max_len": 77}])
def test_parameter_count_is_the_built_models_without_building_it(shape):
    """What the driver's size check counts (issue 74, point 4): the module's own parameters
    (a tied head counted once)."""
    config = TinyLMConfig(**shape)
    assert config.parameter_count() == sum(p.numel() for p in TinyCausalLM(config).parameters())


def test_backward_and_a_tiny_overfit_lower_the_loss():
    ds = AdditionDataset(32, digits=2, seed=0)
    model = tiny_model(max_len=ds.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = [ds.input_ids[:16], ds.input_ids[16:]], [ds.labels[:16], ds.labels[16:]]
    losses = []
    for step in range(60):
        ids, labels = batches[0][step % 2], batches[1][step % 2]
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4


# ---- decoding and exact match --------------------------------------------------------------


def test_generate_greedy_follows_the_model_and_stops_at_eos():
    tok = CharTokenizer()
    prompts = ["12+3=", "999+1="]
    width = max(map(len, prompts))
    ids = torch.tensor([tok.encode(p) + [tok.pad_id] * (width - len(p)) for p in prompts])
    out = generate_greedy(
        AdditionOracle(),
        ids,
        max_new_tokens=6,
        eos_id=tok.eos_id,
        prompt_lengths=[len(p) for p in prompts],
    )
    assert [tok.decode(o) for o in out] == ["15", "1000"]
    capped = generate_greedy(AdditionOracle(stop=False), ids, 3, tok.eos_id, [5, 6])
    assert [len(o) for o in capped] == [3, 3]


def test_exact_match_is_one_for_an_oracle_and_zero_for_wrong_answers():
    ds = AdditionDataset(60, digits=3, seed=0, split="val")
    assert exact_match(AdditionOracle(), ds, batch_size=16) == 1.0
    assert exact_match(AdditionOracle(offset=1), ds, batch_size=16) == 0.0
    # Right digits but never stopping is wrong too.
    assert exact_match(AdditionOracle(stop=False), ds, batch_size=16) == 0.0


def test_exact_match_of_an_untrained_model_is_near_zero_and_restores_mode():
    ds = AdditionDataset(200, digits=3, seed=0, split="val")
    model = tiny_model(max_len=ds.seq_len).train()
    assert exact_match(model, ds, n=200, batch_size=64) < 0.05
    assert model.training
    model.eval()
    exact_match(model, ds, n=10)
    assert not model.training


# ---- build_demo ------------------------------------------------------------------------------


def test_demo_defaults_carry_the_training_settings():
    for key in ("batch_size", "learning_rate", "warmup_steps", "max_steps", "digits", "d_model"):
        assert key in DEMO_DEFAULTS
    assert DEMO_DEFAULTS["warmup_steps"] < DEMO_DEFAULTS["max_steps"]


def test_build_demo_applies_overrides_and_builds_fresh_models():
    demo = build_demo(digits=2, n_train=256, n_val=64, d_model=32, n_heads=2, eval_samples=32)
    assert len(demo.train_dataset) == 256 and len(demo.val_dataset) == 64
    assert demo.model_config.max_len == demo.train_dataset.seq_len == 10
    assert demo.model_config.vocab_size == demo.tokenizer.vocab_size
    m1, m2 = demo.model_factory(), demo.model_factory()
    assert m1 is not m2 and m1.tok_emb.weight.shape == (14, 32)
    metrics = demo.eval_fn(m1)
    assert set(metrics) == {"exact_match"} and 0.0 <= metrics["exact_match"] <= 0.1
    assert not set(demo.train_dataset.pairs) & set(demo.val_dataset.pairs)


def test_build_demo_rejects_unknown_and_training_keys():
    with pytest.raises(ValueError, match="did you mean 'digits'"):
        build_demo(digit=2)
    with pytest.raises(ValueError, match=r"TrainingArgs\.max_steps"):
        build_demo(max_steps=10)
