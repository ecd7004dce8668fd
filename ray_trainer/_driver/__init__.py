"""The driver: runs in the process that calls ``run_training`` (a user's script, ``ray-trainer
run``, or a Ray job's entrypoint).

``checks`` (with ``lora_checks``) validates a run before any Ray resource is taken, ``launch``
starts Ray, the callback actor and the Ray Train workers, ``result`` turns the actor's summary
into ``TrainingResult``. Of ``ray_trainer._worker`` the driver imports only its door,
``_worker/entry.py``, which imports the loop inside the worker process. The commands that work
with a run from the user's terminal (status, submit, save/stop) are ``ray_trainer._client``,
which the driver never imports.
"""
