"""Driver, data-preparation tasks and workers: the data formats a run reads and trains on.

Shared by every process that touches data: the driver (resolving and checking inputs), the
data-preparation Ray tasks (rendering and tokenizing once per run) and the training workers
(reading their samples). Nothing here imports Ray.
"""

from ray_trainer._data.text import (
    IGNORE_INDEX,
    ByteTokenizer,
    DataFileError,
    JsonlTextDataset,
    collate_batch,
    data_file_size,
    read_data_file,
    validate_jsonl,
)

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "DataFileError",
    "JsonlTextDataset",
    "collate_batch",
    "data_file_size",
    "read_data_file",
    "validate_jsonl",
]
