"""Node identity: one ed25519 key is both the libp2p peer id and the signing key.

The libp2p peer id of an ed25519 key is the *identity* multihash of the
protobuf-encoded public key, in base58btc.  Computing it here (no libp2p
import) keeps protocol/ pure and lets anyone verify a signature from a peer id
alone: the public key is inside it.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import ProtocolError

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}
# protobuf PublicKey{Type=Ed25519(1), Data=<32 bytes>}: 08 01 12 20 || key
_PB_PREFIX = b"\x08\x01\x12\x20"
# identity multihash (code 0x00), length 36
_MH_PREFIX = b"\x00\x24"
PEER_ID_MAX_LEN = 64


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\x00"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    n = 0
    for c in text:
        try:
            n = n * 58 + _B58_INDEX[c]
        except KeyError:
            raise ProtocolError("peer_id", f"invalid base58 character {c!r}") from None
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    pad = len(text) - len(text.lstrip("1"))
    return b"\x00" * pad + body


def peer_id_from_public_bytes(public: bytes) -> str:
    if len(public) != 32:
        raise ProtocolError("peer_id", "ed25519 public key must be 32 bytes")
    return b58encode(_MH_PREFIX + _PB_PREFIX + public)


def public_bytes_from_peer_id(peer_id: str) -> bytes:
    """Extract the ed25519 public key embedded in a peer id, or raise ProtocolError."""
    if not isinstance(peer_id, str) or not 1 <= len(peer_id) <= PEER_ID_MAX_LEN:
        raise ProtocolError("peer_id", "malformed peer id")
    raw = b58decode(peer_id)
    if len(raw) != 38 or not raw.startswith(_MH_PREFIX + _PB_PREFIX):
        raise ProtocolError("peer_id", "not an ed25519 identity peer id")
    return raw[6:]


class NodeKey:
    """An ed25519 private key with its peer id.  ``seed`` is the 32-byte secret."""

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise ValueError("an ed25519 seed is 32 bytes")
        self.seed = bytes(seed)
        self._private = Ed25519PrivateKey.from_private_bytes(self.seed)
        self.public_bytes = self._private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = peer_id_from_public_bytes(self.public_bytes)

    @classmethod
    def generate(cls) -> NodeKey:
        private = Ed25519PrivateKey.generate()
        return cls(
            private.private_bytes(
                serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
            )
        )

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)

    def __repr__(self) -> str:
        return f"NodeKey({self.peer_id})"


_PUBKEY_CACHE: dict[str, Ed25519PublicKey] = {}


def verify_signature(peer_id: str, data: bytes, signature: bytes) -> None:
    """Check an ed25519 signature against the key inside ``peer_id``."""
    key = _PUBKEY_CACHE.get(peer_id)
    if key is None:
        key = Ed25519PublicKey.from_public_bytes(public_bytes_from_peer_id(peer_id))
        if len(_PUBKEY_CACHE) > 4096:
            _PUBKEY_CACHE.clear()
        _PUBKEY_CACHE[peer_id] = key
    try:
        key.verify(signature, data)
    except InvalidSignature:
        raise ProtocolError("signature", f"bad signature from {peer_id}") from None
    except Exception as exc:  # malformed signature length etc.
        raise ProtocolError("signature", f"unverifiable signature: {exc}") from None
