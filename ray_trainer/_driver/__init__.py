"""The driver: runs in the process that calls ``run_training`` (a user's script, ``ray-trainer
run``, or a Ray job's entrypoint), and in the ``ray-trainer status``/``submit`` commands.

``checks`` validates a run before any Ray resource is taken, ``launch`` starts Ray, the callback
actor and the Ray Train workers, ``result`` turns the actor's summary into ``TrainingResult``,
``status`` and ``submit`` work with runs on a cluster. Nothing here imports
``ray_trainer._worker``: the workers are reached through ``_contract.train_loop_per_worker``.
"""
