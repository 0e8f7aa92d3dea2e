"""``primenode join --role trainer --nproc N``: the trainer as N ranks of one torchrun.

The command re-executes itself under ``torch.distributed.run`` (torchrun) with
``--nproc-per-node N``, minus ``--nproc``; torchrun sets RANK / WORLD_SIZE / MASTER_* for
each rank and stops every rank when one fails (``max_restarts`` 0). Under torchrun, rank 0
runs the ordinary trainer role (the network node, ``node.rl.ranks.RankGroup``) and the other
ranks run ``node.rl.ranks.follow``.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from node.rl.torchrun import launched_rank, under_torchrun


def without_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` minus ``--nproc N`` / ``--nproc=N``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def torchrun_argv(argv: Sequence[str], nproc: int) -> list[str]:
    """The command that runs ``primenode <argv>`` as ``nproc`` ranks on this machine."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "-m",
        "node.ops.cli",
        *without_nproc(argv),
    ]


def exec_torchrun(argv: Sequence[str], nproc: int) -> None:
    """Run torchrun in this process and exit with its outcome. Signals to the node reach the
    launcher, which stops every rank: SIGTERM or Ctrl+C (a requested stop) exits 0 without a
    traceback, as the single-process node does; a failed rank exits non-zero."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    cmd = torchrun_argv(argv, nproc)
    try:
        torchrun(cmd[3:])  # the arguments after "python -m torch.distributed.run"
    except SignalException as exc:
        stop = exc.sigval in (signal.SIGTERM, signal.SIGINT)
        print(f"trainer group stopped by {exc.sigval.name}", file=sys.stderr)
        sys.exit(0 if stop else 128 + int(exc.sigval))
    sys.exit(0)


__all__ = ["exec_torchrun", "launched_rank", "torchrun_argv", "under_torchrun", "without_nproc"]
