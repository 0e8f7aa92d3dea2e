"""In-process transport fault layer: network partitions for tests and benchmarks.

A :class:`Partition` splits peer ids into groups; while it is cut, two nodes in
different groups cannot exchange anything, exactly where a real cut would bite:

* dialling (``ConnectionManager.dial``) fails like a dead link (counted as a
  failed dial, with the usual back-off);
* existing connections between the groups are closed by the connection
  manager's next round (``PeerStanding.refuses``), and gossip links to such peers
  are closed at once (``Gossip._sync_links``); frames still arriving from them
  are dropped;
* request/response (``ReqResp.request``: ``RequestError("unreachable")``; the
  serving side resets the stream), and with it chunk tickets: the data plane's
  raw TCP connections need a ticket granted over request/response, so no new
  data connection crosses the cut (a chunk transfer already in flight when the
  cut starts may finish).

Each node consults its own ``PeerStanding.link_filter``, installed by
:meth:`Partition.install`; production nodes have none (every link is up). A
peer id in no group is reachable from everyone (put every node of the network
in a group: an ungrouped node would relay gossip across the cut).

Why not network namespaces: the in-process networks of the tests (every node a
trio task on 127.0.0.1) have no per-node interface to cut, namespaces need root,
and this layer cuts at the same points (dial, connection, stream) with no
privileges. See docs/security.md ("Partitions and churn").

Example::

    part = Partition()
    for n in nodes:
        part.install(n)
    part.cut([a.peer_id, b.peer_id], [c.peer_id, d.peer_id])
    ...
    part.heal()
"""

from __future__ import annotations

from collections.abc import Iterable


class Partition:
    def __init__(self) -> None:
        self._group: dict[str, int] = {}

    @property
    def active(self) -> bool:
        return bool(self._group)

    def cut(self, *groups: Iterable[str]) -> None:
        """Cut the network into ``groups`` (peer ids); replaces any earlier cut."""
        group: dict[str, int] = {}
        for i, g in enumerate(groups):
            for pid in g:
                if pid in group and group[pid] != i:
                    raise ValueError(f"{pid} is in two groups")
                group[pid] = i
        self._group = group

    def heal(self) -> None:
        """Every link is up again (nodes reconnect on their own)."""
        self._group = {}

    def allows(self, a: str, b: str) -> bool:
        ga, gb = self._group.get(a), self._group.get(b)
        return ga is None or gb is None or ga == gb

    def install(self, node) -> None:
        """Make ``node`` (a ``node.p2p.Node``) obey this partition."""
        me = node.peer_id
        node.standing.link_filter = lambda peer_id: self.allows(me, peer_id)
