"""Every process of an online-RL run: the rollout side of GRPO (engines, weight sync, rewards).

The rollout engines live here behind one seam (``engines.py``: a registry of backends, ``"hf"``
now), with the weights they receive (``weights.py``, ``transport.py``), the check that they
hold the trainer's weights (``probe.py``), the Ray actor that hosts one (``actor.py``), the
record both sides use (``types.py``), and the reward functions, run as Ray tasks, whose rewards
become group advantages (``rewards.py``). Nothing here imports a process room (``_worker``,
``_actor``, ``_driver``). See docs/rl.md, "Rollout engines".
"""
