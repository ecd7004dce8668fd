"""Driver, preparation tasks and workers: the data pipeline, from a run's sources to packed rows.

Shared by every process that touches data: the driver (resolving and checking inputs), the
preparation tasks it launches (rendering and tokenizing once per run) and the training workers
(reading their samples, planning their batches). Nothing here imports Ray, nor the driver's, the
workers' or the actor's code; import each name from the module that defines it. In the order
data flows:

- ``sources``: where records come from (files, globs, folders, buckets, a ``datasets.Dataset``)
  and in which format; ``records``: every record checked, the source cut into pieces (driver).
- ``chat``: what a valid record is, and where a conversation's assistant turns are;
  ``template``: the chat template resolved, rendered and probed; ``encode``: one record to
  tokens and labels, the one adapter over a run's tokenizer.
- ``prepare``: a preparation task's body, one piece encoded into ``cache``, the run's token
  cache on storage, which the workers read sample by sample; ``batches``: the same for a batch
  of a ``ray.data.Dataset`` that Ray Data hands a task (checked as ``records`` checks a file's).
- ``packing``: which samples each rank trains on at each step, and a packed row's layout.
"""
