"""Every process that takes part in online RL: rollouts, their rewards, and what they produce.

A package shared by the driver, the rollout engines' actors and the reward tasks; import each
name from the module that defines it (``rewards``: the reward functions, their rewards and the
advantages). It holds no code of its own, so the modules beside each other import nothing here.
"""
