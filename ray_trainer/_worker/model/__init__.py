"""Training worker: the model of one rank, built, adapted, spread over the ranks.

``build`` builds a pretrained model without memory and fills it once placed; ``adaptation``
is what LoRA changes (``WholeModel`` or ``LoraAdapters``, one object); ``parallel`` spreads it
(DDP or FSDP); ``chunked_loss``, ``packed_attention`` (with ``packing_check``) and ``offload``
are the forward's memory and speed options.
"""
