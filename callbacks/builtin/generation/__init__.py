"""Runs in the eval task (built in the driver): ``GenerationEval`` and the generation child.

``eval`` holds ``GenerationEval`` (users import it from ``callbacks``), standing on ``prompts``
(the rows to ask, from a list or a data file), ``samples`` (every answer kept beside the
checkpoint) and ``process`` (the child run as a subprocess, spoken to in JSON lines). ``child/``
is the folder the child's interpreter gets on its path: the ``generation_child`` package, which
imports nothing of ``callbacks`` or ``ray_trainer``, so that a vLLM environment without
ray-trainer runs it, and its launcher. This ``__init__`` imports nothing: ``lm_eval`` stands on
``child`` and ``process`` while ``eval`` stands on ``lm_eval``.
"""
