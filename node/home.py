"""The node home directory: identity key, config, and everything a node persists.

Layout::

    HOME/key          32-byte ed25519 seed, mode 0600 (refused if looser)
    HOME/config.toml  NodeConfig
    HOME/chunks/      content-addressed chunk store
    HOME/node.db      SQLite: admitted rollouts, votes, trainer state
    HOME/runtime.json  written while running: where the status server listens
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from node.config import NodeConfig
from node.errors import NodeError
from protocol import NodeKey

KEY_FILE = "key"
CONFIG_FILE = "config.toml"
RUNTIME_FILE = "runtime.json"


class NodeHome:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path).expanduser().resolve()

    @property
    def key_path(self) -> Path:
        return self.path / KEY_FILE

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def runtime_path(self) -> Path:
        return self.path / RUNTIME_FILE

    def exists(self) -> bool:
        return self.key_path.exists()

    def init(self, config: NodeConfig | None = None, force: bool = False) -> NodeKey:
        """Create the home with a fresh key. Refuses to overwrite an existing key."""
        if self.key_path.exists() and not force:
            raise NodeError(f"{self.path} already holds a node key (peer id {self.load_key().peer_id})")
        self.path.mkdir(parents=True, exist_ok=True)
        key = NodeKey.generate()
        tmp = self.key_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, key.seed)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.key_path)
        if not self.config_path.exists():
            (config or NodeConfig()).save(self.config_path)
        return key

    def load_key(self) -> NodeKey:
        """Read the identity key; refuse a key file others can read or write."""
        try:
            st = self.key_path.stat()
        except FileNotFoundError:
            raise NodeError(f"no node key in {self.path}: run `primenode init --home {self.path}` first") from None
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise NodeError(
                f"{self.key_path} has permissions {mode:04o}; the key must be private: chmod 600 {self.key_path}"
            )
        seed = self.key_path.read_bytes()
        if len(seed) != 32:
            raise NodeError(f"{self.key_path} is {len(seed)} bytes; an ed25519 seed is 32 bytes")
        return NodeKey(seed)

    def load_config(self) -> NodeConfig:
        return NodeConfig.load(self.config_path)
