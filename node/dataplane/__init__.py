"""Checkpoint data plane: tickets over libp2p, chunk bytes over raw TCP, the swarm fetcher."""

from .client import DataConnection, DataPlaneError
from .overlay import ChunkOverlay, LocalOverlay
from .ratelimit import TokenBucket
from .server import ChunkServer
from .service import Distribution
from .swarm import FetchProgress, SwarmFetcher

__all__ = [
    "ChunkOverlay", "ChunkServer", "DataConnection", "DataPlaneError", "Distribution", "FetchProgress",
    "LocalOverlay", "SwarmFetcher", "TokenBucket",
]
