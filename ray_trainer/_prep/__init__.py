"""Data-preparation tasks: the Ray tasks that encode a run's data once, for every worker.

The driver launches one task per piece of a source (``tasks.encode_piece``) wherever the cluster
has a free CPU; each reads its piece from the source (local path or bucket), renders and
tokenizes its records, and writes them into the run's token cache on storage. Imports nothing of
the driver, the workers or the actor.
"""
