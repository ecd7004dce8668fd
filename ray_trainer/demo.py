"""The built-in demo task, public: a tiny causal transformer learning multi-digit addition.

`run_training()` with no `model` and no `data` trains it. These names let your own code (an
evaluation task, an example) rebuild the same model and data: ``build_demo().model_factory()``.
"""

from ray_trainer._demo import DEMO_DEFAULTS, AdditionDataset, TinyCausalLM, build_demo, exact_match

__all__ = ["DEMO_DEFAULTS", "AdditionDataset", "TinyCausalLM", "build_demo", "exact_match"]
