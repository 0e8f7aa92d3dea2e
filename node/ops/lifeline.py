"""A node started by another primenode process (``primenode devnet``) stops when that process dies.

``primenode devnet`` stops its nodes itself on SIGTERM, SIGINT or SIGHUP. A SIGKILL (the OOM
killer, ``kill -9``, a supervisor's last resort) gives it no chance: without help its six
node processes kept training for good as orphans. So the devnet names itself in
``PRIMENODE_PARENT_PID`` and each node, first thing in ``main``, asks Linux for a
parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``): the kernel sends the node
SIGTERM the moment its parent exits, however it exits, and the node stops as on any SIGTERM.

Done in the child at start-up rather than in a ``preexec_fn``: a ``preexec_fn`` runs
between fork and exec and is unsafe while the parent has threads (the devnet's live view
has one). The window before the ``prctl`` (the parent dying while the child starts) is
closed by comparing ``getppid()`` with the named parent afterwards. Where ``prctl`` is
missing (not Linux) a daemon thread watches ``getppid()`` once a second instead.

Linux sends the signal when the parent *thread* that forked the child exits, so a parent
must start such children from a thread that lives as long as it does (the devnet and its
tests start nodes from the main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import MutableMapping

PARENT_ENV = "PRIMENODE_PARENT_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_env() -> dict[str, str]:
    """The environment entry a parent adds to a child it wants to stop when it dies."""
    return {PARENT_ENV: str(os.getpid())}


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def stop_with_parent(environ: MutableMapping[str, str] | None = None) -> str | None:
    """If a parent named itself in ``PRIMENODE_PARENT_PID``, have this process receive SIGTERM
    when that parent exits. Returns how (``"prctl"`` or ``"watch"``), None when not asked.
    The variable is removed so that this process's own children (sandboxes, torchrun ranks)
    do not tie themselves to a process that is not their parent."""
    env = os.environ if environ is None else environ
    raw = env.pop(PARENT_ENV, None)
    if not raw:
        return None
    try:
        parent = int(raw)
    except ValueError:
        return None
    how = "watch"
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0:
            how = "prctl"
    if os.getppid() != parent:  # the parent died before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)
    if how == "watch":
        threading.Thread(target=_watch, args=(parent,), daemon=True, name="parent-watch").start()
    return how
