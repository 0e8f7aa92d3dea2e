"""Node configuration: ``config.toml`` in the node home, with defaults for everything."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import tomli_w

from node.errors import ConfigError
from node.util import atomic_write_text


@dataclasses.dataclass
class NodeConfig:
    """What an operator may set per node. CLI options override these for one run."""

    listen: list[str] = dataclasses.field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    bootstrap: list[str] = dataclasses.field(default_factory=list)
    # Connections the node keeps to distinct peers (replacing lost ones).
    target_peers: int = 6
    # Status JSON and Prometheus metrics, served on 127.0.0.1 only. 0 = pick a free port.
    status_port: int = 0
    # Chunk data plane (raw TCP). 0 = pick a free port.
    data_port: int = 0
    # Public host other peers use to reach the data plane.
    advertise_host: str = "127.0.0.1"
    # Upload cap for checkpoint chunks, in Mbit/s; 0 = unlimited.
    max_upload_mbps: float = 0.0
    heartbeat_interval_s: float = 2.0
    # "auto" (ask peers: AutoNAT), or "public" / "private" for an operator who knows: a node
    # behind NAT that says "private" reserves relay slots at once instead of after the checks.
    reachability: str = "auto"
    # Write checkpoint chunks and assembled files with O_DIRECT (bypassing the page
    # cache; docs/checkpoints.md says why). Falls back by itself where the filesystem
    # refuses it; set false to always write through the page cache.
    direct_io: bool = True

    @classmethod
    def load(cls, path: Path) -> NodeConfig:
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config at {path}: run `primenode init --home {path.parent}` first") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(raw) - set(known)
        if unknown:
            raise ConfigError(f"{path}: unknown setting(s): {', '.join(sorted(unknown))}")
        cfg = cls()
        for key, value in raw.items():
            default = getattr(cfg, key)
            if type(default) is float and isinstance(value, int):
                value = float(value)
            if type(value) is not type(default):
                raise ConfigError(f"{path}: {key} must be {type(default).__name__}, got {type(value).__name__}")
            setattr(cfg, key, value)
        if cfg.reachability not in ("auto", "public", "private"):
            raise ConfigError(f"{path}: reachability must be auto, public or private, got {cfg.reachability!r}")
        return cfg

    def save(self, path: Path) -> None:
        atomic_write_text(path, tomli_w.dumps(dataclasses.asdict(self)))
