"""The swarm at 10 to 1,000 nodes on a discrete event clock, with the real protocol cores
(issue 32 point 3): gossip (the real Plumtree core; delivery, latency and cost per message,
with and without churn, beside a plain flood of the same overlay) and admission (the real
committee draw and rule; admitted share and latency as workers grow, beside every validator
checking every batch) and checkpoint distribution (the real fetch schedule and super-seeding
rules, full checkpoints and deltas to 10-1,000 fetchers: ``bench/simulate_fetch.py``, whose
docstring states that model).

    python bench/simulate.py [--nodes 10,100,1000] [--rate 20] [--seconds 30] [--degree 6]
                             [--churn 0,10] [--loss 0.001] [--heartbeat-s 0] [--seed 0]
    python bench/simulate.py --what admission [--validators 1,2,4,8] [--sizes 0,1,2,3]
                             [--workers 4,8,16,32,64] [--gen-s 60] [--dead 0]
    python bench/simulate.py --what distribution [--fetchers 10,100,1000] [--sizes-mb 269,62000]
                             [--dist-churn 0,10] [--seed-mbps 1000] [--known 32]
    ... [--plots DIR]; python bench/simulate.py --replot OUTPUT_FILE... --plots DIR

What is real and what is modelled:

* **Real**: every node runs ``node.p2p.plumtree.Plumtree``, the object the daemon's gossip
  drives (eager/lazy links, pruning, IHAVE batching and GRAFT deadlines, the bounded
  tables), fed the real encoded frames (``protocol.gossip``); the timers fire at the
  daemon's intervals (IHAVE every 0.5 s, GRAFT checks every 0.05 s, graft timeout 0.25 s).
* **Modelled** (a discrete event clock, no sockets): each node's link has an upload and a
  download cap and an access latency; a frame waits for the sender's uplink, travels the two
  access latencies, waits for the receiver's downlink, then for the receiver's CPU
  (``--cpu-ms`` per frame: validation, Noise and yamux cost ~1 ms of Python per frame,
  bench/gossip.py). TCP hides loss as delay: a frame lost (``--loss``) arrives one
  retransmission timeout later (200 ms + 2 x the path latency). Each frame carries
  ``FRAME_OVERHEAD`` bytes of TCP/Noise/yamux framing.
* **Links**: 70 % home links (download log-uniform 50-1000 Mbit/s, upload 1/10 to 1/2 of
  it, at least 20 Mbit/s), 30 % datacentre links (1-10 Gbit/s both ways); access latency
  log-uniform 2.5-150 ms, so a path takes 5-300 ms one way.
* **Overlay**: each node links to ``--degree`` random peers (the connection manager's
  target); a node that leaves is noticed by its peers ``DETECT_S`` later, and a peer left
  below the target links a random live node ``DIAL_S`` after that. ``--churn P``: P % of
  the nodes leave per minute and as many fresh ones join (Poisson).
* **Load**: ``--rate`` messages per second in all (announces and votes: 400-byte
  envelopes), each from a random live node; with ``--heartbeat-s S`` every node also
  gossips a heartbeat every S seconds, as the daemon does every 2 s (each node keeps a view
  of the whole swarm from them): N / S more messages per second, to every node.

Reported per configuration: delivery ratio (deliveries to nodes alive from the message's
publication to the end, over those nodes), latency p50 / p99 / max from publication to
delivery, message frames sent per delivery (1 on a perfect tree, the degree for a flood),
control frames per delivery, upload bytes per node per second, the busiest node's CPU share,
and the simulator's own wall time. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from node.p2p.plumtree import Plumtree, Send  # noqa: E402
from protocol import gossip as frames  # noqa: E402
from protocol.committee import Ballot, CommitteeRule, committee_order, committee_seed  # noqa: E402
from protocol.gossip import GRAFT, IHAVE, PRUNE, Control  # noqa: E402
from protocol.rules import Quorum  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import simulate_fetch  # noqa: E402

FRAME_OVERHEAD = 60  # bytes of TCP/IP, Noise and yamux framing per gossip frame (4-byte length prefix included)
ENVELOPE_BYTES = 400  # a rollout announce or a vote
IHAVE_INTERVAL_S = 0.5  # node/p2p/gossip.py's defaults
GRAFT_CHECK_S = 0.05
GRAFT_TIMEOUT_S = 0.25
DETECT_S = 2.0  # a peer that left is noticed (connection closed, or the watchdog) after this
DIAL_S = 1.0  # and a replacement link is up this long after that
DRAIN_S = 10.0  # simulated time after the last publication


@dataclass
class Node:
    name: int
    up_bps: float
    down_bps: float
    latency_s: float  # access latency, one way
    tree: Plumtree | None  # None: the flood baseline
    phase: float  # where this node's IHAVE timer ticks
    links: set[int] = field(default_factory=set)
    alive: bool = True
    born: float = 0.0
    died: float = math.inf
    up_free: float = 0.0
    down_free: float = 0.0
    cpu_free: float = 0.0
    cpu_busy: float = 0.0
    seen: set[bytes] = field(default_factory=set)  # flood mode
    ihave_due: bool = False
    graft_due: bool = False
    sent_bytes: int = 0


class Sim:
    def __init__(self, args: argparse.Namespace, n: int, mode: str, churn: float) -> None:
        self.a, self.mode, self.churn = args, mode, churn
        self.rnd = random.Random(f"{args.seed}-{n}-{churn}")  # the same overlay and load for both modes
        self.now = 0.0
        self.events: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.seq = 0
        self.nodes: dict[int, Node] = {}
        self.origin: dict[bytes, int] = {}
        self.published: dict[bytes, float] = {}
        self.delivered: dict[bytes, dict[int, float]] = {}
        self.counts = {"message_frames": 0, "control_frames": 0, "duplicates": 0}
        self.topic = "/primenode/sim/rollout"
        for _ in range(n):
            self._new_node()
        names = list(self.nodes)
        for name in names:
            while len(self.nodes[name].links) < min(args.degree, n - 1):
                other = self.rnd.choice(names)
                if other != name and other not in self.nodes[name].links:
                    self._link(name, other)

    # ------------------------------------------------------------ the overlay
    def _new_node(self) -> Node:
        up, down, lat = simulate_fetch.draw_link(self.rnd)  # one link distribution for every simulation
        tree = Plumtree(graft_timeout_s=GRAFT_TIMEOUT_S) if self.mode == "plumtree" else None
        node = Node(len(self.nodes), up, down, lat, tree, self.rnd.uniform(0, IHAVE_INTERVAL_S), born=self.now)
        self.nodes[node.name] = node
        return node

    def _link(self, a: int, b: int) -> None:
        for x, y in ((a, b), (b, a)):
            self.nodes[x].links.add(y)
            tree = self.nodes[x].tree
            if tree is not None:
                tree.add_link(y)

    def _unlink(self, a: int, b: int) -> None:
        node = self.nodes[a]
        node.links.discard(b)
        if node.tree is not None:
            node.tree.remove_link(b)

    def live(self) -> list[int]:
        return [n.name for n in self.nodes.values() if n.alive]

    # ------------------------------------------------------------ events
    def at(self, t: float, kind: str, *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, args))

    def send(self, src: Node, dst_name: int, frame: bytes) -> None:
        dst = self.nodes[dst_name]
        if not dst.alive or dst_name not in src.links:
            return
        size = len(frame) + FRAME_OVERHEAD
        start = max(self.now, src.up_free)
        src.up_free = start + size * 8 / src.up_bps
        src.sent_bytes += size
        path = src.latency_s + dst.latency_s
        if self.rnd.random() < self.a.loss:
            path += 0.2 + 2 * path  # TCP: a lost segment is a retransmission timeout later
        self.at(src.up_free + path, "arrive", dst_name, src.name, frame)

    def do(self, node: Node, sends: list[Send], message: bytes | None = None) -> None:
        """Send the tree's frames: ``message`` (the same bytes object) is counted as a message
        frame, everything else as control (IHAVE, GRAFT, PRUNE)."""
        for s in sends:
            self.counts["message_frames" if s.frame is message else "control_frames"] += 1
            self.send(node, s.peer, s.frame)
        self.timers(node)

    def timers(self, node: Node) -> None:
        tree = node.tree
        if tree is None or not node.alive:
            return
        if tree.ihave_out and not node.ihave_due:
            node.ihave_due = True
            k = math.floor((self.now - node.phase) / IHAVE_INTERVAL_S) + 1
            self.at(node.phase + k * IHAVE_INTERVAL_S, "ihave", node.name)
        if tree.missing and not node.graft_due:
            node.graft_due = True
            self.at(self.now + GRAFT_CHECK_S, "graft", node.name)

    def arrive(self, dst_name: int, src_name: int, frame: bytes) -> None:
        """A frame reached ``dst``'s downlink: it is read, then validated on its CPU."""
        dst = self.nodes[dst_name]
        if not dst.alive:
            return
        size = len(frame) + FRAME_OVERHEAD
        dst.down_free = max(self.now, dst.down_free) + size * 8 / dst.down_bps
        cost = self.a.cpu_ms / 1000
        dst.cpu_free = max(dst.down_free, dst.cpu_free) + cost
        dst.cpu_busy += cost
        self.at(dst.cpu_free, "process", dst_name, src_name, frame)

    def process(self, dst_name: int, src_name: int, frame: bytes) -> None:
        dst = self.nodes[dst_name]
        if not dst.alive:
            return
        decoded = frames.decode_frame(frame)
        if isinstance(decoded, Control):
            kind, ids = decoded
            assert dst.tree is not None
            if src_name not in dst.links:
                return
            if kind == PRUNE:
                dst.tree.on_prune(src_name)  # type: ignore[arg-type]
            elif kind == GRAFT:
                for s in dst.tree.on_graft(src_name, ids):  # type: ignore[arg-type]
                    self.counts["message_frames"] += 1  # a GRAFT is answered with the messages
                    self.send(dst, s.peer, s.frame)
            elif kind == IHAVE:
                dst.tree.on_ihave(src_name, ids, self.now)  # type: ignore[arg-type]
                self.timers(dst)
            return
        _topic, data = decoded
        msg_id = frames.message_id(data)
        tree = dst.tree
        if tree is None:
            if msg_id in dst.seen:
                self.counts["duplicates"] += 1
                return
            dst.seen.add(msg_id)
            self.delivered[msg_id][dst_name] = self.now
            origin = self.origin[msg_id]
            for peer in dst.links:
                if peer not in (src_name, origin):
                    self.counts["message_frames"] += 1
                    self.send(dst, peer, frame)
            return
        if tree.is_seen(msg_id):
            self.counts["duplicates"] += 1
            self.do(dst, tree.duplicate(src_name))  # type: ignore[arg-type]
            return
        tree.mark_seen(msg_id, self.now)
        self.delivered[msg_id][dst_name] = self.now
        self.do(dst, tree.deliver(src_name, self.origin[msg_id], msg_id, frame, self.now), message=frame)  # type: ignore[arg-type]

    def publish(self, i: int, name: int | None = None) -> None:
        """Message ``i`` from ``name`` (a random live node if None)."""
        if name is None:
            name = self.rnd.choice(self.live())
        node = self.nodes[name]
        data = i.to_bytes(8, "big") + bytes(ENVELOPE_BYTES - 8)
        msg_id = frames.message_id(data)
        frame = frames.encode_message(self.topic, data)
        self.origin[msg_id] = name
        self.published[msg_id] = self.now
        self.delivered[msg_id] = {name: self.now}
        if node.tree is None:
            node.seen.add(msg_id)
            for peer in node.links:
                self.counts["message_frames"] += 1
                self.send(node, peer, frame)
            return
        self.do(node, node.tree.publish(msg_id, frame, self.now), message=frame)

    def heartbeat(self, name: int) -> None:
        """Every node gossips a heartbeat every ``--heartbeat-s`` (the full swarm view)."""
        if not self.nodes[name].alive or self.now > 1.0 + self.a.seconds:
            return
        self.n_published += 1
        self.publish(self.n_published, name)
        self.at(self.now + self.a.heartbeat_s, "heartbeat", name)

    def leave(self) -> None:
        live = self.live()
        if len(live) <= self.a.degree + 1:
            return
        node = self.nodes[self.rnd.choice(live)]
        node.alive, node.died = False, self.now
        for peer in list(node.links):
            self.at(self.now + DETECT_S, "lost", peer, node.name)

    def lost(self, name: int, gone: int) -> None:
        node = self.nodes[name]
        self._unlink(name, gone)
        if node.alive and len(node.links) < self.a.degree:
            self.at(self.now + DIAL_S, "dial", name)

    def dial(self, name: int) -> None:
        node = self.nodes[name]
        candidates = [p for p in self.live() if p != name and p not in node.links]
        if node.alive and candidates and len(node.links) < self.a.degree:
            self._link(name, self.rnd.choice(candidates))

    def join(self) -> None:
        node = self._new_node()
        if self.a.heartbeat_s > 0:
            self.at(self.now + self.rnd.uniform(0, self.a.heartbeat_s), "heartbeat", node.name)
        live = [p for p in self.live() if p != node.name]
        for peer in self.rnd.sample(live, min(self.a.degree, len(live))):
            self._link(node.name, peer)

    def ihave(self, name: int) -> None:
        node = self.nodes[name]
        node.ihave_due = False
        if node.alive and node.tree is not None:
            self.do(node, node.tree.flush_ihave())

    def graft(self, name: int) -> None:
        node = self.nodes[name]
        node.graft_due = False
        if node.alive and node.tree is not None:
            self.do(node, node.tree.due_grafts(self.now))

    # ------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        a = self.a
        n_msgs = int(a.rate * a.seconds)
        for i in range(n_msgs):
            self.at(1.0 + i / a.rate, "publish", i)
        self.n_published = n_msgs
        if a.heartbeat_s > 0:
            for name in list(self.nodes):
                self.at(1.0 + self.rnd.uniform(0, a.heartbeat_s), "heartbeat", name)
        end = 1.0 + a.seconds + DRAIN_S
        if self.churn > 0:
            per_s = self.churn / 100 * len(self.nodes) / 60
            t = 1.0
            while True:
                t += self.rnd.expovariate(per_s)
                if t >= 1.0 + a.seconds:
                    break
                self.at(t, "leave")
                self.at(t + self.rnd.uniform(0, 1), "join")
        handlers = {
            "publish": self.publish,
            "heartbeat": self.heartbeat,
            "arrive": self.arrive,
            "process": self.process,
            "ihave": self.ihave,
            "graft": self.graft,
            "leave": self.leave,
            "lost": self.lost,
            "dial": self.dial,
            "join": self.join,
        }
        wall0 = time.perf_counter()
        n_events = 0
        while self.events and self.events[0][0] <= end:
            self.now, _seq, kind, args = heapq.heappop(self.events)
            handlers[kind](*args)
            n_events += 1
        wall = time.perf_counter() - wall0
        return self.report(end, wall, n_events)

    def report(self, end: float, wall: float, n_events: int) -> dict[str, Any]:
        lat: list[float] = []
        expected = got = 0
        for msg_id, t_pub in self.published.items():
            eligible = [
                n.name
                for n in self.nodes.values()
                if n.born <= t_pub and n.died > end and n.name != self.origin[msg_id]
            ]
            expected += len(eligible)
            times = self.delivered[msg_id]
            for name in eligible:
                if name in times:
                    got += 1
                    lat.append(times[name] - t_pub)
        lat.sort()
        deliveries = sum(len(d) - 1 for d in self.delivered.values())
        horizon = end
        return {
            "nodes": len([n for n in self.nodes.values() if n.born == 0.0]),
            "mode": self.mode,
            "churn_pct_per_min": self.churn,
            "heartbeat_s": self.a.heartbeat_s,
            "messages": len(self.published),
            "delivery_ratio": round(got / expected, 5) if expected else None,
            "latency_p50_ms": round(1000 * lat[len(lat) // 2], 1) if lat else None,
            "latency_p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1) if lat else None,
            "latency_max_ms": round(1000 * lat[-1], 1) if lat else None,
            "message_frames_per_delivery": round(self.counts["message_frames"] / deliveries, 3) if deliveries else None,
            "control_frames_per_delivery": round(self.counts["control_frames"] / deliveries, 3) if deliveries else None,
            "upload_kB_per_node_s": round(
                statistics.mean(n.sent_bytes for n in self.nodes.values()) / horizon / 1000, 2
            ),
            "busiest_cpu_share": round(max(n.cpu_busy for n in self.nodes.values()) / horizon, 3),
            "events": n_events,
            "sim_wall_s": round(wall, 1),
        }


# ---------------------------------------------------------------------------- admission
REPLAY_RATIO = 3.9  # a worker's generation costs 3.9 x a validator's replay of it on the same CPU (issue 32)


class Admission:
    """Workers, validators with committees and the trainer's ledger on a discrete event clock.

    Real: the committee draw (``protocol.committee.committee_order`` of the slot's seed) and
    the decision on the votes (``CommitteeRule.outcome``, the rule the ledger and validators
    apply), including escalation past a dead member. Modelled: each worker announces a batch
    every ``gen_s`` seconds (continuous generation, staggered starts); an announce and a vote
    reach their readers after a gossip delay drawn from a gossip simulation of the same
    swarm; each validator replays the batches it is called on one at a time, in arrival
    order, ``gen_s / REPLAY_RATIO`` seconds each; ``dead`` of the validators never vote.
    """

    def __init__(self, a: argparse.Namespace, workers: int, validators: int, size: int, delays: list[float]) -> None:
        self.a, self.workers, self.size, self.delays = a, workers, size, delays
        self.rnd = random.Random(f"{a.seed}-adm-{workers}-{validators}-{size}")
        self.vals = [f"v{i}" for i in range(validators)]
        self.dead = set(self.vals[: a.dead])
        on = size if 0 < size < validators else validators
        self.rule = CommitteeRule(size, on // 2 + 1, a.deadline_s, 1e-6)
        self.replay_s = a.gen_s / REPLAY_RATIO
        # a batch is stale (refused without a replay) once max_async versions passed since it
        # was generated: the trainer steps about once per generation time when keeping up
        self.expiry_s = a.max_async * a.gen_s
        self.expired = 0
        self.end = a.hours * 3600
        self.events: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.seq = 0
        self.free = dict.fromkeys(self.vals, 0.0)  # when each validator's replay queue drains
        self.busy = dict.fromkeys(self.vals, 0.0)
        self.queued: dict[str, list[float]] = {v: [] for v in self.vals}  # finish times of queued replays
        self.max_backlog = 0
        self.batches: dict[int, dict[str, Any]] = {}
        self.replays = 0

    def at(self, t: float, kind: str, *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, args))

    def delay(self) -> float:
        return self.rnd.choice(self.delays)

    def announce(self, now: float, worker: int, counter: int) -> None:
        seed = committee_seed(b"sim", f"w{worker}", 0, counter, b"root")
        order = committee_order(self.vals, seed)
        b = self.batches[len(self.batches)] = {"t": now, "order": order, "votes": {}, "called": set(), "admitted": None}
        self.call(len(self.batches) - 1, now)
        nxt = now + self.a.gen_s
        if nxt < self.a.hours * 3600:
            self.at(nxt, "announce", worker, counter + 1)
        if not self.rule.everyone(len(order)):
            self.at(now + self.a.deadline_s, "recheck", len(self.batches) - 1)
        del b

    def call(self, bid: int, now: float) -> None:
        """Validators in reach that have not started on the batch queue its replay."""
        b = self.batches[bid]
        reach = self.rule.reach(b["order"], b["votes"], now - b["t"], 1)
        for v in b["order"][:reach]:
            if v in b["called"] or v in self.dead:
                continue
            b["called"].add(v)
            heard = now + self.delay()  # the announce (or the votes that escalate) reach it
            start = max(heard, self.free[v])
            if start - b["t"] > self.expiry_s:
                self.expired += 1  # stale by the time its turn came: voted on without a replay
                continue
            self.free[v] = start + self.replay_s
            self.busy[v] += max(0.0, min(self.free[v], self.end) - start)
            self.replays += 1
            q = self.queued[v] = [t for t in self.queued[v] if t > heard] + [self.free[v]]
            self.max_backlog = max(self.max_backlog, len(q))
            self.at(self.free[v] + self.delay(), "vote", bid, v)

    def vote(self, now: float, bid: int, v: str) -> None:
        b = self.batches[bid]
        b["votes"][v] = Ballot(accept=True, rewards=(1.0,))
        self.decide(bid, now)

    def decide(self, bid: int, now: float) -> None:
        b = self.batches[bid]
        if b["admitted"] is not None:
            return
        d = self.rule.outcome(b["order"], b["votes"], now - b["t"], 1)
        if d.outcome is Quorum.ACCEPTED:
            b["admitted"] = now
        else:
            self.call(bid, now)

    def recheck(self, now: float, bid: int) -> None:
        b = self.batches[bid]
        if b["admitted"] is None:
            self.decide(bid, now)
            self.at(now + self.a.deadline_s, "recheck", bid)

    def run(self) -> dict[str, Any]:
        for w in range(self.workers):
            self.at(self.rnd.uniform(0, self.a.gen_s), "announce", w, 0)
        end = self.a.hours * 3600
        while self.events and self.events[0][0] <= end + 600:
            now, _s, kind, args = heapq.heappop(self.events)
            {"announce": self.announce, "vote": self.vote, "recheck": self.recheck}[kind](now, *args)
        # batches announced in the second half of the run, once queues have formed (or not)
        late = [b for b in self.batches.values() if b["t"] >= end / 2 and b["t"] < end]
        lat = sorted(b["admitted"] - b["t"] for b in late if b["admitted"] is not None)
        admitted = len(lat)
        on = self.size if 0 < self.size < len(self.vals) else len(self.vals)
        return {
            "workers": self.workers,
            "validators": len(self.vals),
            "committee": self.size,
            "quorum": self.rule.quorum,
            "dead": len(self.dead),
            "offered_load": round(self.workers * on / (REPLAY_RATIO * (len(self.vals) - len(self.dead))), 2),
            "admitted_share": round(admitted / len(late), 4) if late else None,
            "admit_p50_s": round(lat[len(lat) // 2], 1) if lat else None,
            "admit_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1) if lat else None,
            "max_backlog": self.max_backlog,
            "replays_per_batch": round(self.replays / len(self.batches), 2) if self.batches else None,
            "expired_replays": self.expired,
            "validator_busy": round(max(self.busy.values()) / end, 3),
        }


def gossip_delays(a: argparse.Namespace, nodes: int) -> list[float]:
    """Announce and vote delays: every delivery latency of a short gossip simulation of a
    swarm of ``nodes`` (Plumtree, no churn)."""
    quiet = argparse.Namespace(**{**vars(a), "rate": 10.0, "seconds": 5.0})
    sim = Sim(quiet, nodes, "plumtree", 0.0)
    sim.run()
    return [t - sim.published[m] for m, d in sim.delivered.items() for n, t in d.items() if n != sim.origin[m]]


def admission_rows(a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for v in (int(x) for x in a.validators.split(",")):
        for w in (int(x) for x in a.workers.split(",")):
            delays = gossip_delays(a, w + v + 1)
            for k in (int(x) for x in a.sizes.split(",")):
                if k >= v and k != 0:
                    continue  # the same as every validator
                row = Admission(a, w, v, k, delays).run()
                rows.append(row)
                print(
                    f"V={v} k={k or 'all'} W={w}: load {row['offered_load']}, admitted {row['admitted_share']}, "
                    f"p50 {row['admit_p50_s']} s, p99 {row['admit_p99_s']} s, backlog {row['max_backlog']}",
                    flush=True,
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="10,100,1000")
    ap.add_argument("--rate", type=float, default=20.0, help="messages per second, all publishers together")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--degree", type=int, default=6)
    ap.add_argument("--churn", default="0,10", help="%% of nodes leaving (and as many joining) per minute")
    ap.add_argument("--loss", type=float, default=0.001)
    ap.add_argument(
        "--heartbeat-s",
        type=float,
        default=0.0,
        help="every node gossips a heartbeat this often (the daemon: 2 s); 0: none",
    )
    ap.add_argument("--cpu-ms", type=float, default=1.0, help="CPU per frame received")
    ap.add_argument("--modes", default="plumtree,flood")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--what", default="gossip,admission")
    # admission: V validators, committees of k (0: every validator), W workers
    ap.add_argument("--validators", default="1,2,4,8")
    ap.add_argument("--sizes", default="0,1,2,3")
    ap.add_argument("--workers", default="4,8,16,32,64")
    ap.add_argument("--gen-s", type=float, default=60.0, help="a worker's generation time per batch")
    ap.add_argument("--deadline-s", type=float, default=60.0, help="[config] committee_deadline_s")
    ap.add_argument("--dead", type=int, default=0, help="validators that never vote")
    ap.add_argument("--max-async", type=int, default=2, help="[config] max_async: batches older are stale")
    ap.add_argument("--hours", type=float, default=2.0, help="simulated time of each admission run")
    simulate_fetch.add_arguments(ap)
    ap.add_argument("--plots", type=Path, default=None, help="write PNG plots of the results into this folder")
    ap.add_argument(
        "--replot",
        type=Path,
        nargs="*",
        default=None,
        help="plot earlier runs' output files (their last lines) instead of simulating",
    )
    a = ap.parse_args()
    if a.replot:
        runs = [json.loads(f.read_text().strip().splitlines()[-1]) for f in a.replot]
        plot(
            [r for run in runs for r in run["rows"]],
            [r for run in runs for r in run["admission"]],
            a.plots or Path("."),
            [r for run in runs for r in run.get("distribution", [])],
        )
        return
    rows: list[dict[str, Any]] = []
    adm: list[dict[str, Any]] = []
    dist: list[dict[str, Any]] = []
    if "admission" in a.what:
        adm = admission_rows(a)
    if "distribution" in a.what:
        dist = simulate_fetch.distribution_rows(a)
    if "gossip" not in a.what:
        a.nodes = ""
    for n in (int(x) for x in a.nodes.split(",") if x):
        for churn in (float(x) for x in a.churn.split(",")):
            for mode in a.modes.split(","):
                row = Sim(a, n, mode, churn).run()
                rows.append(row)
                print(
                    f"N={n} churn={churn:g}%/min {mode}: delivery {row['delivery_ratio']}, "
                    f"p50 {row['latency_p50_ms']} ms, p99 {row['latency_p99_ms']} ms, "
                    f"{row['message_frames_per_delivery']} msg + {row['control_frames_per_delivery']} ctl frames/delivery, "
                    f"{row['sim_wall_s']} s",
                    flush=True,
                )
    cols = [
        ("nodes", "N"),
        ("churn_pct_per_min", "churn %/min"),
        ("mode", "mode"),
        ("delivery_ratio", "delivery"),
        ("latency_p50_ms", "p50 ms"),
        ("latency_p99_ms", "p99 ms"),
        ("latency_max_ms", "max ms"),
        ("message_frames_per_delivery", "msg frames/dlv"),
        ("control_frames_per_delivery", "ctl frames/dlv"),
        ("upload_kB_per_node_s", "up kB/node/s"),
        ("busiest_cpu_share", "max CPU"),
        ("sim_wall_s", "sim s"),
    ]
    table(rows, cols)
    table(
        adm,
        [
            ("validators", "V"),
            ("committee", "k"),
            ("quorum", "quorum"),
            ("workers", "W"),
            ("dead", "dead"),
            ("offered_load", "load"),
            ("admitted_share", "admitted"),
            ("admit_p50_s", "p50 s"),
            ("admit_p99_s", "p99 s"),
            ("max_backlog", "max backlog"),
            ("replays_per_batch", "replays/batch"),
            ("validator_busy", "max busy"),
        ],
    )
    table(
        dist,
        [
            ("full_bytes", "checkpoint B"),
            ("what", "what"),
            ("size_bytes", "bytes"),
            ("chunks", "chunks"),
            ("fetchers", "fetchers"),
            ("churn_pct_per_min", "churn %/min"),
            ("p50_s", "50 % s"),
            ("p95_s", "95 % s"),
            ("p100_s", "100 % s"),
            ("bound_s", "bound s"),
            ("p95_over_bound", "95 % / bound"),
            ("own_bound_p50", "own p50"),
            ("own_bound_p95", "own p95"),
            ("seed_copies", "seed copies"),
            ("sim_wall_s", "sim s"),
        ],
    )
    out = {"bench": "simulate", "rate": a.rate, "seconds": a.seconds, "degree": a.degree, "loss": a.loss}
    out |= {"cpu_ms": a.cpu_ms, "gen_s": a.gen_s, "deadline_s": a.deadline_s, "hours": a.hours}
    out |= {"seed_mbps": a.seed_mbps, "known": a.known, "verify_mib_s": a.verify_mib_s, "apply_mib_s": a.apply_mib_s}
    print(json.dumps({**out, "rows": rows, "admission": adm, "distribution": dist}))
    if a.plots is not None:
        plot(rows, adm, a.plots, dist)


def plot(rows: list[dict[str, Any]], adm: list[dict[str, Any]], out: Path, dist: list[dict[str, Any]]) -> None:
    """gossip.png (p50 and p99 latency, and message frames per delivery, against nodes, per mode
    and churn; runs without heartbeats), admission.png (admitted share against offered load,
    per committee size) and distribution.png (time to 50/95/100 % of the fetchers over the
    bound, against fetchers, per checkpoint, full or delta, and churn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    plain = [r for r in rows if not r.get("heartbeat_s")]
    if plain:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for mode in sorted({r["mode"] for r in plain}):
            for churn in sorted({r["churn_pct_per_min"] for r in plain}):
                sel = sorted(
                    (r for r in plain if r["mode"] == mode and r["churn_pct_per_min"] == churn),
                    key=lambda r: r["nodes"],
                )
                if not sel:
                    continue
                label = f"{mode}, churn {churn:g} %/min"
                ns = [r["nodes"] for r in sel]
                ax1.plot(ns, [r["latency_p50_ms"] for r in sel], marker="o", label=f"{label}, p50")
                ax1.plot(ns, [r["latency_p99_ms"] for r in sel], marker="x", linestyle="--", label=f"{label}, p99")
                ax2.plot(ns, [r["message_frames_per_delivery"] for r in sel], marker="o", label=label)
        for ax, title, unit in ((ax1, "publication to delivery", "ms"), (ax2, "message frames per delivery", "frames")):
            ax.set_xscale("log")
            ax.set_xlabel("nodes")
            ax.set_ylabel(unit)
            ax.set_title(title)
            ax.grid(alpha=0.3)
        ax1.legend(fontsize=6)
        ax2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "gossip.png", dpi=120)
        plt.close(fig)
    if adm:
        fig, ax = plt.subplots(figsize=(6, 4))
        for k in sorted({r["committee"] for r in adm}):
            sel = sorted((r for r in adm if r["committee"] == k and not r["dead"]), key=lambda r: r["offered_load"])
            ax.scatter(
                [r["offered_load"] for r in sel], [r["admitted_share"] for r in sel], label=f"k = {k or 'all'}", s=14
            )
        xs = [x / 10 for x in range(1, 170)]
        ax.plot(xs, [min(1.0, 1 / x) for x in xs], color="grey", linewidth=0.8, label="1 / load")
        ax.set_xscale("log")
        ax.set_xlabel("offered load: W k / (r V)")
        ax.set_ylabel("share of batches admitted")
        ax.set_title("admission with committees (simulated)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "admission.png", dpi=120)
        plt.close(fig)
    if dist:
        sizes = sorted({r["full_bytes"] for r in dist})
        fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
        for ax, size in zip(axes[0], sizes):
            for what in ("full", "delta"):
                for churn in sorted({r["churn_pct_per_min"] for r in dist}):
                    sel = sorted(
                        (
                            r
                            for r in dist
                            if r["full_bytes"] == size and r["what"] == what and r["churn_pct_per_min"] == churn
                        ),
                        key=lambda r: r["fetchers"],
                    )
                    if not sel:
                        continue
                    ns = [r["fetchers"] for r in sel]
                    for key, style in (("p50_s", ":"), ("p95_s", "-"), ("p100_s", "--")):
                        ys = [r[key] / r["bound_s"] if r[key] is not None else None for r in sel]
                        ax.plot(ns, ys, linestyle=style, marker="o", label=f"{what}, churn {churn:g}, {key[1:-2]} %")
            ax.axhline(1.5, color="grey", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_xlabel("fetchers")
            ax.set_ylabel("time / bound")
            ax.set_title(f"{size / 1e9:g} GB checkpoint (simulated)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "distribution.png", dpi=120)
        plt.close(fig)


def table(rows: list[dict[str, Any]], cols: list[tuple[str, str]]) -> None:
    if not rows:
        return
    print()
    print(" ".join(f"{h:>{max(len(h), 6)}}" for _k, h in cols))
    for r in rows:
        print(" ".join(f"{(r[k] if r[k] != 0 or k != 'committee' else 'all')!s:>{max(len(h), 6)}}" for k, h in cols))


if __name__ == "__main__":
    main()
