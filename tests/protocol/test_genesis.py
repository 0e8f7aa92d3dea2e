"""Run genesis files: written by `primenode run init`, verified on load, tamper-evident."""

from __future__ import annotations

import pytest

from node.errors import NodeError
from node.genesis_file import genesis_config, make_genesis, read_genesis, write_genesis
from protocol import NodeKey

OWNER, TRAINER, V1, V2 = (NodeKey(bytes([i]) * 32) for i in (11, 12, 13, 14))


def genesis(**over):
    fields = dict(
        name="t",
        model="tiny",
        dataset="builtin:target-length",
        dataset_size=64,
        trainer=TRAINER.peer_id,
        validators=[V1.peer_id, V2.peer_id],
        quorum=2,
        max_async=2,
        prompts_per_batch=4,
        group_size=4,
        chunk_size=1 << 20,
    )
    fields.update(over)
    return make_genesis(OWNER, {"lr": 1e-4, "steps": 5, "task": "target-length"}, **fields)


def test_file_round_trip_keeps_run_id(tmp_path):
    signed = genesis()
    write_genesis(signed, tmp_path / "run.toml")
    loaded = read_genesis(tmp_path / "run.toml")
    assert loaded == signed
    assert loaded.genesis.run_id == signed.genesis.run_id
    assert genesis_config(loaded.genesis)["lr"] == 1e-4


@pytest.mark.parametrize(
    "old,new", [("steps = 5", "steps = 6"), ("quorum = 2", "quorum = 1"), ("max_async = 2", "max_async = 9")]
)
def test_edited_file_is_refused(tmp_path, old, new):
    path = tmp_path / "run.toml"
    write_genesis(genesis(), path)
    path.write_text(path.read_text().replace(old, new))
    with pytest.raises(NodeError, match="invalid genesis"):
        read_genesis(path)


def test_quorum_larger_than_validators_is_refused():
    with pytest.raises(NodeError, match="quorum"):
        genesis(quorum=3)


def test_missing_file_and_missing_field(tmp_path):
    with pytest.raises(NodeError, match="does not exist"):
        read_genesis(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text('run_id = "00"\n')
    with pytest.raises(NodeError, match="missing"):
        read_genesis(tmp_path / "bad.toml")


# --------------------------------------------------------------------------- over the network
# A joiner without a local genesis file asks a bootstrap for it (node.p2p.node.fetch_genesis,
# what `primenode join --bootstrap ... [--run-id HEX]` runs): real libp2p hosts in one process.


async def _serve_and_fetch(served, expected_run_id=None, tamper=None):
    """Start a bootstrap serving ``served`` (``tamper`` swaps what it hands out after the
    node has started: a node refuses to *start* with a bad genesis), fetch from it."""
    import trio

    from node.p2p.node import fetch_genesis
    from node.p2p.testing import NodeFactory

    out: dict = {}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery, genesis=served)
            boot = await net.start()
            if tamper is not None:
                boot.signed_genesis = tamper
            try:
                out["genesis"] = await fetch_genesis(
                    NodeKey.generate(), net.bootstrap_addrs, timeout=10.0, expected_run_id=expected_run_id
                )
            except NodeError as exc:
                out["error"] = exc  # raised outside the nursery, not wrapped in an exception group
            nursery.cancel_scope.cancel()
    if "error" in out:
        raise out["error"]
    return out["genesis"]


async def test_joiner_fetches_and_verifies_the_genesis_from_a_bootstrap():
    signed = genesis()
    got = await _serve_and_fetch(signed, expected_run_id=signed.genesis.run_id)
    assert got == signed


async def test_joiner_with_another_run_id_is_refused():
    served, wanted = genesis(name="y"), genesis(name="x")
    assert served.genesis.run_id != wanted.genesis.run_id
    with pytest.raises(NodeError) as err:
        await _serve_and_fetch(served, expected_run_id=wanted.genesis.run_id)
    msg = str(err.value)
    assert "run id" in msg and "could not get the run genesis" in msg, msg


async def test_tampered_genesis_from_a_bootstrap_is_refused():
    import dataclasses

    from protocol import SignedGenesis, sign_genesis

    signed = genesis()
    g = signed.genesis
    # the owner's signature over an edited genesis (quorum lowered): the signature no longer fits
    edited = SignedGenesis(genesis=dataclasses.replace(g, quorum=1), signature=signed.signature)
    with pytest.raises(NodeError, match="could not get the run genesis") as err:
        await _serve_and_fetch(signed, tamper=edited)
    assert "signature" in str(err.value).lower(), str(err.value)
    with pytest.raises(NodeError):
        await _serve_and_fetch(signed, expected_run_id=g.run_id, tamper=edited)
    # a garbage signature on the genuine genesis
    with pytest.raises(NodeError, match="signature"):
        await _serve_and_fetch(signed, tamper=SignedGenesis(genesis=g, signature=bytes(64)))
    # re-signed by someone else while still naming the owner: the owner's key does not verify it
    mallory = NodeKey(bytes([99]) * 32)
    forged = SignedGenesis(genesis=g, signature=mallory.sign(b"primenode/genesis/v1" + g.encode()))
    with pytest.raises(NodeError, match="signature"):
        await _serve_and_fetch(signed, tamper=forged)
    # a run of mallory's own is validly signed, so only --run-id tells it apart: pinned, refused
    own = sign_genesis(mallory, dataclasses.replace(g, owner=mallory.peer_id, quorum=1))
    assert (await _serve_and_fetch(signed, tamper=own)).genesis.owner == mallory.peer_id
    with pytest.raises(NodeError, match="run id"):
        await _serve_and_fetch(signed, expected_run_id=g.run_id, tamper=own)
