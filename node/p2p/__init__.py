"""The P2P overlay: libp2p host, validated gossip, request/response, peer
exchange and connection management, heartbeats and the swarm view.

Entry point: :class:`Node` (see node.py). Roles plug in via :class:`RoleHook`.
"""

from node.p2p.connmgr import ConnectionManager
from node.p2p.gossip import Gossip, GossipError
from node.p2p.host import full_addrs, install_libp2p_fixes, make_host, parse_peer_addr
from node.p2p.metrics import NodeMetrics
from node.p2p.node import BootstrapRole, Node, P2PConfig, RoleHook, fetch_genesis
from node.p2p.reqresp import ReqResp, RequestError
from node.p2p.standing import PeerStanding
from node.p2p.swarm import PeerState, SwarmView

__all__ = [
    "BootstrapRole",
    "ConnectionManager",
    "Gossip",
    "GossipError",
    "Node",
    "NodeMetrics",
    "P2PConfig",
    "PeerStanding",
    "PeerState",
    "ReqResp",
    "RequestError",
    "RoleHook",
    "SwarmView",
    "fetch_genesis",
    "full_addrs",
    "install_libp2p_fixes",
    "make_host",
    "parse_peer_addr",
]
