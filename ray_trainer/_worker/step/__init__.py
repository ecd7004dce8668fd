"""Training worker: the step, from micro-batches to the step boundary.

``loop`` runs the steps (``train_step`` reads in one screen), firing events through ``hooks``
(rank 0 also sends them to the callback actor with ``event_forwarder``); ``micro_batches`` cuts
each step's micro-batches; ``agreement`` agrees control and loss across ranks (what a boundary
then does is ``_worker/boundary.py``, which the checkpoints read too); ``validation`` runs the
in-loop validation and ``throughput`` measures tokens/s and MFU.
"""
