"""The FSDP2 trainer at 1 and 2 ranks vs the single-process trainer: seconds per GRPO step and
peak memory (RSS) per rank, on CPU with the gloo backend, in one run.

    python bench/trainer_scale.py [--model smollm2|tiny] [--ranks 1,2] [--steps 3]
                                  [--prompts 2] [--group 4] [--completion 64] [--cache DIR]

Each configuration runs in fresh processes (``torch.distributed.run`` for the ranks, a plain
process for the single-process baseline ``GRPOTrainer``) on the same synthetic groups (random
completion tokens, rewards chosen so no group is filtered). The first step is a warm-up and
not timed; seconds per step is the median of the rest. Peak RSS is each process's
``ru_maxrss``. The FSDP2 ranks start as the trainer role's group does: rank 0 loads the
weights, the other ranks build the model on the meta device and receive only their shards, so
rank 0's peak includes one full copy of the weights at load and the others' do not. On a machine with fewer cores than ranks, ranks share cores: the timing then
measures overhead, not speed-up. The machine's load average is printed with the table.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def groups_for(step: int, prompts: int, group: int, completion: int, vocab: int, version: int) -> list[Any]:
    from node.rl.grpo import Rollout

    rng = random.Random(step)
    out = []
    for _ in range(prompts):
        prompt = [rng.randrange(vocab) for _ in range(32)]
        out.append(
            [
                Rollout(prompt, [rng.randrange(vocab) for _ in range(completion)], float(i % 2), policy_version=version)
                for i in range(group)
            ]
        )
    return out


def load_model(spec: dict[str, Any]) -> Any:
    import torch

    if spec["model"] == "tiny":
        from node.models import tiny_llama

        return tiny_llama(vocab_size=512, hidden_size=256, layers=4)
    from transformers import AutoModelForCausalLM

    os.environ["HF_HUB_OFFLINE"] = "1"
    if spec.get("meta"):  # the architecture only (inside meta_model: parameters on the meta device)
        from transformers import AutoConfig

        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec["folder"]), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32).eval()


def worker(spec_path: str) -> None:
    """One process of one configuration: ``spec["mode"]`` is "single" or "fsdp"."""
    import torch

    from node.rl.grpo import GRPOConfig, GRPOTrainer

    torch.set_num_threads(int(spec_threads()))
    spec = json.loads(Path(spec_path).read_text())
    cfg = GRPOConfig(lr=1e-5, warmup_steps=0, max_tokens=spec["completion"], micro_batch_size=spec["micro"])
    rank, world = 0, 1
    if spec["mode"] == "fsdp":
        import torch.distributed as dist

        from node.rl.distributed import DistributedGRPOTrainer, broadcast_groups, init_distributed, meta_model

        # as the trainer role's group starts (node.rl.ranks): rank 0 loads the weights, the
        # other ranks build the architecture on the meta device and receive their shards
        rank, world, _ = init_distributed("cpu")
        full: dict[str, Any] = {}
        if rank == 0:
            model = load_model(spec)
            full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            with meta_model():
                model = load_model({**spec, "meta": True})
        trainer: Any = DistributedGRPOTrainer(model, cfg)
        trainer.adopt_rank0_weights(full)
        del full
    else:
        model = load_model(spec)
        trainer = GRPOTrainer(model, cfg)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    del model
    setup_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the start-up's share of the peak
    times = []
    for step in range(spec["steps"]):
        groups = groups_for(step, spec["prompts"], spec["group"], spec["completion"], vocab, trainer.version)
        if spec["mode"] == "fsdp":
            groups = broadcast_groups(groups if rank == 0 else None)
        t0 = time.perf_counter()
        trainer.step(groups)
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row = {"rank": rank, "peak_rss_bytes": rss, "setup_peak_rss_bytes": setup_peak, "step_s": times}
    rows = [row]
    if spec["mode"] == "fsdp":
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, row)
        rows = gathered
        dist.destroy_process_group()
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(rows))


def spec_threads() -> str:
    return os.environ.get("OMP_NUM_THREADS", "1")


def run_config(tmp: Path, mode: str, ranks: int, base: dict[str, Any]) -> dict[str, Any]:
    out = tmp / f"{mode}_{ranks}.json"
    spec_file = tmp / f"{mode}_{ranks}.spec.json"
    spec_file.write_text(json.dumps({**base, "mode": mode, "out": str(out)}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    me = [str(Path(__file__).resolve()), "--worker", str(spec_file)]
    if mode == "fsdp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *me]
    else:
        cmd = [sys.executable, *me]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=REPO)
    rows = json.loads(out.read_text())
    timed = [t for r in rows for t in r["step_s"][1:]] or [t for r in rows for t in r["step_s"]]
    return {
        "config": "single-process GRPOTrainer" if mode == "single" else f"FSDP2 {ranks} rank(s)",
        "ranks": ranks,
        "step_s": round(statistics.median(timed), 3),
        "peak_rss_mib_per_rank": [round(r["peak_rss_bytes"] / 2**20) for r in sorted(rows, key=lambda r: r["rank"])],
        "setup_peak_rss_mib_per_rank": [
            round(r["setup_peak_rss_bytes"] / 2**20) for r in sorted(rows, key=lambda r: r["rank"])
        ],
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8, help="micro_batch_size")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "primenode"), help="SmolLM2 HF folder cache")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    base: dict[str, Any] = {k: getattr(args, k) for k in ("model", "steps", "prompts", "group", "completion", "micro")}
    if args.model == "smollm2":
        from node.models import SMOLLM2_DIRNAME, load_smollm2

        load_smollm2(Path(args.cache))  # converts the GGUF once
        base["folder"] = str(Path(args.cache) / SMOLLM2_DIRNAME)
    results = []
    with tempfile.TemporaryDirectory() as d:
        results.append(run_config(Path(d), "single", 1, base))
        for n in [int(x) for x in args.ranks.split(",")]:
            results.append(run_config(Path(d), "fsdp", n, base))
    load = os.getloadavg()
    print(f"\nmodel {args.model}, {args.prompts} prompts x {args.group} completions x {args.completion} tokens,")
    print(f"{os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}\n")
    print(f"{'configuration':30s} {'s/step':>8s}  {'peak RSS per rank (MiB)':24s} of which start-up peak")
    for r in results:
        print(
            f"{r['config']:30s} {r['step_s']:8.2f}  {r['peak_rss_mib_per_rank']!s:24s} {r['setup_peak_rss_mib_per_rank']}"
        )
    print(json.dumps({"bench": "trainer_scale", **base, "load_avg": load[0], "results": results}))


if __name__ == "__main__":
    main()
