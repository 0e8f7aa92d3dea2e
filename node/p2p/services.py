"""What a running node offers the roles and the checkpoints' wiring: one typed seam.

A role (``RoleHook.run``) and ``node.roles.checkpoint_wiring`` receive a
:class:`NodeServices`, never the :class:`node.p2p.node.Node` itself: request/response,
gossip, the peer standing (penalties and bans), this node's identity and the run's genesis,
reachability and the addresses a peer dials from. Everything libp2p-specific (the host,
the peerstore, connections, the NAT service) stays behind it in ``node.p2p``, so a role
cannot reach into a private libp2p attribute, and the seam is what mypy checks.

:class:`RunningNode` is the implementation ``Node.run`` hands to its hook once gossip and
request/response exist (hence their types are not optional here, as they are on ``Node``
before it runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from node.p2p.gossip import Gossip
    from node.p2p.metrics import NodeMetrics
    from node.p2p.reqresp import ReqResp
    from node.p2p.standing import PeerStanding
    from protocol import NodeKey, RunGenesis, SequenceCounter


class NodeServices(Protocol):
    """The services of a running node that roles and the checkpoints' wiring use."""

    @property
    def peer_id(self) -> str: ...

    @property
    def key(self) -> NodeKey:
        """This node's signing key (announces, votes, batches)."""
        ...

    @property
    def seq(self) -> SequenceCounter:
        """The envelope sequence counter every message this node signs takes a number from."""
        ...

    @property
    def run_id(self) -> bytes: ...

    @property
    def genesis(self) -> RunGenesis | None:
        """The run's verified genesis (None only on a bootstrap node that serves none)."""
        ...

    @property
    def gossip(self) -> Gossip: ...

    @property
    def reqresp(self) -> ReqResp: ...

    @property
    def standing(self) -> PeerStanding:
        """Penalties and bans (``PeerStanding``): who this node refuses."""
        ...

    @property
    def metrics(self) -> NodeMetrics:
        """The node's Prometheus registry (``/metrics``), where a role adds its collectors."""
        ...

    def peer_ips(self, peer_id: str) -> set[str]:
        """Where ``peer_id`` may be dialled directly (its advertised or observed addresses)."""
        ...

    def reachable(self) -> bool:
        """Whether peers can dial this node directly (AutoNAT has not found it behind NAT)."""
        ...


@dataclasses.dataclass(frozen=True)
class RunningNode:
    """:class:`NodeServices` of a node whose gossip and request/response are up."""

    peer_id: str
    key: NodeKey
    seq: SequenceCounter
    run_id: bytes
    genesis: RunGenesis | None
    gossip: Gossip
    reqresp: ReqResp
    standing: PeerStanding
    metrics: NodeMetrics
    _peer_ips: Callable[[str], set[str]]
    _reachable: Callable[[], bool]

    def peer_ips(self, peer_id: str) -> set[str]:
        return self._peer_ips(peer_id)

    def reachable(self) -> bool:
        return self._reachable()
