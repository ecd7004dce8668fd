"""Runs in the generation subprocess: the file an interpreter runs to start the generation child.

``<python> run_generation_child.py``: Python puts this file's folder first on ``sys.path``, and
the folder holds the ``generation_child`` package and this file only, so the child imports its
own package and nothing else of the project (vLLM's worker processes inherit that path, and
import ``generation_child.vllm_engine`` by name for ``refresh_tied_head``).
"""

import sys

from generation_child.main import main

if __name__ == "__main__":  # vLLM's engine processes may import this file again: no second loop
    sys.exit(main())
