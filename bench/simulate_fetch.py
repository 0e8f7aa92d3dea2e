"""Checkpoint distribution on a discrete event clock, driving the real fetch schedule and the
real super-seeding rules (issue 32 points 3, 5 and 6). ``bench/simulate.py --what
distribution`` runs it; so does this file alone with the same flags.

What is real and what is modelled:

* **Real**: every fetcher runs ``node.checkpoints.schedule.FetchSchedule``, the object the
  daemon's ``VersionFetcher`` drives: which peers to open sessions with, which chunk to ask
  each for (rarest first, seed-only chunks from seeds), pipeline depth, ``ELSEWHERE``
  hold-offs, ``NOT_HELD`` corrections, the end game, cool-downs after failures, rates.
  Every node holding a whole version answers GETs with the chunk server's super-seeding
  rules: ``node.checkpoints.server.SeedLog`` (who got each chunk and when; hold-off 10 s,
  1 s once every chunk went out) and ``SendPace`` (a send to a slow recipient holds nothing
  off), at the server's defaults.
* **Modelled**: a data connection opens ``SETUP_RTTS`` round trips after the schedule
  starts it (ticket over request/response, TCP connect, HELLO and the first HAVE); a GET
  reaches the holder one path latency after it is sent; a holder answers one connection's
  requests one after another, a refusal at once and a chunk at a rate fixed when its send
  starts and ends, the chunks on their way through either of its links are re-shared (the
  max-min fair level of each link, see :meth:`Distribution.reshare`), at ``WIRE`` bytes per
  payload byte; the payload
  arrives one path latency after its send ends. Have-sets travel as the daemon's do: pushed
  ahead of every reply (``FLAG_PUSH_HAVE``), polled on idle connections every
  ``have_poll_s`` (scaled with the chunk size as the fetcher scales it) and gossiped in
  heartbeats every ``HEARTBEAT_S``; each fetcher knows the seed and ``--known`` other nodes
  (the daemon knows every node: a full view of 1,000 nodes costs this simulator a million
  have-set updates per heartbeat, see docs/scale.md). Each arriving chunk is hash-checked
  and written on the fetcher's CPU at ``--verify-mib-s`` (measured: bench/distribution.py,
  ``verify_s``), or on a pool of ``--cores`` cores shared by all nodes (the 8-process
  benches on this machine); a delta is then applied at ``--apply-mib-s`` of the full
  checkpoint (bench/delta.py: loadable 0.67 s after held for 269 MB). TCP loss is not modelled for bulk (it
  shows as a lower rate on real links).
* **Links**: as ``bench/simulate.py``'s (70 % home links: download log-uniform
  50-1000 Mbit/s, upload 1/10-1/2 of it and at least 20 Mbit/s; 30 % datacentre links
  1-10 Gbit/s; access latency 2.5-150 ms), or exact caps (``--link-caps``, seeder first,
  zero latency: the 8-node ``bench/distribution.py --link-caps`` configuration).
* **Churn**: ``--churn P``: P % of the fetchers leave per minute (their connections fail at
  once) and as many fresh ones join and start from nothing.

Reported per configuration: seconds until 50, 95 and 100 % of the fetchers present at the
end hold the version loadable (each from when it learnt of the version; under churn the
newcomers too, churn stopping once every fetcher of the first generation is done), against
the bound ``max(size / seeder upload, size / slowest fetcher download)`` (plus, for a delta,
its apply); the median and 95th percentile over fetchers of each one's time over its own
bound (its own download instead of the slowest's); the copies the seeder uploaded, duplicate
chunks, and the simulator's own wall time.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from node.checkpoints.fetcher import HAVE_POLL_CHUNK, HAVE_POLL_MIN_S  # noqa: E402
from node.checkpoints.schedule import FetchPeer, FetchSchedule  # noqa: E402
from node.checkpoints.server import SeedLog, SendPace  # noqa: E402
from node.checkpoints.store import delta_chunk_size  # noqa: E402
from protocol import chunk_frames as F  # noqa: E402
from protocol.bitmap import Bitmap  # noqa: E402

HEARTBEAT_S = 2.0  # the daemon's heartbeat period
RESEED_AFTER_S = 10.0  # ChunkServer defaults
RESEED_AFTER_ALL_S = 1.0
HAVE_POLL_S = 0.25  # VersionFetcher default
MAX_PEERS = 16  # sessions one fetch keeps open
SETUP_RTTS = 3  # ticket request/response, TCP connect, HELLO + first HAVE
SETUP_CPU_S = 0.005  # a ticket's signature and the connection's set-up, per session
MIB = 1 << 20
# Payload bytes per byte on the wire: TCP/IP headers (1448 of 1514 bytes per segment). Measured:
# a raw TCP copy of 64 MiB through a 20 Mbit/s tbf took 28.06 s against 26.84 s of payload.
WIRE = 1514 / 1448
RESHARE_ALL = 16  # hosts with at most this many flows re-share on every change (see reshare)


def draw_link(rnd: random.Random) -> tuple[float, float, float]:
    """(upload bit/s, download bit/s, access latency s) from the stated distribution (every
    simulation's: bench/simulate.py's gossip and admission runs draw from it too)."""
    if rnd.random() < 0.7:
        down = math.exp(rnd.uniform(math.log(50e6), math.log(1000e6)))
        up = max(20e6, down * rnd.uniform(0.1, 0.5))
    else:
        up = down = math.exp(rnd.uniform(math.log(1e9), math.log(10e9)))
    latency = math.exp(rnd.uniform(math.log(0.0025), math.log(0.150)))
    return up, down, latency


@dataclass
class Conn:
    """One data connection, fetcher ``f`` to holder ``h``: ``arrived`` are the GETs that
    reached the holder and wait for their reply (replies go one after another)."""

    f: int
    h: int
    peer: FetchPeer
    gen: int
    open: bool = False
    arrived: deque[int] = field(default_factory=deque)
    serving: bool = False
    poll_due: bool = False
    pushed: int = -1  # the holder's have-set version this fetcher last saw on the connection


@dataclass(eq=False)
class Flow:
    """One chunk on its way from ``src`` to ``dst`` at ``rate`` bit/s since ``last``."""

    c: Conn
    i: int
    src: Host
    dst: Host
    left_bits: float
    started: float
    share: int  # sends running at the source when it started (SendPace)
    rate: float = 0.0
    last: float = 0.0
    token: int = 0


def fair_level(capacity: float, demands: list[float]) -> float:
    """Max-min fair share of ``capacity`` among flows that can each take at most their
    demand: the level every flow not limited by its demand gets."""
    left, k = capacity, len(demands)
    for d in sorted(demands):
        if d * k >= left:
            return left / k
        left -= d
        k -= 1
    return math.inf


@dataclass
class Host:
    name: int
    up_bps: float
    down_bps: float
    latency_s: float
    held: Bitmap
    sched: FetchSchedule | None = None  # None: the seeder
    log: SeedLog | None = None  # super-seeding memory, once the version is held whole
    pace: SendPace = field(default_factory=SendPace)
    # chunk sends running from / to this host (dicts: ordered, so a seeded run repeats exactly)
    outgoing: dict[Flow, None] = field(default_factory=dict)
    incoming: dict[Flow, None] = field(default_factory=dict)
    version: int = 0  # bumps whenever ``held`` grows
    known: list[int] = field(default_factory=list)
    known_by: set[int] = field(default_factory=set)  # fetchers whose heartbeats view holds this host
    watchers: list[Conn] = field(default_factory=list)  # idle connections to this host, polling HAVE
    dirty: bool = False  # its have-set grew since the last heartbeat
    shared_n: int = 0  # its flows (both ways) when they were last re-shared
    first: tuple[float, float] | None = None  # Distribution.first_levels, cached
    levels: tuple[float, float, float, float] | None = None  # Distribution.levels, cached
    seen: dict[int, int] = field(default_factory=dict)  # known peer -> its have-set version given
    conns: dict[int, Conn] = field(default_factory=dict)  # holder -> this fetcher's connection
    alive: bool = True
    start: float = 0.0
    held_at: float | None = None
    loadable_at: float | None = None
    cpu_free: float = 0.0
    seed_sent: int = 0


class Distribution:
    """One version from one seeder to ``fetchers`` nodes."""

    def __init__(self, a: argparse.Namespace, fetchers: int, size: int, churn: float, delta: bool) -> None:
        self.a, self.size, self.churn, self.delta = a, size, churn, delta
        self.rnd = random.Random(f"{a.seed}-dist-{fetchers}-{size}-{churn}-{delta}")
        self.n = max(1, math.ceil(size / a.chunk_bytes))
        self.chunk = math.ceil(size / self.n)
        self.now = 0.0
        self.events: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.seq = 0
        self.gen = 0
        self.hosts: dict[int, Host] = {}
        self.left = 0
        self.cores_free: list[float] = [0.0] * a.cores if a.cores else []
        self.have_poll_s = HAVE_POLL_S
        if self.chunk < HAVE_POLL_CHUNK:  # as VersionFetcher scales it
            self.have_poll_s = max(HAVE_POLL_S * self.chunk / HAVE_POLL_CHUNK, min(HAVE_POLL_S, HAVE_POLL_MIN_S))
        self.verify_s = self.chunk / (a.verify_mib_s * MIB)
        self.apply_s = a.full_bytes / (a.apply_mib_s * MIB) if delta else 0.0
        self.duplicates = 0
        self.events_run = 0
        self.wire = 1.0 if a.payload_caps else WIRE
        caps = [float(x) * 1e6 for x in a.link_caps.split(",")] if a.link_caps else []
        down = a.down_mbps * 1e6 if a.down_mbps else None  # --link-caps: downloads capped apart
        seed_bps = caps[0] if caps else a.seed_mbps * 1e6
        seed = self._host(seed_bps, down or seed_bps, 0.0 if caps else 0.005)
        for i in range(self.n):
            seed.held.set(i)
        seed.version = 1
        seed.log = SeedLog(self.n)
        for k in range(fetchers):
            if caps:
                c = caps[1 + k % (len(caps) - 1)]
                self._host(c, down or c, 0.0)
            else:
                self._host(*draw_link(self.rnd))
        for h in list(self.hosts.values())[1:]:
            self._introduce(h)

    # ------------------------------------------------------------ hosts
    def _host(self, up: float, down: float, latency: float) -> Host:
        name = len(self.hosts)
        h = Host(name, up, down, latency, Bitmap(self.n), start=self.now)
        if name:
            self.left += 1  # fetchers alive without the version loadable
            h.sched = FetchSchedule(h.held, self.chunk, rng=random.Random(f"{self.a.seed}-{name}"))
        self.hosts[name] = h
        return h

    def _introduce(self, h: Host) -> None:
        """``h`` learns of the seeder and ``--known`` other live fetchers (and they of it), then
        of the version (the announce) after a path latency from the seeder."""
        others = [x for x in self.hosts if x not in (0, h.name) and self.hosts[x].alive]
        h.known = [0, *self.rnd.sample(others, min(self.a.known, len(others)))]
        for x in h.known:
            self.hosts[x].known_by.add(h.name)
        for x in h.known[1:]:
            o = self.hosts[x]
            if h.name not in o.known and len(o.known) <= 2 * self.a.known:
                o.known.append(h.name)
                h.known_by.add(o.name)
        self.at(self.now + h.latency_s + self.hosts[0].latency_s, "announce", h.name)

    def path(self, a: int, b: int) -> float:
        return self.hosts[a].latency_s + self.hosts[b].latency_s

    def at(self, t: float, kind: str, *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, args))

    # ------------------------------------------------------------ the fetcher's driver
    def announce(self, f: int) -> None:
        h = self.hosts[f]
        if not h.alive:
            return
        assert h.sched is not None
        h.start = self.now
        h.sched.start(self.now)
        self.gossip_haves(h)
        self.start_sessions(h)

    def gossip_haves(self, h: Host) -> None:
        """Heartbeats: the have-sets of the peers ``h`` knows, where they changed."""
        assert h.sched is not None
        for x in h.known:
            o = self.hosts[x]
            if not o.alive:
                continue
            if o.version and h.seen.get(x) != o.version:
                h.seen[x] = o.version
                h.sched.update_have(str(x), o.held.to_bytes())
            else:  # a heartbeat without the version: tried anyway (node/checkpoints/service.py)
                h.sched.add_peer(str(x))

    def start_sessions(self, h: Host) -> None:
        if not h.alive or h.held_at is not None:
            return
        assert h.sched is not None
        for p in h.sched.to_start(self.now, MAX_PEERS, lambda p: self.hosts[int(p.peer_id)].alive):
            x = int(p.peer_id)
            self.gen += 1
            c = h.conns[x] = Conn(h.name, x, p, self.gen)
            self.at(self.now + SETUP_CPU_S + SETUP_RTTS * 2 * self.path(h.name, x), "opened", h.name, x, c.gen)

    def conn(self, f: int, x: int, gen: int) -> Conn | None:
        c = self.hosts[f].conns.get(x)
        return c if c is not None and c.gen == gen and self.hosts[f].alive else None

    def opened(self, f: int, x: int, gen: int) -> None:
        c = self.conn(f, x, gen)
        if c is None:
            return
        if not self.hosts[x].alive:
            self.fail(c, "connection refused")
            return
        c.open = True
        self.push_have(c)
        self.pump(c)

    def push_have(self, c: Conn) -> None:
        """The holder's have-set, as pushed ahead of a reply or answered to a HAVE poll."""
        o = self.hosts[c.h]
        if c.pushed != o.version:
            c.pushed = o.version
            sched = self.hosts[c.f].sched
            assert sched is not None
            sched.update_have(str(c.h), o.held.to_bytes())

    def pump(self, c: Conn) -> None:
        """Send the GETs the schedule asks for on ``c``; an idle connection polls HAVE."""
        f = self.hosts[c.f]
        if not c.open or f.held_at is not None:
            return
        assert f.sched is not None
        while (i := f.sched.next_request(c.peer, self.now)) is not None:
            self.at(self.now + self.path(c.f, c.h), "get", c.f, c.h, c.gen, i)
        if c.peer.inflight or c.poll_due:
            return
        # An idle connection polls HAVE every have_poll_s. Simulated without the polls that
        # would find nothing new: the holder wakes its idle connections when its have-set
        # grows, each after a random part of the poll period (when its next poll would come);
        # timed polls remain where time alone changes the answer (a refusal's hold-off ending,
        # the end game's stragglers).
        o = self.hosts[c.h]
        if c.peer.refused:
            c.poll_due = True
            wait = min(self.have_poll_s, max(0.01, min(c.peer.refused.values()) - self.now))
            self.at(self.now + wait, "poll", c.f, c.h, c.gen)
        elif o.held.complete and not f.sched.missing:
            c.poll_due = True
            self.at(self.now + self.have_poll_s, "poll", c.f, c.h, c.gen)
        else:
            o.watchers.append(c)

    def poll(self, f: int, x: int, gen: int) -> None:
        c = self.conn(f, x, gen)
        if c is None:
            return
        c.poll_due = False
        if not self.hosts[x].alive:
            self.fail(c, "connection reset")
            return
        self.push_have(c)  # (the reply's round trip is ignored: polls are cheap and frequent)
        self.pump(c)

    def fail(self, c: Conn, why: str) -> None:
        f = self.hosts[c.f]
        assert f.sched is not None
        f.conns.pop(c.h, None)
        f.sched.failed(c.peer, self.now, why)
        f.sched.ended(c.peer)
        self.at(c.peer.cooldown_until, "wake", f.name)  # the driver's rescheduling
        self.start_sessions(f)
        for other in list(f.conns.values()):  # its chunks are back in the pool
            self.pump(other)

    def wake(self, f: int) -> None:
        self.start_sessions(self.hosts[f])

    def close_all(self, f: Host) -> None:
        assert f.sched is not None
        for c in list(f.conns.values()):
            f.sched.ended(c.peer)
        f.conns.clear()

    # ------------------------------------------------------------ the holder's server
    def get(self, f: int, x: int, gen: int, i: int) -> None:
        c = self.conn(f, x, gen)
        if c is None:
            return
        if not self.hosts[x].alive:
            self.fail(c, "connection reset")
            return
        c.arrived.append(i)
        if not c.serving:
            self.serve(c)

    def serve(self, c: Conn) -> None:
        o, f = self.hosts[c.h], self.hosts[c.f]
        while c.arrived:
            i = c.arrived.popleft()
            if i not in o.held:
                self.at(self.now + self.path(c.f, c.h), "reply", c.f, c.h, c.gen, i, F.NOT_HELD)
                continue
            if o.log is not None and o.log.held_off(
                i,
                str(c.f),
                self.now,
                RESEED_AFTER_S,
                RESEED_AFTER_ALL_S,
                o.pace.slow_after_s(self.chunk, len(o.outgoing)),
            ):
                self.at(self.now + self.path(c.f, c.h), "reply", c.f, c.h, c.gen, i, F.ELSEWHERE)
                continue
            c.serving = True
            fl = Flow(c, i, o, f, self.chunk * 8 * self.wire, self.now, len(o.outgoing) + 1, last=self.now)
            o.outgoing[fl] = None
            f.incoming[fl] = None
            if o.log is not None:
                o.log.start(i, str(c.f), self.now)
            self.reshare(o, f, new=(fl,))
            return
        c.serving = False

    def reshare(self, *hosts: Host, new: tuple[Flow, ...] = ()) -> None:
        """Flows touching ``hosts`` (whose flows just changed) get new rates, from two rounds of
        max-min fair sharing: first each link's fair level when every flow on it asks for an
        equal share of its other end's link; then each link's level when every flow asks for
        what its other end's first level gives it. A flow's rate is the smaller of what its two
        ends give it. Local, not a global max-min: a host's levels are recomputed only when its
        own flows change (a neighbour's change reaches them later), so a link may be over- or
        under-used by a few per cent for a moment."""
        for h in hosts:
            h.first = h.levels = None
        flows: dict[Flow, None] = dict.fromkeys(new)
        for h in hosts:
            n = len(h.outgoing) + len(h.incoming)
            # a host with many flows is re-shared when their number changed by a tenth: a seed
            # serving hundreds re-shared on every change costs N^2 (its rates move by < 10 %)
            if n <= RESHARE_ALL or abs(n - h.shared_n) * 10 > h.shared_n:
                h.shared_n = n
                flows.update(h.outgoing)
                flows.update(h.incoming)
        for fl in flows:
            src, dst = fl.src, fl.dst
            su, sd = self.levels(src), self.levels(dst)
            rate = min(dst.down_bps, sd[1], su[2], src.up_bps, su[0], sd[3])
            fl.left_bits -= fl.rate * (self.now - fl.last)
            fl.last, fl.rate = self.now, rate
            fl.token += 1
            self.at(self.now + max(0.0, fl.left_bits) / rate, "sent", fl, fl.token)

    @staticmethod
    def first_levels(h: Host) -> tuple[float, float]:
        """``h``'s first-round fair levels (up, down), cached until its own flows change."""
        if h.first is None:
            h.first = (
                fair_level(h.up_bps, [g.dst.down_bps / len(g.dst.incoming) for g in h.outgoing]),
                fair_level(h.down_bps, [g.src.up_bps / len(g.src.outgoing) for g in h.incoming]),
            )
        return h.first

    def levels(self, h: Host) -> tuple[float, float, float, float]:
        """``h``'s fair levels (first round up and down, second round up and down), cached
        until its own flows change."""
        if h.levels is None:
            l1_up, l1_down = self.first_levels(h)
            l2_up = fair_level(h.up_bps, [min(g.dst.down_bps, self.first_levels(g.dst)[1]) for g in h.outgoing])
            l2_down = fair_level(h.down_bps, [min(g.src.up_bps, self.first_levels(g.src)[0]) for g in h.incoming])
            h.levels = (l1_up, l1_down, l2_up, l2_down)
        return h.levels

    def sent(self, fl: Flow, token: int) -> None:
        if token != fl.token:
            return  # re-shared since: a later event ends it
        o, fh, c = fl.src, fl.dst, fl.c
        o.outgoing.pop(fl, None)
        fh.incoming.pop(fl, None)
        self.reshare(o, fh)
        took = self.now - fl.started
        if o.name == 0:
            o.seed_sent += self.chunk
        if o.log is not None:
            o.log.finish(
                fl.i, str(c.f), True, self.now, o.pace.sent(self.chunk, took, max(fl.share, len(o.outgoing) + 1))
            )
        self.at(self.now + self.path(c.f, c.h), "payload", c.f, c.h, c.gen, fl.i, took)
        if self.conn(c.f, c.h, c.gen) is c:
            c.serving = False
            self.serve(c)

    # ------------------------------------------------------------ replies at the fetcher
    def reply(self, f: int, x: int, gen: int, i: int, status: int) -> None:
        c = self.conn(f, x, gen)
        if c is None:
            return
        sched = self.hosts[f].sched
        assert sched is not None
        self.push_have(c)
        if not sched.refused_reply(c.peer, i, status, self.now):
            self.fail(c, f"status {status}")
            return
        self.pump(c)

    def payload(self, f: int, x: int, gen: int, i: int, took: float) -> None:
        c = self.conn(f, x, gen)
        if c is None:
            return
        fh = self.hosts[f]
        assert fh.sched is not None
        self.push_have(c)
        if fh.sched.payload(c.peer, i, self.chunk, self.now, took):
            if self.cores_free:  # a pool of cores all nodes share
                k = min(range(len(self.cores_free)), key=self.cores_free.__getitem__)
                done = self.cores_free[k] = max(self.now, self.cores_free[k]) + self.verify_s
            else:
                done = fh.cpu_free = max(self.now, fh.cpu_free) + self.verify_s
            self.at(done, "checked", f, x, gen, i)
        else:
            self.duplicates += 1
        self.pump(c)

    def checked(self, f: int, x: int, gen: int, i: int) -> None:
        fh = self.hosts[f]
        if not fh.alive:
            return
        assert fh.sched is not None
        fh.held.set(i)
        fh.version += 1
        fh.dirty = True
        watchers, fh.watchers = fh.watchers, []
        for w in watchers:
            if self.conn(w.f, w.h, w.gen) is w and not w.poll_due:
                w.poll_due = True
                self.at(self.now + self.rnd.uniform(0, self.have_poll_s), "poll", w.f, w.h, w.gen)
        peer = fh.sched.peers.get(str(x))
        if peer is not None:
            fh.sched.checked(peer, i, self.chunk, True)
        if fh.held.complete:
            fh.held_at = self.now
            fh.loadable_at = self.now + self.apply_s
            self.left -= 1
            fh.log = SeedLog(self.n)
            self.close_all(fh)
            return
        for c in list(fh.conns.values()):
            self.pump(c)

    # ------------------------------------------------------------ the swarm
    @staticmethod
    def fetching(h: Host) -> bool:
        return h.alive and h.sched is not None and h.held_at is None and h.sched.started is not None

    def heartbeat(self) -> None:
        """Every node's heartbeat reaches the fetchers that know it: the have-sets that grew."""
        for o in self.hosts.values():
            if not (o.dirty and o.alive):
                continue
            o.dirty = False
            have = o.held.to_bytes()
            for x in o.known_by:
                f = self.hosts[x]
                if self.fetching(f) and f.seen.get(o.name) != o.version:
                    assert f.sched is not None
                    f.seen[o.name] = o.version
                    f.sched.update_have(str(o.name), have)
        for h in self.hosts.values():
            if self.fetching(h) and len(h.conns) < MAX_PEERS:
                self.start_sessions(h)
        if self.pending():
            self.at(self.now + HEARTBEAT_S, "heartbeat")

    def leave(self) -> None:
        live = [h for h in self.hosts.values() if h.name and h.alive]
        if live:
            h = self.rnd.choice(live)
            h.alive = False
            if h.loadable_at is None:
                self.left -= 1
            for fl in (*h.outgoing, *h.incoming):  # its chunks in flight stop
                fl.token += 1
                fl.src.outgoing.pop(fl, None)
                fl.dst.incoming.pop(fl, None)
                self.reshare(fl.src, fl.dst)
            for o in self.hosts.values():  # connections to it fail at once
                c = o.conns.get(h.name)
                if c is not None and o.alive:
                    self.fail(c, "connection reset")
            h.conns.clear()
            self._introduce(self._host(*draw_link(self.rnd)))
        if self.churning():
            self.at(self.now + self.rnd.expovariate(self.churn_rate), "leave")

    def churning(self) -> bool:
        """Churn goes on while a fetcher of the first generation still fetches (those who join
        later then finish undisturbed: else a run under churn never ends)."""
        return any(h.alive and h.loadable_at is None for h in self.hosts.values() if 0 < h.name <= self.first)

    def pending(self) -> bool:
        return self.left > 0

    def run(self) -> dict[str, Any]:
        wall = time.monotonic()
        fetchers = self.first = len(self.hosts) - 1
        self.at(HEARTBEAT_S, "heartbeat")
        self.churn_rate = self.churn / 100 * fetchers / 60.0
        if self.churn_rate > 0:
            self.at(self.rnd.expovariate(self.churn_rate), "leave")
        handlers = {
            "announce": self.announce,
            "opened": self.opened,
            "get": self.get,
            "sent": self.sent,
            "reply": self.reply,
            "payload": self.payload,
            "checked": self.checked,
            "poll": self.poll,
            "heartbeat": self.heartbeat,
            "wake": self.wake,
            "leave": self.leave,
        }
        limit = self.a.max_sim_s
        while self.events and self.pending():
            t, _s, kind, args = heapq.heappop(self.events)
            if t > limit:
                break
            self.now = t
            self.events_run += 1
            handlers[kind](*args)
        return self.report(time.monotonic() - wall)

    def report(self, wall: float) -> dict[str, Any]:
        present = [h for h in self.hosts.values() if h.name and h.alive]
        times = sorted((h.loadable_at - h.start) if h.loadable_at is not None else math.inf for h in present)
        seed = self.hosts[0]
        slowest = min(h.down_bps for h in present)
        # the seeder's uplink and the slowest fetcher's downlink, and a delta's apply
        bound = max(self.size * 8 / seed.up_bps, self.size * 8 / slowest) + self.apply_s

        def q(p: float, xs: list[float] = times) -> float | None:
            t = xs[min(len(xs) - 1, max(0, math.ceil(p * len(xs)) - 1))]
            return round(t, 2) if t != math.inf else None

        # each fetcher against its own bound: the seeder's uplink or its own download
        own = sorted(
            (h.loadable_at - h.start) / (max(self.size * 8 / seed.up_bps, self.size * 8 / h.down_bps) + self.apply_s)
            if h.loadable_at is not None
            else math.inf
            for h in present
        )

        per = {}
        if self.a.link_caps:
            per = {
                "by_fetcher": [
                    {
                        "mbps": round(h.down_bps / 1e6),
                        "loadable_s": round(h.loadable_at - h.start, 3) if h.loadable_at is not None else None,
                        "bound_s": round(
                            max(self.size * 8 / seed.up_bps, self.size * 8 / h.down_bps) + self.apply_s, 3
                        ),
                    }
                    for h in present
                ]
            }
        return {
            "what": "delta" if self.delta else "full",
            "fetchers": len(present),
            "size_bytes": self.size,
            "chunks": self.n,
            "churn_pct_per_min": self.churn,
            "bound_s": round(bound, 2),
            "p50_s": q(0.5),
            "p95_s": q(0.95),
            "p100_s": q(1.0),
            "p95_over_bound": round(q(0.95) / bound, 2) if q(0.95) else None,
            "own_bound_p50": q(0.5, own),
            "own_bound_p95": q(0.95, own),
            "seed_copies": round(seed.seed_sent / self.size, 2),
            "duplicates": self.duplicates,
            "left": sum(1 for h in self.hosts.values() if h.name and not h.alive),
            "events": self.events_run,
            "sim_wall_s": round(wall, 1),
            **per,
        }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--fetchers", default="10,100,1000", help="distribution: fetcher counts")
    ap.add_argument(
        "--sizes-mb",
        default="269,62000",
        help="distribution: full checkpoints in MB (SmolLM2-135M bf16, INTELLECT-2's 32B in bf16)",
    )
    ap.add_argument(
        "--delta-ratio", type=float, default=52.0, help="a delta is this many times smaller (bench/delta.py)"
    )
    ap.add_argument("--chunk-bytes", type=int, default=4 * MIB, help="chunk size (coarser: a faster simulation)")
    ap.add_argument("--max-chunks", type=int, default=256, help="coarsen chunks so a version has at most this many")
    ap.add_argument("--seed-mbps", type=float, default=1000.0, help="the seeder's (trainer's) link, both ways")
    ap.add_argument("--known", type=int, default=32, help="other fetchers each fetcher knows")
    ap.add_argument(
        "--verify-mib-s",
        type=float,
        default=500.0,
        help="chunk hash-check and write, MiB/s per core (bench/distribution.py --link-caps: 0.11-0.14 s for 64 MiB)",
    )
    ap.add_argument(
        "--apply-mib-s",
        type=float,
        default=385.0,
        help="delta apply on the critical path, MiB of the full checkpoint per s (bench/delta.py: 0.67 s for 269 MB)",
    )
    ap.add_argument("--cores", type=int, default=0, help="a pool of cores all nodes share (0: a core each)")
    ap.add_argument(
        "--link-caps",
        default="",
        help="Mbit/s, seeder first: exact caps both ways, zero latency (fetchers take them in turn)",
    )
    ap.add_argument(
        "--payload-caps",
        action="store_true",
        help="--link-caps count payload bytes (the chunk server's upload cap, bench/delta.py), not wire bytes",
    )
    ap.add_argument(
        "--down-mbps",
        type=float,
        default=0.0,
        help="--link-caps: every download capped at this instead (bench/delta.py caps uploads only)",
    )
    ap.add_argument("--max-sim-s", type=float, default=6 * 3600.0, help="give up after this much simulated time")
    ap.add_argument("--dist-churn", default="0,10", help="%% of fetchers leaving (and joining) per minute")
    ap.add_argument(
        "--skip",
        default="",
        help="rows to leave out, as MB:full|delta:fetchers:churn, comma separated (e.g. 62000:full:1000:10)",
    )


def distribution_rows(a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for size_mb in (float(x) for x in a.sizes_mb.split(",")):
        full = int(size_mb * 1e6)
        for delta in (False, True):
            size = max(1, int(full / a.delta_ratio)) if delta else full
            for fetchers in (int(x) for x in a.fetchers.split(",")):
                for churn in (float(x) for x in a.dist_churn.split(",")):
                    if f"{size_mb:g}:{'delta' if delta else 'full'}:{fetchers}:{churn:g}" in a.skip.split(","):
                        continue
                    b = argparse.Namespace(**vars(a))
                    b.full_bytes = full
                    cs = delta_chunk_size(size, a.chunk_bytes) if delta else a.chunk_bytes  # as published
                    b.chunk_bytes = max(cs, math.ceil(size / a.max_chunks))
                    row = Distribution(b, fetchers, size, churn, delta).run()
                    row["full_bytes"] = full
                    rows.append(row)
                    print(
                        f"{size_mb:g} MB {row['what']} ({size / 1e6:.0f} MB, {row['chunks']} chunks) to {fetchers}, "
                        f"churn {churn:g}%/min: p50 {row['p50_s']} s, p95 {row['p95_s']} s, p100 {row['p100_s']} s, "
                        f"bound {row['bound_s']} s (p95 {row['p95_over_bound']} x), seed {row['seed_copies']} copies, "
                        f"{row['sim_wall_s']} s",
                        flush=True,
                    )
                    print("row " + json.dumps(row), flush=True)  # each row as it is done (long runs)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rows = distribution_rows(a)
    print(json.dumps({"bench": "simulate_fetch", "rows": rows}))


if __name__ == "__main__":
    main()
