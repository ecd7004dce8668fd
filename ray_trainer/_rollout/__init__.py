"""Every process of an online-RL run: the rollout side of GRPO (engines, weight sync, rewards).

The rollout engines live here behind one seam (``engines.py``: a registry of backends, ``"hf"``
and ``"vllm"``), with the weights they receive (``weights.py``, ``transport.py``; ``shm.py``: how
they reach vLLM's child through shared memory), the check that they
hold the trainer's weights (``probe.py``), the Ray actor that hosts one (``actor.py``), the
rollout queue's actor of an asynchronous run (``buffer.py``, its logic ``queue.py``), the
record both sides use (``types.py``), and the reward functions, run as Ray tasks, whose rewards
become group advantages (``rewards.py``). Nothing here imports a process room (``_worker``,
``_actor``, ``_driver``). See docs/rl.md, "Rollout engines".
"""
