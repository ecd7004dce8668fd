"""The training worker: runs in each Ray Train worker process, one per rank.

``loop.run_worker`` is the entry point (reached through ``_contract.train_loop_per_worker``):
``setup`` builds the model, optimizer and data for this rank, ``resume`` restores a checkpoint,
``loop`` runs the steps, firing events through ``hooks`` (rank 0 also forwards them to the
callback actor with ``forward``), ``agreement`` agrees control and loss across ranks, and
``boundary`` decides what each step boundary does; ``saving`` writes checkpoints and runs
validation. Nothing here imports ``ray_trainer._driver`` or ``ray_trainer._actor``.
"""
