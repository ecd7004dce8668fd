"""Driver and workers: whether this process can run ``torch.compile`` (inductor).

Checked in the driver before training, and again in each worker, whose node may differ.
"""

from __future__ import annotations

import os


def missing_compile_toolchain(use_gpu: bool) -> str | None:
    """What ``torch.compile`` (inductor) lacks in this process, or None: on a GPU the triton
    package, on a CPU a C++ compiler. Checked in the driver and again in each worker."""
    import shutil

    if use_gpu:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "compile=True on GPU workers needs the triton package (pip install triton)"
        return None
    compilers = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    if any(c and shutil.which(c) for c in compilers):
        return None
    return (
        "compile=True on CPU workers needs a C++ compiler for torch.compile's CPU code "
        "(g++ or clang++, e.g. apt-get install g++); install one on every node, or set "
        "compile=False"
    )
