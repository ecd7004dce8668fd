"""Runs in every benchmark's process (and its Ray workers): bench/ and each subfolder on sys.path.

The benchmarks import each other's helpers by plain name (``import _support``, ``from
_memory_load import ...``, ``import bench_packing``) from whichever folder they live in: a
script puts bench/ on the path and imports this module, which adds every bench folder once.
``FOLDERS`` is also the ``PYTHONPATH`` their Ray workers get (``_support.init_ray``). Module
names are unique across the folders, so a plain name means one file.
"""

from __future__ import annotations

import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
#: bench/ and its subfolders that hold Python files, in the order they go on the path.
_SUBFOLDERS = sorted(
    entry.path
    for entry in os.scandir(BENCH)
    if entry.is_dir() and any(name.endswith(".py") for name in os.listdir(entry.path))
)
FOLDERS = [BENCH, *_SUBFOLDERS]

for _folder in reversed(FOLDERS):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)
