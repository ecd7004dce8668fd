"""The driver: runs in the process that calls ``run_training`` (a user's script, ``ray-trainer
run``, or a Ray job's entrypoint), and in the ``ray-trainer status``/``submit`` commands.

``checks`` validates a run before any Ray resource is taken, ``launch`` starts Ray, the callback
actor and the Ray Train workers, ``result`` turns the actor's summary into ``TrainingResult``,
``status`` and ``submit`` work with runs on a cluster. Of ``ray_trainer._worker`` the driver
imports only its door, ``_worker/entry.py``, which imports the loop inside the worker process.
"""
