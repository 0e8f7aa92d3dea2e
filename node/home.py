"""The node home directory: identity key, config, and everything a node persists.

This module is the one place that knows the layout; every other module asks
:class:`NodeHome` for a path instead of joining names onto ``HOME`` itself::

    HOME/key                  32-byte ed25519 seed, mode 0600 (refused if looser)
    HOME/config.toml          NodeConfig
    HOME/runtime.json         written while running: pid, status port, addresses
    HOME/chunks/              content-addressed chunk store (node.checkpoints)
    HOME/cache/               run context cache: SmolLM2 folder, version-0 HF folders
    HOME/node.db              trainer: SQLite ledger of batches, votes, admissions, steps
    HOME/metrics.jsonl        trainer: one line per training step
    HOME/trainer/states/      trainer: the resumable training state, a folder per version
                              (model + optimizer; node/roles/resume.py); older homes kept
                              one folder, HOME/trainer/checkpoint/, adopted at start
    HOME/trainer/export/      trainer: each published version's files before chunking
"""

from __future__ import annotations

import stat
from pathlib import Path

from node.config import NodeConfig
from node.errors import ConfigError
from node.util import atomic_write_bytes
from protocol import NodeKey

KEY_FILE = "key"
CONFIG_FILE = "config.toml"
RUNTIME_FILE = "runtime.json"
CHUNKS_DIR = "chunks"
CACHE_DIR = "cache"
LEDGER_FILE = "node.db"
METRICS_FILE = "metrics.jsonl"
TRAINER_DIR = "trainer"
WORKER_BATCHES_DIR = "worker/batches"


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

    @property
    def chunks_dir(self) -> Path:
        return self.path / CHUNKS_DIR

    @property
    def cache_dir(self) -> Path:
        return self.path / CACHE_DIR

    @property
    def ledger_path(self) -> Path:
        return self.path / LEDGER_FILE

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def trainer_checkpoint_dir(self) -> Path:
        return self.path / TRAINER_DIR / "checkpoint"

    @property
    def trainer_states_dir(self) -> Path:
        return self.path / TRAINER_DIR / "states"

    @property
    def trainer_export_dir(self) -> Path:
        return self.path / TRAINER_DIR / "export"

    def worker_batches_dir(self, run_id: bytes) -> Path:
        """A worker's latest signed batches of one run, one file per batch counter: its chain
        position survives a restart (docs/rl.md, "The pipeline")."""
        return self.path / WORKER_BATCHES_DIR / run_id.hex()[:16]

    def exists(self) -> bool:
        return self.key_path.exists()

    def init(self, config: NodeConfig | None = None, force: bool = False) -> NodeKey:
        """Create the home with a fresh key. Refuses to overwrite an existing key."""
        if self.key_path.exists() and not force:
            raise ConfigError(f"{self.path} already holds a node key (peer id {self.load_key().peer_id})")
        self.path.mkdir(parents=True, exist_ok=True)
        key = NodeKey.generate()
        atomic_write_bytes(self.key_path, key.seed, mode=0o600)
        if not self.config_path.exists():
            (config or NodeConfig()).save(self.config_path)
        return key

    def load_key(self) -> NodeKey:
        """Read the identity key; refuse a key file others can read or write."""
        try:
            st = self.key_path.stat()
        except FileNotFoundError:
            raise ConfigError(f"no node key in {self.path}: run `primenode init --home {self.path}` first") from None
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"{self.key_path} has permissions {mode:04o}; the key must be private: chmod 600 {self.key_path}"
            )
        seed = self.key_path.read_bytes()
        if len(seed) != 32:
            raise ConfigError(f"{self.key_path} is {len(seed)} bytes; an ed25519 seed is 32 bytes")
        return NodeKey(seed)

    def load_config(self) -> NodeConfig:
        return NodeConfig.load(self.config_path)
