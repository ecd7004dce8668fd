"""The training worker: runs in each Ray Train worker process, one per rank.

``entry.train_loop_per_worker`` is the door Ray Train runs (the one module the driver
imports); it imports ``step.loop.run_worker`` inside the worker. ``assemble`` builds this
rank's ``state.WorkerState``: the model (``model/``), what it trains (``workload``), its
micro-batches and hooks (``step/``), and the ``hf/`` export chosen once (``checkpoints/``).
Three rooms and a few modules beside them:

- ``step/``: the loop, the micro-batches, the events (``hooks``, ``event_forwarder``), the
  agreement across ranks, validation and throughput;
- ``model/``: the model built (``build``), adapted (``adaptation``: LoRA or the whole model),
  spread over the ranks (``parallel``), and the forward's options (``chunked_loss``,
  ``packed_attention``, ``packing_check``, ``offload``);
- ``checkpoints/``: ``saving`` (and ``async_save`` in the background), ``export``, ``resume``;
- beside them: ``entry``, ``assemble``, ``state``, ``workload``, ``boundary`` (what a step
  boundary does, read by the loop and the checkpoints), ``summary`` (the attempt's end).

Nothing here imports ``ray_trainer._driver``, ``ray_trainer._actor`` or ``ray_trainer._client``.
"""
