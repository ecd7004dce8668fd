"""Runs in the generation subprocess (or in the eval task, imported): GenerationEval's generator.

A standalone package: its modules import only the standard library at module level (torch,
transformers, peft and vllm inside functions), each other by relative imports, and nothing of
``ray_trainer`` or ``callbacks``. Its root is the folder ``callbacks/builtin/generation/child/``,
which holds this package and the launcher ``run_generation_child.py`` only: any interpreter with
torch and transformers (and vllm for ``backend="vllm"``) runs ``<python>
callbacks/builtin/generation/child/run_generation_child.py``, e.g. the one
``bench/eval/vllm_env.sh`` builds; running a file puts its folder first on ``sys.path``, so the
child sees this package and nothing else of the project. The eval task imports it as
``callbacks.builtin.generation.child.generation_child`` and calls :class:`session.Session`
itself (the ``hf`` backend, no subprocess); the relative imports work under either name.

The wire (the spec is the package's test, ``tests/unit/test_generation_child.py``): one JSON
request per line on stdin, exactly one JSON response per line on stdout; EOF or
``{"op": "exit"}`` ends it. The child keeps the original stdout for the protocol and points fd 1
at stderr, so what libraries print never lands in it. Requests:

- ``{"op": "hello"}`` -> the interpreter and the versions of torch, transformers, vllm, peft.
- ``{"op": "generate", "model", "adapter", "adapter_rank", "tokenizer", "backend", "prompts",
  "max_new_tokens", "temperature", "top_p", "seed", "stop", "engine", "token_ids"}`` -> the
  answers, with ``{"ok": false, "kind": "missing_backend" | "unsupported" | "bad_rows" |
  "error", "error": ...}`` when it cannot.

- the rollout engine's ops (``rollout_start``, ``sample``, ``score``, ``begin_weights``,
  ``load_weights``, ``weights_loaded``, ``load_adapter``, and ``resume`` / ``abort`` for a
  sample paused between two decoding steps, whose pause is the one answer that is not the last
  for its request; ray-trainer's ``"vllm"`` rollout engine sends them, prompts as token ids,
  weights through ``/dev/shm``): see ``rollout``.

One Session keeps its vLLM engine warm: a model of the same shape reloads its weights in place
(and resets the prefix cache), an adapter gets a new LoRA id whenever it changes.

The modules, in the order they stand on each other: ``files`` (JSON files, folder signatures,
versions), ``request`` (a request checked, the backend picked, what vLLM cannot load),
``tokens`` (tokenizer, prompts, stops, the answer's end), ``hf`` and ``vllm_engine`` (the two
backends), ``rollout`` (the rollout engine's vLLM: sampling, scoring, weights loaded in place),
``session`` (answers requests, keeps the engine) and ``main`` (the subprocess loop).
"""
