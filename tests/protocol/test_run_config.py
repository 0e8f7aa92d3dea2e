"""The genesis [config] table is checked against protocol/run_config.py: a typo or a value out
of bounds is refused where it would be signed in (run init, the devnet) and where a genesis is
read (a file, one from the swarm), naming the key and the nearest known one."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

from node.errors import ConfigError
from node.genesis_file import genesis_config, make_genesis, read_genesis, write_genesis
from protocol import NodeKey, ProtocolError
from protocol.run_config import KEYS, check_run_config

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "node.ops.cli"]
OWNER = NodeKey(b"\x05" * 32)
FIELDS = dict(
    name="cfg-test", model="tiny", dataset="builtin:target-length", dataset_size=8, trainer=OWNER.peer_id,
    validators=[OWNER.peer_id], quorum=1, max_async=2, prompts_per_batch=2, group_size=2, chunk_size=1 << 20,
)  # fmt: skip


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize(
    "cfg, says",
    [
        ({"learning_rat": 1e-3}, "unknown [config] key 'learning_rat'; did you mean 'lr'?"),
        ({"tempreature": 0.1}, "did you mean 'temperature'?"),
        ({"lr": -1.0}, "lr must be in (0, 1]"),
        ({"lr": "fast"}, "lr must be a number"),
        ({"steps": 1.5}, "steps must be an integer"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"betas": [0.9]}, "betas must be a list of 2 numbers"),
        ({"policy_dtype": "fp16"}, "policy_dtype must be one of float32, bfloat16"),
        ({"gradient_checkpointing": 1}, "must be true or false"),
        ({"max_async": 3}, "max_async is a [run] field"),
        ({"sampling_delta": float("nan")}, "must be a finite number"),
    ],
)
def test_a_bad_key_or_value_is_refused_naming_it(cfg, says):
    with pytest.raises(ProtocolError) as err:
        check_run_config(cfg)
    assert says in err.value.detail
    with pytest.raises(ConfigError) as err2:
        make_genesis(OWNER, cfg, **FIELDS)
    assert says in str(err2.value)


def test_every_key_with_a_good_value_is_accepted_control():
    good = {
        "int": 1, "float": 0.5, "str": "", "bool": True, "floats": [0.9, 0.99],
    }  # fmt: skip
    for key in KEYS.values():
        value = key.choices[0] if key.choices else good[key.kind]
        if key.lo is not None and key.kind in ("int", "float"):
            value = type(good[key.kind])(key.lo) + 1  # inside every lower bound, open or not
        check_run_config({key.name: value})
    # the devnet's and the docs' usual values
    check_run_config({"lr": 1e-4, "temperature": 1.0, "max_tokens": 48, "steps": 40, "seed": 0, "numerics": "x"})


def test_run_init_refuses_a_typo_and_writes_nothing(tmp_path):
    home = tmp_path / "owner"
    assert cli("init", "--home", str(home)).returncode == 0
    pid = NodeKey(b"\x06" * 32).peer_id
    base = ["run", "init", "--home", str(home), "--trainer", pid, "--validator", pid, "--model", "tiny"]
    bad = cli(*base, "--out", str(tmp_path / "bad.toml"), "--set", "learning_rat=1e-3", "--set", "tempreature=0.1")
    assert bad.returncode == 1, bad.stderr
    assert re.search(r"^error: unknown \[config\] key 'learning_rat'; did you mean 'lr'\?", bad.stderr, re.M), (
        bad.stderr
    )
    assert "Traceback" not in bad.stderr and not (tmp_path / "bad.toml").exists()
    # control: the keys spelt right
    ok = cli(*base, "--out", str(tmp_path / "ok.toml"), "--set", "lr=1e-3", "--set", "temperature=0.1")
    assert ok.returncode == 0, ok.stderr
    assert genesis_config(read_genesis(tmp_path / "ok.toml").genesis) == {"lr": 1e-3, "temperature": 0.1}


def test_a_signed_genesis_with_an_unknown_key_is_refused_where_it_is_read(tmp_path):
    """A genesis made by a node that did not check (an older or foreign one), correctly signed:
    a node does not run it with the key ignored, from a file or from the swarm."""
    from node.util import now_ms
    from protocol import RunGenesis, sign_genesis

    genesis = RunGenesis(
        config_toml=tomli_w.dumps({"learning_rat": 1e-3}), owner=OWNER.peer_id, created_ms=now_ms(),
        **{**FIELDS, "validators": tuple(FIELDS["validators"])},
    )  # fmt: skip
    signed = sign_genesis(OWNER, genesis)
    with pytest.raises(ConfigError, match="unknown \\[config\\] key 'learning_rat'; did you mean 'lr'"):
        genesis_config(signed.genesis)  # what a node runs a genesis from the swarm with
    path = tmp_path / "run.toml"
    write_genesis(signed, path)
    with pytest.raises(ConfigError, match="learning_rat"):
        read_genesis(path)


def test_the_operating_guide_lists_every_key():
    """docs/operating.md's [config] reference is checked against the table (no key undocumented,
    none documented that does not exist)."""
    text = (REPO / "docs" / "operating.md").read_text()
    section = text.split("### Every `[config]` key", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_0-9]+)` \|", section, re.M))
    assert documented == set(KEYS), (sorted(set(KEYS) - documented), sorted(documented - set(KEYS)))


def test_the_table_decodes_once_into_a_typed_config():
    """``RunConfig.decode``: every key a typed attribute, ints given for floats become floats,
    a list of numbers a tuple, an absent key its default; ``explicit`` says which the table set."""
    from protocol.run_config import RunConfig

    c = RunConfig.decode({"lr": 1, "betas": [0.9, 0.95], "numerics": "transformers-fp32-cpu"})
    assert c.lr == 1.0 and isinstance(c.lr, float) and c.betas == (0.9, 0.95)
    assert c.explicit == {"lr", "betas", "numerics"} and c.temperature == 1.0 and c.max_tokens == 48
    assert RunConfig.decode({}) == RunConfig()
    assert {f.name for f in dataclasses.fields(RunConfig)} == set(KEYS) | {"explicit"}
    with pytest.raises(ProtocolError, match="did you mean 'lr'"):
        RunConfig.decode({"learning_rate": 1e-3})


def test_the_config_defaults_are_the_ones_the_rooms_use():
    """The defaults RunConfig states are what the rooms did with an absent key before it
    existed (old geneses keep their meaning): the trainer's intake and ledger limits, the
    checkpoint deltas, the tiny model, and the GRPO settings (the trainer's demo values for
    the keys it sets itself, GRPOConfig's own for the rest)."""
    from node.rl.grpo import GRPOConfig
    from node.roles import trainer as trainer_module
    from node.roles.context import GRPO_DEMO, TINY_MODEL
    from node.roles.ledger import REWARD_AGREEMENT
    from protocol.run_config import RunConfig

    d = RunConfig()
    assert d.step_token_budget == trainer_module.STEP_TOKEN_BUDGET and d.reward_agreement == REWARD_AGREEMENT
    for k, v in trainer_module.LEDGER_LIMITS.items():
        assert getattr(d, f"ledger_{k}") == v, k
    assert (d.tiny_hidden_size, d.tiny_layers, d.tiny_heads) == tuple(TINY_MODEL.values())
    grpo = GRPOConfig()
    for name in KEYS:
        if name not in GRPOConfig.__dataclass_fields__ or getattr(d, name) is None:
            continue
        if name in ("temperature", "max_tokens"):  # the run's sampling settings, not GRPO's
            continue
        want = GRPO_DEMO.get(name, getattr(grpo, name))
        assert getattr(d, name) == want, (name, getattr(d, name), want)
