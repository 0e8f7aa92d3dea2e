"""Build the role hook a ``primenode join --role R`` process runs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from node.errors import RoleError
from node.home import NodeHome
from node.p2p.node import RoleHook
from node.roles.context import RunContext
from protocol import SignedGenesis


def check_code_sandbox(problems: Iterable[Any]) -> None:
    """Fail closed: a run with code tasks needs the bubblewrap sandbox to score them (workers claim
    rewards, validators and the trainer recompute them); SandboxError names what to install."""
    if any(getattr(p, "task", None) == "code" for p in problems):
        from node.rl.sandbox import require_sandbox

        require_sandbox()


def make_role(
    role: str,
    home: NodeHome,
    genesis: SignedGenesis,
    *,
    key_peer_id: str,
    max_upload_mbps: float = 0.0,
    data_port: int = 0,
    advertise_host: str = "127.0.0.1",
    device: str = "cpu",
    tamper: str | None = None,
    direct_io: bool = True,
    engine: str = "transformers",
) -> RoleHook:
    """The hook for ``role``; refuses a trainer/validator whose key the genesis does not name."""
    from node.roles.engines import check_engine_choice

    check_engine_choice(engine, role, tamper)
    g = genesis.genesis
    if role == "trainer" and key_peer_id != g.trainer:
        raise RoleError(f"this node ({key_peer_id}) is not the run's trainer ({g.trainer})")
    if role == "validator" and key_peer_id not in g.validators:
        raise RoleError(f"this node ({key_peer_id}) is not one of the run's validators")
    ctx = RunContext.from_genesis(g, home.cache_dir)
    check_code_sandbox(ctx.problems)
    common: dict[str, Any] = dict(
        max_upload_mbps=max_upload_mbps, data_port=data_port, advertise_host=advertise_host, direct_io=direct_io
    )
    if role == "trainer":
        from node.roles.trainer import TrainerRole

        return TrainerRole(home, ctx, device=device, **common)
    if role == "validator":
        from node.roles.validator import ValidatorRole

        return ValidatorRole(home, ctx, device=device, engine=engine, **common)
    if role == "worker":
        from node.roles.worker import WorkerRole

        return WorkerRole(home, ctx, device=device, tamper=tamper, engine=engine, **common)
    raise RoleError(f"unknown role {role!r}")
