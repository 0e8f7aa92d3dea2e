"""Test helpers others reuse: a signed test genesis and a factory of in-process nodes.

Example::

    async with trio.open_nursery() as nursery:
        net = NodeFactory(nursery)
        boot = await net.start()                      # the first node is the bootstrap
        nodes = [await net.start(hook=MyRole()) for _ in range(5)]
        await net.wait_connected()
        ...
        net.kill(boot)                                # cancel one node (closes its host)
        nursery.cancel_scope.cancel()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from node.p2p.nat import NatConfig
from node.p2p.node import BootstrapRole, Node, P2PConfig, RoleHook
from node.p2p.services import NodeServices
from node.util import now_ms
from protocol import Envelope, NodeKey, RolloutAnnounce, RunGenesis, SignedGenesis, sign_genesis


def overlay_genesis(
    owner: NodeKey | None = None,
    trainer: NodeKey | None = None,
    validators: list[NodeKey] | None = None,
    name: str = "test-run",
    **overrides,
) -> SignedGenesis:
    owner = owner or NodeKey.generate()
    trainer = trainer or owner
    validators = validators or [trainer]
    fields: dict[str, Any] = dict(
        name=name,
        owner=owner.peer_id,
        created_ms=now_ms(),
        model="tiny-llama",
        dataset="synthetic",
        dataset_size=64,
        trainer=trainer.peer_id,
        validators=tuple(v.peer_id for v in validators),
        quorum=1,
        max_async=2,
        prompts_per_batch=4,
        group_size=4,
        chunk_size=1 << 20,
        config_toml="",
    )
    fields.update(overrides)
    return sign_genesis(owner, RunGenesis(**fields))


def fast_config(**overrides) -> P2PConfig:
    """Short intervals for tests on a loaded 2-core machine. Nodes on loopback are all
    reachable: reachability is not asked (AutoNAT dial-backs would cost a dozen nodes in one
    process about a hundred Noise handshakes at start) and nothing is hole-punched; the NAT
    tests (tests/system/test_nat_netns.py) run real NATs in network namespaces instead."""
    cfg = P2PConfig(
        listen=["/ip4/127.0.0.1/tcp/0"],
        target_peers=4,
        heartbeat_interval_s=0.5,
        forget_after_s=5.0,
        conn_interval_s=0.3,
        px_interval_s=1.0,
        dial_timeout_s=3.0,
        nat=NatConfig(mode="public", hole_punch=False),
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


async def wait_until(
    pred: Callable[[], bool], timeout: float = 30.0, poll: float = 0.05, what: str = "condition"
) -> None:
    """Poll ``pred`` until true; raises ``trio.TooSlowError`` naming ``what`` after ``timeout``.

    For conditions over live libp2p nodes on real sockets (connections, meshes, bans), which
    raise no event and run on the wall clock, so a MockClock cannot stand in."""
    try:
        with trio.fail_after(timeout):
            while not pred():  # noqa: ASYNC110 (no event to wait on; see the docstring)
                await trio.sleep(poll)
    except trio.TooSlowError:
        raise trio.TooSlowError(f"timed out after {timeout} s waiting for {what}") from None


class NodeFactory:
    """Starts :class:`Node` s in one trio process sharing a test genesis.

    The first node started is the bootstrap (``BootstrapRole``) unless
    ``bootstrap=False``; later nodes dial it. ``start(key=...)`` restarts a
    node with the same identity.
    """

    def __init__(self, nursery: trio.Nursery, genesis: SignedGenesis | None = None, **config_overrides) -> None:
        self.nursery = nursery
        self.genesis = genesis or overlay_genesis()
        self.config_overrides = config_overrides
        self.nodes: list[Node] = []
        self.bootstrap_addrs: list[str] = []
        self._scopes: dict[int, trio.CancelScope] = {}

    async def start(
        self, hook: RoleHook | None = None, key: NodeKey | None = None, bootstrap: list[str] | None = None, **overrides
    ) -> Node:
        cfg = fast_config(**{**self.config_overrides, **overrides})
        first = not self.bootstrap_addrs
        cfg.bootstrap = list(self.bootstrap_addrs if bootstrap is None else bootstrap)
        if hook is None:
            hook = BootstrapRole() if first else RoleHook()
        node = Node(key or NodeKey.generate(), genesis=self.genesis, config=cfg, hook=hook)
        scope = trio.CancelScope()

        async def _run(task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                await node.run(task_status=task_status)

        await self.nursery.start(_run)
        self._scopes[id(node)] = scope
        self.nodes.append(node)
        if first:
            self.bootstrap_addrs = node.full_addrs()
        return node

    def node_of(self, who: Node | NodeServices | str) -> Node:
        """The running ``Node`` behind a role's services (``role.node``), or with a peer id: what
        a test reaches into (connections, the host) where a role sees only its services."""
        pid = who if isinstance(who, str) else who.peer_id
        for n in reversed(self.nodes):  # a restarted identity: its newest node
            if n.peer_id == pid:
                return n
        raise KeyError(f"no running node with peer id {pid}")

    def kill(self, node: Node | NodeServices) -> None:
        if not isinstance(node, Node):
            node = self.node_of(node)
        self._scopes[id(node)].cancel()
        if node in self.nodes:
            self.nodes.remove(node)

    async def wait_connected(self, nodes: list[Node] | None = None, min_peers: int = 2, timeout: float = 60.0) -> None:
        """Until every node has ``min_peers`` connections, sees all others' heartbeats,
        and has gossip mesh peers on every topic."""
        nodes = nodes or self.nodes
        ids = {n.peer_id for n in nodes}

        def ok() -> bool:
            for n in nodes:
                if n.conns is None or len(n.conns.connected()) < min(min_peers, len(nodes) - 1):
                    return False
                if not (ids - {n.peer_id}) <= set(n.swarm.peers()):
                    return False
                if n.gossip is None or any(not n.gossip.mesh_peers(k) for k in ("heartbeat", "vote", "rollout")):
                    return False
            return True

        await wait_until(ok, timeout, poll=0.2, what="the overlay to connect")


def tagged_announce(tag: int) -> RolloutAnnounce:
    """A small gossip message anyone may publish, told apart by ``tag`` (votes are validators' only)."""
    return RolloutAnnounce(
        batch_id=tag.to_bytes(32, "big"), policy_version=0, batch_counter=0, num_samples=1, size_bytes=1
    )


def collect_tags(nodes: list[Node], kind: str = "rollout") -> dict[str, list[int]]:
    """Record, per node, the tags of the ``kind`` messages its handlers receive (in order)."""
    got: dict[str, list[int]] = {n.peer_id: [] for n in nodes}

    def recorder(tags: list[int]) -> Callable[[Envelope[Any]], None]:
        return lambda env: tags.append(int.from_bytes(env.body.batch_id, "big"))

    for n in nodes:
        assert n.gossip is not None, "collect_tags needs started nodes"
        n.gossip.on(kind, recorder(got[n.peer_id]))
    return got
