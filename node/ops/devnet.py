"""``primenode devnet``: a whole local network as separate processes on 127.0.0.1.

One bootstrap, one trainer, N workers and M validators, each a real
``primenode`` process with its own home under the output folder. The devnet
signs a genesis naming them, starts everything, renders live progress from
each node's local status endpoint, copies the trainer's per-step metrics into
``OUT/metrics.jsonl``, draws ``OUT/reward_curve.png``, and stops every process
cleanly after the requested steps or on Ctrl+C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from node.errors import ConfigError, NodeError
from node.home import NodeHome
from node.ops.emulation import DILATION_ENV, NodeCores
from node.ops.lifeline import parent_env
from node.util import atomic_write_text

if TYPE_CHECKING:
    from rich.console import Group, RenderableType
    from rich.table import Table


@dataclasses.dataclass
class DevnetOptions:
    out: Path
    workers: int = 2
    validators: int = 2
    quorum: int | None = None  # default: all validators... capped below
    steps: int = 30
    model: str = "tiny"
    task: str = "target-length"
    # a dataset file or folder (e.g. ``primenode dataset filter``'s output) instead of the
    # built-in task; pinned in the genesis by its content hash like any run's data
    dataset: Path | None = None
    # genesis [config] overrides (None: the run's defaults): the prompt style of math problems
    # and the precision of the published policy (float32 or bfloat16)
    system_prompt: str | None = None
    math_instruction: str | None = None
    policy_dtype: str = "float32"
    max_async: int = 2
    # workers make one batch per version and wait for the next ([config] worker_lead_versions
    # 0), instead of running one version ahead of the trainer (the default; docs/rl.md)
    lockstep: bool = False
    # prompts each trainer step learns from, split across the workers' batches (16: 8 per
    # worker; 8 learned less by step 40, docs/benchmarks.md, issue 20); prompts_per_batch, when
    # set, overrides the split
    prompts_per_step: int = 16
    prompts_per_batch: int = 0
    group_size: int = 8
    lr: float = 1e-4
    max_tokens: int = 48
    temperature: float = 1.0
    seed: int = 0
    # admitted batches a trainer step waits for (it then takes every fresh one up to its token
    # budget); 0: one per worker, the batches each version brings (docs/benchmarks.md, issue 20)
    batches_per_step: int = 0
    timeout_s: float = 900.0
    # stop cleanly (metrics, curve, summary) after this many seconds whatever the step; 0: off.
    # A learning budget ("does it learn within 30 minutes"), unlike timeout_s, which is a failure.
    duration_s: float = 0.0
    # inference engine of workers and validators: transformers, or vllm (needs vLLM installed)
    engine: str = "transformers"
    # a held-out split of this many problems (never assigned to a worker) and the trainer's
    # evaluation on it every eval_every versions (0: off): eval_problems of them (0: all),
    # eval_samples completions each; the second curve of reward_curve.png
    heldout: int = 0
    eval_every: int = 0
    eval_problems: int = 0
    eval_samples: int = 1
    extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Benchmarks (node/ops/emulation.py): each node capped at its role's CPUs (empty: no cap;
    # the workers and validators then run in the background), every node's trio clock
    # time_dilation times slower than real time (1: real time), checkpoint uploads capped
    # at max_upload_mbps (0: none)
    node_cores: dict[str, float] = dataclasses.field(default_factory=dict)
    time_dilation: float = 1.0
    max_upload_mbps: float = 0.0
    # Node flavours for adversarial tests: name -> list of extra CLI args.
    node_args: dict[str, list[str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class NodeProc:
    name: str
    role: str
    home: NodeHome
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None

    def status(self, timeout: float = 1.0) -> dict[str, Any] | None:
        try:
            port = json.loads(self.home.runtime_path.read_text())["status_port"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=timeout) as r:
                st: dict[str, Any] = json.loads(r.read())
                return st
        except Exception:
            return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def primenode_cmd() -> list[str]:
    return [sys.executable, "-m", "node.ops.cli"]


class Devnet:
    """Owns the processes of one local network. Use as a context manager."""

    def __init__(self, opts: DevnetOptions) -> None:
        self.opts = opts
        self.out = Path(opts.out).resolve()
        self.nodes: list[NodeProc] = []
        self.genesis_path = self.out / "run.toml"
        self.bootstrap_addr = ""
        # wraps each process start; run_devnet makes stop signals wait for it (StopSignals)
        self.critical: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
        # per-node CPU quotas (benchmarks: node/ops/emulation.py); checked before any start
        if not opts.time_dilation >= 1.0:
            raise ConfigError(f"--time-dilation must be >= 1 (1: real time), got {opts.time_dilation}")
        self.cores = NodeCores(str(os.getpid())) if opts.node_cores else None

    # ------------------------------------------------------------- set-up
    def prepare(self) -> None:
        from node.genesis_file import make_genesis, write_genesis
        from node.roles.context import POLICY_DTYPES
        from node.roles.engines import check_engine_choice

        o = self.opts
        if o.workers < 1 or o.validators < 1:
            raise ConfigError("a devnet needs at least one worker and one validator")
        check_engine_choice(o.engine)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)

        def home(name: str) -> NodeHome:
            h = NodeHome(self.out / "nodes" / name)
            if not h.exists():
                h.init()
            return h

        owner = home("owner").load_key()
        boot = home("bootstrap")
        trainer = home("trainer")
        workers = [home(f"worker-{i}") for i in range(o.workers)]
        validators = [home(f"validator-{i}") for i in range(o.validators)]
        quorum = o.quorum or max(1, (o.validators // 2) + 1 if o.validators > 2 else o.validators)
        dataset, size, pins = self._dataset()
        split: dict[str, Any] = {}
        if o.heldout:
            from node.roles.context import pin_problems

            fields, split = pin_problems(dataset, size if o.dataset is None else None, o.seed, o.heldout)
            size, pins = fields["dataset_size"], {"dataset_hash": fields["dataset_hash"]}
        if o.eval_every:
            if not o.heldout:
                raise ConfigError("--eval-every needs --heldout N: the trainer evaluates on held-out problems")
            split.update(eval_every=o.eval_every, eval_problems=o.eval_problems, eval_samples=o.eval_samples)
        style = {"system_prompt": o.system_prompt, "math_instruction": o.math_instruction}
        config = {
            "task": o.task if o.dataset is None else "dataset",
            "steps": o.steps,
            "lr": o.lr,
            "max_tokens": o.max_tokens,
            "temperature": o.temperature,
            "seed": o.seed,
            "batches_per_step": o.batches_per_step or o.workers,
            # a step learns from one batch per worker, as in lock-step
            "max_batches_per_step": o.batches_per_step or o.workers,
            # and each worker makes one batch per version: lock-step waits for each version;
            # the asynchronous devnet runs one version ahead, so the batch of the next step
            # generates while the trainer trains (all six nodes share this machine's cores:
            # batches beyond what the trainer takes would only be work it throws away)
            "worker_batches_per_version": 1,
            "worker_lead_versions": 0 if o.lockstep else 1,
            "policy_dtype": o.policy_dtype,
            **{k: v for k, v in style.items() if v is not None},
            **split,
            # every devnet worker and validator runs one engine in the policy's dtype on this
            # CPU: one numerics stack, so validators use its tight TOPLOC thresholds (docs/proofs.md)
            "numerics": f"{o.engine}-{POLICY_DTYPES.get(o.policy_dtype, o.policy_dtype)}-cpu",
            **o.extra_config,
        }
        signed = make_genesis(
            owner,
            config,
            name=f"devnet-{o.task if o.dataset is None else Path(o.dataset).stem}",
            model=o.model,
            dataset=dataset,
            dataset_size=size,
            **pins,
            trainer=trainer.load_key().peer_id,
            validators=[v.load_key().peer_id for v in validators],
            quorum=min(quorum, o.validators),
            max_async=o.max_async,
            prompts_per_batch=o.prompts_per_batch or -(-o.prompts_per_step // o.workers),
            group_size=o.group_size,
            chunk_size=1 << 20,
        )
        write_genesis(signed, self.genesis_path)

        if o.model == "smollm2":
            self._share_smollm2([trainer, *workers, *validators])

        port = free_port()
        boot_id = boot.load_key().peer_id
        self.bootstrap_addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id}"
        common = ["--genesis", str(self.genesis_path)]
        self.nodes.append(
            NodeProc(
                "bootstrap",
                "bootstrap",
                boot,
                ["bootstrap", "--home", str(boot.path), "--listen", f"/ip4/127.0.0.1/tcp/{port}", *common],
            )
        )
        join = ["--bootstrap", self.bootstrap_addr, "--listen", "/ip4/127.0.0.1/tcp/0", *common]
        if o.max_upload_mbps:
            join += ["--max-upload-mbps", f"{o.max_upload_mbps:g}"]
        engine = ["--engine", o.engine]
        self.nodes.append(
            NodeProc("trainer", "trainer", trainer, ["join", "--role", "trainer", "--home", str(trainer.path), *join])
        )
        for i, v in enumerate(validators):
            self.nodes.append(
                NodeProc(
                    f"validator-{i}",
                    "validator",
                    v,
                    ["join", "--role", "validator", "--home", str(v.path), *join, *engine],
                )
            )
        for i, w in enumerate(workers):
            self.nodes.append(
                NodeProc(
                    f"worker-{i}", "worker", w, ["join", "--role", "worker", "--home", str(w.path), *join, *engine]
                )
            )
        for n in self.nodes:
            n.args += self.opts.node_args.get(n.name, [])

    def _share_smollm2(self, homes: list[NodeHome]) -> None:
        """Convert SmolLM2's packaged GGUF once (``out/cache``) and hard-link the folder into
        every node's cache: five nodes converting it at once took ~3 minutes of a 2-core
        machine before the first step. Each node still loads the model files itself."""
        import shutil

        from node.models import SMOLLM2_DIRNAME, load_smollm2

        shared = self.out / "cache" / SMOLLM2_DIRNAME
        if not (shared / "config.json").exists():
            load_smollm2(self.out / "cache")
        for h in homes:
            folder = h.cache_dir / SMOLLM2_DIRNAME
            if (folder / "config.json").exists():
                continue
            tmp = folder.with_name(folder.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for f in shared.iterdir():
                try:
                    os.link(f, tmp / f.name)
                except OSError:  # another file system: copy
                    shutil.copy2(f, tmp / f.name)
            tmp.rename(folder)

    def _dataset(self) -> tuple[str, int, dict[str, Any]]:
        """(genesis dataset spec, size, extra genesis fields): the built-in task's 1024 seeded
        problems, or the file given, every problem of it, pinned by ``dataset_hash`` (every node
        loads the same file here and checks the hash, as a real run's nodes do)."""
        o = self.opts
        if o.dataset is None:
            return f"builtin:{o.task}", 1024, {}
        from node.rl.tasks import dataset_hash, load_dataset

        path = Path(o.dataset).resolve()
        try:
            problems = load_dataset(path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"dataset {path}: {exc}") from None
        if not problems:
            raise ConfigError(f"dataset {path} holds no problems")
        return str(path), len(problems), {"dataset_hash": dataset_hash(problems)}

    def start(self, node: NodeProc) -> None:
        # open for the process's whole life; stop_all() and a restart close it
        node.log = open(self.out / "logs" / f"{node.name}.log", "ab")  # noqa: SIM115
        # One compute thread per node process: six processes share this machine's cores. The
        # trainer takes every core: its step runs while the workers and validators wait for the
        # version it makes (a step trains on the batches of the version before, issue 20), so
        # the other cores would idle.
        o = self.opts
        threads = str(os.cpu_count() or 1) if node.role == "trainer" else "1"
        if o.node_cores:  # as many threads as the node's own cores
            threads = str(max(1, math.ceil(o.node_cores[node.role])))
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
        env.update(parent_env())  # the node stops when this process dies, even by SIGKILL (lifeline.py)
        if o.time_dilation > 1.0:
            env[DILATION_ENV] = f"{o.time_dilation:g}"
        # Workers generate continuously (asynchronous pipeline). On a real network each node has
        # its own hardware; here all share the cores, so workers and validators run in the
        # background (:func:`background_priority`): they take only the CPU time the trainer
        # leaves, and its step runs as fast as in lock-step. At equal priority the trainer's
        # OpenMP threads, which meet at a barrier thousands of times a step, wait for whichever
        # one another process preempted: a 3 s step took 45-80 s.
        # With CPU quotas each node has cores of its own (node/ops/emulation.py): all at one priority.
        background = node.role in ("worker", "validator") and not o.node_cores
        idle = ["chrt", "--idle", "0"] if background and shutil.which("chrt") else []
        with self.critical():  # a stop signal waits until the child is recorded: none goes untracked
            node.proc = subprocess.Popen(
                idle + primenode_cmd() + node.args,
                stdout=node.log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            if background:
                background_priority(node.proc.pid)
            if self.cores is not None:
                # CPUs per emulated second: an emulated second lasts time_dilation real ones
                self.cores.place(node.name, node.proc.pid, o.node_cores[node.role] / o.time_dilation)

    def start_all(self) -> None:
        for n in self.nodes:
            self.start(n)
            if n.role == "bootstrap":
                time.sleep(1.0)

    def node(self, name: str) -> NodeProc:
        return next(n for n in self.nodes if n.name == name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        n = self.node(name)
        if n.proc and n.proc.poll() is None:
            n.proc.send_signal(sig)
            n.proc.wait(timeout=30)

    def stop_all(self, grace_s: float = 20.0, hurry: Callable[[], bool] = lambda: False) -> dict[str, int | None]:
        """SIGTERM every live node, SIGKILL those still running after ``grace_s`` (or as soon
        as ``hurry()`` turns true: a second stop signal), and return only once every one has
        exited: a node outliving the devnet would train on as an orphan."""
        running = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        for n in running:
            assert n.proc is not None
            n.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s  # wall time: real processes are given real seconds
        # other processes: no event reaches us when they exit, so poll (a tenth of a second)
        while time.monotonic() < deadline and not hurry():
            if all(n.proc is None or n.proc.poll() is not None for n in running):
                break
            time.sleep(0.1)
        codes: dict[str, int | None] = {}
        for n in self.nodes:
            if n.proc is None:
                continue
            if n.proc.poll() is None:
                n.proc.kill()
            codes[n.name] = n.proc.wait()
            if n.log:
                n.log.close()
        if self.cores is not None:
            self.cores.close()
        return codes

    def __enter__(self) -> Devnet:
        self.prepare()
        self.start_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_all()

    # ----------------------------------------------------------- progress
    def trainer_metrics(self) -> list[dict[str, Any]]:
        """The trainer's step lines of metrics.jsonl."""
        return [r for r in self.metrics_rows() if r.get("kind") != "eval"]

    def eval_metrics(self) -> list[dict[str, Any]]:
        """The trainer's held-out evaluations (``"kind": "eval"`` lines of its metrics.jsonl)."""
        return [r for r in self.metrics_rows() if r.get("kind") == "eval"]

    def metrics_rows(self) -> list[dict[str, Any]]:
        """Every line of the trainer's metrics.jsonl: steps, then held-out evaluations among them."""
        if not any(n.name == "trainer" for n in self.nodes):
            return []  # stopped before prepare() named the nodes
        path = self.node("trainer").home.metrics_path
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
        return rows

    def snapshot(self) -> dict[str, dict[str, Any] | None]:
        return {n.name: n.status() for n in self.nodes}


def render_table(devnet: Devnet, snap: dict[str, Any], started: float, width: int = 200) -> RenderableType:
    """The live view (:func:`live_view`): an 80-column terminal folded the full table's cells
    letter by letter, so a narrow one gets :func:`compact_status`."""
    metrics = devnet.trainer_metrics()
    last = metrics[-1] if metrics else {}
    title = (
        f"devnet  step {last.get('step', 0)}/{devnet.opts.steps}  reward {last.get('reward_mean', float('nan')):.3f}"
        f"{eval_cell(devnet.eval_metrics())}  elapsed {time.monotonic() - started:.0f}s"
    )
    nodes = [(n.name, n.role, bool(n.proc and n.proc.poll() is None)) for n in devnet.nodes]
    return live_view(nodes, snap, title, width)


def live_view(nodes: list[tuple[str, str, bool]], snap: dict[str, Any], title: str, width: int) -> RenderableType:
    """:func:`status_table` where ``width`` columns hold it unfolded, else :func:`compact_status`."""
    from rich.console import Console

    full = status_table(nodes, snap, title)
    if Console(width=100_000).measure(full).maximum <= width:  # its natural width, unbounded
        return full
    return compact_status(nodes, snap, title)


def eval_cell(evals: list[dict[str, Any]]) -> str:
    """The newest held-out evaluation for the live title, e.g. ``  held-out pass@1 0.41 [0.34, 0.48] (v10)``."""
    if not evals:
        return ""
    e, v = evals[-1].get("eval") or {}, evals[-1].get("policy_version")
    lo, hi = e.get("pass@1_ci95", [float("nan")] * 2)
    return f"  held-out pass@1 {e.get('pass@1', float('nan')):.3f} [{lo:.3f}, {hi:.3f}] (v{v})"


TABLE_COLUMNS = (
    "node",
    "alive",
    "peers",
    "version",
    "step",
    "reward",
    "produced",
    "busy",
    "accepted",
    "rejected",
    "used",
    "ratios",
    "reasons",
)
# the compact view's table: the short cells under short headings; "ratios" and "reasons"
# (free text) go to one line per node below it
COMPACT_COLUMNS = {
    "node": "node",
    "alive": "up",
    "peers": "peers",
    "version": "ver",
    "step": "step",
    "reward": "reward",
    "produced": "made",
    "busy": "busy",
    "accepted": "acc",
    "rejected": "rej",
    "used": "used",
}


def staleness_cell(by_staleness: Any) -> str:
    """The last step's importance ratios per staleness, e.g. ``s0 1.000/0% s2 0.962/7%``:
    mean ratio of the tokens whose rollouts were that many versions behind, then the share of
    them whose gradient the clip cut ("-" before the first step)."""
    if not isinstance(by_staleness, dict) or not by_staleness:
        return "-"
    parts = []
    for s, st in sorted(by_staleness.items(), key=lambda kv: int(kv[0])):
        if isinstance(st, dict):
            parts.append(f"s{s} {st.get('ratio_mean', 1.0):.3f}/{100 * st.get('clip_fraction', 0.0):.0f}%")
    return " ".join(parts) or "-"


def reasons_cell(reasons: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def background_priority(pid: int) -> None:
    """Let process ``pid`` run only on CPU time others leave. ``chrt --idle`` (SCHED_IDLE) does
    that among the tasks of one scheduling group, but a devnet node is a session of its own
    (start_new_session), and with the kernel's autogroups (sched_autogroup_enabled, on by
    default on desktops and most distributions) every session is a group with a normal share
    of the CPU whatever its tasks' policy: the group's own nice value is what counts, so it
    goes to 19 (a weight of 15 against the trainer's 1024). Best effort: no autogroup, no
    change."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text("19")
    except OSError:
        pass


def status_cells(nodes: list[tuple[str, str, bool]], snap: dict[str, Any]) -> list[dict[str, str]]:
    """One dict of :data:`TABLE_COLUMNS` cells per node (``nodes``: name, role, whether its
    process lives; devnet names say the role, so it gets no column), from its status object
    (``snap[name]``; None while it does not answer). Columns: the policy version each learning
    node holds; the trainer's step and reward; batches accepted / rejected as each role sees
    them: the trainer's ledger (admitted / rejected), a worker's own batches (a quorum of
    accept votes / a quorum no longer possible) next to how many it produced, a validator's
    verdicts, with its rejection rules under "reasons". The trainer's "used" is how many
    admitted batches it trained on (and how many it discarded, by reason under "reasons");
    a worker's "busy" the share of wall time it spent generating (utilization, see its status);
    "ratios" its last step's importance ratios and clip fractions per staleness
    (:func:`staleness_cell`). "-" where a column does not apply."""
    rows = []
    for name, role, alive in nodes:
        s = snap.get(name) or {}
        rs = s.get("role_state") or {}
        cells = dict.fromkeys(TABLE_COLUMNS, "-")
        cells.update(node=name, alive="yes" if alive else "no")
        if s:
            cells["peers"] = str(len(s.get("peers") or []))
        if "policy_version" in rs:
            cells["version"] = str(rs["policy_version"])
        if role == "trainer" and rs:
            target = rs.get("target_steps")
            cells["step"] = f"{rs.get('step', '-')}/{target}" if target else str(rs.get("step", "-"))
            reward = rs.get("reward_mean")
            cells["reward"] = f"{reward:.3f}" if isinstance(reward, (int, float)) else "-"
            cells["accepted"], cells["rejected"] = str(rs.get("admitted", "-")), str(rs.get("rejected", "-"))
            discarded = rs.get("discarded_batches") or {}
            if "trained_batches" in rs:
                lost = sum(discarded.values())
                cells["used"] = str(rs["trained_batches"]) + (f" (+{lost} discarded)" if lost else "")
            cells["ratios"] = staleness_cell((rs.get("last_step") or {}).get("by_staleness"))
            cells["reasons"] = reasons_cell(discarded)
        elif role == "worker" and rs:
            cells["produced"] = str(rs.get("batches_produced", "-"))
            busy = rs.get("utilization")
            cells["busy"] = f"{100 * busy:.0f}%" if isinstance(busy, (int, float)) else "-"
            cells["accepted"] = str(rs.get("batches_accepted", "-"))
            cells["rejected"] = str(rs.get("batches_rejected", "-"))
        elif role == "validator" and rs:
            verdicts, reasons = rs.get("verdicts") or {}, rs.get("reasons") or {}
            cells["accepted"], cells["rejected"] = str(verdicts.get("accept", 0)), str(verdicts.get("reject", 0))
            cells["reasons"] = reasons_cell(reasons)
            if verdicts.get("unverifiable"):
                cells["reasons"] = ", ".join(
                    [*([cells["reasons"]] if reasons else []), f"unverifiable {verdicts['unverifiable']} (no vote)"]
                )
        rows.append(cells)
    return rows


def status_table(nodes: list[tuple[str, str, bool]], snap: dict[str, Any], title: str = "devnet") -> Table:
    """Every :func:`status_cells` column, one row per node."""
    from rich.table import Table

    t = Table(title=title)
    longest = max((len(name) for name, _, _ in nodes), default=4)
    for col in TABLE_COLUMNS:
        if col == "node":  # node names stay whole (the other cells fold on a narrow terminal)
            t.add_column(col, min_width=longest, no_wrap=True)
        else:
            t.add_column(col, overflow="fold")
    for cells in status_cells(nodes, snap):
        t.add_row(*(cells[c] for c in TABLE_COLUMNS))
    return t


def compact_status(nodes: list[tuple[str, str, bool]], snap: dict[str, Any], title: str = "devnet") -> Group:
    """The view for an 80-column terminal: the short cells in a table without vertical rules
    (:data:`COMPACT_COLUMNS`, every cell on one line), then one line per node for the free text
    ("ratios", "reasons"), wrapped at the terminal's edge under the node's name."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    for col, heading in COMPACT_COLUMNS.items():
        t.add_column(heading, no_wrap=True, overflow="ellipsis" if col == "used" else "fold")
    notes = Table.grid(padding=(0, 1))
    notes.add_column(no_wrap=True)
    notes.add_column(overflow="fold")
    for cells in status_cells(nodes, snap):
        row = {**cells, "used": cells["used"].replace(" discarded", "")}
        t.add_row(*(row[c] for c in COMPACT_COLUMNS))
        text = "; ".join(f"{c} {cells[c]}" for c in ("ratios", "reasons") if cells[c] != "-")
        if text:
            notes.add_row(cells["node"], Text(text))
    return Group(t, notes)


def plot_rewards(rows: list[dict[str, Any]], path: Path) -> None:
    """The training reward per step and, when the trainer evaluated (``"kind": "eval"`` rows),
    the held-out mean reward and pass@1 per evaluated version (version v is the policy after
    step v, so both curves share the x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in rows if r.get("kind") == "eval" and isinstance(r.get("eval"), dict)]
    rows = [r for r in rows if r.get("kind") != "eval"]
    steps = [r["step"] for r in rows if "reward_mean" in r]
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, marker=".", label="mean reward (admitted rollouts)")
    if len(rewards) >= 5:
        k = 5
        smooth = [
            sum(rewards[max(0, i - k + 1) : i + 1]) / len(rewards[max(0, i - k + 1) : i + 1])
            for i in range(len(rewards))
        ]
        ax.plot(steps, smooth, label=f"moving average ({k})")
    if evals:
        xs = [r["policy_version"] for r in evals]
        ax.plot(xs, [r["eval"]["reward_mean"] for r in evals], marker="o", label="held-out mean reward")
        ax.plot(xs, [r["eval"]["pass@1"] for r in evals], marker="s", linestyle="--", label="held-out pass@1")
        lo = [r["eval"]["pass@1_ci95"][0] for r in evals]
        hi = [r["eval"]["pass@1_ci95"][1] for r in evals]
        ax.fill_between(xs, lo, hi, alpha=0.15, label="held-out pass@1, 95 % interval")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_title("primenode devnet")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def final_eval_done(devnet: Devnet) -> bool:
    """Whether the held-out evaluation of the last version is in (or none is due): the devnet
    waits for it, so the run ends with the score of the policy it made."""
    o = devnet.opts
    if not o.eval_every or o.steps % o.eval_every:
        return True
    return any(r.get("policy_version", -1) >= o.steps for r in devnet.eval_metrics())


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class DevnetStopped(BaseException):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) reached the devnet.

    A BaseException, as KeyboardInterrupt is: the signal lands wherever the main thread is,
    and an ``except Exception`` there (a node's status request, ``NodeProc.status``) swallowed
    it, leaving the devnet running on for good with the signal recorded and never acted on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP stop the devnet the same way: the first raises
    :class:`DevnetStopped` in the main thread, at once or, inside :meth:`critical` (a process
    being started), right after it; once :meth:`stopping` began, a signal raises nothing
    (the stop must finish, or nodes are orphaned) and only cuts the nodes' grace short.
    A signal the devnet inherited ignored (``nohup``: SIGHUP; a shell's background job:
    SIGINT) stays ignored. Python's default left SIGTERM and SIGHUP killing the devnet at
    once, its nodes running on."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.hurry = False
        self._depth = 0
        self._stopping = False
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: object) -> None:
        if self._stopping:
            self.hurry = True
            return
        if self.signum is None:
            self.signum = signum
        if self._depth == 0:
            raise DevnetStopped(signum)

    def check(self) -> None:
        """Raise :class:`DevnetStopped` if a signal came and was lost on the way (belt and braces:
        the loop acts on a recorded signal within a second, whatever caught the raise)."""
        if self.signum is not None and not self._stopping:
            raise DevnetStopped(self.signum)

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self.signum is not None and not self._stopping:
            raise DevnetStopped(self.signum)

    def stop(self, devnet: Devnet) -> dict[str, int | None]:
        """``devnet.stop_all``, never cut short: a signal landing before ``_stopping`` is set
        still raises, so the call is simply made again (stopping twice is harmless)."""
        while True:
            try:
                self._stopping = True
                return devnet.stop_all(hurry=lambda: self.hurry)
            except DevnetStopped:
                continue

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            current = signal.getsignal(sig)
            if current is not signal.SIG_IGN:
                self._previous[sig] = current
                signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _print_safely(console: Any, *args: Any, **kw: Any) -> None:
    """After SIGHUP the terminal may be gone: writing to it must not turn a clean stop into
    a traceback."""
    try:
        console.print(*args, **kw)
    except OSError:
        pass


def run_devnet(opts: DevnetOptions, live: bool = True) -> dict[str, Any]:
    """Run to completion or until a stop signal; returns a summary dict. Every node process
    is gone when this returns, however it returns (``stop_all``)."""
    from rich.console import Console
    from rich.live import Live

    # SIGUSR1 prints every thread's stack to stderr and the devnet runs on: how to see where a
    # devnet that does not stop is stuck (tests send it before they give up on one)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    console = Console(stderr=False)
    devnet = Devnet(opts)
    started = time.monotonic()  # wall time: what the operator waits (no trio run here)
    stopped_by: str | None = None
    last_snap: dict[str, Any] = {}
    with StopSignals() as stops:
        devnet.critical = stops.critical
        try:
            devnet.prepare()
            _print_safely(console, f"devnet in {devnet.out}: bootstrap {devnet.bootstrap_addr}")
            devnet.start_all()
            with Live(console=console, refresh_per_second=1, transient=not live) as view:
                while True:
                    snap = last_snap = devnet.snapshot()
                    view.update(render_table(devnet, snap, started, console.width))
                    rows = devnet.trainer_metrics()
                    if rows and rows[-1].get("step", 0) >= opts.steps and final_eval_done(devnet):
                        break
                    if opts.duration_s and time.monotonic() - started >= opts.duration_s:
                        break
                    trainer = devnet.node("trainer")
                    if trainer.proc and trainer.proc.poll() is not None:
                        raise NodeError(
                            f"the trainer exited with code {trainer.proc.returncode}; "
                            f"see {devnet.out / 'logs' / 'trainer.log'}"
                        )
                    if time.monotonic() - started > opts.timeout_s:
                        raise NodeError(f"devnet did not reach {opts.steps} steps in {opts.timeout_s:.0f}s")
                    stops.check()
                    time.sleep(1.0)
        except DevnetStopped as exc:
            stopped_by = signal.Signals(exc.signum).name
        except OSError:  # the terminal went away (SIGHUP's usual cause) while the view drew
            if stops.signum is None:
                raise
            stopped_by = signal.Signals(stops.signum).name
        finally:
            codes = stops.stop(devnet)
        if stopped_by is None and stops.signum is not None:  # arrived while the view closed
            stopped_by = signal.Signals(stops.signum).name
    every = devnet.metrics_rows()
    rows = [r for r in every if r.get("kind") != "eval"]
    evals = [r for r in every if r.get("kind") == "eval"]
    if devnet.out.exists():
        atomic_write_text(devnet.out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in every), durable=False)
    if rows:
        plot_rewards(every, devnet.out / "reward_curve.png")
    last10 = [r["reward_mean"] for r in rows[-10:] if "reward_mean" in r]
    summary = {
        "steps": rows[-1]["step"] if rows else 0,
        "first_reward": rows[0].get("reward_mean") if rows else None,
        "last_reward": rows[-1].get("reward_mean") if rows else None,
        "reward_last10": round(sum(last10) / len(last10), 4) if last10 else None,
        "batches_used": rows[-1].get("batches_used") if rows else None,
        "batches_discarded": rows[-1].get("batches_discarded") if rows else None,
        "heldout": [
            {"version": r["policy_version"], **{k: r["eval"][k] for k in ("pass@1", "pass@1_ci95", "reward_mean")}}
            for r in evals
        ]
        or None,
        "seconds": round(time.monotonic() - started, 1),
        # each worker's share of wall time spent generating, as last seen (its status)
        "workers_busy": {
            name: (st or {}).get("role_state", {}).get("utilization")
            for name, st in sorted(last_snap.items())
            if name.startswith("worker-")
        },
        **(
            {"time_dilation": opts.time_dilation, "node_cores": opts.node_cores}
            if opts.time_dilation > 1.0 or opts.node_cores
            else {}
        ),
        "exit_codes": codes,
        "interrupted": stopped_by is not None,
        "stopped_by": stopped_by,
        "out": str(devnet.out),
    }
    try:
        if not console.is_terminal:
            console.line()  # the live table leaves no newline behind when stdout is not a terminal
    except OSError:
        pass
    _print_safely(console, json.dumps(summary), soft_wrap=True, markup=False, highlight=False)  # one line
    return summary
