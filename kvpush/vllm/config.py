"""kvpush's settings, read from vLLM's `kv_connector_extra_config` (and the environment).

    --kv-transfer-config '{"kv_connector": "KvpushConnector",
                           "kv_connector_module_path": "kvpush.vllm",
                           "kv_role": "kv_producer", "engine_id": "prefill-0",
                           "kv_connector_extra_config": {"mode": "push"}}'

Every key is optional. The side channel (our control port) defaults to the same variables
vLLM's NIXL connectors use, so operators need to learn nothing new:
VLLM_NIXL_SIDE_CHANNEL_HOST / VLLM_NIXL_SIDE_CHANNEL_PORT (+ the worker's TP rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

MODES = ("push", "pull")
# vLLM's kv_role -> the side kvpush plays.
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}


@dataclass(frozen=True, slots=True)
class KvpushConfig:
    mode: str = "push"
    host: str = "127.0.0.1"
    port: int = 5600
    # How long a decode waits for prefill's KV before failing the request.
    transfer_timeout_s: float = 30.0
    # How long prefill keeps finished blocks for decode: push, for a registration that has
    # not arrived; pull, for a READ (decode renews the lease every lease_s / 2 until done).
    lease_s: float = 30.0
    # Shared secret that authenticates control messages between instances (None: off).
    secret: bytes | None = None
    backend: str = "UCX"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"kv_connector_extra_config.mode must be one of {MODES}, got {self.mode!r}"
            )
        if self.transfer_timeout_s <= 0 or self.lease_s <= 0:
            raise ValueError("transfer_timeout_s and lease_s must be positive seconds")
        if not 0 < self.port < 65536:
            raise ValueError(f"side-channel port {self.port} is out of range")

    @classmethod
    def from_extra(cls, extra: dict[str, Any], env: dict[str, str] | None = None) -> KvpushConfig:
        env = dict(os.environ) if env is None else env
        known = {"mode", "host", "port", "transfer_timeout_s", "lease_s", "secret_env", "backend"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}; kvpush knows {sorted(known)}"
            )
        secret_env = str(extra.get("secret_env", "KVPUSH_SECRET"))
        secret = env.get(secret_env) or None
        return cls(
            mode=str(extra.get("mode", "push")),
            host=str(extra.get("host", env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"))),
            port=int(extra.get("port", env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))),
            transfer_timeout_s=float(extra.get("transfer_timeout_s", 30.0)),
            lease_s=float(extra.get("lease_s", 30.0)),
            secret=secret.encode() if secret else None,
            backend=str(extra.get("backend", "UCX")),
        )
