"""Child process for the resume test: fetch one version with a pre-granted ticket.

usage: python -m harness.fetch_child STORE_DIR TRAINER_ID ANNOUNCE_FILE PEER_ID HOST PORT TICKET_HEX
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

from harness.checkpoints import RUN_ID
from node.checkpoints import ChunkStore, VersionFetcher
from protocol import ChunkTicket


class StaticTicketOverlay:
    def __init__(self, ticket: ChunkTicket) -> None:
        self.ticket = ticket

    async def request_ticket(self, peer_id, req, timeout):
        return self.ticket

    def penalise(self, peer_id, reason):
        pass

    def ban(self, peer_id, reason):
        pass


async def main(argv: list[str], announce: bytes) -> None:
    store_dir, trainer, _, peer, host, port, tok = argv
    store = ChunkStore(store_dir, RUN_ID, trainer)
    st, _ = store.add_announce(announce, guard=None)
    ticket = ChunkTicket(ok=True, reason="", ticket=bytes.fromhex(tok), host=host, port=int(port), expires_ms=0)
    f = VersionFetcher(store, st.version, StaticTicketOverlay(ticket), depth=2)
    f.add_peer(peer)
    await f.run()


if __name__ == "__main__":
    trio.run(main, sys.argv[1:], Path(sys.argv[3]).read_bytes())
