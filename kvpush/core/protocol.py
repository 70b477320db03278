"""The wire protocol: every message kvpush instances exchange, and its one codec.

A frame is

    b"KP" | version: u8 | type: u8 | [seal: nonce (16 bytes) | sequence: u64]
          | msgpack array of the fields | [HMAC-SHA256 (32 bytes)]

Two flag bits of the type byte say what is present. The HMAC is present exactly when the
sender has a shared secret, and covers everything before it. Peers must agree on the
secret: a frame with a MAC where none is configured is refused like a wrong MAC, so a
half-configured pair fails at the first message instead of running unauthenticated.

The seal binds a frame to one connection and one position in it, so a recorded frame
cannot be replayed: each side of a control connection opens with a greeting carrying a
fresh random nonce, and every frame it then receives must be sealed with that nonce and
the next sequence number (`Seal`). A replayed frame keeps a valid MAC but names another
connection's nonce or an old position, and is refused as "replayed". The seal is covered
by the MAC, so it is only as strong as the shared secret; without one it only catches
confusion, not an attacker.

`decode` is the one place where untrusted bytes are checked. It bounds the frame size,
checks header, MAC and seal before parsing, then checks every field's exact type and
range, and raises `ProtocolError` (and nothing else) for anything it does not accept.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import struct
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal, TypeGuard

import msgpack

from kvpush.core.planning import KVLayout, PlanError, check_mappable

PROTOCOL_VERSION = 10  # 10: KV layouts with state groups; 9: layers named, pipeline stages
MAGIC = b"KP"
GREETING_MAGIC = b"KPHI"
MAC_SIZE = 32
NONCE_SIZE = 16
DEFAULT_MAX_FRAME = 1 << 20
MAX_BLOCK_IDS = 1_000_000
MAX_KV_GROUPS = 1024  # vLLM's KV cache groups (hybrid models)
MAX_REGIONS = 65_536
MAX_ID_LEN = 512
MAX_TEXT_LEN = 4096
MAX_TP = 4096
U64_MAX = 2**64 - 1
I63_MAX = 2**63 - 1

_HEADER_SIZE = 4
_MAC_FLAG = 0x80
_SEAL_FLAG = 0x40
_TYPE_MASK = 0x3F
_SEQ = struct.Struct(">Q")
_SEAL_SIZE = NONCE_SIZE + _SEQ.size
GREETING_SIZE = len(GREETING_MAGIC) + 1 + NONCE_SIZE

Role = Literal["prefill", "decode"]
Mode = Literal["push", "pull"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
MODES: tuple[Mode, ...] = ("push", "pull")

# The first output token of a request, sampled by prefill, that decode must reproduce (so
# the proxy may stream prefill's token before decode's first step): the keys of the decode
# leg's `vllm_xargs` (vLLM's SamplingParams.extra_args) that kvpush's logits processor
# reads. Pull: the token itself, from prefill's kv_transfer_params (`FIRST_TOKEN_PARAM`).
# Push: the transfer id whose `WriteDone` carries the token.
FIRST_TOKEN_ARG = "kvpush_first_token"
FIRST_TOKEN_OF_ARG = "kvpush_first_token_of"
FIRST_TOKEN_PARAM = "first_token_id"
NO_TOKEN = -1
# Push, prefill's kv_transfer_params: the prefill engine decode registers with. An engine
# that gets a request meant for another (a data-parallel front end that did not honour
# the proxy's X-data-parallel-rank) frees its KV at once instead of holding it for nobody.
ENGINE_PARAM = "kvpush_engine_id"
# ... and in its answer's kv_transfer_params, the engine that ran it instead: the proxy
# then fails the request at once, which ends decode's wait for a WRITE that cannot come
MISROUTED_PARAM = "kvpush_ran_on_engine"


def is_token_id(value: object) -> TypeGuard[int]:
    """A token id as JSON carries one: an int >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class ProtocolError(Exception):
    """A frame that was refused. `kind` is a short code to count as a metric."""

    KINDS = (
        "too_large",
        "bad_magic",
        "bad_version",
        "bad_type",
        "bad_mac",
        "replayed",
        "malformed",
    )

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


class _Invalid(Exception):
    """A field value `decode` refuses; becomes a `ProtocolError` naming the field."""


Check = Callable[[object], Any]


def _int(lo: int = 0, hi: int = U64_MAX) -> Check:
    def check(value: object) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _Invalid(f"expected an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise _Invalid(f"{value} is outside [{lo}, {hi}]")
        return value

    return check


def _str(
    max_len: int, choices: tuple[str, ...] = (), empty: bool = False, ids: bool = False
) -> Check:
    def check(value: object) -> str:
        if not isinstance(value, str):
            raise _Invalid(f"expected a string, got {type(value).__name__}")
        if len(value) > max_len:
            raise _Invalid(f"string of {len(value)} characters exceeds {max_len}")
        if not value and not empty:
            raise _Invalid("must not be empty")
        if ids and any(c < " " for c in value):
            raise _Invalid("ids hold no control characters")
        if choices and value not in choices:
            raise _Invalid(f"{value!r} is not one of {choices}")
        return value

    return check


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"expected a boolean, got {type(value).__name__}")
    return value


def _bytes(value: object) -> bytes:
    if not isinstance(value, bytes):
        raise _Invalid(f"expected bytes, got {type(value).__name__}")
    return value


def _ints(max_items: int, lo: int = 0, hi: int = U64_MAX) -> Check:
    item = _int(lo, hi)

    def check(value: object) -> tuple[int, ...]:
        if not isinstance(value, list):
            raise _Invalid(f"expected a list, got {type(value).__name__}")
        if len(value) > max_items:
            raise _Invalid(f"{len(value)} items exceed {max_items}")
        # plain ints in range, checked at C speed: a long prompt's registration lists
        # thousands of block ids, read on prefill's control thread during its forward
        if value and set(map(type, value)) == {int} and lo <= min(value) and max(value) <= hi:
            return tuple(value)
        return tuple(item(v) for v in value)  # the item at fault, named

    return check


def _ranges(value: object) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list) or len(value) > MAX_REGIONS:
        raise _Invalid(f"expected a list of at most {MAX_REGIONS} [base, length] pairs")
    out: list[tuple[int, int]] = []
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2:
            raise _Invalid("expected [base, length] pairs")
        base, length = _int()(pair[0]), _int(1)(pair[1])
        if base + length > U64_MAX + 1:
            raise _Invalid(f"range at {base:#x} of {length} bytes wraps the address space")
        out.append((base, length))
    return tuple(out)


def _names_per_region(value: object) -> tuple[tuple[str, ...], ...]:
    if not isinstance(value, list) or len(value) > MAX_REGIONS:
        raise _Invalid(f"expected a list of at most {MAX_REGIONS} lists of layer names")
    name = _str(MAX_ID_LEN, empty=True, ids=True)  # "": that group has no layer there
    out: list[tuple[str, ...]] = []
    for names in value:
        if not isinstance(names, list) or not 0 < len(names) <= MAX_KV_GROUPS:
            raise _Invalid(f"expected lists of 1 to {MAX_KV_GROUPS} layer names")
        out.append(tuple(name(n) for n in names))
    return tuple(out)


_LAYOUT_FIELDS: tuple[Check, ...] = (
    _ints(MAX_REGIONS),  # region_bases
    _int(1, I63_MAX),  # num_blocks
    _int(1, 1 << 20),  # block_size
    _int(1, MAX_TP * 1024),  # num_heads
    _int(1, 1 << 24),  # unit_bytes
    _int(1, I63_MAX),  # block_stride
    _int(1, I63_MAX),  # head_stride
    _int(1, I63_MAX),  # token_stride
    _int(1, MAX_TP * 1024),  # total_heads
    _int(1, 1 << 20),  # sub_blocks
    _bool,  # whole_blocks
    _int(1, MAX_KV_GROUPS),  # groups
    _names_per_region,  # layers
    _ints(MAX_KV_GROUPS, 0, MAX_KV_GROUPS - 1),  # state_groups
    _int(0, I63_MAX),  # state_bytes
)


def _layout(value: object) -> KVLayout:
    if not isinstance(value, list) or len(value) != len(_LAYOUT_FIELDS):
        raise _Invalid(f"expected a list of {len(_LAYOUT_FIELDS)} KV layout fields")
    try:
        return KVLayout(*(check(v) for check, v in zip(_LAYOUT_FIELDS, value, strict=True)))
    except PlanError as exc:
        raise _Invalid(str(exc)) from None


def _wire(check: Check) -> dict[str, Check]:
    return {"check": check}


_ID = _wire(_str(MAX_ID_LEN, ids=True))
_TEXT = _wire(_str(MAX_TEXT_LEN, empty=True))
_GENERATION = _wire(_int(0, I63_MAX))
_TP_RANK = _wire(_int(0, MAX_TP - 1))
_TP_SIZE = _wire(_int(1, MAX_TP))


@dataclass(frozen=True, slots=True)
class Hello:
    """Handshake: what one instance tells a peer about itself on first contact.

    `memory` lists the (base, length) ranges registered with NIXL; every KV region of
    `layout` must lie inside one of them. Block size is `layout.block_size`. `agent_name`
    is unique per process: it names this incarnation of the rank. `host`:`port` is the
    rank's control address, the only one a peer sends its notices to.
    """

    version: int = field(metadata=_wire(_int(0, 255)))
    engine_id: str = field(metadata=_ID)
    role: Role = field(metadata=_wire(_str(16, ROLES)))
    mode: Mode = field(metadata=_wire(_str(16, MODES)))
    model: str = field(metadata=_wire(_str(1024)))
    kv_dtype: str = field(metadata=_wire(_str(32)))
    tp_rank: int = field(metadata=_TP_RANK)
    tp_size: int = field(metadata=_TP_SIZE)
    layout: KVLayout = field(metadata=_wire(_layout))
    agent_name: str = field(metadata=_ID)
    agent_metadata: bytes = field(metadata=_wire(_bytes))
    memory: tuple[tuple[int, int], ...] = field(metadata=_wire(_ranges))
    # where this rank takes control messages (what the peer may send notices to)
    host: str = field(default="", metadata=_wire(_str(255, empty=True)))
    port: int = field(default=0, metadata=_wire(_int(0, 65535)))
    # the rank's pipeline stage: it holds those layers' KV alone (`layout.layers`)
    pp_rank: int = field(default=0, metadata=_TP_RANK)
    pp_size: int = field(default=1, metadata=_TP_SIZE)

    @property
    def block_size(self) -> int:
        return self.layout.block_size


@dataclass(frozen=True, slots=True)
class Registration:
    """Decode -> prefill (push): "write transfer `transfer_id` into these blocks of mine".

    Decode wants tokens [first_token, num_tokens) of the prompt: it holds the ones before
    `first_token` in its prefix cache, and `block_ids` begins with the block holding
    `first_token`. `generation` fences retries: decode bumps it each time it (re)allocates
    blocks for the transfer, and prefill writes only the newest. `deadline_ms` is how long
    the registration stays valid after it is received (prefill caps it at its own
    transfer timeout).

    A registration is valid only on the connection where its sender's `Hello` came, and
    only for that incarnation: `agent_name`, `engine_id`, `tp_rank` and `host`:`port` must
    be that Hello's. Prefill drops the registrations of a connection that closes.
    """

    transfer_id: str = field(metadata=_ID)
    request_id: str = field(metadata=_ID)
    engine_id: str = field(metadata=_ID)
    host: str = field(metadata=_wire(_str(255)))
    port: int = field(metadata=_wire(_int(0, 65535)))
    tp_rank: int = field(metadata=_TP_RANK)
    tp_size: int = field(metadata=_TP_SIZE)
    block_ids: tuple[int, ...] = field(metadata=_wire(_ints(MAX_BLOCK_IDS, 0, 2**32 - 1)))
    num_tokens: int = field(metadata=_wire(_int(0, I63_MAX)))
    generation: int = field(metadata=_GENERATION)
    deadline_ms: int = field(metadata=_wire(_int(0, 2**32 - 1)))
    first_token: int = field(default=0, metadata=_wire(_int(0, I63_MAX)))
    agent_name: str = field(default="", metadata=_wire(_str(MAX_ID_LEN, empty=True)))


@dataclass(frozen=True, slots=True)
class WriteDone:
    """Prefill -> decode: the NIXL notification of one producer rank's WRITE.

    `tp_rank`/`tp_size`/`pp_rank` are the producer's. Decode counts one ok completion per
    producer rank writing into it (`producer_rank`); ok=False (with `error`) fails the
    transfer at once. `sampled`: the first output token prefill sampled for the request
    (`NO_TOKEN` if none), which decode's first step then reproduces
    (`kvpush.vllm.first_token`).
    """

    transfer_id: str = field(metadata=_ID)
    generation: int = field(metadata=_GENERATION)
    tp_rank: int = field(metadata=_TP_RANK)
    tp_size: int = field(metadata=_TP_SIZE)
    ok: bool = field(metadata=_wire(_bool))
    error: str = field(metadata=_TEXT)
    sampled: int = field(default=NO_TOKEN, metadata=_wire(_int(NO_TOKEN, I63_MAX)))
    pp_rank: int = field(default=0, metadata=_TP_RANK)

    @property
    def producer_rank(self) -> int:
        """The producer among all of its engine's ranks, stage after stage."""
        return producer_rank(self.pp_rank, self.tp_rank, self.tp_size)


def producer_rank(pp_rank: int, tp_rank: int, tp_size: int) -> int:
    """A rank's place among its engine's ranks, pipeline stage by stage: what decode counts
    arrivals by and what its control port is counted by (the engine's first port + this)."""
    return pp_rank * tp_size + tp_rank


@dataclass(frozen=True, slots=True)
class Cancel:
    """Either direction: generations up to `generation` of the transfer are abandoned.

    Decode -> prefill (push): prefill answers at `ack_host`:`ack_port` with a `WriteDone`
    for `generation` once none of its WRITEs can land in decode's blocks any more: at once
    (ok=False) when none is in flight, else when the one in flight ended. Decode reuses the
    blocks only after that answer (or when prefill is gone). Prefill -> decode (pull, the
    negative answer to a `ReadDone` or `LeaseRenew`): `ack_port` is 0, nothing is answered.
    """

    transfer_id: str = field(metadata=_ID)
    generation: int = field(metadata=_GENERATION)
    reason: str = field(metadata=_TEXT)
    ack_host: str = field(default="", metadata=_wire(_str(255, empty=True)))
    ack_port: int = field(default=0, metadata=_wire(_int(0, 65535)))


@dataclass(frozen=True, slots=True)
class LeaseRenew:
    """Decode -> prefill (pull): keep the blocks of this transfer, a READ is coming.

    Prefill answers with this message if it still holds them, else with a `Cancel`."""

    transfer_id: str = field(metadata=_ID)
    generation: int = field(metadata=_GENERATION)


@dataclass(frozen=True, slots=True)
class ReadDone:
    """Decode -> prefill (pull): one decode rank's READ finished (or, ok=False, never will).

    `tp_rank`/`tp_size` are the reader's: prefill frees its blocks once every decode rank
    that reads from it is done, or at the first failure. Prefill answers with this message
    if it held the blocks until now (the READ's bytes are valid), else with a `Cancel`.
    """

    transfer_id: str = field(metadata=_ID)
    generation: int = field(metadata=_GENERATION)
    tp_rank: int = field(metadata=_TP_RANK)
    tp_size: int = field(metadata=_TP_SIZE)
    ok: bool = field(metadata=_wire(_bool))
    error: str = field(metadata=_TEXT)


@dataclass(frozen=True, slots=True)
class Wait:
    """Prefill -> decode (pull), the answer to a `ReadDone` or `LeaseRenew` for a transfer
    prefill has not leased yet (its engine loop has not handed it over): ask again. Prefill
    confirms only transfers it leased, so a READ is never taken as valid on trust."""

    transfer_id: str = field(metadata=_ID)
    generation: int = field(metadata=_GENERATION)


@dataclass(frozen=True, slots=True)
class Writing:
    """Prefill -> decode (push): a WRITE into this transfer's blocks is still in flight a
    moment after it was posted. Decode then calls into NIXL until the transfer settles:
    over UCX's TCP transport the bytes move only while the target's worker runs, and
    decode does not otherwise spend its engine's GIL on that while it merely waits."""

    transfer_id: str = field(metadata=_ID)
    generation: int = field(metadata=_GENERATION)


Message = Hello | Registration | WriteDone | Cancel | LeaseRenew | ReadDone | Wait | Writing

_TYPES: dict[int, type[Message]] = {
    1: Hello,
    2: Registration,
    3: WriteDone,
    4: Cancel,
    5: LeaseRenew,
    6: ReadDone,
    7: Wait,
    8: Writing,
}
_CODES: dict[type[Message], int] = {cls: code for code, cls in _TYPES.items()}
_FIELDS: dict[type[Message], tuple[Field[Any], ...]] = {cls: fields(cls) for cls in _CODES}


@dataclass(frozen=True, slots=True)
class Seal:
    """Where a frame belongs: the receiver's connection `nonce` and position `sequence`."""

    nonce: bytes
    sequence: int

    def __post_init__(self) -> None:
        if len(self.nonce) != NONCE_SIZE or not 0 <= self.sequence <= U64_MAX:
            raise ValueError(f"a seal is a {NONCE_SIZE}-byte nonce and a u64 sequence number")


def greeting(nonce: bytes) -> bytes:
    """What each side of a control connection sends first: version and its fresh nonce."""
    if len(nonce) != NONCE_SIZE:
        raise ValueError(f"a greeting carries a {NONCE_SIZE}-byte nonce")
    return GREETING_MAGIC + bytes((PROTOCOL_VERSION,)) + nonce


def parse_greeting(data: bytes) -> bytes:
    """The peer's nonce from its `greeting`; raises `ProtocolError` for anything else."""
    if len(data) != GREETING_SIZE or data[: len(GREETING_MAGIC)] != GREETING_MAGIC:
        raise ProtocolError(
            "bad_magic",
            f"not a kvpush greeting (starts with {bytes(data[:4])!r}); check that the peer "
            "address points at a kvpush side channel",
        )
    version = data[len(GREETING_MAGIC)]
    if version != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", _version_mismatch(version))
    return bytes(data[len(GREETING_MAGIC) + 1 :])


def encode(msg: Message, secret: bytes | None = None, seal: Seal | None = None) -> bytes:
    """One frame for `msg`, authenticated when `secret` is set, bound to `seal` if given."""
    _check_secret(secret)
    cls = type(msg)
    values = [_to_wire(getattr(msg, f.name)) for f in _FIELDS[cls]]
    payload: bytes = msgpack.packb(values)
    flags = (_MAC_FLAG if secret else 0) | (_SEAL_FLAG if seal else 0)
    frame = MAGIC + bytes((PROTOCOL_VERSION, _CODES[cls] | flags))
    if seal:
        frame += seal.nonce + _SEQ.pack(seal.sequence)
    frame += payload
    if secret:
        frame += hmac.digest(secret, frame, hashlib.sha256)
    return frame


def decode(
    data: bytes,
    secret: bytes | None = None,
    max_size: int = DEFAULT_MAX_FRAME,
    seal: Seal | None = None,
) -> Message:
    """The message in `data`; raises `ProtocolError` for anything not a valid frame.

    With `seal`, the frame must be sealed with exactly that nonce and sequence number.
    """
    _check_secret(secret)
    if len(data) > max_size:
        raise ProtocolError(
            "too_large",
            f"frame of {len(data)} bytes exceeds the {max_size}-byte limit; "
            "raise the receiver's max frame size if such messages are expected",
        )
    if len(data) < _HEADER_SIZE:
        raise ProtocolError("malformed", f"frame of {len(data)} bytes is shorter than a header")
    if data[:2] != MAGIC:
        raise ProtocolError(
            "bad_magic",
            f"not a kvpush frame (starts with {bytes(data[:2])!r}); check that the peer "
            "address points at a kvpush side channel",
        )
    if data[2] != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", _version_mismatch(data[2]))
    cls = _TYPES.get(data[3] & _TYPE_MASK)
    if cls is None:
        raise ProtocolError("bad_type", f"unknown message type {data[3] & _TYPE_MASK}")
    body = _authenticated_body(data, bool(data[3] & _MAC_FLAG), secret)
    start = _HEADER_SIZE
    if data[3] & _SEAL_FLAG:
        start += _SEAL_SIZE
        if len(body) < start:
            raise ProtocolError("malformed", "frame is too short to carry its seal")
    if seal is not None:
        _check_seal(body, seal)
    try:
        values = msgpack.unpackb(
            body[start:],
            raw=False,
            max_str_len=4 * MAX_TEXT_LEN,
            max_bin_len=max_size,
            max_array_len=MAX_BLOCK_IDS,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types on garbage; all mean "malformed"
        raise ProtocolError("malformed", f"{cls.__name__}: undecodable payload ({exc})") from None
    return _build(cls, values)


def _version_mismatch(version: int) -> str:
    return (
        f"peer speaks kvpush protocol v{version}, this instance v{PROTOCOL_VERSION}; "
        "run the same kvpush version on prefill and decode"
    )


def _check_secret(secret: bytes | None) -> None:
    if secret is not None and not secret:
        raise ValueError("the shared secret is empty; configure a non-empty secret or none")


def _check_seal(body: bytes, seal: Seal) -> None:
    if not body[3] & _SEAL_FLAG:
        raise ProtocolError("replayed", "frame is not sealed to this connection")
    nonce = body[_HEADER_SIZE : _HEADER_SIZE + NONCE_SIZE]
    (sequence,) = _SEQ.unpack_from(body, _HEADER_SIZE + NONCE_SIZE)
    if nonce != seal.nonce:
        raise ProtocolError(
            "replayed", "frame is sealed to another connection (a recorded frame sent again?)"
        )
    if sequence != seal.sequence:
        raise ProtocolError(
            "replayed",
            f"frame is number {sequence} of this connection, expected {seal.sequence} "
            "(a frame sent twice or dropped?)",
        )


def _authenticated_body(data: bytes, signed: bool, secret: bytes | None) -> bytes:
    if not secret:
        if signed:
            raise ProtocolError(
                "bad_mac",
                "frame is authenticated but no shared secret is configured here; "
                "configure the same secret on both sides",
            )
        return data
    if not signed:
        raise ProtocolError(
            "bad_mac",
            "frame is not authenticated but a shared secret is configured here; "
            "configure the same secret on both sides",
        )
    if len(data) < _HEADER_SIZE + MAC_SIZE:
        raise ProtocolError("bad_mac", "frame is too short to carry its MAC")
    body, mac = data[:-MAC_SIZE], data[-MAC_SIZE:]
    if not hmac.compare_digest(mac, hmac.digest(secret, body, hashlib.sha256)):
        raise ProtocolError(
            "bad_mac",
            "MAC mismatch: the peer uses a different shared secret or the frame was altered",
        )
    return body


def _to_wire(value: object) -> object:
    if isinstance(value, KVLayout):
        return [getattr(value, f.name) for f in fields(value)]
    return value


def _build(cls: type[Message], values: object) -> Message:
    specs = _FIELDS[cls]
    if not isinstance(values, list) or len(values) != len(specs):
        raise ProtocolError("malformed", f"{cls.__name__}: expected a list of {len(specs)} fields")
    checked: list[Any] = []
    for spec, value in zip(specs, values, strict=True):
        try:
            checked.append(spec.metadata["check"](value))
        except _Invalid as exc:
            raise ProtocolError("malformed", f"{cls.__name__}.{spec.name}: {exc}") from None
    msg = cls(*checked)
    problem = _cross_check(msg)
    if problem:
        raise ProtocolError("malformed", f"{cls.__name__}: {problem}")
    return msg


def _cross_check(msg: Message) -> str | None:
    if isinstance(msg, Hello | Registration | WriteDone | ReadDone) and msg.tp_rank >= msg.tp_size:
        return f"tp_rank {msg.tp_rank} is not below tp_size {msg.tp_size}"
    if isinstance(msg, Hello):
        if msg.pp_rank >= msg.pp_size:
            return f"pp_rank {msg.pp_rank} is not below pp_size {msg.pp_size}"
        return _outside_memory(msg.layout, msg.memory)
    if isinstance(msg, Registration) and msg.first_token > msg.num_tokens:
        return f"first_token {msg.first_token} is beyond num_tokens {msg.num_tokens}"
    return None


def _outside_memory(layout: KVLayout, memory: tuple[tuple[int, int], ...]) -> str | None:
    ranges = sorted(memory)
    starts = [base for base, _ in ranges]
    size = layout.region_bytes
    for base in layout.region_bases:
        i = bisect.bisect_right(starts, base) - 1
        if i < 0 or base + size > ranges[i][0] + ranges[i][1]:
            return (
                f"KV region at {base:#x} ({size} bytes) is outside the registered memory; "
                "register every KV cache tensor with NIXL"
            )
    return None


def grant(
    secret: bytes,
    engine_id: str,
    transfer_id: str,
    block_ids: tuple[int, ...],
    num_tokens: int,
    tp_size: int,
    pp_size: int = 1,
) -> str:
    """Pull: prefill's signature over the blocks it leased for a transfer.

    Prefill hands it out in `kv_transfer_params` with everything a READ depends on (its
    engine id, the blocks, how many tokens they hold, its TP and pipeline sizes), which
    travel through the router; decode checks it (`grant_ok`) before it READs, and checks
    that the prefill it reaches is that engine, so coordinates forged or altered on the way
    never make it read blocks prefill did not lease for that transfer. Prefill in turn
    confirms a READ only for a lease it holds (a grant of an earlier incarnation finds
    none).

    It runs on vLLM's scheduler thread once per finished prefill, after a forward has
    evicted most of the caches, so it is keyed BLAKE2b (a MAC by design, in Python's own
    C) over a length-prefixed packing: 20-30 us there against ~100 for HMAC-SHA256 of
    msgpack. Secrets longer than BLAKE2b's 64-byte key are hashed to one first.
    """
    _check_secret(secret)
    engine, transfer = engine_id.encode(), transfer_id.encode()
    signed = b"".join(
        (
            _GRANT_HEAD.pack(
                len(engine), len(transfer), len(block_ids), num_tokens, tp_size, pp_size
            ),
            engine,
            transfer,
            struct.pack(f"<{len(block_ids)}q", *block_ids),
        )
    )
    return hashlib.blake2b(
        signed, key=_grant_key(secret), digest_size=32, person=b"kvpush-grant"
    ).hexdigest()


# the lengths of engine, transfer and blocks; tokens, TP, pipeline stages
_GRANT_HEAD = struct.Struct("<IIIqII")


def _grant_key(secret: bytes) -> bytes:
    return secret if len(secret) <= 64 else hashlib.sha256(secret).digest()


def grant_ok(
    secret: bytes,
    token: str,
    engine_id: str,
    transfer_id: str,
    block_ids: tuple[int, ...],
    num_tokens: int,
    tp_size: int,
    pp_size: int = 1,
) -> bool:
    try:
        expected = grant(secret, engine_id, transfer_id, block_ids, num_tokens, tp_size, pp_size)
    except struct.error:  # a number out of range: no grant was ever made for it
        return False
    return hmac.compare_digest(token.encode(), expected.encode())


def check_compatible(local: Hello, remote: Hello) -> str | None:
    """Why `local` cannot exchange KV with `remote` (None when it can).

    Block sizes and TP sizes may differ (planning maps them); everything else must match.
    """
    peer = f"remote {remote.engine_id}"
    if local.version != remote.version:
        return (
            f"{peer} speaks kvpush protocol v{remote.version}, local v{local.version}: "
            "run the same kvpush version on both sides"
        )
    if local.mode != remote.mode:
        return (
            f"{peer} runs in {remote.mode} mode, local in {local.mode} mode: "
            "configure the same kvpush mode on prefill and decode"
        )
    if local.role == remote.role:
        return (
            f"{peer} and local are both {local.role} instances: connect a prefill instance "
            "to a decode instance"
        )
    if local.model != remote.model:
        return (
            f"{peer} serves model {remote.model!r}, local {local.model!r}: "
            "serve the same model on both sides"
        )
    if local.kv_dtype != remote.kv_dtype:
        return (
            f"{peer} stores its KV cache as {remote.kv_dtype}, local as {local.kv_dtype}: "
            "use the same --dtype and --kv-cache-dtype on both sides"
        )
    problem = check_mappable(
        local.layout, remote.layout, local.tp_size, remote.tp_size, "local", peer
    )
    return f"KV layouts cannot be mapped: {problem}" if problem else None
