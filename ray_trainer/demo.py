"""Anywhere (driver, eval tasks, notebooks): the built-in demo task and tiny models, public.

`run_training()` with no `model` and no `data` trains the demo. These names let your own code
(an evaluation task, an example) rebuild the same model and data:
``build_demo().model_factory()``. ``make_tiny_causal_lm(path)`` writes a tiny random Hugging
Face GPT-2 and its tokenizer on the spot (needs ``ray-trainer[hf]``), for examples and tests
that must not download anything; ``make_tiny_chat_model(path)`` a tiny chat model (a real
tokenizer and chat template) and ``chat_conversations(n)`` conversations it learns;
``make_tool_model(path)`` one warmed up to call a ``multiply`` tool, and ``product_prompts(n)``
its GRPO prompts, for multi-turn runs with ``tools``.
"""

from ray_trainer._demo import DEMO_DEFAULTS, AdditionDataset, TinyCausalLM, build_demo, exact_match
from ray_trainer._demo.agents import make_tool_model, multiply, product_prompts
from ray_trainer._demo.chat import chat_conversations, make_tiny_chat_model
from ray_trainer._demo.tiny_hf import TINY_WORDS, make_tiny_causal_lm

__all__ = [
    "DEMO_DEFAULTS",
    "TINY_WORDS",
    "AdditionDataset",
    "TinyCausalLM",
    "build_demo",
    "chat_conversations",
    "exact_match",
    "make_tiny_causal_lm",
    "make_tiny_chat_model",
    "make_tool_model",
    "multiply",
    "product_prompts",
]
