"""Errors a user can act on. The CLI prints them as one line and exits non-zero."""


class NodeError(Exception):
    """A user-facing failure (bad home directory, unreachable peer, bad config...)."""
