"""Every process: the tied parameters of a module (one tensor under several names).

Read by the training workers (a sharded checkpoint holds a tied weight once, the ``hf/`` export
and the pretrained fill keep the ties) and by whatever reads a checkpoint back.
"""

from __future__ import annotations

from typing import Any


def tied_aliases(named: Any) -> dict[str, str]:
    """The tied names among ``(name, tensor)`` pairs (``module.named_parameters(
    remove_duplicate=False)``): each name of a tensor seen before, mapped to its first name."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in named:
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return aliases
