"""What vLLM's scheduler decides for a node's workers, one spec per request and step.

The scheduler side (`kvpush.vllm.scheduler`) builds these and vLLM ships them to the
workers inside `KvpushMetadata`; the node's threads act on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.core.protocol import NO_TOKEN


@dataclass(frozen=True, slots=True)
class RecvSpec:
    """Decode: blocks just allocated for a request whose KV comes from prefill.

    Decode's prefix cache holds the prompt's first `first_token` tokens; `block_ids` (the
    blocks just allocated) hold the rest, from the block of `first_token` on. Push:
    prefill writes them. Pull: decode reads prefill's `remote_block_ids`, where prefill
    computed `remote_num_tokens` tokens (both from prefill's kv_transfer_params).
    """

    transfer_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    prefill_host: str
    prefill_port: int
    prefill_tp: int
    generation: int
    first_token: int = 0
    remote_block_ids: tuple[int, ...] = ()
    remote_num_tokens: int = 0
    remote_engine_id: str = ""
    remote_grant: str = ""  # prefill's signature over the above (`protocol.grant`)
    prefill_pp: int = 1  # prefill's pipeline stages: each holds some layers, its own ports


@dataclass(frozen=True, slots=True)
class HoldSpec:
    """Decode: a request whose KV comes from prefill is still waiting for decode's blocks
    (decode's KV cache is full, or its queue is long). Until it has blocks (then its
    `RecvSpec` follows) or ends (an `AbortSpec`), decode renews what prefill holds for it
    every half `lease_s`, as a READ would, so a long wait here does not lose prefill's KV.
    """

    transfer_id: str
    request_id: str
    prefill_host: str
    prefill_port: int
    prefill_tp: int = 1
    prefill_pp: int = 1  # prefill's pipeline stages: each holds some layers, its own ports


@dataclass(frozen=True, slots=True)
class SendSpec:
    """Prefill: a finished prefill whose blocks wait for decode (push: its registration,
    pull: its READ)."""

    transfer_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    sampled: int = NO_TOKEN  # the first output token prefill sampled (push: for decode)
    # when vLLM finished the prefill (time.monotonic, which every process of a host shares)
    finished_at: float = 0.0
    # push: this copy came straight from the scheduler (`kvpush.node.direct`), not with the
    # next step's metadata, which carries the other copy
    direct: bool = False


@dataclass(frozen=True, slots=True)
class AbortSpec:
    """A request that ended locally before its transfer did (aborts, client disconnects).

    Decode names the prefill it expected KV from (empty host: not known), so a request that
    ended before it got any blocks still tells prefill to free the KV it holds for it.
    """

    transfer_id: str
    request_id: str
    prefill_host: str = ""
    prefill_port: int = 0
    prefill_tp: int = 1
    prefill_pp: int = 1
