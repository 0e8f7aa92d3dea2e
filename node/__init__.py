"""The primenode daemon: CLI, node home, p2p host, chunk store, roles, RL, engines."""

__version__ = "0.1.0"
