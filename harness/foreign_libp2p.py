"""A plain py-libp2p host that is not primenode: Noise only, none of primenode's protocols.

    python -m harness.foreign_libp2p            # listen; print the full address; run until killed
    python -m harness.foreign_libp2p --dial ADDR  # also dial ADDR, print "connected", then
                                                         # "closed" once the remote drops us

Used by tests/system/test_join_foreign.py as the "libp2p node that is not primenode" a join may be
pointed at, and as a foreign peer connecting to a primenode node.
"""

from __future__ import annotations

import sys

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
from libp2p.security.noise.transport import Transport as NoiseTransport


async def main(dial: str | None) -> None:
    kp = create_new_key_pair()
    noise = NoiseTransport(libp2p_keypair=kp, noise_privkey=create_x25519_key_pair().private_key)
    host = new_host(key_pair=kp, sec_opt={NOISE_ID: noise})
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        print(host.get_addrs()[0], flush=True)
        if dial is not None:
            info = info_from_p2p_addr(multiaddr.Multiaddr(dial))
            with trio.fail_after(30):
                await host.connect(info)
            print("connected", flush=True)
            # hang guard 60 s: the remote drops a peer without its gossip; the library has no
            # event for a closed connection that a plain host could wait on, hence the poll
            with trio.fail_after(60):
                while host.get_network().get_connections(info.peer_id):  # noqa: ASYNC110
                    await trio.sleep(0.1)
            print("closed", flush=True)
            await host.close()
            return
        await trio.sleep_forever()


if __name__ == "__main__":
    args = sys.argv[1:]
    trio.run(main, args[1] if args[:1] == ["--dial"] else None)
