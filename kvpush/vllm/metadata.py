"""What the scheduler hands the workers each step (pickled by vLLM between processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpush.node.specs import AbortSpec, HoldSpec, RecvSpec, SendSpec


@dataclass
class KvpushMetadata(KVConnectorMetadata):
    recv: list[RecvSpec | HoldSpec] = field(default_factory=list)  # decode's
    send: list[SendSpec] = field(default_factory=list)
    aborted: list[AbortSpec] = field(default_factory=list)


# What a step with nothing to move ships (most steps): one shared instance, which no one
# changes (the workers only read their metadata), so such a step allocates nothing.
EMPTY_METADATA = KvpushMetadata()
