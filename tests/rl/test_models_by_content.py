"""Issue 16 point 1: the run's model and dataset are pinned by content in the genesis.

``primenode run init --model FOLDER`` (or ``hf:owner/name@rev`` from the local hub cache)
signs the content root of the model's files; every node uses a model only from a folder
whose every byte it hashed against that root, and refuses a version 0 whose manifest
names other files. The dataset is pinned by the hash of its problems; a node whose copy
differs refuses to join, naming both hashes. The network path (version 0 fetched from the
swarm) is tests/rl/test_qwen_network.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from harness.genesis import tiny_genesis
from harness.qwen import qwen_folder
from harness.roles import homes
from node.checkpoints.manifest import build_manifest
from node.errors import ConfigError, ModelError
from node.genesis_file import read_genesis
from node.models import VERIFIED_MARKER, model_files, model_root_of
from node.rl.tasks import Problem, dataset_hash, load_dataset, save_dataset
from node.roles.context import RunContext
from node.roles.trainer import TrainerRole
from protocol import NodeKey, ProtocolError, check_initial_manifest

PRIMENODE = shutil.which("primenode")
BASE = [PRIMENODE] if PRIMENODE else [sys.executable, "-m", "node.ops.cli"]
CHUNK = 64 * 1024


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*BASE, *args], capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})}
    )


def fake_hub_model(hub, name: str, folder, commit: str = "c" * 40):
    """``folder`` laid out as huggingface_hub caches a model: blobs + snapshot symlinks + refs/main."""
    repo = hub / ("models--" + name.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap


def flip_byte(path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def pinned_genesis(folder, **fields):
    run = {
        "model": str(folder),
        "model_root": model_root_of(model_files(folder), CHUNK),
        "chunk_size": CHUNK,
        **fields,
    }
    return tiny_genesis(fields=run, max_tokens=8).genesis


# ------------------------------------------------------------------ run init


def test_run_init_pins_a_folder_and_the_same_model_from_the_hub_cache(tmp_path):
    folder = tmp_path / "qwen"
    qwen_folder(folder)
    hub = tmp_path / "hub"
    fake_hub_model(hub, "org/qwen-tiny", folder)
    owner = tmp_path / "owner"
    assert cli("init", "--home", str(owner)).returncode == 0
    base = ["run", "init", "--home", str(owner), "--trainer", NodeKey(b"\x01" * 32).peer_id]
    base += ["--validator", NodeKey(b"\x02" * 32).peer_id, "--chunk-size", str(CHUNK)]

    res = cli(*base, "--out", str(tmp_path / "a.toml"), "--model", str(folder))
    assert res.returncode == 0, res.stderr
    a = read_genesis(tmp_path / "a.toml").genesis
    want = model_root_of(model_files(folder), CHUNK)
    assert a.model_root == want and f"model_root {want.hex()}" in res.stdout
    assert a.model == str(folder.resolve())
    assert a.dataset_hash and f"dataset_hash {a.dataset_hash.hex()}" in res.stdout
    # the pinned files: config, weights, tokenizer; not the README next to them
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(model_files(folder))
    assert "README.md" not in model_files(folder)

    res = cli(
        *base, "--out", str(tmp_path / "b.toml"), "--model", "hf:org/qwen-tiny@main", env={"HF_HUB_CACHE": str(hub)}
    )
    assert res.returncode == 0, res.stderr
    b = read_genesis(tmp_path / "b.toml").genesis
    assert b.model == "hf:org/qwen-tiny@main" and b.model_root == want  # same bytes, same root

    shown = cli("run", "show", str(tmp_path / "b.toml"))
    assert f"model_root   {want.hex()}" in shown.stdout and a.dataset_hash.hex() in shown.stdout

    # a folder with pickled weights only, or a model the cache does not hold: one clear line each
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(folder / name, pickled / name)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04 not loaded")
    res = cli(*base, "--out", str(tmp_path / "c.toml"), "--model", str(pickled))
    assert res.returncode == 1 and "no .safetensors weights" in res.stderr and "Traceback" not in res.stderr
    res = cli(*base, "--out", str(tmp_path / "c.toml"), "--model", "hf:org/absent", env={"HF_HUB_CACHE": str(hub)})
    assert res.returncode == 1 and "not in the local Hugging Face cache" in res.stderr
    assert not (tmp_path / "c.toml").exists()


# ------------------------------------------------------------------ the model, byte for byte


def test_a_node_uses_the_model_only_after_hashing_every_byte(tmp_path):
    folder = tmp_path / "qwen"
    tok = qwen_folder(folder)
    g = pinned_genesis(folder)

    ctx = RunContext.from_genesis(g, tmp_path / "a")  # the genesis's folder is here: staged and checked
    assert ctx.model_ready and ctx.model_dir == tmp_path / "a" / "models" / g.model_root.hex()
    assert ctx.eos_token_id == tok.eos_token_id and ctx.vocab_size == ctx.initial_model().config.vocab_size > len(tok)
    assert model_root_of(model_files(ctx.model_dir), CHUNK) == g.model_root
    assert ctx.initial_model().config.model_type == "qwen2"

    # version 0 from the swarm with one flipped bit: refused, naming both roots; nothing kept
    swarm = tmp_path / "from-swarm"
    shutil.copytree(folder, swarm)
    flip_byte(swarm / "model.safetensors")
    other = RunContext.from_genesis(g, tmp_path / "b")
    shutil.rmtree(other.pinned_model_dir)  # as on a machine without the folder
    with pytest.raises(ModelError) as err:
        other.adopt_model_files(model_files(swarm))
    bad = model_root_of(model_files(swarm), CHUNK)
    assert g.model_root.hex() in str(err.value) and bad.hex() in str(err.value)
    assert not other.pinned_model_dir.exists()
    other.adopt_model_files(model_files(folder))  # the right bytes are taken
    assert other.model_dir == other.pinned_model_dir

    # a verified folder is re-used without its source, and not trusted once a file changed
    shutil.copytree(folder, tmp_path / "keep")
    shutil.rmtree(folder)
    again = RunContext.from_genesis(g, tmp_path / "a")
    assert again.model_ready
    flip_byte(again.model_dir / "tokenizer.json", 10)
    stale = RunContext.from_genesis(g, tmp_path / "a")
    assert not stale.model_ready
    with pytest.raises(ModelError, match="not on this node yet"):
        stale.prompt_tokens(0)

    # a local folder of the genesis's name with other bytes is never used; a trainer refuses to start
    shutil.copytree(tmp_path / "keep", folder)
    flip_byte(folder / "model.safetensors")
    local = RunContext.from_genesis(g, tmp_path / "c")
    assert not local.model_ready and "the genesis pins model_root" in local.model_note
    with pytest.raises(ModelError, match="the trainer needs the run's model on its machine"):
        TrainerRole(homes(tmp_path, "trainer"), local)

    # a trainer whose folder lives elsewhere: the operator copies it into the node's model cache
    shutil.copytree(tmp_path / "keep", local.pinned_model_dir)
    moved = RunContext.from_genesis(g, tmp_path / "c")
    assert moved.model_ready and moved.model_dir == local.pinned_model_dir


def test_version_0_manifest_must_hold_the_pinned_files(tmp_path):
    folder = tmp_path / "qwen"
    qwen_folder(folder)
    staged = RunContext.from_genesis(pinned_genesis(folder), tmp_path / "cache")
    g = staged.genesis
    assert staged.model_dir is not None
    check_initial_manifest(g, build_manifest(g.run_id, 0, staged.model_dir, CHUNK))  # what the trainer publishes

    # the files a trainer would publish if it exported the model itself: other bytes, refused
    exported = tmp_path / "exported"
    staged.initial_model().save_pretrained(exported)
    with pytest.raises(ProtocolError) as err:
        check_initial_manifest(g, build_manifest(g.run_id, 0, exported, CHUNK))
    assert err.value.rule == "model_root" and g.model_root.hex() in err.value.detail
    with pytest.raises(ProtocolError, match="chunks"):
        check_initial_manifest(g, build_manifest(g.run_id, 0, staged.model_dir, 2 * CHUNK))
    with pytest.raises(ProtocolError, match="not version 1"):
        check_initial_manifest(g, build_manifest(g.run_id, 1, staged.model_dir, CHUNK))
    assert VERIFIED_MARKER not in {f.path for f in build_manifest(g.run_id, 0, staged.model_dir, CHUNK).files}


# ------------------------------------------------------------------ the dataset


def math_problems(n: int) -> list[Problem]:
    return [Problem(id=f"q{i}", prompt=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(n)]


def test_a_node_whose_dataset_differs_refuses_naming_both_hashes(tmp_path):
    data = tmp_path / "math.jsonl"
    save_dataset(math_problems(8), data)
    pinned = dataset_hash(load_dataset(data))
    fields = {"dataset": str(data), "dataset_size": 8, "dataset_hash": pinned}
    g = tiny_genesis(fields=fields).genesis
    RunContext.from_genesis(g, tmp_path / "ok")  # the same problems: joins

    # the same problems as Parquet hash alike (the problems are pinned, not the file format)
    save_dataset(load_dataset(data), tmp_path / "math.parquet")
    assert dataset_hash(load_dataset(tmp_path / "math.parquet")) == pinned

    # one answer changed on this node: refused, naming both hashes
    records = [json.loads(line) for line in data.read_text().splitlines()]
    records[3]["answer"] = "7"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ConfigError) as err:
        RunContext.from_genesis(g, tmp_path / "bad")
    have = dataset_hash(load_dataset(data))
    assert pinned.hex() in str(err.value) and have.hex() in str(err.value)
    # reordered problems are another dataset too (prompt indices would mean other prompts)
    assert dataset_hash(list(reversed(math_problems(8)))) != dataset_hash(math_problems(8))


def test_join_with_another_dataset_is_one_clear_line_before_a_node_starts(tmp_path):
    """The user path: run init pins the dataset; the worker's copy changes; join refuses."""
    data = tmp_path / "math.jsonl"
    save_dataset(math_problems(6), data)
    owner, worker = tmp_path / "owner", tmp_path / "worker"
    for home in (owner, worker):
        assert cli("init", "--home", str(home)).returncode == 0
    res = cli(
        "run", "init", "--home", str(owner), "--out", str(tmp_path / "run.toml"),
        "--trainer", NodeKey(b"\x01" * 32).peer_id, "--validator", NodeKey(b"\x02" * 32).peer_id,
        "--dataset", str(data), "--prompts-per-batch", "2",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    g = read_genesis(tmp_path / "run.toml").genesis
    assert g.dataset_size == 6 and g.dataset_hash == dataset_hash(load_dataset(data))  # size: the whole file

    save_dataset(math_problems(5) + [Problem(id="q5", prompt="What is 5 + 5?", answer="11")], data)
    res = cli("join", "--role", "worker", "--home", str(worker), "--genesis", str(tmp_path / "run.toml"))
    assert res.returncode == 1, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert g.dataset_hash.hex() in errors[0] and dataset_hash(load_dataset(data)).hex() in errors[0]
    assert not (worker / "runtime.json").exists()
