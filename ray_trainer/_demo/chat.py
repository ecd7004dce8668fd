"""Anywhere (examples, tests, benchmarks): a tiny chat model with a real tokenizer and template.

:func:`make_tiny_chat_model` saves, as ``save_pretrained`` writes them, a small randomly
initialised Hugging Face causal LM and a real fast tokenizer (byte-level BPE trained on the spot
on a generated English corpus) with the special tokens and a chat template of one of two styles:
ChatML (``<|im_start|>``/``<|im_end|>``, as Qwen uses; a ``Qwen2ForCausalLM``) or Llama 3 (header
tokens and ``<|eot_id|>``; a ``LlamaForCausalLM``). Nothing is downloaded. The templates are
ours, written for these tests; :data:`REASONING_TEMPLATE` is a Qwen3-like one that shows an
assistant's reasoning only on the turns after the last user message.
:func:`chat_conversations` generates conversations a tiny model can learn (its loss falls).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

STYLES = ("chatml", "llama3")
_GEN, _END_GEN = "{% generation %}", "{% endgeneration %}"

# ChatML: a system block (with the tools' schemas when given), then one block per message.
_CHATML = """\
{%- set sys = messages[0].content if messages and messages[0].role == 'system' else '' %}
{%- if tools %}
{{- '<|im_start|>system\\n' + (sys + '\\n\\n' if sys else '') + 'You may call these tools:' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif sys %}
{{- '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}@GEN@{{- message.content or '' }}
{%- for call in message.tool_calls or [] %}
{{- '<tool_call>' + (call.function | tojson) + '</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>' }}@END@{{- '\\n' }}
{%- elif not (loop.first and message.role == 'system') %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Llama 3: BOS, then a header and the trimmed content of each message, each ended by <|eot_id|>.
_LLAMA3 = """\
{{- bos_token }}
{%- set sys = messages[0].content | trim if messages and messages[0].role == 'system' else '' %}
{%- if tools or sys %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + sys }}
{%- if tools %}
{{- ('\\n\\n' if sys else '') + 'Tools (answer with a JSON call):' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}@GEN@{{- (message.content or '') | trim }}
{%- for call in message.tool_calls or [] %}{{- call.function | tojson }}{%- endfor %}
{{- '<|eot_id|>' }}@END@
{%- elif not (loop.first and message.role == 'system') %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
{{- (message.content | trim) + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

#: A Qwen3-like ChatML template: an assistant message's reasoning (``reasoning_content``, or a
#: ``<think>...</think>`` block leading its content) is shown only on the turns after the last
#: user message, and dropped from earlier ones, so that a conversation's rendering is not the
#: rendering of its first turns followed by the rest.
REASONING_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- set reasoning = message.reasoning_content or '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1] %}
{%- endif %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_user and reasoning | trim %}
{{- '<think>\\n' + (reasoning | trim) + '\\n</think>\\n\\n' }}
{%- endif %}
{{- (content | trim) + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def chat_template(style: str = "chatml", generation_markers: bool = False) -> str:
    """Our chat template of ``style`` ("chatml" or "llama3"), with its assistant text inside
    ``{% generation %}`` blocks if ``generation_markers``."""
    text = {"chatml": _CHATML, "llama3": _LLAMA3}[_check_style(style)]
    gen, end = (_GEN, _END_GEN) if generation_markers else ("", "")
    return text.replace("@GEN@", gen).replace("@END@", end)


# The special tokens of each style: (all in id order, bos, eos, pad).
_SPECIALS: dict[str, tuple[list[str], str | None, str, str]] = {
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>"),
    "llama3": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
         "<|eot_id|>", "<|finetune_right_pad_id|>"],
        "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>",
    ),
}  # fmt: skip


def make_tiny_chat_model(
    path: str | os.PathLike[str],
    style: str = "chatml",
    generation_markers: bool = False,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Save a tiny randomly initialised chat model, its tokenizer and chat template to ``path``
    (as ``save_pretrained`` writes them) and return ``path``. Nothing is downloaded; the tokenizer
    trains in about 0.1 s and the whole takes well under a second once transformers is imported.
    Deterministic for a given ``seed``: the same files byte for byte.

    ``style="chatml"``: a ``Qwen2ForCausalLM``; EOS is ``<|im_end|>`` (the end of a turn, as in
    Qwen's instruct models), pad ``<|endoftext|>``. ``style="llama3"``: a ``LlamaForCausalLM``;
    BOS ``<|begin_of_text|>``, EOS ``<|end_of_text|>`` (as in base Llama 3 checkpoints, so
    generation stops at ``<|eot_id|>`` only if the generation config lists it), pad
    ``<|finetune_right_pad_id|>``. The tokenizer is a byte-level BPE with ``vocab_size``
    entries, so any text encodes.

    Example:
        >>> path = make_tiny_chat_model("runs/tiny-chat", style="llama3")  # doctest: +SKIP
        >>> run_training(model=str(path), data="chat.jsonl")  # doctest: +SKIP
    """
    import torch
    import transformers

    style = _check_style(style)
    tokenizer = make_tiny_chat_tokenizer(
        style, generation_markers, vocab_size=vocab_size, seed=seed
    )
    ids = {
        f"{kind}_token_id": tokenizer.convert_tokens_to_ids(tok) if tok else None
        for kind, tok in zip(("bos", "eos", "pad"), _SPECIALS[style][1:], strict=True)
    }
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        **ids,
    )
    if style == "chatml":
        config: Any = transformers.Qwen2Config(**common)
        model_cls: Any = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    path = Path(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model_cls(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_chat_tokenizer(
    style: str = "chatml",
    generation_markers: bool = False,
    *,
    vocab_size: int = 1024,
    seed: int = 0,
) -> Any:
    """The tokenizer of :func:`make_tiny_chat_model`, in memory (nothing written): a byte-level
    BPE fast tokenizer trained on a generated corpus, with the style's special tokens and chat
    template. About 0.1 s; deterministic for a given ``seed``."""
    tokenizer = _train_tokenizer(_check_style(style), vocab_size, seed)
    tokenizer.chat_template = chat_template(style, generation_markers)
    return tokenizer


def _check_style(style: str) -> str:
    if style not in STYLES:
        raise ValueError(f"unknown chat style {style!r}; choose one of {', '.join(STYLES)}")
    return style


def _train_tokenizer(style: str, vocab_size: int, seed: int) -> Any:
    """A byte-level BPE fast tokenizer trained on a generated corpus, with the style's tokens."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials, bos, eos, pad = _SPECIALS[style]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(seed)
    corpus = [_sentence(rng) for _ in range(3000)]
    corpus += [f"{m['role']}\n{m['content']}" for c in chat_conversations(300, seed) for m in c]
    backend.train_from_iterator(corpus, trainer)
    named = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    others = [t for t in specials if t not in named.values()]
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        additional_special_tokens=others,
        **{k: v for k, v in named.items() if v is not None},
    )


# -- generated conversations ----------------------------------------------------------------------

_THINGS = (
    "sky", "grass", "sun", "snow", "night", "rose", "lemon", "sea", "coal", "cloud",
    "leaf", "fire", "milk", "plum", "sand", "ice",
)  # fmt: skip
_COLORS = ("blue", "green", "yellow", "white", "black", "red", "orange", "gray", "purple", "brown")
_OPPOSITES = (
    ("big", "small"), ("hot", "cold"), ("up", "down"), ("fast", "slow"), ("old", "new"),
    ("early", "late"), ("happy", "sad"), ("light", "dark"), ("open", "closed"), ("full", "empty"),
)  # fmt: skip
_WORDS = (
    "the", "a", "cat", "dog", "sat", "ran", "on", "mat", "home", "what", "is", "it", "you", "we",
    "they", "how", "why", "when", "where", "please", "thanks", "hello", "answer", "question",
    "tell", "me", "about", "weather", "today", "good", "bad", "river", "tree", "house", "book",
    "reads", "walks", "sings", "finds", "keeps", "near", "under", "after", "before", "every",
)  # fmt: skip
_SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a kind teacher.")


def chat_conversations(n: int, seed: int = 0, max_exchanges: int = 3) -> list[list[dict]]:
    """``n`` generated conversations (lists of ``{"role", "content"}`` messages): an optional
    system message, then 1 to ``max_exchanges`` user questions each answered by the assistant.
    The answers follow fixed rules a tiny model learns (colours of things, opposites, echoing a
    phrase), so the loss on the assistant's tokens falls well below that of a random model."""
    rng = random.Random(seed)
    colors = {t: _COLORS[(i * 7 + seed) % len(_COLORS)] for i, t in enumerate(_THINGS)}
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": rng.choice(_SYSTEMS)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, max_exchanges)):
            kind = rng.randrange(3)
            if kind == 0:
                thing = rng.choice(_THINGS)
                q, a = f"What color is the {thing}?", f"The {thing} is {colors[thing]}."
            elif kind == 1:
                word, opposite = rng.choice(_OPPOSITES)[:: rng.choice((1, -1))]
                q, a = f"What is the opposite of {word}?", f"The opposite of {word} is {opposite}."
            else:
                phrase = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 8)))
                q, a = f"Repeat after me: {phrase}", f"{phrase[0].upper()}{phrase[1:]}."
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append(msgs)
    return out


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    return " ".join(words).capitalize() + rng.choice((".", "?", "!"))
