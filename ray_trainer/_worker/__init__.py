"""The training worker: runs in each Ray Train worker process, one per rank.

``entry.train_loop_per_worker`` is the door Ray Train runs (the one module the driver
imports); it imports ``loop.run_worker`` inside the worker. ``setup`` builds this rank's
``state.WorkerState``: the model (``loading``, ``lora``: what LoRA changes, as one object),
how it is spread over the ranks (``parallel``), what it trains (``workload``), its micro-batches
(``loader``), its hooks, and the ``hf/`` export chosen once (``export``). ``resume`` restores a
checkpoint; ``loop`` runs the steps, firing events through ``hooks`` (rank 0 also sends them to
the callback actor with ``event_forwarder``); ``agreement`` agrees control and loss across
ranks and ``boundary`` decides what each step boundary does; ``saving`` (and ``async_save`` in
the background) writes checkpoints, ``validation`` runs the in-loop validation and ``summary``
gathers the attempt's end. Nothing here imports ``ray_trainer._driver`` or ``ray_trainer._actor``.
"""
