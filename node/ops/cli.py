"""The ``primenode`` command line.

Every command turns a :class:`NodeError` (or any other failure) into one line on
stderr and a non-zero exit; ``--debug`` shows the traceback instead. ``--debug`` is
kept on the click context and passed down to the daemon's entry points as an
argument (the daemon never reads it back from this module).
"""

from __future__ import annotations

import enum
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from node.errors import ConfigError, ModelError, NodeError
from node.home import NodeHome

app = typer.Typer(
    name="primenode",
    help="Peer-to-peer node for decentralized asynchronous RL training.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
run_app = typer.Typer(help="Create and inspect run genesis files.", no_args_is_help=True)
dataset_app = typer.Typer(help="Prepare datasets.", no_args_is_help=True)
app.add_typer(run_app, name="run")
app.add_typer(dataset_app, name="dataset")

HomeOpt = Annotated[Path, typer.Option("--home", help="Node home directory (key, config, store, database).")]


class Role(enum.StrEnum):
    trainer = "trainer"
    worker = "worker"
    validator = "validator"


@app.callback()
def _main(
    ctx: typer.Context, debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False
) -> None:
    ctx.obj = {"debug": debug}


def _debug(ctx: typer.Context) -> bool:
    """The global ``--debug`` flag, as the app callback left it on the click context."""
    return bool((ctx.find_root().obj or {}).get("debug"))


@app.command()
def init(
    home: HomeOpt,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing key (a new identity!).")] = False,
) -> None:
    """Create a node home: a private ed25519 identity key and a config file."""
    key = NodeHome(home).init(force=force)
    typer.echo(f"initialised {NodeHome(home).path}")
    typer.echo(f"peer id {key.peer_id}")


@app.command("id")
def show_id(home: HomeOpt) -> None:
    """Print this node's peer id (derived from its key; stable across runs)."""
    typer.echo(NodeHome(home).load_key().peer_id)


@app.command()
def bootstrap(
    ctx: typer.Context,
    home: HomeOpt,
    listen: Annotated[
        list[str] | None,
        typer.Option("--listen", help="Multiaddr to listen on, e.g. /ip4/0.0.0.0/tcp/4001 (repeatable)."),
    ] = None,
    genesis: Annotated[
        Path | None, typer.Option("--genesis", help="Signed run genesis file to serve to joiners.")
    ] = None,
    status_port: Annotated[
        int | None, typer.Option("--status-port", help="Local status/metrics port (127.0.0.1).")
    ] = None,
) -> None:
    """Run a rendezvous node: others dial it first; it serves the genesis and peer addresses."""
    from node.ops.daemon import run_bootstrap

    run_bootstrap(home=home, listen=listen, genesis=genesis, status_port=status_port, debug=_debug(ctx))


@app.command()
def join(
    ctx: typer.Context,
    home: HomeOpt,
    role: Annotated[Role, typer.Option("--role", help="What this node does in the run.")],
    bootstrap: Annotated[
        list[str] | None,
        typer.Option("--bootstrap", help="Multiaddr of a bootstrap node, with /p2p/<peer id> (repeatable)."),
    ] = None,
    listen: Annotated[list[str] | None, typer.Option("--listen", help="Multiaddr to listen on (repeatable).")] = None,
    run_id: Annotated[
        str | None, typer.Option("--run-id", help="Hex run id to join; refuses a bootstrap serving another run.")
    ] = None,
    genesis: Annotated[
        Path | None, typer.Option("--genesis", help="Signed genesis file (instead of asking the bootstrap).")
    ] = None,
    target_peers: Annotated[
        int | None, typer.Option("--target-peers", help="Connections to keep to distinct peers.")
    ] = None,
    max_upload_mbps: Annotated[
        float | None, typer.Option("--max-upload-mbps", help="Cap on checkpoint upload rate (Mbit/s); 0 = none.")
    ] = None,
    data_port: Annotated[int | None, typer.Option("--data-port", help="TCP port of the chunk data plane.")] = None,
    status_port: Annotated[
        int | None, typer.Option("--status-port", help="Local status/metrics port (127.0.0.1).")
    ] = None,
    device: Annotated[str, typer.Option("--device", help="Torch device for inference/training (cpu, cuda).")] = "cpu",
    engine: Annotated[str, typer.Option("--engine", help="Inference engine: transformers or vllm.")] = "transformers",
    tamper: Annotated[
        str | None, typer.Option("--tamper", hidden=True, help="Adversarial tests: misbehave this way.")
    ] = None,
    nproc: Annotated[
        int, typer.Option("--nproc", help="Trainer only: ranks of one torchrun group (FSDP2), one per GPU.")
    ] = 1,
) -> None:
    """Join a run as trainer, worker or validator."""
    from node.ops import launch
    from node.ops.daemon import run_join

    if nproc > 1 and role != Role.trainer:
        raise typer.BadParameter("--nproc is for --role trainer")
    if nproc > 1 and not launch.under_torchrun():
        launch.exec_torchrun(sys.argv[1:], nproc)
    if launch.under_torchrun() and launch.launched_rank() != 0:
        from node.rl.ranks import follow

        follow(device)  # the network node is rank 0; this rank takes part in its steps
        return

    run_join(
        home=home,
        role=role.value,
        bootstrap=bootstrap,
        listen=listen,
        run_id=run_id,
        genesis=genesis,
        target_peers=target_peers,
        max_upload_mbps=max_upload_mbps,
        data_port=data_port,
        status_port=status_port,
        device=device,
        engine=engine,
        tamper=tamper,
        debug=_debug(ctx),
    )


@app.command()
def status(
    home: HomeOpt,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """Show what a running node is doing: peers, gossip, swarm, role state."""
    from node.ops.status_cli import show_status

    show_status(home=home, as_json=as_json)


@app.command()
def doctor(
    home: HomeOpt,
    bootstrap: Annotated[
        list[str] | None,
        typer.Option("--bootstrap", help="A bootstrap address to check (repeatable; default: the home's config)."),
    ] = None,
    genesis: Annotated[
        Path | None, typer.Option("--genesis", help="The run's genesis: sizes the disk check, names the run id.")
    ] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="The run id the bootstraps must serve.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")] = False,
) -> None:
    """Check this machine for a run: engine, disk, sandbox, bootstraps, reachability, clock,
    bandwidth. One line per check with its fix; exit 1 when a blocker fails."""
    import json

    from node.ops.doctor import DoctorOptions, exit_code, render, run_doctor

    addrs = list(bootstrap or [])
    if not addrs and home.exists():
        try:
            addrs = list(NodeHome(home).load_config().bootstrap)
        except Exception:
            addrs = []
    checks = run_doctor(DoctorOptions(home=home, bootstrap=addrs, genesis=genesis, run_id=run_id))
    rc = exit_code(checks)
    if as_json:
        print(json.dumps({"ok": rc == 0, "checks": [c.to_json() for c in checks]}))
    else:
        from rich.console import Console

        Console().print(render(checks))
    if rc:
        raise typer.Exit(rc)


@run_app.command("init")
def run_init(
    home: Annotated[Path, typer.Option("--home", help="The run owner's node home (its key signs the genesis).")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the genesis TOML.")],
    trainer: Annotated[str, typer.Option("--trainer", help="Peer id of the trainer.")],
    validator: Annotated[list[str], typer.Option("--validator", help="Peer id of a validator (repeatable).")],
    name: Annotated[str, typer.Option("--name", help="Run name.")] = "primenode-run",
    quorum: Annotated[
        int | None,
        typer.Option("--quorum", help="Accept votes needed to admit a batch (default: a majority of the validators)."),
    ] = None,
    committee_size: Annotated[
        int | None,
        typer.Option(
            "--committee-size",
            help="Validators that verify each batch, drawn per batch (0: every validator; default: 3 once "
            "there are four or more validators, with a quorum of 2).",
        ),
    ] = None,
    max_async: Annotated[
        int, typer.Option("--max-async", help="Versions a batch's policy may lag (INTELLECT-2: 2).")
    ] = 2,
    model: Annotated[
        str,
        typer.Option(
            "--model",
            help="tiny, smollm2, a Hugging Face model FOLDER or hf:owner/name@revision (local hub cache); "
            "a HF model is pinned by content (config, tokenizer and weights of version 0).",
        ),
    ] = "tiny",
    dataset: Annotated[
        str,
        typer.Option(
            "--dataset", help="Dataset spec (builtin:<task>, a .jsonl/.parquet file or folder, or hf:owner/name@rev)."
        ),
    ] = "builtin:target-length",
    dataset_size: Annotated[
        int | None,
        typer.Option("--dataset-size", help="Number of prompts (default: the whole dataset; 1024 for a builtin)."),
    ] = None,
    heldout: Annotated[
        int,
        typer.Option(
            "--heldout",
            help="Hold out this many problems (whole prompts, by hash): never assigned to a worker; "
            "scored by `primenode eval --split heldout` and the trainer's eval_every.",
        ),
    ] = 0,
    prompts_per_batch: Annotated[int, typer.Option("--prompts-per-batch", help="Prompts per worker batch.")] = 4,
    group_size: Annotated[int, typer.Option("--group-size", help="Completions per prompt (GRPO group).")] = 8,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="Checkpoint chunk size in bytes.")] = 4 << 20,
    config: Annotated[
        list[str] | None, typer.Option("--set", help="Hyper-parameter KEY=VALUE (TOML value), repeatable.")
    ] = None,
) -> None:
    """Write a signed run genesis; its hash is the run id."""
    from node.genesis_file import check_config, make_genesis, write_genesis
    from protocol.committee import default_committee
    from protocol.run_config import RunConfig

    cfg = _set_values(config)
    check_config(cfg)  # a typo is named before the model and dataset are hashed
    owner = NodeHome(home).load_key()
    size, majority = default_committee(len(validator))
    if committee_size is not None or "committee_size" in cfg:
        size = committee_size if committee_size is not None else int(cfg["committee_size"])
        on_committee = size if 0 < size < len(validator) else len(validator)
        majority = on_committee // 2 + 1
    if quorum is None:
        quorum = majority  # a majority (of a committee): with two or more, no validator admits alone
    if size:
        cfg["committee_size"] = size
    pins, split = _content_pins(model, dataset, dataset_size, chunk_size, RunConfig.decode(cfg).seed, heldout)
    cfg.update(split)
    signed = make_genesis(
        owner,
        cfg,
        name=name,
        **pins,
        trainer=trainer,
        validators=validator,
        quorum=quorum,
        max_async=max_async,
        prompts_per_batch=prompts_per_batch,
        group_size=group_size,
        chunk_size=chunk_size,
    )
    write_genesis(signed, out)
    g = signed.genesis
    typer.echo(f"wrote {out}")
    typer.echo(f"run id {g.run_id.hex()}")
    if 0 < size < len(g.validators):
        typer.echo(f"committees of {size} of {len(g.validators)} validators per batch, quorum {g.quorum}")
    else:
        typer.echo(f"quorum {g.quorum} of {len(g.validators)} validators")
    typer.echo(f"dataset {g.dataset}: {g.dataset_size} problems, dataset_hash {g.dataset_hash.hex()}")
    if split:
        typer.echo(f"held out {split['heldout_size']} problems, heldout_hash {split['heldout_hash']}")
    if g.model_root:
        typer.echo(f"model {g.model}: model_root {g.model_root.hex()}")


def _content_pins(
    model: str, dataset: str, size: int | None, chunk_size: int, seed: int, heldout: int = 0
) -> tuple[dict[str, object], dict[str, object]]:
    """Genesis fields that pin the run's data by content: the dataset's hash (every run) and,
    for a Hugging Face model, the content root of its files (version 0); plus the [config]
    keys of a held-out split (``node.roles.context.pin_problems``). Reads every byte."""
    from node.models import BUILTIN_MODELS, model_files, model_root_of, model_source_folder
    from node.roles.context import pin_problems

    if heldout < 0:
        raise ConfigError("--heldout must be >= 0")
    fields, split = pin_problems(dataset, size, seed, heldout)
    if model in BUILTIN_MODELS:
        fields["model"] = model
    else:
        folder = model_source_folder(model)
        fields["model"] = model if model.startswith("hf:") else str(folder.resolve())
        fields["model_root"] = model_root_of(model_files(folder), chunk_size)
    return fields, split


@run_app.command("show")
def run_show(path: Annotated[Path, typer.Argument(help="Genesis TOML file.")]) -> None:
    """Verify a genesis file and print its run id and settings."""
    from node.genesis_file import read_genesis

    g = read_genesis(path).genesis
    typer.echo(f"run id     {g.run_id.hex()}")
    typer.echo(f"owner      {g.owner}")
    typer.echo(f"trainer    {g.trainer}")
    typer.echo(f"validators {', '.join(g.validators)} (quorum {g.quorum})")
    typer.echo(f"model      {g.model}   dataset {g.dataset} ({g.dataset_size} prompts)")
    typer.echo(f"max_async  {g.max_async}   batch {g.prompts_per_batch} prompts x {g.group_size}")
    typer.echo(f"dataset_hash {g.dataset_hash.hex() or '(not pinned)'}")
    typer.echo(f"model_root   {g.model_root.hex() or '(built-in model, not pinned)'}")
    from node.genesis_file import run_config

    cfg = run_config(g)
    if cfg.heldout_size:
        typer.echo(f"heldout    {cfg.heldout_size} problems, heldout_hash {cfg.heldout_hash or '?'}")


@dataset_app.command("make")
def dataset_make(
    task: Annotated[str, typer.Argument(help="Built-in task: target-length, arithmetic or addition.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Dataset file to write (.jsonl or .parquet).")],
    n: Annotated[int, typer.Option("-n", "--n", help="Number of problems.")] = 1024,
    seed: Annotated[int, typer.Option("--seed", help="Seed (same seed, same problems).")] = 0,
    max_operand: Annotated[
        int | None,
        typer.Option("--max-operand", help="Largest operand (arithmetic, addition; default: the task's own)."),
    ] = None,
) -> None:
    """Write a built-in task's seeded problems as a dataset file (to filter, edit or pin by hash)."""
    from node.rl.tasks import builtin_problems, save_dataset

    if n < 1:
        raise ConfigError("-n must be at least 1")
    try:
        problems = builtin_problems(task, n, seed, max_operand)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    typer.echo(f"{len(problems)} {task} problems -> {save_dataset(problems, output)}")


@dataset_app.command("filter")
def dataset_filter(
    input_path: Annotated[
        str,
        typer.Argument(help="Dataset: a .jsonl/.json/.parquet file or folder, or hf:owner/name@rev (docs/rl.md)."),
    ],
    model: Annotated[
        str,
        typer.Option(
            "--model",
            help="Model sampling the completions: tiny, smollm2, a local HF folder or hf:owner/name@rev (local cache).",
        ),
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Filtered dataset (.jsonl or .parquet), with pass_rate.")
    ],
    k: Annotated[int, typer.Option("--k", help="Completions sampled per problem.")] = 16,
    lo: Annotated[
        float, typer.Option("--min-pass", help="Keep problems with pass rate >= this (INTELLECT-2: 0.1).")
    ] = 0.1,
    hi: Annotated[
        float, typer.Option("--max-pass", help="Keep problems with pass rate <= this (INTELLECT-2: 0.8).")
    ] = 0.8,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Max new tokens per completion.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature.")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed (same seed, same pass rates).")] = 0,
    limit: Annotated[int | None, typer.Option("--limit", help="Only the first N problems.")] = None,
    device: Annotated[str, typer.Option("--device", help="Torch device (cpu, cuda).")] = "cpu",
    split: Annotated[str, typer.Option("--split", help="Split of an hf: dataset.")] = "train",
    system_prompt: Annotated[
        str | None,
        typer.Option("--system-prompt", help="System prompt of math problems (the run's [config] system_prompt)."),
    ] = None,
    math_instruction: Annotated[
        str | None,
        typer.Option("--math-instruction", help="Instruction after a math problem ([config] math_instruction)."),
    ] = None,
) -> None:
    """Sample k completions per problem, record pass rates, keep problems whose rate lies from --min-pass to --max-pass.

    Prompts go through the model's chat template with the system prompt and the \\boxed{}
    instruction the run will use; pass --system-prompt / --math-instruction when the genesis
    sets its own."""
    from node.ops.dataset_cli import filter_dataset
    from node.rl.tasks import PromptStyle
    from protocol.run_config import RunConfig

    overrides = {"system_prompt": system_prompt, "math_instruction": math_instruction}
    style = PromptStyle.from_config(RunConfig.decode({k: v for k, v in overrides.items() if v is not None}))

    try:
        summary = filter_dataset(
            input_path,
            model,
            output,
            k=k,
            lo=lo,
            hi=hi,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            limit=limit,
            device=device,
            split=split,
            style=style,
            progress=lambda done, total: typer.echo(f"\r{done}/{total} problems", nl=False, err=True),
        )
    except (FileNotFoundError, ValueError) as exc:
        raise ModelError(str(exc)) from exc
    typer.echo("", err=True)
    typer.echo(f"kept {summary.kept}/{summary.total} problems with pass rate in [{lo}, {hi}] -> {summary.output}")
    rates = list(summary.pass_rates.values())
    if rates:  # the base model's rate over every problem, kept or not: where the run starts from
        typer.echo(f"mean pass rate {sum(rates) / len(rates):.4f} over all {len(rates)} problems")


@app.command("eval")
def eval_cmd(
    genesis: Annotated[
        Path | None, typer.Option("--genesis", help="The run's genesis: its model, prompts, sampling, held-out split.")
    ] = None,
    home: Annotated[
        Path | None, typer.Option("--home", help="A node home holding published versions (read only).")
    ] = None,
    version: Annotated[
        int | None, typer.Option("--version", help="Policy version to score (default: the newest in --home).")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option("--model", help="Score this model instead: tiny, smollm2, a HF folder or hf:owner/name@rev."),
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(
            "--dataset", help="Problems: builtin:<task>, a .jsonl/.parquet file or folder, hf:owner/name@rev."
        ),
    ] = None,
    split: Annotated[
        str | None,
        typer.Option("--split", help="heldout or train: the run's split (default: heldout when it has one)."),
    ] = None,
    n: Annotated[int | None, typer.Option("--n", help="Score the first N problems.")] = None,
    samples: Annotated[
        int, typer.Option("--samples", help="Seeded completions per problem (pass@1 and pass@K from them).")
    ] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed (same seed, same score).")] = 0,
    temperature: Annotated[float | None, typer.Option("--temperature", help="Override the run's.")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="Override the run's.")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="Override the run's.")] = None,
    device: Annotated[str, typer.Option("--device", help="Torch device (cpu, cuda).")] = "cpu",
    threads: Annotated[
        int | None, typer.Option("--threads", help="CPU compute threads (default: torch's; 1 on a busy machine).")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write one JSON line per problem here.")] = None,
    baseline: Annotated[
        Path | None,
        typer.Option("--baseline", help="An earlier eval's --out file: add the paired change and its interval."),
    ] = None,
) -> None:
    """Score a policy on problems (pass@1, pass@K, mean reward, 95 % intervals); a table, then a JSON line."""
    from node.ops.eval_cli import EvalOptions, run_eval_command

    run_eval_command(
        EvalOptions(
            genesis=genesis,
            home=home,
            version=version,
            model=model,
            dataset=dataset,
            split=split,
            n=n,
            samples=samples,
            seed=seed,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            device=device,
            out=out,
            baseline=baseline,
            threads=threads,
        )
    )


@app.command()
def devnet(
    out: Annotated[
        Path, typer.Option("--out", help="Output folder: node homes, logs, metrics.jsonl, reward_curve.png.")
    ] = Path("devnet-out"),
    workers: Annotated[int, typer.Option("--workers", help="Number of worker processes.")] = 2,
    validators: Annotated[int, typer.Option("--validators", help="Number of validator processes.")] = 2,
    steps: Annotated[int, typer.Option("--steps", help="Trainer steps before stopping.")] = 40,
    model: Annotated[
        str, typer.Option("--model", help="Model: tiny (random init, char vocabulary) or smollm2.")
    ] = "tiny",
    task: Annotated[
        str, typer.Option("--task", help="Built-in task: target-length, arithmetic or addition.")
    ] = "target-length",
    dataset: Annotated[
        Path | None,
        typer.Option(
            "--dataset",
            help="Dataset file or folder (e.g. `primenode dataset filter` output) instead of --task; "
            "pinned in the genesis by its content hash.",
        ),
    ] = None,
    max_async: Annotated[int, typer.Option("--max-async", help="Versions a batch may lag behind the trainer.")] = 2,
    timeout: Annotated[float, typer.Option("--timeout", help="Give up after this many seconds.")] = 900.0,
    duration: Annotated[
        float,
        typer.Option("--duration", help="Stop cleanly after this many seconds, whatever the step (0: off)."),
    ] = 0.0,
    engine: Annotated[
        str, typer.Option("--engine", help="Engine of workers and validators: transformers or vllm.")
    ] = "transformers",
    prompts_per_step: Annotated[
        int,
        typer.Option(
            "--prompts-per-step", help="Prompts a trainer step learns from, split across the workers' batches."
        ),
    ] = 16,
    prompts_per_batch: Annotated[
        int, typer.Option("--prompts-per-batch", help="Prompts per worker batch (overrides the split; 0: split).")
    ] = 0,
    group_size: Annotated[int, typer.Option("--group-size", help="Completions sampled per prompt (GRPO group).")] = 8,
    lr: Annotated[float, typer.Option("--lr", help="Trainer AdamW learning rate.")] = 1e-4,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Max new tokens per completion.")] = 48,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature.")] = 1.0,
    policy_dtype: Annotated[
        str,
        typer.Option(
            "--policy-dtype", help="Precision of the published policy and of the engines: float32 or bfloat16."
        ),
    ] = "float32",
    system_prompt: Annotated[
        str | None,
        typer.Option("--system-prompt", help="System prompt of math problems (empty: the chat template's own)."),
    ] = None,
    math_instruction: Annotated[
        str | None, typer.Option("--math-instruction", help="Instruction appended to a math problem.")
    ] = None,
    heldout: Annotated[
        int, typer.Option("--heldout", help="Hold out this many problems from training (run init --heldout).")
    ] = 0,
    eval_every: Annotated[
        int, typer.Option("--eval-every", help="The trainer scores the held-out problems every N versions (0: off).")
    ] = 0,
    eval_problems: Annotated[
        int, typer.Option("--eval-problems", help="Held-out problems each evaluation scores (0: all).")
    ] = 0,
    eval_samples: Annotated[int, typer.Option("--eval-samples", help="Completions per held-out problem.")] = 1,
    lockstep: Annotated[
        bool,
        typer.Option(
            "--lockstep",
            help="One batch per worker per version, then wait for the next (the old pipeline, for comparisons); "
            "by default each worker runs one version ahead of the trainer, generating the next step's batch "
            "while the trainer trains.",
        ),
    ] = False,
    node_cores: Annotated[
        str,
        typer.Option(
            "--node-cores",
            help="Benchmarks: give every node process this many CPUs of its own per emulated second (a cgroup "
            "CPU quota of CPUs / --time-dilation, needs root): one number for all, or per role "
            "(trainer=2,worker=0.5,validator=1); 0: no cap.",
        ),
    ] = "0",
    time_dilation: Annotated[
        float,
        typer.Option(
            "--time-dilation",
            help="Benchmarks: run every node's clock this many times slower than real time "
            "(with --node-cores: nodes x cores / this machine's cores); 1: real time.",
        ),
    ] = 1.0,
    max_upload_mbps: Annotated[
        float, typer.Option("--max-upload-mbps", help="Cap every node's checkpoint uploads (Mbit/s); 0: none.")
    ] = 0.0,
    config: Annotated[
        list[str] | None,
        typer.Option("--set", help="Genesis [config] KEY=VALUE (TOML value) over the devnet's own, repeatable."),
    ] = None,
) -> None:
    """Start a whole local network (bootstrap, trainer, workers, validators) as processes and train."""
    from node.ops.devnet import DevnetOptions, run_devnet
    from node.ops.emulation import parse_node_cores

    summary = run_devnet(
        DevnetOptions(
            out=out,
            workers=workers,
            validators=validators,
            steps=steps,
            model=model,
            task=task,
            dataset=dataset,
            max_async=max_async,
            lockstep=lockstep,
            node_cores=parse_node_cores(node_cores),
            extra_config=_set_values(config),
            time_dilation=time_dilation,
            max_upload_mbps=max_upload_mbps,
            timeout_s=timeout,
            duration_s=duration,
            engine=engine,
            prompts_per_step=prompts_per_step,
            prompts_per_batch=prompts_per_batch,
            group_size=group_size,
            lr=lr,
            max_tokens=max_tokens,
            temperature=temperature,
            policy_dtype=policy_dtype,
            system_prompt=system_prompt,
            math_instruction=math_instruction,
            heldout=heldout,
            eval_every=eval_every,
            eval_problems=eval_problems,
            eval_samples=eval_samples,
        )
    )
    if summary["stopped_by"]:  # 128 + the signal, as a shell reports a process it stopped
        raise typer.Exit(128 + int(signal.Signals[summary["stopped_by"]]))


def main() -> None:
    """Console-script entry: one clear line per error, traceback only with --debug."""
    debug = "--debug" in sys.argv[1:]
    from node.ops.lifeline import stop_with_parent

    stop_with_parent()  # started by `primenode devnet`: stop when it dies, even by SIGKILL
    try:
        rc = app(standalone_mode=False)  # click returns a typer.Exit's code instead of raising it here
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except NodeError as exc:
        if debug:
            raise
        typer.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # click usage errors and anything unexpected
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if debug:
            raise
        typer.echo(f"error: {type(exc).__name__}: {exc} (rerun with --debug for a traceback)", err=True)
        sys.exit(1)


def _set_values(items: list[str] | None) -> dict[str, Any]:
    """``--set KEY=VALUE`` options as genesis ``[config]`` entries (VALUE read as a TOML value,
    else kept as a string)."""
    import tomllib

    cfg: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            cfg[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            cfg[key.strip()] = value
    return cfg


if __name__ == "__main__":
    main()
