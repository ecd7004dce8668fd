"""The generation child on the real vLLM engine (`make test-vllm`), against the hf backend.

Each test runs one child under the vLLM env's python (RAY_TRAINER_VLLM_PYTHON) and talks the
wire protocol to it; the hf answers come from the same child (backend="hf"). Two engines start
in all (about a minute each on 2 cores): one plain, one with LoRA enabled.
"""

from __future__ import annotations

from pathlib import Path

#: Every vLLM engine start costs about a minute on 2 cores: the tests keep the count at two.
ENGINE = {
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 256 << 20,  # else vLLM takes most of the machine's memory
    "max_model_len": 256,
}

SHORT = [
    {"text": "the cat sat on the mat"},
    {"messages": [{"role": "user", "content": "what is the sky?"}]},
    {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "tell me about the river"},
        ]
    },
]
# Longer than one KV block (128 tokens on CPU), so a stale prefix cache would be hit.
LONG = {"text": "the dog ran home and the cat sat on the mat near the house " * 12}
PROMPTS = [*SHORT, LONG]


def _generate(model, backend="vllm", **fields) -> dict:
    return {"op": "generate", "model": str(model), "backend": backend, "prompts": PROMPTS,
            "max_new_tokens": 8, "token_ids": True, "engine": ENGINE, **fields}  # fmt: skip


def _ok(response: dict) -> dict:
    assert response["ok"], response
    return response


def _same_answers(one: dict, other: dict) -> None:
    """Token-identical answers (and so the same text, lengths and finish reasons)."""
    for key in ("answer_ids", "answers", "prompt_tokens", "answer_tokens", "finish_reasons"):
        assert one[key] == other[key], key


def _eot_model(models, out: Path) -> Path:
    """c0 with the lm_head rows of its 3rd greedy chat answer token and <|eot_id|> swapped: it
    says <|eot_id|> there, so the answer must stop after 2 tokens (a same-shape checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["c0"])
    model = AutoModelForCausalLM.from_pretrained(models["c0"]).eval()
    text = tokenizer.apply_chat_template(SHORT[1]["messages"], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        out_ids = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                 do_sample=False, eos_token_id=None, pad_token_id=None)  # fmt: skip
    third = out_ids[0, -1].item()
    assert third not in out_ids[0, -3:-1].tolist()
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    with torch.no_grad():
        rows = model.lm_head.weight
        rows[[third, eot]] = rows[[eot, third]]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_parity_and_a_warm_engine_across_checkpoints(child, models, tmp_path):
    hello = _ok(child.ask({"op": "hello"}))
    assert hello["versions"]["vllm"] and hello["versions"]["vllm"].startswith("0.32")
    eot = _eot_model(models, tmp_path / "eot")
    checkpoints = [models["c0"], models["c1"], models["c2"], eot]
    hf = [_ok(child.ask(_generate(c, backend="hf"))) for c in checkpoints]
    assert len({str(r["answer_ids"]) for r in hf}) == 4  # each checkpoint answers its own way
    assert hf[0]["prompt_tokens"][-1] > 128

    cold = _ok(child.ask(_generate(models["c0"])))
    assert cold["backend"] == "vllm" and cold["engine"]["reused"] is False
    _same_answers(cold, hf[0])  # parity: text and chat prompts, token for token
    print(f"vLLM engine start + first answers: {cold['seconds']['load']:.1f} s")

    again = _ok(child.ask(_generate(models["c0"])))  # same weights: the prefix cache is live
    assert again["engine"]["reused"] is True and again["engine"]["prefix_cache_reset"] is False
    assert again["engine"]["cached_prompt_tokens"] >= 128
    _same_answers(again, hf[0])

    for checkpoint, expected in zip(checkpoints[1:], hf[1:], strict=True):
        warm = _ok(child.ask(_generate(checkpoint)))
        assert warm["engine"]["reused"] is True and warm["engine"]["prefix_cache_reset"] is True
        assert warm["engine"]["cached_prompt_tokens"] == 0  # nothing from the old weights
        assert warm["seconds"]["load"] < 30  # a reload, not a new engine
        _same_answers(warm, expected)
    # The eot checkpoint stops at the chat template's end of turn, not at EOS or the length.
    assert hf[3]["answer_tokens"][1] == 2 and hf[3]["finish_reasons"][1] == "stop"


def test_lora_adapters_unmerged_equal_their_merged_exports(child, models):
    base = _ok(child.ask(_generate(models["c0"], backend="hf")))
    merged = {
        n: _ok(child.ask(_generate(models[f"{n}_merged"], backend="hf"))) for n in ("a1", "a2")
    }
    hf_unmerged = _ok(child.ask(_generate(models["c0"], backend="hf", adapter=str(models["a1"]))))
    _same_answers(hf_unmerged, merged["a1"])
    assert merged["a1"]["answer_ids"] != merged["a2"]["answer_ids"] != base["answer_ids"]

    ids = []
    for name in ("a1", "a2"):  # two adapters in a row on one warm engine
        vllm = _ok(child.ask(_generate(models["c0"], adapter=str(models[name]), adapter_rank=8)))
        assert vllm["backend"] == "vllm" and vllm["engine"]["reused"] is (name == "a2")
        _same_answers(vllm, merged[name])
        ids.append(vllm["engine"]["lora_id"])
    assert ids == [1, 2]

    # The merged export on the same (LoRA-enabled) engine: its weights loaded in place.
    export = _ok(child.ask(_generate(models["a1_merged"])))
    assert export["engine"]["reused"] is True and export["engine"]["prefix_cache_reset"] is True
    assert export["engine"]["lora_id"] is None
    _same_answers(export, merged["a1"])
    # Back to the base with an adapter: the base weights come back, the adapter gets a new id.
    back = _ok(child.ask(_generate(models["c0"], adapter=str(models["a1"]))))
    assert back["engine"]["prefix_cache_reset"] is True and back["engine"]["lora_id"] == 3
    _same_answers(back, merged["a1"])


def test_what_vllm_cannot_load_is_unsupported_and_auto_falls_back(child, models):
    cases = {
        "no LoRA support": _generate(models["gpt2"], adapter=str(models["gpt2_lora"])),
        "no transformers config.json": _generate(models["plain"]),
        "modules_to_save": _generate(models["c0"], adapter=str(models["saving"])),
    }
    for words, request in cases.items():
        response = child.ask({**request, "prompts": SHORT[:1]})
        assert response["ok"] is False and response["kind"] == "unsupported", response
        assert words in response["error"]
    gpt2 = {"adapter": str(models["gpt2_lora"]), "prompts": SHORT[:1]}
    auto = _ok(child.ask(_generate(models["gpt2"], backend="auto", **gpt2)))
    assert auto["backend"] == "hf" and "no LoRA support" in auto["fallback"]
    _same_answers(auto, _ok(child.ask(_generate(models["gpt2"], backend="hf", **gpt2))))
    assert auto["answer_tokens"] != [0]
