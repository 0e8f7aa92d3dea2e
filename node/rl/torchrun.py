"""Whether this process is one rank of a torchrun group, read from the environment torchrun
sets (no torch import).

Why a module of its own: ``primenode join`` asks this before anything else, and asking it
through ``node.rl.ranks`` imported torch and the distributed trainer first, about 3 CPU
seconds before a worker even dialled its bootstrap (bench/soak.py measured joins at 6 CPU
seconds each, half of it that import).
"""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    """Launched by torchrun as one rank of a group (its environment names rank and size)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_rank() -> int:
    """This process's rank as torchrun set it (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


__all__ = ["launched_rank", "under_torchrun"]
