"""Every process of an online-RL run: the rollout side of GRPO (engines, weight sync, rewards).

The rollout engines live here behind one seam (``engines.py``: a registry of backends, ``"hf"``
now), with the weights they receive (``weights.py``, ``transport.py``), the check that they
hold the trainer's weights (``probe.py``), the Ray actor that hosts one (``actor.py``), and the
record both sides use (``types.py``). Nothing here imports a process room (``_worker``,
``_actor``, ``_driver``). See docs/rl.md, "Rollout engines".
"""
