"""The delta chain: which versions a node must keep, and which it may stop offering for
loading, as plain functions of what it holds (no files, no clock).

A delta version applies to one base version (``DeltaRef``: its number and root), which may
itself be a delta, down to an anchor. A late joiner rebuilds the newest version by fetching
the newest anchor and every delta after it from any peer, so every node keeps the chain
under the versions it keeps, behind the ``max_async`` window or not. ``ChunkStore`` does
the file work these decisions call for (node/checkpoints/store.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from protocol import DeltaRef
from protocol.rules import is_stale


@dataclasses.dataclass(frozen=True)
class Link:
    """What the chain needs to know of one version held."""

    version: int
    root: bytes
    delta: DeltaRef | None  # None: an anchor
    pinned: bool = False  # in use (being served or loaded): never removed
    assembled: bool = False  # loadable: its full files are on disk


@dataclasses.dataclass(frozen=True)
class GcPlan:
    """``remove``: versions to delete with their files. ``release``: versions kept for the
    chain only, whose full files are no longer offered for loading (every delta applying to
    them has been applied)."""

    remove: tuple[int, ...]
    release: tuple[int, ...]


def base_chain(links: Mapping[int, Link], versions: set[int]) -> set[int]:
    """Every earlier version held that one of ``versions`` applies to (or one of those, and so
    on, down to an anchor), not counting ``versions`` themselves. A base held under another
    root than the delta names is not its base."""
    out: set[int] = set()
    stack = sorted(versions)
    while stack:
        link = links.get(stack.pop())
        ref = link.delta if link is not None else None
        if ref is None:
            continue
        base = links.get(ref.base_version)
        if base is not None and base.root == ref.base_root and base.version not in out and base.version not in versions:
            out.add(base.version)
            stack.append(base.version)
    return out


def gc_plan(links: Mapping[int, Link], newest: int, max_async: int, pinned_forever: set[int]) -> GcPlan:
    """What garbage collection does once ``newest`` is the newest version known: keep the
    ``max_async`` window, every pinned version, ``pinned_forever`` (a run's version 0, for
    late joiners) and the base chain of all of those; remove the rest. Of the kept versions
    behind the window, release those whose every kept dependent delta is assembled."""
    keep = {v for v, link in links.items() if link.pinned or not is_stale(v, newest, max_async)}
    keep |= {v for v in pinned_forever if v in links}
    keep |= base_chain(links, keep)
    remove = tuple(v for v in sorted(links) if v not in keep)
    release = []
    for v in sorted(keep):
        link = links[v]
        if not (is_stale(v, newest, max_async) and link.assembled and not link.pinned and v not in pinned_forever):
            continue
        users = [u for u in (links[k] for k in keep) if u.delta is not None and u.delta.base_version == v]
        if users and all(u.assembled for u in users):
            release.append(v)
    return GcPlan(remove=remove, release=tuple(release))
