"""Run genesis as a TOML file: what operators write, sign, pass around and join with.

Layout::

    run_id = "<hex sha256 of the canonical genesis>"   # informative; re-checked on load
    signature = "<hex ed25519 by owner>"

    [run]        # the typed RunGenesis fields (everything but config_toml)
    name = "devnet" ...
    model_root = "<hex>"     # bytes fields as hex text ("" when not pinned)

    [config]     # hyper-parameters; canonical text = tomli_w.dumps(this table)

The ``[config]`` table is turned into the genesis ``config_toml`` string by
``tomli_w.dumps``; loading re-derives the same string and checks that the
result hashes to ``run_id`` and carries the owner's signature.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from node.errors import ConfigError
from node.util import atomic_write_text, now_ms
from protocol import NodeKey, ProtocolError, RunGenesis, SignedGenesis, sign_genesis, verify_genesis
from protocol.committee import check_committee
from protocol.run_config import RunConfig, check_run_config

_RUN_FIELDS = [f.name for f in dataclasses.fields(RunGenesis) if f.name != "config_toml"]
_HEX_FIELDS = ("model_root", "dataset_hash")  # bytes in the genesis, hex text in the file (TOML has no bytes)


def _file_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


def check_config(config: dict[str, Any]) -> None:
    """``ConfigError`` unless every ``[config]`` key is known and its value fits
    (``protocol/run_config.py``): before anything slow (hashing a model) and before signing."""
    try:
        check_run_config(config)
    except ProtocolError as exc:
        raise ConfigError(f"{exc.detail} (docs/operating.md lists every [config] key)") from None


def make_genesis(owner: NodeKey, config: dict[str, Any], **fields: Any) -> SignedGenesis:
    """Build and sign a genesis. ``fields`` are RunGenesis fields (owner/created_ms filled in)."""
    fields.setdefault("owner", owner.peer_id)
    fields.setdefault("created_ms", now_ms())
    if "validators" in fields:
        fields["validators"] = tuple(fields["validators"])
    check_config(config)  # a typo would be signed in for good: refuse it now
    genesis = RunGenesis(config_toml=tomli_w.dumps(config), **fields)
    try:
        RunGenesis.decode(genesis.encode())  # run every protocol rule now, with a clear error
        check_committee(config.get("committee_size", 0), genesis.quorum, len(genesis.validators))
    except ProtocolError as exc:
        raise ConfigError(f"invalid genesis: {exc.detail if exc.rule.startswith('config:') else exc}") from None
    return sign_genesis(owner, genesis)


def genesis_config(genesis: RunGenesis) -> dict[str, Any]:
    """The genesis ``[config]`` table, checked against ``protocol/run_config.py`` (a genesis
    from a file or from the swarm: one whose table a node cannot read is not run with
    silently ignored keys)."""
    try:
        config = tomllib.loads(genesis.config_toml)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"genesis [config] is not valid TOML: {exc}") from None
    try:
        check_run_config(config)
        check_committee(config.get("committee_size", 0), genesis.quorum, len(genesis.validators))
    except ProtocolError as exc:
        raise ConfigError(
            f"genesis {genesis.name!r}: {exc.detail} (a genesis is signed: fix it with `primenode run init`, "
            "which makes a new run)"
        ) from None
    return config


def run_config(genesis: RunGenesis) -> RunConfig:
    """The genesis ``[config]`` decoded into :class:`RunConfig` (checked as
    :func:`genesis_config` checks it): what a node runs with, read by attribute."""
    return RunConfig.decode(genesis_config(genesis))


def write_genesis(signed: SignedGenesis, path: Path) -> None:
    g = signed.genesis
    doc: dict[str, Any] = {
        "run_id": g.run_id.hex(),
        "signature": signed.signature.hex(),
        "run": {name: _file_value(getattr(g, name)) for name in _RUN_FIELDS},
        "config": tomllib.loads(g.config_toml),  # as signed, checked or not
    }
    atomic_write_text(path, tomli_w.dumps(doc))


def read_genesis(path: Path) -> SignedGenesis:
    """Load a genesis file and verify hash and signature; ConfigError says what is wrong."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"genesis file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    try:
        if not isinstance(doc.get("run", {}), dict) or not isinstance(doc.get("config", {}), dict):
            raise ConfigError(f"{path}: [run] and [config] must be tables")
        run = dict(doc["run"])
        run["validators"] = tuple(run.get("validators", ()))
        for name in _HEX_FIELDS:
            if name in run:
                if not isinstance(run[name], str):
                    raise ConfigError(f"{path}: [run] {name} must be hex text")
                run[name] = bytes.fromhex(run[name])
        genesis = RunGenesis(config_toml=tomli_w.dumps(doc.get("config", {})), **run)
        signed = SignedGenesis(genesis=genesis, signature=bytes.fromhex(doc["signature"]))
        signed = SignedGenesis.decode(signed.encode())  # every field rule
        verify_genesis(signed, bytes.fromhex(doc["run_id"]))
        check_run_config(doc.get("config", {}))
    except KeyError as exc:
        raise ConfigError(f"{path}: missing {exc.args[0]!r}") from None
    except (
        TypeError,
        ValueError,
        OverflowError,
    ) as exc:  # ProtocolError is a ValueError; ints beyond msgpack's range overflow
        raise ConfigError(f"{path}: invalid genesis: {exc}") from None
    return signed
