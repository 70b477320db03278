from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.core.planning import KVLayout
from kvpush.core.protocol import (
    I63_MAX,
    MAC_SIZE,
    MAX_BLOCK_IDS,
    MAX_ID_LEN,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    Cancel,
    Hello,
    LeaseRenew,
    Message,
    ProtocolError,
    ReadDone,
    Registration,
    Seal,
    Wait,
    WriteDone,
    Writing,
    check_compatible,
    decode,
    encode,
    grant,
    grant_ok,
    greeting,
    parse_greeting,
)

SECRET = b"correct horse battery staple"

# 2 layers x 4 blocks of 16 tokens x 2 heads x 8 bytes, heads outermost in a block
LAYOUT = KVLayout((0x1000, 0x9000), 4, 16, 2, 8, 256, 128, 8, 2)


def hello(**changes: object) -> Hello:
    base = Hello(
        version=PROTOCOL_VERSION,
        engine_id="prefill-0",
        role="prefill",
        mode="push",
        model="Qwen/Qwen3-32B",
        kv_dtype="bfloat16",
        tp_rank=0,
        tp_size=1,
        layout=LAYOUT,
        agent_name="agent-prefill-0",
        agent_metadata=b"\x00\x01nixl",
        memory=((0x1000, 0x1000), (0x9000, 0x1000)),
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


REGISTRATION = Registration(
    transfer_id="t-1",
    request_id="chat-1-0a1b2c3d",
    engine_id="decode-0",
    host="10.0.0.2",
    port=5600,
    tp_rank=0,
    tp_size=2,
    block_ids=(4, 5, 6, 9),
    num_tokens=60,
    generation=0,
    deadline_ms=30_000,
)

EXAMPLES: list[Message] = [
    hello(),
    REGISTRATION,
    WriteDone("t-1", 3, 1, 2, True, ""),
    WriteDone("t-1", 3, 1, 2, True, "", 151_643),
    WriteDone("t-1", 3, 0, 2, False, "NIXL_ERR_REMOTE_DISCONNECT"),
    Cancel("t-1", 2, "client went away"),
    Cancel("t-1", 2, "client went away", "10.0.0.2", 5601),
    LeaseRenew("t-1", 0),
    ReadDone("t-1", 0, 1, 2, True, ""),
    Wait("t-1", 0),
    Writing("t-1", 3),
]


# -- strategies for valid messages -------------------------------------------------------

ids = st.text(
    st.characters(min_codepoint=0x20, exclude_categories=("Cs",)), min_size=1, max_size=40
)
texts = st.text(max_size=100)
generations = st.integers(0, I63_MAX)


@st.composite
def tp(draw: st.DrawFn) -> tuple[int, int]:
    size = draw(st.integers(1, 64))
    return draw(st.integers(0, size - 1)), size


@st.composite
def hellos(draw: st.DrawFn) -> Hello:
    regions = draw(st.integers(1, 8))
    blocks, tokens = draw(st.integers(1, 16)), draw(st.integers(1, 64))
    heads = draw(st.integers(1, 8))
    unit = draw(st.integers(1, 256))
    head_major = draw(st.booleans())
    head_stride, token_stride = (tokens * unit, unit) if head_major else (unit, heads * unit)
    lay = KVLayout(
        tuple(0x100000 * (r + 1) for r in range(regions)),
        blocks,
        tokens,
        heads,
        unit,
        heads * tokens * unit + draw(st.integers(0, 64)),
        head_stride,
        token_stride,
        heads * draw(st.integers(1, 4)),
        draw(st.sampled_from([1, blocks])),
    )
    rank, size = draw(tp())
    return Hello(
        version=draw(st.integers(0, 255)),
        engine_id=draw(ids),
        role=draw(st.sampled_from(["prefill", "decode"])),
        mode=draw(st.sampled_from(["push", "pull"])),
        model=draw(ids),
        kv_dtype=draw(st.sampled_from(["bfloat16", "float16", "fp8_e4m3"])),
        tp_rank=rank,
        tp_size=size,
        layout=lay,
        agent_name=draw(ids),
        agent_metadata=draw(st.binary(max_size=200)),
        memory=tuple((base, lay.region_bytes) for base in lay.region_bases),
    )


@st.composite
def registrations(draw: st.DrawFn) -> Registration:
    rank, size = draw(tp())
    return Registration(
        transfer_id=draw(ids),
        request_id=draw(ids),
        engine_id=draw(ids),
        host=draw(st.text(min_size=1, max_size=30)),
        port=draw(st.integers(0, 65535)),
        tp_rank=rank,
        tp_size=size,
        block_ids=tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=50))),
        num_tokens=draw(st.integers(0, 10**9)),
        generation=draw(generations),
        deadline_ms=draw(st.integers(0, 2**32 - 1)),
    )


@st.composite
def write_dones(draw: st.DrawFn) -> WriteDone:
    rank, size = draw(tp())
    sampled = draw(st.integers(-1, 2**63 - 1))
    return WriteDone(
        draw(ids), draw(generations), rank, size, draw(st.booleans()), draw(texts), sampled
    )


@st.composite
def read_dones(draw: st.DrawFn) -> ReadDone:
    rank, size = draw(tp())
    return ReadDone(draw(ids), draw(generations), rank, size, draw(st.booleans()), draw(texts))


messages = st.one_of(
    hellos(),
    registrations(),
    write_dones(),
    st.builds(Cancel, ids, generations, texts, st.text(max_size=30), st.integers(0, 65535)),
    st.builds(LeaseRenew, ids, generations),
    read_dones(),
    st.builds(Wait, ids, generations),
    st.builds(Writing, ids, generations),
)


def kind_of(data: bytes, secret: bytes | None = None, **kwargs: int) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(data, secret, **kwargs)
    assert info.value.kind in ProtocolError.KINDS
    return info.value.kind


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("secret", [None, SECRET])
def test_examples_round_trip(msg: Message, secret: bytes | None) -> None:
    frame = encode(msg, secret)
    assert frame[:2] == b"KP"
    assert decode(frame, secret) == msg


@settings(max_examples=200, deadline=None)
@given(messages, st.sampled_from([None, SECRET]))
def test_any_valid_message_round_trips(msg: Message, secret: bytes | None) -> None:
    assert decode(encode(msg, secret), secret) == msg


def test_frame_is_compact() -> None:
    assert len(encode(WriteDone("t-1", 3, 1, 2, True, ""))) < 20
    assert len(encode(WriteDone("t-1", 3, 1, 2, True, ""), SECRET)) < 20 + MAC_SIZE


# -- seals: a frame belongs to one connection and one position in it ---------------------

NONCE = bytes(range(NONCE_SIZE))
OTHER_NONCE = b"\xff" * NONCE_SIZE


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_sealed_frame_decodes_only_at_its_own_place(secret: bytes | None) -> None:
    frame = encode(REGISTRATION, secret, Seal(NONCE, 7))
    assert decode(frame, secret, seal=Seal(NONCE, 7)) == REGISTRATION
    assert decode(frame, secret) == REGISTRATION, "a receiver that checks no seal"
    assert kind_of(frame, secret, seal=Seal(OTHER_NONCE, 7)) == "replayed"
    assert kind_of(frame, secret, seal=Seal(NONCE, 8)) == "replayed"
    assert kind_of(encode(REGISTRATION, secret), secret, seal=Seal(NONCE, 0)) == "replayed"


def test_a_resealed_frame_fails_its_mac() -> None:
    frame = bytearray(encode(REGISTRATION, SECRET, Seal(NONCE, 7)))
    frame[4:20] = OTHER_NONCE  # an attacker moving a recorded frame to its own connection
    assert kind_of(bytes(frame), SECRET, seal=Seal(OTHER_NONCE, 7)) == "bad_mac"


def test_greetings() -> None:
    assert parse_greeting(greeting(NONCE)) == NONCE
    with pytest.raises(ProtocolError, match="not a kvpush greeting") as info:
        parse_greeting(b"GET / HTTP/1.1\r\nHost: xy\r\n")
    assert info.value.kind == "bad_magic"
    other = greeting(NONCE)[:4] + bytes([PROTOCOL_VERSION + 1]) + NONCE
    with pytest.raises(ProtocolError, match="run the same kvpush version") as info:
        parse_greeting(other)
    assert info.value.kind == "bad_version"
    with pytest.raises(ValueError):
        greeting(b"short")
    with pytest.raises(ValueError):
        Seal(b"short", 0)


@settings(max_examples=200, deadline=None)
@given(messages, st.binary(min_size=NONCE_SIZE, max_size=NONCE_SIZE), st.integers(0, 2**64 - 1))
def test_any_sealed_message_round_trips_and_nowhere_else(
    msg: Message, nonce: bytes, sequence: int
) -> None:
    frame = encode(msg, SECRET, Seal(nonce, sequence))
    assert decode(frame, SECRET, seal=Seal(nonce, sequence)) == msg
    elsewhere = Seal(nonce, (sequence + 1) % 2**64)
    assert kind_of(frame, SECRET, seal=elsewhere) == "replayed"


@settings(max_examples=200, deadline=None)
@given(messages, st.data())
def test_fuzz_sealed_bit_flips(msg: Message, data: st.DataObject) -> None:
    frame = bytearray(encode(msg, SECRET, Seal(NONCE, 3)))
    for bit in data.draw(st.lists(st.integers(0, len(frame) * 8 - 1), min_size=1, max_size=3)):
        frame[bit // 8] ^= 1 << (bit % 8)
    try:
        decoded = decode(bytes(frame), SECRET, seal=Seal(NONCE, 3))
    except ProtocolError as exc:
        assert exc.kind in ProtocolError.KINDS
    else:
        assert decoded == msg and bytes(frame) == encode(msg, SECRET, Seal(NONCE, 3))


# -- refusals ----------------------------------------------------------------------------


def test_header_refusals() -> None:
    frame = encode(REGISTRATION)
    assert kind_of(b"") == "malformed"
    assert kind_of(b"KP\x01") == "malformed"
    assert kind_of(b"GET / HTTP/1.1\r\n") == "bad_magic"
    assert kind_of(frame[:2] + bytes([PROTOCOL_VERSION + 1]) + frame[3:]) == "bad_version"
    assert kind_of(frame[:3] + b"\x7f" + frame[4:]) == "bad_type"
    assert kind_of(frame, max_size=len(frame) - 1) == "too_large"
    assert kind_of(frame + b"\x00") == "malformed"


def test_error_messages_say_what_to_fix() -> None:
    frame = encode(REGISTRATION)
    with pytest.raises(ProtocolError, match="run the same kvpush version"):
        decode(frame[:2] + bytes([PROTOCOL_VERSION + 1]) + frame[3:])
    with pytest.raises(ProtocolError, match="configure the same secret on both sides"):
        decode(frame, SECRET)
    with pytest.raises(ProtocolError, match="raise the receiver's max frame size"):
        decode(frame, max_size=8)


def test_mac_refusals() -> None:
    signed, plain = encode(REGISTRATION, SECRET), encode(REGISTRATION)
    assert kind_of(signed, b"another secret") == "bad_mac"
    assert kind_of(signed) == "bad_mac"
    assert kind_of(plain, SECRET) == "bad_mac"
    assert kind_of(signed[:-1], SECRET) == "bad_mac"
    assert kind_of(signed[:5], SECRET) == "bad_mac"
    with pytest.raises(ValueError, match="empty"):
        encode(REGISTRATION, b"")


def payload_frame(values: object, type_code: int = 2) -> bytes:
    payload: bytes = msgpack.packb(values)
    return b"KP" + bytes([PROTOCOL_VERSION, type_code]) + payload


def registration_fields(**changes: object) -> list[object]:
    values = {f.name: getattr(REGISTRATION, f.name) for f in dataclasses.fields(Registration)}
    values.update(changes)
    return [list(v) if isinstance(v, tuple) else v for v in values.values()]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"port": True}, "port"),
        ({"port": 70000}, "port"),
        ({"generation": -1}, "generation"),
        ({"num_tokens": 1.5}, "num_tokens"),
        ({"transfer_id": ""}, "transfer_id"),
        ({"transfer_id": "x" * (MAX_ID_LEN + 1)}, "transfer_id"),
        ({"transfer_id": "t1\x1f0"}, "control characters"),
        ({"request_id": b"bytes"}, "request_id"),
        ({"block_ids": [1, -2]}, "block_ids"),
        ({"block_ids": [1, None]}, "block_ids"),
        ({"block_ids": [1, True]}, "block_ids"),
        ({"block_ids": [3, 1.0]}, "block_ids"),
        ({"block_ids": [0, 2**32]}, "block_ids"),
        ({"block_ids": 7}, "block_ids"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank 2 is not below"),
    ],
)
def test_field_refusals_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ProtocolError, match=field) as info:
        decode(payload_frame(registration_fields(**changes)))
    assert info.value.kind == "malformed"


def test_structural_refusals() -> None:
    assert kind_of(payload_frame(registration_fields()[:-1])) == "malformed"
    assert kind_of(payload_frame({"transfer_id": "t"})) == "malformed"
    assert kind_of(payload_frame(msgpack.ExtType(1, b"x"))) == "malformed"
    assert kind_of(payload_frame("just a string")) == "malformed"
    assert kind_of(b"KP" + bytes([PROTOCOL_VERSION, 2]) + b"\x91" * 5000) == "malformed"
    assert kind_of(b"KP" + bytes([PROTOCOL_VERSION, 2]) + b"\xa2\xff\xfe") == "malformed"


def test_hello_layout_must_lie_in_registered_memory() -> None:
    outside = hello(memory=((0x1000, 0x1000), (0x9000, 0x10)))
    with pytest.raises(ProtocolError, match="outside the registered memory"):
        decode(encode(outside))
    values = encode_fields(hello())
    values[[f.name for f in dataclasses.fields(Hello)].index("memory")] = [[2**64 - 1, 2]]
    with pytest.raises(ProtocolError, match="wraps the address space"):
        decode(payload_frame(values, type_code=1))


def encode_fields(msg: Hello) -> list[object]:
    values = msgpack.unpackb(encode(msg)[4:])
    assert isinstance(values, list)
    return values


def test_block_ids_are_bounded() -> None:
    big = dataclasses.replace(REGISTRATION, block_ids=(200,) * MAX_BLOCK_IDS)
    frame = encode(big)
    assert kind_of(frame) == "too_large"
    assert decode(frame, max_size=4 << 20) == big
    too_many = payload_frame(registration_fields(block_ids=[7] * (MAX_BLOCK_IDS + 1)))
    assert kind_of(too_many, max_size=4 << 20) == "malformed"


# -- fuzzing: nothing but ProtocolError, ever ---------------------------------------------


def decode_or_refuse(data: bytes, secret: bytes | None = None) -> Message | None:
    try:
        return decode(data, secret)
    except ProtocolError as exc:
        assert exc.kind in ProtocolError.KINDS
        return None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    decode_or_refuse(data)
    decode_or_refuse(b"KP\x01" + data)
    assert decode_or_refuse(data, SECRET) is None


@settings(max_examples=200, deadline=None)
@given(messages, st.data())
def test_fuzz_truncations(msg: Message, data: st.DataObject) -> None:
    frame = encode(msg, SECRET)
    cut = data.draw(st.integers(0, len(frame) - 1))
    assert decode_or_refuse(frame[:cut], SECRET) is None
    plain = encode(msg)
    decode_or_refuse(plain[: min(cut, len(plain) - 1)])


@settings(max_examples=300, deadline=None)
@given(messages, st.data())
def test_fuzz_bit_flips(msg: Message, data: st.DataObject) -> None:
    for secret in (None, SECRET):
        frame = bytearray(encode(msg, secret))
        flips = data.draw(st.lists(st.integers(0, len(frame) * 8 - 1), min_size=1, max_size=3))
        for bit in flips:
            frame[bit // 8] ^= 1 << (bit % 8)
        decoded = decode_or_refuse(bytes(frame), secret)
        if secret is not None:
            # an authenticated frame that changed is always refused
            assert decoded is None or bytes(frame) == encode(msg, secret)


wire_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=12),
    max_leaves=40,
)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 8), st.lists(wire_values, max_size=13))
def test_fuzz_structured_payloads(type_code: int, values: list[object]) -> None:
    decode_or_refuse(payload_frame(values, type_code))


@settings(max_examples=300, deadline=None)
@given(messages, st.data())
def test_fuzz_one_field_replaced(msg: Message, data: st.DataObject) -> None:
    frame = encode(msg)
    values = msgpack.unpackb(frame[4:])
    index = data.draw(st.integers(0, len(values) - 1))
    values[index] = data.draw(wire_values)
    decode_or_refuse(frame[:4] + msgpack.packb(values))


# -- compatibility -------------------------------------------------------------------------


def test_compatible_peers() -> None:
    decode_side = hello(engine_id="decode-0", role="decode")
    assert check_compatible(hello(), decode_side) is None
    # different block size and TP size are planned for, not refused
    other = dataclasses.replace(
        LAYOUT, block_size=32, num_heads=1, region_bases=(0x1000, 0x5000), num_blocks=2
    )
    assert check_compatible(hello(), hello(role="decode", tp_size=2, layout=other)) is None


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        (
            {"version": PROTOCOL_VERSION + 1},
            [f"v{PROTOCOL_VERSION + 1}", f"v{PROTOCOL_VERSION}", "same kvpush version"],
        ),
        ({"mode": "pull"}, ["pull", "push", "same kvpush mode"]),
        ({"role": "prefill"}, ["both prefill", "connect a prefill instance"]),
        ({"model": "other/model"}, ["'other/model'", "'Qwen/Qwen3-32B'", "same model"]),
        ({"kv_dtype": "float16"}, ["float16", "bfloat16", "--kv-cache-dtype"]),
        (
            {"layout": dataclasses.replace(LAYOUT, unit_bytes=4, head_stride=64, token_stride=4)},
            ["8 bytes per head", "decode-0 4", "same KV cache dtype"],
        ),
        (
            {"layout": dataclasses.replace(LAYOUT, head_stride=8, token_stride=16)},
            ["head-major", "token-major", "same KV cache layout"],
        ),
        ({"layout": dataclasses.replace(LAYOUT, total_heads=4)}, ["2 KV heads", "decode-0 4"]),
        ({"layout": dataclasses.replace(LAYOUT, region_bases=(0x1000,))}, ["2 KV layers"]),
    ],
)
def test_incompatible_peers_are_named(changes: dict[str, object], words: list[str]) -> None:
    remote = hello(engine_id="decode-0", role="decode")
    remote = dataclasses.replace(remote, **changes)  # type: ignore[arg-type]
    problem = check_compatible(hello(), remote)
    assert problem is not None
    assert "decode-0" in problem
    for word in words:
        assert word in problem


# -- grants: prefill's signature over the blocks it leased (pull) ---------------------------


def test_a_grant_checks_out_only_for_exactly_what_was_granted() -> None:
    token = grant(SECRET, "prefill-0", "t-1", (4, 5, 9), 40, 2)
    assert grant_ok(SECRET, token, "prefill-0", "t-1", (4, 5, 9), 40, 2)
    for engine, transfer, blocks, tokens, tp in [
        ("prefill-1", "t-1", (4, 5, 9), 40, 2),
        ("prefill-0", "t-2", (4, 5, 9), 40, 2),
        ("prefill-0", "t-1", (4, 5, 8), 40, 2),
        ("prefill-0", "t-1", (4, 5), 40, 2),
        ("prefill-0", "t-1", (4, 5, 9), 41, 2),
        ("prefill-0", "t-1", (4, 5, 9), 40, 1),
    ]:
        assert not grant_ok(SECRET, token, engine, transfer, blocks, tokens, tp)
    assert not grant_ok(b"another secret", token, "prefill-0", "t-1", (4, 5, 9), 40, 2)
    assert not grant_ok(SECRET, "", "prefill-0", "t-1", (4, 5, 9), 40, 2)
    # numbers no grant can hold (coordinates altered on the way) are refused, not raised
    for blocks, tokens, tp in [((4, 5, 2**63), 40, 2), ((4, -5, 9), 40, -1), ((4,), 2**64, 2)]:
        assert not grant_ok(SECRET, token, "prefill-0", "t-1", blocks, tokens, tp)
    # a field's bytes cannot move into its neighbour: every length is signed
    assert grant(SECRET, "ab", "c", (), 0, 1) != grant(SECRET, "a", "bc", (), 0, 1)
    long_secret = b"s" * 100  # longer than BLAKE2b's key: hashed to one, still binding
    assert grant(long_secret, "e", "t", (1,), 1, 1) != grant(b"s" * 99, "e", "t", (1,), 1, 1)
    assert grant_ok(long_secret, grant(long_secret, "e", "t", (1,), 1, 1), "e", "t", (1,), 1, 1)


def test_a_pipeline_stage_hello_names_its_stage_and_its_regions_layers() -> None:
    """A stage's Hello carries its pipeline rank and size and, per region, each KV cache
    group's layer there ("" where the group has none): what decode pairs regions by."""
    stage = dataclasses.replace(
        LAYOUT, groups=2, layers=(("model.layers.2.attn", ""), ("", "model.layers.3.attn"))
    )
    sent = hello(layout=stage, pp_rank=1, pp_size=2)
    assert decode(encode(sent)) == sent
    assert decode(encode(hello())).pp_size == 1  # a plain server: one stage
    with pytest.raises(ProtocolError, match="pp_rank 2 is not below pp_size 2"):
        decode(encode(hello(pp_rank=2, pp_size=2)))
    values = encode_fields(sent)
    layout_at = [f.name for f in dataclasses.fields(Hello)].index("layout")
    layers_at = [f.name for f in dataclasses.fields(KVLayout)].index("layers")
    values[layout_at][layers_at] = [["", ""], ["model.layers.3.attn", ""]]  # a region of none
    with pytest.raises(ProtocolError, match="one per KV cache group"):
        decode(payload_frame(values, type_code=1))
    done = WriteDone("t-1", 0, 1, 2, True, "", pp_rank=1)
    assert decode(encode(done)) == done and done.producer_rank == 3  # stage 1 follows TP 2


def test_a_grant_covers_the_pipeline_stages() -> None:
    """Decode reads from every stage prefill names: a grant for one stage count is no grant
    for another, so a router cannot make decode read fewer layers than prefill holds."""
    token = grant(b"s" * 32, "prefill-0", "t-1", (4, 5), 60, 2, 2)
    assert grant_ok(b"s" * 32, token, "prefill-0", "t-1", (4, 5), 60, 2, 2)
    assert not grant_ok(b"s" * 32, token, "prefill-0", "t-1", (4, 5), 60, 2, 1)
    assert grant(b"s" * 32, "prefill-0", "t-1", (4, 5), 60, 2) == grant(
        b"s" * 32, "prefill-0", "t-1", (4, 5), 60, 2, 1
    )
