"""Golden (fixed-answer) tests: the wire bytes, signatures, run ids, peer ids and
prompt assignments of fixed inputs never change.

The round-trip tests in test_protocol_messages.py show that encoding is
canonical *within* one version of the code; these pin the answers *across*
versions. Every node of a run must compute the same bytes (signatures, batch
ids, manifest roots and the run id are hashes or signatures over them) and the
same owed prompts, so any change to a value below is a wire-protocol break:
it needs a new wire/domain version, not an edit of the literal.

The literals were computed once with the code of the commit that introduced
them (the gossip and request/response frames and the sample seed before their
codecs moved into protocol/, so the move is shown to keep the bytes) and checked
where an outside answer exists: the key is RFC 8032's test vector 1 (its public
key and the signature of the empty message are the RFC's), its peer id is
py-libp2p's for the same key, and the msgpack layout of the small messages is
spelled out byte by byte from the msgpack specification.
"""

from __future__ import annotations

import pytest

from protocol import (
    NodeKey,
    ProtocolError,
    ReplayGuard,
    assign_prompts,
    assignment_seed,
    gossip,
    open_envelope,
    public_bytes_from_peer_id,
    reqresp,
    sample_seed,
    seal,
    sha256,
    sign_genesis,
    topic,
    verify_genesis,
)
from protocol import messages as m

# RFC 8032, section 7.1, TEST 1.
RFC_SEED = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC_PUBLIC = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
RFC_SIG_EMPTY = bytes.fromhex(
    "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
)

OWNER = NodeKey(RFC_SEED)
TRAINER = NodeKey(bytes(range(32)))  # seed 00 01 .. 1f
VALIDATOR = NodeKey(bytes(range(32, 64)))  # seed 20 21 .. 3f

OWNER_ID = "12D3KooWQK1wnefoLrcVHbbnf5tLzbopUd3K3bFAoJpA7YJgL5pV"
TRAINER_ID = "12D3KooWA4Xop1JaT3MHxwYMkCepYsv4iPVopMXwCz5iHYdBfeSB"
VALIDATOR_ID = "12D3KooWCd3eX8r5ihRvzK7P1yPq5aakaBJhG5GNj18YTztPhoCa"

T0 = 1_700_000_000_000  # 2023-11-14T22:13:20Z in ms

GENESIS = m.RunGenesis(
    name="golden",
    owner=OWNER_ID,
    created_ms=T0,
    model="tiny",
    dataset="builtin:length",
    dataset_size=1000,
    trainer=TRAINER_ID,
    validators=(VALIDATOR_ID,),
    quorum=1,
    max_async=2,
    prompts_per_batch=4,
    group_size=8,
    chunk_size=4 * 1024 * 1024,
    config_toml="lr = 0.0001\n",
)
# The genesis gained two fields (model_root, dataset_hash: the content pins), which changed its
# bytes, run id and signature: a deliberate wire break (see docs/protocol.md, section 5).
GENESIS_RUN_ID = bytes.fromhex("89d3e250c9f6258e86beb027c4458d1b3a8b7e1a4a4ba6cda0b82229988ef108")
GENESIS_SIGNATURE = bytes.fromhex(
    "1b6ab70b5bea6ef5e77c8a888837645dd29d38ff56fa3ab6ac9d3c471a42e1f02fcbae0e397a97e2d055882fc7b08cca7268e50ac99d11c3d76d366f1d77820e"
)
# The literals below (envelope, seeds, assignments, frames) need some fixed run id, not this
# genesis's: they keep the one the genesis hashed to before the content pins, so they still
# pin exactly the bytes they pinned before.
RUN_ID = bytes.fromhex("9bac524d45707b78f9600e298037e7db51dee366eaa0469e77efd4dde02550a7")

ANNOUNCE = m.RolloutAnnounce(
    batch_id=bytes(range(32)), policy_version=3, batch_counter=7, num_samples=32, size_bytes=123456
)
# seal(TRAINER, RUN_ID, ANNOUNCE, timestamp_ms=T0, seq=42)
ENVELOPE = bytes.fromhex(
    "9801c4209bac524d45707b78f9600e298037e7db51dee366eaa0469e77efd4dde02550a706d934313244334b6f6f574134586f70314a"
    "6154334d487877594d6b436570597376346950566f704d5877437a35694859644266655342cf0000018bcfe568002ac42b95c42000010203"
    "0405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f030720ce0001e240c440d41d3b32058d6594d140d156e5092719e9c1"
    "c37219b72a1c1da1656aaf36480bd550614efb0e0d3ee1b6041ac6c4d963d61e9407ed911249d8d3e9751336450b"
)
ENVELOPE_ID = bytes.fromhex("7112354bc17de57f0acb58aa4a437f6c617b9201e356a319b62be849d52e6475")


# ------------------------------------------------------------------ identity


def test_rfc8032_key_gives_the_rfc_answers():
    assert OWNER.public_bytes == RFC_PUBLIC
    assert OWNER.sign(b"") == RFC_SIG_EMPTY  # ed25519 is deterministic


@pytest.mark.parametrize(
    "seed, peer_id",
    [(RFC_SEED, OWNER_ID), (bytes(range(32)), TRAINER_ID), (bytes(range(32, 64)), VALIDATOR_ID)],
    ids=["rfc8032", "seed00-1f", "seed20-3f"],
)
def test_fixed_seed_gives_fixed_peer_id(seed, peer_id):
    key = NodeKey(seed)
    assert key.peer_id == peer_id
    assert public_bytes_from_peer_id(peer_id) == key.public_bytes


# ------------------------------------------------------------------ messages


@pytest.mark.parametrize(
    "message, hex_bytes",
    [
        # fixarray(1) [fixint 0]
        (m.GenesisRequest(want=0), "9100"),
        # fixarray(1) [fixint 5]
        (m.PeerExchangeRequest(max_peers=5), "9105"),
        # fixarray(1) [bin8 len 32, 32 x 0x11]
        (m.BatchRequest(batch_id=b"\x11" * 32), "91c420" + "11" * 32),
        # fixarray(2) [fixstr "busy", fixstr ""]
        (m.ErrorResponse(code="busy", detail=""), "92a462757379a0"),
        # fixarray(3) [3, bin8 32 x 0xaa, fixarray(3) [0, 1, uint16 300]]
        (
            m.ChunkTicketRequest(version=3, root=b"\xaa" * 32, chunk_indices=(0, 1, 300)),
            "9303c420" + "aa" * 32 + "930001cd012c",
        ),
        # fixarray(5) [bin8 00..1f, 3, 7, 32, uint32 123456]
        (ANNOUNCE, "95c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f030720ce0001e240"),
        # fixarray(8) ["worker", 3, ["/ip4/127.0.0.1/tcp/4001"], uint16 9000,
        #              [[3, bin8 32 x 0, bin8 0f]], float64 12.5, -1, 7]
        (
            m.Heartbeat(
                role="worker",
                policy_version=3,
                addrs=("/ip4/127.0.0.1/tcp/4001",),
                data_port=9000,
                have=(m.HaveEntry(version=3, root=bytes(32), bitmap=b"\x0f"),),
                uptime_s=12.5,
                step=-1,
                batches=7,
            ),
            "98a6776f726b65720391b72f6970342f3132372e302e302e312f7463702f34303031cd2328919303c420"
            + "00" * 32
            + "c4010fcb4029000000000000ff07",
        ),
        # fixarray(6) [bin8 00..1f, str8 peer id, 3, false, "toploc", [float64 1.0, float64 -0.5]]
        (
            m.Vote(
                batch_id=bytes(range(32)),
                worker=TRAINER_ID,
                policy_version=3,
                accept=False,
                reason="toploc",
                rewards=(1.0, -0.5),
            ),
            "96c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fd934"
            + TRAINER_ID.encode().hex()
            + "03c2a6746f706c6f6392cb3ff0000000000000cbbfe0000000000000",
        ),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, m.Message) else "bytes",
)
def test_fixed_message_encodes_to_fixed_bytes(message, hex_bytes):
    data = bytes.fromhex(hex_bytes)
    assert message.encode() == data
    assert type(message).decode(data) == message


def test_fixed_manifest_root():
    fe = m.FileEntry(path="model.safetensors", size=10, chunk_hashes=(sha256(b"0123456789"),))
    root = m.CheckpointManifest.compute_root(RUN_ID, 3, 4096, (fe,))
    assert root.hex() == "ebf02eb785f7b5df24b93be831d09e90d146988aeea2ec6d8b7a0a301670477c"
    man = m.CheckpointManifest(run_id=RUN_ID, version=3, chunk_size=4096, files=(fe,), created_ms=T0, root=root)
    assert m.CheckpointManifest.decode(man.encode()) == man


# ------------------------------------------------------------------ genesis


def test_fixed_genesis_gives_fixed_run_id():
    # 16 fields (array16 header), the two unset pins as empty bin8 (c4 00) at the end
    data = GENESIS.encode()
    assert len(data) == 231 and data[:3] == bytes.fromhex("dc0010") and data[-4:] == bytes.fromhex("c400c400")
    assert GENESIS.run_id == GENESIS_RUN_ID
    assert sha256(GENESIS.encode()) == GENESIS_RUN_ID


def test_fixed_genesis_signature():
    signed = sign_genesis(OWNER, GENESIS)
    assert signed.signature == GENESIS_SIGNATURE
    assert verify_genesis(m.SignedGenesis(genesis=GENESIS, signature=GENESIS_SIGNATURE), GENESIS_RUN_ID) == GENESIS


def test_fixed_model_content_root():
    """The genesis's model pin: files sorted by path, so the order given does not matter."""
    from protocol import model_content_root

    weights = m.FileEntry(path="model.safetensors", size=10, chunk_hashes=(sha256(b"0123456789"),))
    config = m.FileEntry(path="config.json", size=2, chunk_hashes=(sha256(b"{}"),))
    root = "02fd9885a456d5a84513b00a1a630079c989b629dfa79b3b0a69ca09fef64584"
    assert model_content_root(4096, (weights, config)).hex() == root
    assert model_content_root(4096, (config, weights)).hex() == root
    assert model_content_root(8192, (weights, config)).hex() != root


# ------------------------------------------------------------------ envelope


def test_sealed_envelope_is_fixed_bytes():
    assert seal(TRAINER, RUN_ID, ANNOUNCE, T0, 42) == ENVELOPE
    assert sha256(ENVELOPE) == ENVELOPE_ID


def test_pinned_envelope_opens():
    env = open_envelope(ENVELOPE, run_id=RUN_ID, now_ms=T0, guard=ReplayGuard())
    assert (env.sender, env.timestamp_ms, env.seq, env.type_id) == (TRAINER_ID, T0, 42, m.RolloutAnnounce.TYPE_ID)
    assert env.body == ANNOUNCE
    assert env.message_id == ENVELOPE_ID


# ------------------------------------------------------------------ prompt assignment


def test_fixed_assignment_seed():
    """Protocol 4: the worker's batch counter alone (one chain over the run), no version."""
    seed = assignment_seed(RUN_ID, TRAINER_ID, 7)
    assert seed.hex() == "fa66711e3fd57bc99ea297d7e75ec116fba966c5f09ac1a01f6b8f337e937e15"


@pytest.mark.parametrize(
    "worker, counter, size, count, expected",
    [
        (TRAINER_ID, 7, 1000, 8, [137, 5, 910, 277, 705, 831, 142, 556]),
        (VALIDATOR_ID, 7, 1000, 8, [718, 49, 866, 327, 385, 908, 53, 30]),
        (TRAINER_ID, 0, 5, 10, [0, 1, 3, 4, 2]),  # count > dataset: a permutation of all of it
    ],
    ids=["worker-a", "worker-b", "count-over-dataset"],
)
def test_fixed_inputs_give_fixed_prompts(worker, counter, size, count, expected):
    assert assign_prompts(RUN_ID, worker, counter, size, count) == expected


# ------------------------------------------------------------------ sample seeds


@pytest.mark.parametrize(
    "run_id, worker, counter, prompt_index, member, expected",
    [
        (b"\x01" * 32, "12D3KooWworker", 3, 42, 0, 3377041653643834038),
        (b"\x01" * 32, "12D3KooWworker", 3, 42, 1, 5393011109364373478),
        (b"\x01" * 32, "12D3KooWworker", 4, 42, 0, 8056624659961645016),
        (b"", "", 0, 0, 0, 8370586266486320253),
    ],
    ids=["typical", "next-member", "next-counter", "empty"],
)
def test_fixed_inputs_give_fixed_sample_seed(run_id, worker, counter, prompt_index, member, expected):
    """Protocol 4: the seed hashes the run, worker, batch counter, prompt and group member;
    not the policy version nor its manifest root (one seed per completion whatever version
    makes it, so computing a counter with two versions draws the same noise twice)."""
    assert sample_seed(run_id, worker, counter, prompt_index, member) == expected


def test_fixed_seed_gives_fixed_gumbel_noise():
    """The noise stream (Philox4x32-10, counter (v // 4, position, DOMAIN, 0)) is wire-visible:
    worker and validator must draw the same words for (seed, position, vocabulary id)."""
    import torch

    from proofs.sampling import gumbel, philox4x32_reference, uniform_words

    seed, position = 8758997740110991532, 5
    words = uniform_words(torch.tensor(seed), torch.tensor(position), torch.arange(6)).tolist()
    assert words == [381387475, 2345175059, 2660519845, 1243979928, 2944840526, 3234930382]
    assert list(philox4x32_reference([0, 5, 0x50524E31, 0], [seed & 0xFFFFFFFF, seed >> 32])) == words[:4]
    noise = gumbel(torch.tensor(seed), torch.tensor(position), torch.arange(3)).tolist()
    assert noise == pytest.approx([-0.8843390155043088, 0.5023881700329854, 0.7362166850203936], abs=1e-15)


# ------------------------------------------------------------------ gossip frames

# length prefix, then fixarray(2) [str8 topic, bin8 ENVELOPE]
GOSSIP_FRAME = (
    bytes.fromhex(
        "000000fe92d9252f7072696d656e6f64652f396261633532346434353730376237382f726f6c6c6f75742f34c4d4"
    )  # .../rollout/4: protocol 4
    + ENVELOPE
)
# length prefix, then fixarray(2) [kind, fixarray(1) [bin8 ENVELOPE_ID]]
IHAVE_FRAME = bytes.fromhex("00000025920191c420") + ENVELOPE_ID
GRAFT_FRAME = bytes.fromhex("00000025920291c420") + ENVELOPE_ID
PRUNE_FRAME = bytes.fromhex("00000003920390")  # [3, []]


def test_fixed_gossip_message_frame():
    body = gossip.encode_message(topic(RUN_ID, "rollout"), ENVELOPE)
    assert gossip.frame_header(len(body)) + body == GOSSIP_FRAME
    assert gossip.frame_size(GOSSIP_FRAME[:4]) == len(body)
    assert gossip.decode_frame(GOSSIP_FRAME[4:]) == gossip.GossipMessage(
        "/primenode/9bac524d45707b78/rollout/4", ENVELOPE
    )
    assert gossip.message_id(ENVELOPE) == ENVELOPE_ID


@pytest.mark.parametrize(
    "kind, ids, wire",
    [
        (gossip.IHAVE, [ENVELOPE_ID], IHAVE_FRAME),
        (gossip.GRAFT, [ENVELOPE_ID], GRAFT_FRAME),
        (gossip.PRUNE, [], PRUNE_FRAME),
    ],
    ids=["ihave", "graft", "prune"],
)
def test_fixed_gossip_control_frames(kind, ids, wire):
    body = gossip.encode_control(kind, ids)
    assert gossip.frame_header(len(body)) + body == wire
    assert gossip.decode_frame(wire[4:]) == gossip.Control(kind, ids)


def test_gossip_protocol_constants():
    assert (gossip.PROTOCOL_ID, gossip.IHAVE, gossip.GRAFT, gossip.PRUNE) == ("/primenode/gossip/1.1.0", 1, 2, 3)
    assert (gossip.MAX_GOSSIP_ENVELOPE_BYTES, gossip.FRAME_CAP) == (1044480, 1045504)
    assert (gossip.MAX_IDS_PER_FRAME, gossip.ID_BYTES) == (4096, 32)


# ------------------------------------------------------------------ request/response frames


def test_fixed_reqresp_frame():
    assert reqresp.encode_frame(ENVELOPE) == bytes.fromhex("000000d4") + ENVELOPE
    assert reqresp.frame_size(bytes.fromhex("000000d4"), cap=212) == 212


def test_fixed_reqresp_error_frame():
    """A responder's own ``bad_request`` answer, sealed and framed."""
    err = reqresp.bad_request(ProtocolError("signature", "bad"))
    assert err == m.ErrorResponse(code="bad_request", detail="signature: bad")
    assert reqresp.encode_frame(seal(TRAINER, RUN_ID, err, T0, 43)) == bytes.fromhex(
        "000000c59801c4209bac524d45707b78f9600e298037e7db51dee366eaa0469e77efd4dde02550a711d934313244334b6f6f574134"
        "586f70314a6154334d487877594d6b436570597376346950566f704d5877437a35694859644266655342cf0000018bcfe568002bc4"
        "1c92ab6261645f72657175657374ae7369676e61747572653a20626164c4402b4f7c3be6afad0a260f559fe4db0b1b594853b697c1"
        "b4a0c3403a8596d830d4a3c5a5450303120daa8fe90dfc8eaeaa45a1eaf819120bb3f72a9af45eebba05"
    )


def test_reqresp_protocol_constants():
    assert reqresp.PROTOCOL_ID == "/primenode/rr/1.0.0"
    assert (reqresp.BAD_REQUEST, reqresp.TIMEOUT, reqresp.INTERNAL) == ("bad_request", "timeout", "internal")
