"""Checkpoints: everything that stores a policy version and moves it between nodes.

Layers, bottom up:

* ``store``: the content-addressed chunk store under ``HOME/chunks`` (atomic
  writes, crash-safe have-bitmaps, assembly into files, GC, pins);
  ``manifest`` builds and checks the trainer's signed manifests; ``directio``
  writes whole files with ``O_DIRECT``.
* ``server`` / ``client`` / ``wire``: the raw-TCP data plane (frames in
  ``protocol.chunk_frames``): tickets granted over libp2p, chunk bytes outside it.
* ``fetcher``: ``VersionFetcher`` fetches one version from many peers at once.
* ``service``: ``Checkpoints``, the one object roles use; ``control`` is what it
  needs from the network; ``node.roles.checkpoint_wiring`` wires it into a
  ``node.p2p.Node`` (the roles layer, the lowest that may import both).
"""

from node.checkpoints.client import DataConnection, DataPlaneError
from node.checkpoints.control import ControlPlane, LocalControlPlane
from node.checkpoints.fetcher import FetchProgress, VersionFetcher
from node.checkpoints.manifest import (
    DEFAULT_CHUNK_SIZE,
    accept_announce,
    build_manifest,
    checkpoint_files,
    sign_announce,
    verify_announce,
)
from node.checkpoints.ratelimit import UploadLimiter
from node.checkpoints.server import ChunkServer
from node.checkpoints.service import Checkpoints
from node.checkpoints.store import ChunkRejected, ChunkStore, VersionState

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "Checkpoints",
    "ChunkRejected",
    "ChunkServer",
    "ChunkStore",
    "ControlPlane",
    "DataConnection",
    "DataPlaneError",
    "FetchProgress",
    "LocalControlPlane",
    "UploadLimiter",
    "VersionFetcher",
    "VersionState",
    "accept_announce",
    "build_manifest",
    "checkpoint_files",
    "sign_announce",
    "verify_announce",
]
