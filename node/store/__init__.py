"""On-disk checkpoint storage: content-addressed chunks, signed manifests, assembly, GC."""

from .bitmap import Bitmap
from .manifest import DEFAULT_CHUNK_SIZE, accept_announce, build_manifest, checkpoint_files, sign_announce, verify_announce
from .store import ChunkRejected, ChunkStore, VersionState

__all__ = [
    "Bitmap", "ChunkRejected", "ChunkStore", "VersionState", "DEFAULT_CHUNK_SIZE",
    "accept_announce", "build_manifest", "checkpoint_files", "sign_announce", "verify_announce",
]
