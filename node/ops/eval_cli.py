"""``primenode eval``: score a policy on problems, the way the run's workers sample them.

What is scored (the policy):

* ``--genesis G --home H [--version N]``: a version the run published, read from the
  node home without touching it (no lock, no write: the node may be running): the
  trainer's export folder ``H/trainer/export/vN`` or an assembled version of the chunk
  store whose trainer-signed announce verifies. Default: the newest there. Version 0 is
  the genesis's own model, built as every node builds it.
* ``--model M``: ``tiny``, ``smollm2``, a Hugging Face folder or ``hf:owner/name@rev``
  (local hub cache); with ``--genesis`` the run's prompts and sampling settings apply.

On what (the problems): ``--split heldout`` (the genesis's held-out split, which no
worker was ever assigned: ``node.roles.context.run_problems``), ``--split train``, or
``--dataset SPEC`` (the specs of ``run init``); ``--n`` keeps the first N.

How: ``node.rl.evaluate.sample_problems``, the engine, chat template, rewards and
seeded sampling of the workers; ``--samples K`` completions per problem, pass@1 and
pass@K by the unbiased estimator, 95 % intervals over problems
(``node.rl.scoring``). A table, then one JSON line; ``--out FILE`` writes one JSON
line per problem.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node.errors import ConfigError, ModelError
from node.home import NodeHome
from node.rl.evaluate import ProblemResult, sample_problems, summarize
from protocol.run_config import RunConfig

DEFAULT_CACHE = Path.home() / ".cache" / "primenode"


@dataclasses.dataclass
class Policy:
    """An engine ready to sample, with the prompt encoding and decoding of its run."""

    label: str
    engine: Any
    prompt_ids: Callable[[Any], list[int]]
    decode: Callable[[list[int]], str]
    version: int | None = None


def home_versions(home: NodeHome, run_id: bytes, trainer: str) -> dict[int, dict[str, Path]]:
    """``{version: {file name: path}}`` of the published versions a node home holds, read only:
    the trainer's export folders and the chunk store's assembled versions (their announce
    verified against the run and trainer). Version 0 of a run is not always here (a pinned
    model's version 0 is the genesis's files); the caller builds it from the genesis."""
    from node.checkpoints.manifest import verify_announce
    from protocol import ProtocolError

    found: dict[int, dict[str, Path]] = {}
    store = home.chunks_dir / "versions"
    if store.is_dir():
        for d in sorted(store.iterdir()):
            m = re.fullmatch(r"(\d{10})-[0-9a-f]{16}", d.name)
            files = d / "files"
            if not m or not files.is_dir():
                continue
            try:
                manifest, _ = verify_announce((d / "announce").read_bytes(), run_id, trainer, guard=None)
            except (OSError, ProtocolError):
                continue
            if manifest.version != int(m.group(1)):
                continue
            weights = {str(f.relative_to(files)): f for f in files.rglob("*.safetensors")}
            if weights:
                found[manifest.version] = weights
    export = home.trainer_export_dir
    if export.is_dir():
        for d in export.iterdir():
            if re.fullmatch(r"v\d+", d.name) and (d / "config.json").exists():
                weights = {f.name: f for f in d.glob("*.safetensors")}
                if weights:
                    found.setdefault(int(d.name[1:]), weights)
    return found


def run_policy(ctx: Any, home: Path | None, version: int | None, device: str) -> Policy:
    """A version of the run's policy: from ``home`` (newest by default) or version 0."""
    from node.roles.engines import scoring_engine
    from node.roles.weights import load_state_dict

    g = ctx.genesis
    versions = home_versions(NodeHome(home), g.run_id, g.trainer) if home is not None else {}
    if version is None:
        version = max(versions, default=0)
    if version and version not in versions:
        where = f"{home}" if home is not None else "no --home given"
        raise ConfigError(
            f"policy version {version} is not in {where} (held: {sorted(versions) or 'none'}); "
            "the chunk store keeps the last versions, a trainer's home keeps every exported one"
        )
    state = load_state_dict(versions[version]) if version else None
    engine = scoring_engine(ctx, device, state)
    return Policy(f"{g.model} v{version}", engine, ctx.problem_tokens, ctx.decode, version)


def model_policy(model: str, device: str, style: Any, cache_dir: Path) -> Policy:
    """``tiny``, ``smollm2``, a HF folder or ``hf:owner/name@rev``, as ``dataset filter`` loads it."""
    from node.ops.dataset_cli import load_model_for_sampling

    try:
        engine, prompt_ids, decode = load_model_for_sampling(model, device=device, cache_dir=cache_dir, style=style)
    except (OSError, ValueError) as exc:
        raise ModelError(f"model {model}: {exc}") from exc
    return Policy(model, engine, prompt_ids, decode)


def select_problems(ctx: Any, split: str | None, dataset: str | None, n: int | None, seed: int) -> list[Any]:
    """The problems to score: a split of the run, or a dataset spec (``builtin:<task>`` makes
    ``--n`` problems with ``seed``); then the first ``n``."""
    if dataset is not None:
        if dataset.startswith("builtin:"):
            from node.rl.tasks import builtin_problems

            try:
                problems = builtin_problems(dataset.removeprefix("builtin:"), n or 1024, seed)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        else:
            from node.rl.tasks import load_dataset

            try:
                problems = load_dataset(dataset)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"dataset {dataset}: {exc}") from None
    else:
        if ctx is None:
            raise ConfigError("give --dataset SPEC, or --genesis FILE with --split heldout|train")
        if split == "heldout":
            problems = ctx.heldout
            if not problems:
                raise ConfigError(
                    "this run holds no problems out (genesis [config] heldout_size): `primenode run init --heldout N`"
                )
        elif split == "train":
            problems = ctx.problems
        else:
            raise ConfigError(f"--split must be heldout or train, got {split!r}")
    if n is not None:
        if n < 1:
            raise ConfigError("--n must be at least 1")
        problems = problems[:n]
    if not problems:
        raise ConfigError("no problems to score")
    return list(problems)


@dataclasses.dataclass
class EvalOptions:
    genesis: Path | None = None
    home: Path | None = None
    version: int | None = None
    model: str | None = None
    dataset: str | None = None
    split: str | None = None
    n: int | None = None
    samples: int = 1
    seed: int = 0
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    device: str = "cpu"
    out: Path | None = None
    baseline: Path | None = None
    batch_prompts: int = 8
    threads: int | None = None


def evaluate(
    opts: EvalOptions, progress: Callable[[int, int], None] | None = None
) -> tuple[dict[str, Any], list[ProblemResult]]:
    """The whole command without printing: (summary, per-problem results)."""
    from protocol.messages import SamplingParams

    if opts.samples < 1:
        raise ConfigError("--samples must be at least 1")
    if opts.threads is not None:
        if opts.threads < 1:
            raise ConfigError("--threads must be at least 1")
        import torch

        torch.set_num_threads(opts.threads)
    if opts.home is not None and opts.genesis is None:
        raise ConfigError("--home needs --genesis FILE: the run whose versions to read")
    if opts.version is not None and opts.genesis is None:
        raise ConfigError("--version needs --genesis FILE (and --home H for versions past 0)")
    ctx = None
    cache = NodeHome(opts.home).cache_dir if opts.home is not None else DEFAULT_CACHE
    if opts.genesis is not None:
        from node.genesis_file import read_genesis
        from node.roles.context import RunContext

        ctx = RunContext.from_genesis(read_genesis(opts.genesis).genesis, cache)
    split = opts.split if opts.dataset is None else None
    if ctx is not None and opts.dataset is None and split is None:
        split = "heldout" if ctx.heldout else "train"
    problems = select_problems(ctx, split, opts.dataset, opts.n, opts.seed)

    t0 = time.monotonic()  # wall time: load and evaluation seconds reported to the operator
    if opts.model is not None:
        from node.rl.tasks import PromptStyle

        if opts.version is not None:
            raise ConfigError("give --model or --version, not both")
        style = PromptStyle.from_config(ctx.config if ctx is not None else RunConfig())
        policy = model_policy(opts.model, opts.device, style, cache)
        if ctx is not None and ctx.genesis.model == opts.model:  # the run's own prompts, exactly
            policy.prompt_ids, policy.decode = ctx.problem_tokens, ctx.decode
    elif ctx is not None:
        if not ctx.model_ready:
            raise ModelError(f"the run's model is not on this machine: {ctx.model_note}")
        policy = run_policy(ctx, opts.home, opts.version, opts.device)
    else:
        raise ConfigError("give --model M (tiny, smollm2, a folder, hf:owner/name@rev) or --genesis G [--home H]")
    load_s = time.monotonic() - t0

    base = ctx.sampling if ctx is not None else SamplingParams(temperature=1.0, top_p=1.0, max_tokens=256)
    overrides: dict[str, Any] = {"temperature": opts.temperature, "top_p": opts.top_p, "max_tokens": opts.max_tokens}
    params = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    t1 = time.monotonic()
    results = sample_problems(
        problems,
        policy.engine,
        policy.prompt_ids,
        policy.decode,
        opts.samples,
        params,
        seed=opts.seed,
        batch_prompts=opts.batch_prompts,
        keep_text=opts.out is not None,
        progress=progress,
    )
    seconds = time.monotonic() - t1
    summary = {
        "policy": policy.label,
        "version": policy.version,
        "problems_from": opts.dataset or f"{ctx.genesis.dataset if ctx else '?'} ({split})",
        **summarize(results),
        "seed": opts.seed,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_tokens,
        "load_s": round(load_s, 2),
        "seconds": round(seconds, 2),
        "seconds_per_problem": round(seconds / len(results), 3),
    }
    if opts.baseline is not None:
        summary["vs_baseline"] = compare_with(opts.baseline, results)
    if opts.out is not None:
        by_id = {p.id: p for p in problems}
        lines = []
        for r in results:
            rec = r.to_record()
            rec["prompt"] = by_id[r.id].prompt
            rec["answer"] = by_id[r.id].answer
            lines.append(json.dumps(rec) + "\n")
        from node.util import atomic_write_text

        atomic_write_text(opts.out, "".join(lines), durable=False)
    return summary, results


def compare_with(baseline: Path, results: list[ProblemResult]) -> dict[str, Any]:
    """The paired change of pass@1 and mean reward against another evaluation's per-problem
    file (``--out`` of an earlier ``primenode eval``, e.g. version 0) over the problems both
    scored: a difference per problem, so its interval is tighter than two separate ones."""
    from node.rl.scoring import paired_difference

    try:
        before = {r["id"]: r for r in map(json.loads, baseline.read_text().splitlines()) if r}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--baseline {baseline}: not a per-problem file of primenode eval ({exc})") from None
    both = [r for r in results if r.id in before]
    if not both:
        raise ConfigError(f"--baseline {baseline} scored none of these problems")
    out: dict[str, Any] = {"problems": len(both)}
    for key, now in (("pass_rate", lambda r: r.pass_rate), ("reward_mean", lambda r: r.reward_mean)):
        d, lo, hi = paired_difference([float(before[r.id][key]) for r in both], [now(r) for r in both])
        name = "pass@1" if key == "pass_rate" else key
        out[f"{name}_change"] = round(d, 6)
        out[f"{name}_change_ci95"] = [round(lo, 6), round(hi, 6)]
    return out


def summary_table(summary: dict[str, Any]) -> Any:
    """The scores as a two-column rich table (the JSON line follows it)."""
    from rich.table import Table

    t = Table(title=f"eval {summary['policy']} on {summary['problems_from']}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("95 % interval", justify="right")
    k = summary["k"]
    for name in dict.fromkeys(("pass@1", f"pass@{k}", "reward_mean")):
        lo, hi = summary[f"{name}_ci95"]
        t.add_row(name, f"{summary[name]:.4f}", f"[{lo:.4f}, {hi:.4f}]")
    vs = summary.get("vs_baseline")
    if vs:
        for name in ("pass@1", "reward_mean"):
            lo, hi = vs[f"{name}_change_ci95"]
            t.add_row(f"{name} change vs baseline", f"{vs[f'{name}_change']:+.4f}", f"[{lo:+.4f}, {hi:+.4f}]")
    t.add_row("problems x samples", f"{summary['problems']} x {summary['samples']}", "")
    t.add_row("mean length (tokens)", f"{summary['length_mean']:.1f}", "")
    t.add_row("seconds per problem", f"{summary['seconds_per_problem']:.3f}", "")
    return t


def run_eval_command(opts: EvalOptions) -> dict[str, Any]:
    """``primenode eval``: a progress bar on stderr, the table, then one JSON line on stdout."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console()
    with Progress(
        TextColumn("scoring"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("scoring", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        summary, _ = evaluate(opts, progress)
    console.print(summary_table(summary))
    if opts.out is not None:
        console.print(f"per-problem results -> {opts.out}", markup=False, highlight=False)
    console.print(json.dumps(summary), soft_wrap=True, markup=False, highlight=False)
    return summary
