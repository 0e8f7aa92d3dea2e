"""Learning in the network vs one process: ``primenode devnet`` runs beside a synchronous one
(``--max-async 0``) and the single-process GRPO loop on the same model, task and settings.

    python bench/learning.py [--runs 3] [--lockstep-runs 1] [--steps 40] [--no-sync] [--demo-seeds 0] [--out DIR]
                             [--baseline-tree DIR]   # e.g. a git worktree of main before issue 20
    python bench/learning.py --summarise DIR [DIR ...]     # only read finished devnet folders

Each devnet is started through the CLI (``python -m node.ops.cli devnet``: six OS
processes, the user's path) one after another, never two at once. Reported per run:
wall time (the devnet's own start-to-stop seconds), mean reward over steps 31-40 (the
goal: >= 0.7), admitted batches used / discarded (by reason), the staleness mix of the
trained batches, and per staleness the token-weighted mean |ratio - 1| and clip fraction
over all steps. The single-process loop (``node.rl.demo``, on-policy, one batch of 8
prompts x 8 completions per step) is the baseline. The machine's load average is printed
with every run: devnet wall times mean something only on an otherwise quiet machine.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WINDOW = (31, 40)  # steps whose mean reward the goal names


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        path = folder / "nodes" / "trainer" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") != "eval"]  # held-out evaluations: not steps


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What one run did, from its metrics.jsonl (old trees without the new fields included:
    staleness then follows from ``batch_versions``, ratios are unknown)."""
    window = [r["reward_mean"] for r in rows if WINDOW[0] <= r.get("step", 0) <= WINDOW[1]]
    mix: dict[str, int] = {}
    ratio: dict[str, dict[str, float]] = {}
    for r in rows:
        if "batch_staleness" in r:
            for s, n in r["batch_staleness"].items():
                mix[s] = mix.get(s, 0) + n
        else:  # older trees: one version per batch, "step" is the version after the step
            for v in r.get("batch_versions", []):
                s = str(r["step"] - 1 - v)
                mix[s] = mix.get(s, 0) + 1
        for s, st in (r.get("by_staleness") or {}).items():
            acc = ratio.setdefault(s, {"tokens": 0, "dev": 0.0, "clip": 0.0})
            acc["tokens"] += st["tokens"]
            acc["dev"] += st["ratio_dev"] * st["tokens"]
            acc["clip"] += st["clip_fraction"] * st["tokens"]
    by_version: dict[str, list[float]] = {}  # version -> [rollouts, reward sum], whichever step trained them
    for r in rows:
        for v, st in (r.get("by_version") or {}).items():
            acc_v = by_version.setdefault(v, [0, 0.0])
            acc_v[0] += st["rollouts"]
            acc_v[1] += st["rollouts"] * st["reward_mean"]
    last = rows[-1] if rows else {}
    used = last.get("batches_used")
    discarded = last.get("batches_discarded")
    return {
        "rewards": [round(r["reward_mean"], 4) for r in rows],
        "steps": last.get("step", 0),
        "reward_31_40": round(sum(window) / len(window), 4) if window else None,
        "reward_first5": round(sum(r["reward_mean"] for r in rows[:5]) / max(1, len(rows[:5])), 4),
        "batches_per_step": round(sum(r.get("batches", 1) for r in rows) / max(1, len(rows)), 2),
        "used": used,
        "discarded": discarded,
        "utilisation": (
            round(used / (used + sum(discarded.values()) + last.get("buffer", 0)), 4)
            if used is not None and discarded is not None
            else None
        ),
        "reward_by_version": {
            v: {"rollouts": int(n), "reward_mean": round(t / n, 4)}
            for v, (n, t) in sorted(by_version.items(), key=lambda kv: int(kv[0]))
            if n
        },
        "staleness_mix": dict(sorted(mix.items())),
        "ratio_by_staleness": {
            s: {"ratio_dev": round(a["dev"] / a["tokens"], 4), "clip_fraction": round(a["clip"] / a["tokens"], 4)}
            for s, a in sorted(ratio.items())
            if a["tokens"]
        },
    }


def run_devnet(out: Path, steps: int, extra: list[str], tree: Path = REPO) -> dict[str, Any]:
    """One devnet through the CLI of the source tree ``tree`` (this one, or a baseline's)."""
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "node.ops.cli", "devnet", "--out", str(out), "--steps", str(steps), *extra]
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.monotonic()
    cpu0 = os.times()
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env)
    cpu1 = os.times()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "run": " ".join(["devnet", *extra]) + ("" if tree == REPO else f" (tree {tree})"),
        "seconds": summary["seconds"],
        "process_s": round(wall, 1),
        # CPU of the devnet and all its node processes (children's user + system time)
        "cpu_s": round((cpu1.children_user - cpu0.children_user) + (cpu1.children_system - cpu0.children_system), 1),
        "load_before": round(load, 2),
        "load_after": round(os.getloadavg()[0], 2),
        **summarise(read_metrics(out)),
    }


def run_demo(seed: int, steps: int, prompts: int = 8) -> dict[str, Any]:
    import torch

    from node.rl.demo import demo_config, run_target_length_demo

    torch.set_num_threads(1)  # as each devnet process (OMP_NUM_THREADS=1)
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    res = run_target_length_demo(steps, seed, config=demo_config(prompts_per_step=prompts))
    rows = [{**m.as_dict(), "step": i + 1} for i, m in enumerate(res.metrics)]
    return {
        "run": f"one process (node.rl.demo, seed {seed}, {prompts} prompts/step)",
        "seconds": round(time.monotonic() - t0, 1),
        "load_before": round(load, 2),
        "load_after": round(os.getloadavg()[0], 2),
        **summarise(rows),
    }


def measure_cost(repeats: int = 5) -> dict[str, Any]:
    """What recomputing old log-probs with the generating version costs the trainer: reading a
    published version back (safetensors, page cache warm) for the devnet's tiny model and for a
    SmolLM2-135M-sized state dict (random values, same tensor shapes count), and the old-log-prob
    pass of one devnet batch (64 rollouts) with the live weights vs another version's weights
    substituted by ``torch.func.functional_call``."""
    import statistics

    import torch
    from safetensors.torch import save_file

    from node.models import tiny_llama
    from node.rl.grpo import GRPOConfig, GRPOTrainer, Rollout
    from node.rl.tasks import CharTokenizer
    from node.roles.weights import export_weights, load_state_dict

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="learning-cost-"))
    tok = CharTokenizer()
    model = tiny_llama(vocab_size=tok.vocab_size, hidden_size=256, layers=4, heads=4, eos_token_id=tok.EOS)
    export_weights(model, tmp / "tiny")
    files = {p.name: p for p in (tmp / "tiny").iterdir()}

    def timed(fn: Any) -> float:
        fn()  # warm (page cache, allocator)
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs)

    tiny_bytes = sum(p.stat().st_size for p in files.values())
    tiny_load = timed(lambda: load_state_dict(files))
    # SmolLM2-135M: 30 layers, hidden 576, intermediate 1536, 9 heads / 3 kv heads, vocab 49152, tied
    shapes = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}
    for i in range(30):
        pre = f"model.layers.{i}."
        shapes |= {
            pre + "self_attn.q_proj.weight": (576, 576),
            pre + "self_attn.k_proj.weight": (192, 576),
            pre + "self_attn.v_proj.weight": (192, 576),
            pre + "self_attn.o_proj.weight": (576, 576),
            pre + "mlp.gate_proj.weight": (1536, 576),
            pre + "mlp.up_proj.weight": (1536, 576),
            pre + "mlp.down_proj.weight": (576, 1536),
            pre + "input_layernorm.weight": (576,),
            pre + "post_attention_layernorm.weight": (576,),
        }
    save_file({k: torch.randn(v) for k, v in shapes.items()}, str(tmp / "smollm2.safetensors"))
    big = {"model.safetensors": tmp / "smollm2.safetensors"}
    big_bytes = (tmp / "smollm2.safetensors").stat().st_size
    big_load = timed(lambda: load_state_dict(big))

    trainer = GRPOTrainer(model, GRPOConfig(temperature=1.0, max_tokens=48, micro_batch_size=32))
    gen = torch.Generator().manual_seed(0)
    rollouts = [
        Rollout(
            [1, *torch.randint(3, 70, (6,), generator=gen).tolist()],
            torch.randint(3, 70, (48,), generator=gen).tolist(),
            0.0,
            0,
        )
        for _ in range(64)
    ]
    state = load_state_dict(files)
    live = timed(lambda: trainer.old_logprobs(rollouts))
    other = timed(
        lambda: trainer.old_logprobs(
            [Rollout(r.prompt_tokens, r.completion_tokens, 0.0, 1) for r in rollouts], behaviour=lambda v: state
        )
    )
    return {
        "tiny_state_dict_mib": round(tiny_bytes / 2**20, 1),
        "tiny_read_s": round(tiny_load, 4),
        "smollm2_state_dict_mib": round(big_bytes / 2**20, 1),
        "smollm2_read_s": round(big_load, 3),
        "old_logprobs_64_rollouts_live_s": round(live, 4),
        "old_logprobs_64_rollouts_other_version_s": round(other, 4),
    }


def table(results: list[dict[str, Any]]) -> None:
    cols = (
        "run",
        "seconds",
        "cpu_s",
        "load_before",
        "reward_31_40",
        "batches_per_step",
        "used",
        "discarded",
        "staleness_mix",
    )
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(json.dumps(r.get(c)) if isinstance(r.get(c), dict) else str(r.get(c)) for c in cols))
        if r.get("ratio_by_staleness"):
            print("    ratios:", json.dumps(r["ratio_by_staleness"]))


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Reward per step of every run, with the steps-31-40 window shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        rewards = r["rewards"]
        k = 5  # moving average: one step's 64 rollouts are noisy
        smooth = [
            sum(rewards[max(0, i - k + 1) : i + 1]) / len(rewards[max(0, i - k + 1) : i + 1])
            for i in range(len(rewards))
        ]
        ax.plot(range(1, len(smooth) + 1), smooth, label=f"{r['run']} ({r['reward_31_40']})")
    ax.axvspan(WINDOW[0], WINDOW[1], alpha=0.1)
    ax.axhline(0.7, linestyle=":", color="grey")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward (5-step moving average)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="default devnets")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-sync", action="store_true", help="skip the max_async 0 devnet")
    ap.add_argument(
        "--lockstep-runs",
        type=int,
        default=1,
        help="devnets with --lockstep (one batch per worker per version, the pipeline before issue 35): the wall-time baseline",
    )
    ap.add_argument("--demo-seeds", default="0", help="comma list of single-process seeds ('' for none)")
    ap.add_argument("--demo-prompts", type=int, default=8, help="prompts per single-process step (devnet batch: 8)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--summarise", nargs="+", type=Path, default=None, help="only summarise these devnet folders")
    ap.add_argument("--cost", action="store_true", help="only measure the old-log-prob cost")
    ap.add_argument("--plot", type=Path, default=None, help="write the reward curves here (PNG)")
    ap.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="also run the default devnet of this source tree (before the change) first: the wall-time baseline",
    )
    args = ap.parse_args()
    results = []
    if args.cost:
        print(json.dumps(measure_cost()))
        return
    if args.summarise:
        for folder in args.summarise:
            if folder.suffix == ".json":  # a result line this script printed before
                results.append(json.loads(folder.read_text()))
            else:
                results.append({"run": folder.name, **summarise(read_metrics(folder))})
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="learning-"))
        if args.baseline_tree:
            results.append(run_devnet(out / "devnet-baseline", args.steps, [], tree=args.baseline_tree.resolve()))
            print(json.dumps(results[-1]), flush=True)
        for i in range(args.lockstep_runs):
            results.append(run_devnet(out / f"devnet-lockstep-{i}", args.steps, ["--lockstep"]))
            print(json.dumps(results[-1]), flush=True)
        for i in range(args.runs):
            results.append(run_devnet(out / f"devnet-{i}", args.steps, []))
            print(json.dumps(results[-1]), flush=True)
        if not args.no_sync:
            results.append(run_devnet(out / "devnet-sync", args.steps, ["--max-async", "0"]))
            print(json.dumps(results[-1]), flush=True)
        for seed in [int(s) for s in args.demo_seeds.split(",") if s.strip()]:
            results.append(run_demo(seed, args.steps, args.demo_prompts))
            print(json.dumps(results[-1]), flush=True)
    table(results)
    if args.plot:
        plot(results, args.plot)
    final: dict[str, Any] = {"results": results}
    base = [r for r in results if "(tree " in r["run"]]
    mine = [r for r in results if r["run"] == "devnet"]
    if base and mine:  # wall time of the default devnet against the baseline tree's, same machine, same run
        final["wall_ratio_to_baseline"] = [round(r["seconds"] / base[0]["seconds"], 3) for r in mine]
        print("wall time / baseline:", final["wall_ratio_to_baseline"])
    print(json.dumps(final))


if __name__ == "__main__":
    main()
