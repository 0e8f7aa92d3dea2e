"""A userspace Ethernet switch that delays and drops frames: netem's job, above the kernel.

This machine's kernel has no ``netem`` qdisc, so a :class:`~harness.netns.Testbed`
built with ``emulate=True`` connects each host's link to a tap device instead of the
shared bridge, and this process (run inside the testbed's internet namespace) switches
frames between the taps: it learns MAC addresses like a bridge, floods unknown ones, and
holds every frame from port ``i`` to port ``j`` for ``delay_ms[i] + delay_ms[j]`` (so a
round trip between them takes twice that), dropping each frame with probability
``loss``. Frames of one pair of ports keep their order (a constant delay per pair).
ARP frames are delayed but never dropped: the loss stands for the internet path between
hosts, and ARP only resolves a host's own first hop, which a WAN does not lose. (Dropping
ARP too made a connect fail with EHOSTUNREACH whenever all three of the kernel's ARP probes
were lost: ~0.7 % of resolutions at 10 % loss, a CI failure.)

    python -m harness.lossy_switch --loss 0.01 --seed 0 TAP:DELAY_MS [TAP:DELAY_MS ...]

It prints ``ready`` once every tap is open, and on SIGTERM prints one JSON line with
frames forwarded and dropped.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000

ETHERTYPE_ARP = b"\x08\x06"  # an Ethernet frame's type field (bytes 12-13) for ARP


def open_tap(name: str) -> int:
    """Attach to the (persistent) tap device ``name``."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("ports", nargs="+", help="TAP:ONE_WAY_DELAY_MS")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    fds: list[int] = []
    delay: list[float] = []
    for spec in a.ports:
        name, ms = spec.split(":")
        fds.append(open_tap(name))
        delay.append(float(ms) / 1000)
    port_of = {fd: i for i, fd in enumerate(fds)}
    macs: dict[bytes, int] = {}
    queue: list[tuple[float, int, int, bytes]] = []  # (deliver at, seq, out port, frame)
    seq = 0
    stats = {"forwarded": 0, "dropped": 0, "frames_in": 0}
    stop = False

    def on_term(signum, frame) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print("ready", flush=True)
    while not stop:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, frame = heapq.heappop(queue)
            try:
                os.write(fds[out], frame)
                stats["forwarded"] += 1
            except OSError:
                pass
        timeout = max(0.0, queue[0][0] - now) if queue else 0.5
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd in ready:
            src = port_of[fd]
            while True:
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    break
                if len(frame) < 14:
                    continue
                stats["frames_in"] += 1
                macs[frame[6:12]] = src
                dst = macs.get(frame[0:6])
                outs = [dst] if dst is not None and dst != src else [p for p in range(len(fds)) if p != src]
                arp = frame[12:14] == ETHERTYPE_ARP
                for out in outs:
                    if a.loss and not arp and rng.random() < a.loss:
                        stats["dropped"] += 1
                        continue
                    seq += 1
                    heapq.heappush(queue, (now + delay[src] + delay[out], seq, out, frame))
    print(json.dumps(stats), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
