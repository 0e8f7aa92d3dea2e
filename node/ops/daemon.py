"""The long-running processes behind ``primenode bootstrap`` and ``primenode join``.

One trio run per process holds: the :class:`~node.p2p.node.Node` (libp2p host,
gossip, request/response, connection manager, the role hook), the local status
server (127.0.0.1 only), and a signal watcher. SIGINT or SIGTERM cancels
everything; the host is closed on the way out, ``HOME/runtime.json`` is
removed, and the process exits 0.

``HOME/runtime.json`` (written atomically once the node listens)::

    {"pid": 1234, "status_port": 40123, "addrs": ["/ip4/.../p2p/12D3..."],
     "role": "worker", "peer_id": "12D3...", "run_id": "ab12..."}

stdout carries only the node's full multiaddrs, one per line, so scripts can
read them (``primenode bootstrap ... | head -1``); every other line is a log
line on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import trio

from node.errors import ConfigError, NodeError
from node.home import NodeHome
from node.memory import limit_malloc_arenas
from node.ops.emulation import clock_from_env
from node.util import atomic_write_text, exit_if_abandoned
from protocol import NodeKey

if TYPE_CHECKING:
    from node.checkpoints import FetchProgress
    from node.ops.progress import CheckpointProgress
    from node.p2p.node import Node, P2PConfig

log = logging.getLogger(__name__)

# The loggers the daemon shows at INFO (DEBUG with --debug): every module of ours logs under
# its own name (``logging.getLogger(__name__)``), so the package name covers them all.
OUR_LOGGERS = ("node",)

GENESIS_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------- logging
class _CurrentStderr:
    """A stream that writes to whatever ``sys.stderr`` is at the time (rich's live
    progress display swaps it to keep log lines above the bar)."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


class _QuietTracebacks(logging.Filter):
    """py-libp2p logs full tracebacks for routine events (a peer hanging up, a
    reset stream). Keep the message, drop the traceback (``--debug`` keeps it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({type(exc).__name__}: {exc})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


class _StreamOpenNoise(logging.Filter):
    """py-libp2p logs a 7-line ERROR each time a stream we open fails to negotiate: a peer
    answering "protocol not supported" (our gossip retries, peer exchange, AutoNAT against a
    generic relay or another stack: a dozen per foreign connection), or a connection closed
    mid-negotiation (then the multistream client logs its own one-line ERROR first), or a
    dialer that hung up after the security handshake (an AutoNAT dial-back). The same
    failure is raised to our caller, which reports what matters in one line
    (``reqresp.foreign_peer_detail``), so these go (``--debug`` keeps them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if record.name.startswith("libp2p.host"):
            return not msg.startswith("Failed to open stream")
        if record.name.startswith("libp2p.protocol_muxer"):
            return not msg.startswith("MultiselectClient")
        if record.name.startswith("libp2p.network.swarm"):
            # an AutoNAT dial-back (ours or a peer's) proves reachability with the security
            # handshake and hangs up: the dialled side then fails to negotiate a muxer
            if msg.startswith("fail to upgrade mux"):
                return False
            # a connection still being added when we cancel its task (a dial we gave up, a
            # bootstrap found foreign): py-libp2p logs the cancellation's whole traceback in
            # the message, 20 lines for a routine event
            # and one a peer dialled in while we stop (the swarm's service has stopped: its
            # LifecycleError, 10 lines for each inbound connection of a node shutting down)
            if msg.startswith("[ADDCONN_FAIL]"):
                args = record.args if isinstance(record.args, tuple) else ()
                exc = args[1] if len(args) >= 2 else None
                stopping = type(exc).__name__ == "LifecycleError" and "service has stopped" in str(exc)
                return not (isinstance(exc, trio.Cancelled) or stopping)
        if record.name.startswith("libp2p.stream_muxer.yamux"):
            # the muxer's read loop finds the connection closed under it (we hung up on a
            # foreign bootstrap, a peer we dropped): py-libp2p logs that ERROR and then
            # cleans up exactly as for a clean close
            closed = ("ClosedResourceError", "BrokenResourceError")
            return not (msg.startswith("Error in handle_incoming") and any(f": {c}:" in msg for c in closed))
        return True


def setup_logging(debug: bool = False) -> None:
    """INFO lines with timestamps on stderr for our loggers, WARNING for libraries."""
    from node.p2p.host import attach_libp2p_logging

    fmt = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_primenode", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(_CurrentStderr())
    handler.setFormatter(fmt)
    handler._primenode = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for name in OUR_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if debug else logging.INFO)

    attach_libp2p_logging(logging.DEBUG if debug else logging.WARNING)
    for h in logging.getLogger("libp2p").handlers:
        if getattr(h, "_primenode", False) and isinstance(h, logging.StreamHandler):
            h.setStream(_CurrentStderr())
            # py-libp2p sets INFO on some of its own child loggers: filter at the handler too.
            h.setLevel(logging.DEBUG if debug else logging.WARNING)
            h.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
            if not debug and not any(isinstance(f, _QuietTracebacks) for f in h.filters):
                h.addFilter(_QuietTracebacks())
            if not debug and not any(isinstance(f, _StreamOpenNoise) for f in h.filters):
                h.addFilter(_StreamOpenNoise())


# --------------------------------------------------------------------------- runtime file
def write_runtime(home: NodeHome, info: dict[str, Any]) -> None:
    """Atomically (tmp + rename) write HOME/runtime.json. Not fsynced: it only describes
    the running process, and a crash makes it stale anyway."""
    atomic_write_text(home.runtime_path, json.dumps(info, indent=1) + "\n", durable=False)


def remove_runtime(home: NodeHome) -> None:
    """Remove HOME/runtime.json if it is ours (another process may have replaced it)."""
    path = home.runtime_path
    try:
        if json.loads(path.read_text()).get("pid") != os.getpid():
            return
    except (FileNotFoundError, ValueError, OSError):
        return
    try:
        path.unlink()
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------- trio plumbing
class _Stopped(Exception):
    """A signal arrived before trio took signals over."""


def _first_node_error(exc: BaseException) -> NodeError | None:
    if isinstance(exc, NodeError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _first_node_error(sub)
            if found is not None:
                return found
    return None


def _only_cancellations_or_interrupts(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancellations_or_interrupts(e) for e in exc.exceptions)
    return isinstance(exc, (KeyboardInterrupt, trio.Cancelled, _Stopped))


def run_trio(fn: Callable[[trio.Nursery], Awaitable[Any]]) -> tuple[Any, bool]:
    """``trio.run`` ``fn(nursery)`` with SIGINT/SIGTERM cancelling everything.

    Returns ``(result, stopped_by_signal)``. A NodeError raised anywhere inside
    (even wrapped in exception groups) comes out as itself, so the CLI prints one line."""
    stopped: dict[str, int | None] = {"sig": None}

    async def main() -> Any:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            result = None
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    async for signum in signals:
                        if stopped["sig"] is None:
                            stopped["sig"] = signum
                            log.info("%s received: stopping", signal.Signals(signum).name)
                            nursery.cancel_scope.cancel()
                        else:  # a second signal: the operator means it
                            log.warning("second signal: exiting now")
                            os._exit(130)

                nursery.start_soon(watch)
                result = await fn(nursery)
                nursery.cancel_scope.cancel()
            return result

    limit_malloc_arenas()  # before any worker thread exists: keeps RSS flat (node/memory.py)
    clock = clock_from_env()  # a benchmark's time dilation (node/ops/emulation.py), else None
    try:
        result = trio.run(main, clock=clock, strict_exception_groups=True)
    except BaseException as exc:
        err = _first_node_error(exc)
        if err is not None:
            raise err from None
        if stopped["sig"] is not None and _only_cancellations_or_interrupts(exc):
            return None, True
        if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            raise exc.exceptions[0] from None
        raise
    return result, stopped["sig"] is not None


@dataclasses.dataclass
class _Settings:
    home: NodeHome
    key: NodeKey
    listen: list[str]
    bootstrap: list[str]
    target_peers: int
    max_upload_mbps: float
    data_port: int
    status_port: int
    advertise_host: str
    heartbeat_interval_s: float
    direct_io: bool = True
    reachability: str = "auto"


def _settings(
    home: Path,
    *,
    listen: list[str] | None = None,
    bootstrap: list[str] | None = None,
    target_peers: int | None = None,
    max_upload_mbps: float | None = None,
    data_port: int | None = None,
    status_port: int | None = None,
) -> _Settings:
    h = NodeHome(home)
    key = h.load_key()
    cfg = h.load_config()
    s = _Settings(
        home=h,
        key=key,
        listen=list(listen or cfg.listen),
        bootstrap=list(bootstrap or cfg.bootstrap),
        target_peers=cfg.target_peers if target_peers is None else target_peers,
        max_upload_mbps=cfg.max_upload_mbps if max_upload_mbps is None else max_upload_mbps,
        data_port=cfg.data_port if data_port is None else data_port,
        status_port=cfg.status_port if status_port is None else status_port,
        advertise_host=cfg.advertise_host,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        direct_io=cfg.direct_io,
        reachability=cfg.reachability,
    )
    if s.target_peers < 1:
        raise ConfigError("--target-peers must be at least 1")
    if s.max_upload_mbps < 0:
        raise ConfigError("--max-upload-mbps must be >= 0 (0 = no cap)")
    for name in ("data_port", "status_port"):
        port = getattr(s, name)
        if not 0 <= port <= 65535:
            raise ConfigError(f"{name.replace('_', '-')} {port} is not a TCP port (0-65535)")
    if not s.listen:
        raise ConfigError("no listen address: pass --listen /ip4/0.0.0.0/tcp/4001 or set listen in config.toml")
    from node.p2p.host import parse_peer_addr

    for a in s.bootstrap:
        parse_peer_addr(a)  # a clear NodeError for a bad address, before anything starts
    return s


def _p2p_config(s: _Settings) -> P2PConfig:
    from node.p2p.nat import NatConfig
    from node.p2p.node import P2PConfig

    return P2PConfig(
        nat=NatConfig(mode=s.reachability),
        listen=s.listen,
        bootstrap=s.bootstrap,
        advertise_host=s.advertise_host,
        target_peers=s.target_peers,
        heartbeat_interval_s=s.heartbeat_interval_s,
        data_port=s.data_port,
    )


# --------------------------------------------------------------------------- progress
class _FetchReporter:
    """Checkpoint fetch progress: a rich bar on a terminal, log lines otherwise."""

    def __init__(self, tty: bool, every_s: float = 2.0) -> None:
        self.tty = tty
        self.every_s = every_s
        self.bar: CheckpointProgress | None = None
        self.active: set[int] = set()
        self.last_log: dict[int, float] = {}
        self.done: set[int] = set()

    # Versions remembered (done / last log line): enough to recognise a repeated report,
    # bounded for a run of any length.
    KEEP_VERSIONS = 64

    def update(self, p: FetchProgress) -> None:
        if p.version in self.done:
            return  # the fetcher may report completion more than once
        if p.done:
            self.done.add(p.version)
            floor = p.version - self.KEEP_VERSIONS
            self.done = {v for v in self.done if v > floor}
            self.last_log = {v: t for v, t in self.last_log.items() if v > floor}
        try:
            if self.tty:
                self._bar(p)
            else:
                self._log(p)
        except Exception:  # never let display break a fetch
            log.debug("progress display failed", exc_info=True)

    def _bar(self, p: FetchProgress) -> None:
        from rich.console import Console

        from node.ops.progress import CheckpointProgress

        if self.bar is None and not p.done:
            self.bar = CheckpointProgress(console=Console(stderr=True))
            self.bar.__enter__()
        if self.bar is not None:
            self.bar.update(p)
        if p.done:
            self.active.discard(p.version)
            log.info(
                "checkpoint v%d: all %d chunks held (%.1f MiB in %.1f s)",
                p.version,
                p.total,
                p.bytes_fetched / 2**20,
                p.elapsed_s,
            )
        else:
            self.active.add(p.version)
        if self.bar is not None and not self.active:
            self.close()

    def _log(self, p: FetchProgress) -> None:
        now = time.monotonic()  # wall time: how often a person sees a progress line
        if p.done:
            self.last_log.pop(p.version, None)
            log.info(
                "checkpoint v%d: all %d chunks held (%.1f MiB fetched in %.1f s)",
                p.version,
                p.total,
                p.bytes_fetched / 2**20,
                p.elapsed_s,
            )
            return
        if now - self.last_log.get(p.version, -math.inf) >= self.every_s:  # the first line always
            self.last_log[p.version] = now
            log.info("checkpoint v%d: %d/%d chunks, %.1f MiB/s", p.version, p.held, p.total, p.mib_per_s)

    def close(self) -> None:
        if self.bar is not None:
            bar, self.bar = self.bar, None
            self.active.clear()
            bar.__exit__(None, None, None)


async def _attach_progress(hook: object, reporter: _FetchReporter) -> None:
    """Roles create their ``Checkpoints`` when they start; hook in then.

    Not for a bootstrap (the caller skips it): importing the roles loads proofs/ and torch,
    which tripled a bootstrap's memory (105 -> 295 MiB) for a progress bar it never shows."""
    from node.roles.learning import LearningRole

    if not isinstance(hook, LearningRole):
        return  # a role without checkpoints
    await hook.checkpoints_ready.wait()
    assert hook.checkpoints is not None
    hook.checkpoints.progress_callbacks.append(reporter.update)


# --------------------------------------------------------------------------- the daemon
async def _serve(s: _Settings, node: Node, nursery: trio.Nursery) -> None:
    from node.ops.status_server import serve_status

    status_port = await nursery.start(serve_status, node, s.status_port)
    try:
        await nursery.start(node.run)
        addrs = node.full_addrs()
        for a in addrs:
            print(a, flush=True)
        write_runtime(
            s.home,
            {
                "pid": os.getpid(),
                "status_port": status_port,
                "addrs": addrs,
                "role": node.role,
                "peer_id": node.peer_id,
                "run_id": node.run_id.hex(),
                "started": time.time(),
            },
        )
        log.info(
            "%s %s listening on %s; status on http://127.0.0.1:%d/status",
            node.role,
            node.peer_id,
            ", ".join(addrs),
            status_port,
        )
        reporter = _FetchReporter(tty=sys.stderr.isatty())
        try:
            if node.role != "bootstrap":  # no checkpoints there, and no torch (_attach_progress)
                nursery.start_soon(_attach_progress, node.hook, reporter)
            await trio.sleep_forever()
        finally:
            reporter.close()
    finally:
        remove_runtime(s.home)


def _run_node(s: _Settings, node: Node) -> None:
    try:
        run_trio(lambda nursery: _serve(s, node, nursery))
    finally:
        remove_runtime(s.home)
    log.info("stopped")
    exit_if_abandoned(0)  # a trainer step left running at the stop (node/util.py says why)


def _install_early_stop() -> None:
    """Until trio takes signals over, SIGTERM stops the process cleanly (exit 0)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Stopped()

    signal.signal(signal.SIGTERM, handler)


def _guard_early(fn: Callable[[], None]) -> None:
    try:
        fn()
    except _Stopped:
        log.info("stopped before starting")
    except KeyboardInterrupt:
        log.info("interrupted")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_bootstrap(
    home: Path,
    listen: list[str] | None = None,
    genesis: Path | None = None,
    status_port: int | None = None,
    debug: bool = False,
) -> None:
    """``primenode bootstrap``: serve the genesis and peer addresses; hold no model.
    ``debug``: DEBUG log lines and libp2p's tracebacks (the CLI's ``--debug``)."""
    setup_logging(debug)
    _install_early_stop()

    def go() -> None:
        from node.genesis_file import read_genesis
        from node.p2p.node import BootstrapRole, Node

        s = _settings(home, listen=listen, status_port=status_port)
        s.bootstrap = []  # a bootstrap dials nobody first
        if genesis is None:
            raise ConfigError("bootstrap needs --genesis FILE (write one with `primenode run init`)")
        signed = read_genesis(genesis)
        g = signed.genesis
        log.info("bootstrap for run %s (%s), peer id %s", g.run_id.hex(), g.name, s.key.peer_id)
        node = Node(s.key, genesis=signed, config=_p2p_config(s), hook=BootstrapRole())
        _run_node(s, node)

    _guard_early(go)


def run_join(
    home: Path,
    role: str,
    bootstrap: list[str] | None = None,
    listen: list[str] | None = None,
    run_id: str | None = None,
    genesis: Path | None = None,
    target_peers: int | None = None,
    max_upload_mbps: float | None = None,
    data_port: int | None = None,
    status_port: int | None = None,
    device: str = "cpu",
    engine: str = "transformers",
    tamper: str | None = None,
    debug: bool = False,
) -> None:
    """``primenode join --role R``: get the genesis, build the role, run until stopped.
    ``debug``: DEBUG log lines and libp2p's tracebacks (the CLI's ``--debug``)."""
    setup_logging(debug)
    _install_early_stop()

    def go() -> None:
        from node.genesis_file import read_genesis
        from node.p2p.node import Node, fetch_genesis
        from node.roles.engines import check_engine_choice
        from node.roles.factory import make_role

        check_engine_choice(engine, role)
        s = _settings(
            home,
            listen=listen,
            bootstrap=bootstrap,
            target_peers=target_peers,
            max_upload_mbps=max_upload_mbps,
            data_port=data_port,
            status_port=status_port,
        )
        expected = None
        if run_id:
            try:
                expected = bytes.fromhex(run_id)
            except ValueError:
                raise ConfigError(f"--run-id {run_id!r} is not hex") from None
            if len(expected) != 32:
                raise ConfigError(f"--run-id must be 64 hex digits (a sha256), got {len(run_id)}")
        if genesis is not None:
            signed = read_genesis(genesis)
            if expected is not None and signed.genesis.run_id != expected:
                raise ConfigError(f"{genesis} is run {signed.genesis.run_id.hex()}, not --run-id {run_id}")
        else:
            if not s.bootstrap:
                raise ConfigError("join needs --bootstrap /ip4/.../p2p/<peer id> (or --genesis FILE to start alone)")
            log.info("asking %s for the run genesis", ", ".join(s.bootstrap))
            signed, stopped = run_trio(
                lambda nursery: fetch_genesis(s.key, s.bootstrap, timeout=GENESIS_TIMEOUT_S, expected_run_id=expected)
            )
            if stopped:
                log.info("stopped while fetching the genesis")
                return
        g = signed.genesis
        log.info("run %s (%s): joining as %s with peer id %s", g.run_id.hex(), g.name, role, s.key.peer_id)
        hook = make_role(
            role,
            s.home,
            signed,
            key_peer_id=s.key.peer_id,
            max_upload_mbps=s.max_upload_mbps,
            data_port=s.data_port,
            advertise_host=s.advertise_host,
            device=device,
            tamper=tamper,
            direct_io=s.direct_io,
            engine=engine,
        )
        node = Node(s.key, genesis=signed, config=_p2p_config(s), hook=hook)
        _run_node(s, node)

    _guard_early(go)
