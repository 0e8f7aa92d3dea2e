"""Errors a user can act on: one root, one subclass per subsystem.

The CLI catches :class:`NodeError` (and only it) and prints it as one line
(``--debug`` adds the traceback); anything else reaching the CLI is a bug.
Each subsystem raises its own subclass so callers and tests can tell *where*
an operator must look without parsing messages.

Peer input is never a :class:`NodeError`: bytes from the network that break a
rule raise ``protocol.ProtocolError`` (a rule name as data, charged to the
sender), and malformed proofs raise ``proofs.ProofError``. Network code uses
its own control-flow exceptions (``node.p2p.GossipError``,
``node.p2p.RequestError``, ``node.checkpoints.DataPlaneError``) and translates
``OSError`` at the socket edge; those never reach an operator as such.
"""

from __future__ import annotations


class NodeError(Exception):
    """A user-facing failure (bad home directory, unreachable peer, bad config...)."""


class ConfigError(NodeError):
    """The node home, ``config.toml``, a genesis file or a command-line option is wrong."""


class NetworkError(NodeError):
    """The node cannot listen, dial or parse an address the operator gave."""


class CheckpointError(NodeError):
    """The chunk store or a checkpoint folder cannot be used (disk, permissions, layout)."""


class ModelError(NodeError):
    """A model, tokenizer, dataset or inference engine cannot be loaded as the run asks."""


class RoleError(NodeError):
    """The node cannot take the role it was asked for in this run (not named by the genesis,
    wrong numerics stack, missing sandbox...)."""


class SandboxError(NodeError):
    """Code rewards cannot run untrusted programs here: bubblewrap (or libseccomp) is missing or
    cannot start a sandbox. There is no weaker fallback; the message names what to install."""
