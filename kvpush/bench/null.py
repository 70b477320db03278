"""A KV connector that moves nothing: the floor under `kvpush bench hooks`.

vLLM calls a connector's hooks on its scheduler and worker main threads every engine step,
whatever they do. On a server whose model forward evicts the caches between two steps
even hooks that return at once cost microseconds per step (the calls, the timer's reads,
the misses), and that cost belongs to vLLM's loop and the machine, not to a connector.
`NullConnector` is that floor measured the same way as the others: every hook returns at
once, and (as kvpush's) it tells vLLM it has no metadata, so vLLM skips the two calls per
attention layer it would make around every forward. What a real connector spends on the
engine loop is its figure less this one's.

It is a benchmark setup (`null`), not a way to run P/D: prefill's `request_finished` hands
back the minimal coordinates the proxy's pull mode expects, decode's connector loads
nothing, and decode computes the whole prompt itself, so answers are right and decode's
steps include the prompt's.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

# What prefill returns for each finished request: enough for `kvpush proxy --mode pull` to
# send the request on to decode, which has nothing to load from it.
NULL_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "null_connector": True}


class NullConnector(KVConnectorBase_V1):
    """Every hook vLLM requires, each returning at once (see the module doc)."""

    # -- worker --
    def has_connector_metadata(self) -> bool:
        return False  # no per-layer wait_for_layer_load / save_kv_layer calls

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # -- scheduler --
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, dict(NULL_PARAMS)
