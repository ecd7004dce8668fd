"""Every process: a run's configuration, ``TrainingArgs`` (``args``) and its files (``files``)."""

from ray_trainer._config.args import TrainingArgs

__all__ = ["TrainingArgs"]
