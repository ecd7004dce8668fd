"""Every process: the errors that several rooms raise, at the bottom of the import graph.

A user catches these from ``ray_trainer``; the modules that raise them import them from here,
so that no module imports a higher one only for an exception class.
"""


class TrainingArgsError(ValueError):
    """Bad arguments for a run: the message names each field, the bad value and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing files, incomplete, or of an unknown format."""
