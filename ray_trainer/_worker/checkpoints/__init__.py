"""Training worker: checkpoints written, exported and restored.

``saving`` writes a checkpoint through ``ray.train.report`` (``async_save`` in the background),
``export`` chooses the ``hf/`` export once, ``resume`` restores a checkpoint at start.
"""
