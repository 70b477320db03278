"""kvpush's settings, read from vLLM's `kv_connector_extra_config` (and the environment).

    --kv-transfer-config '{"kv_connector": "KvpushConnector",
                           "kv_connector_module_path": "kvpush.vllm",
                           "kv_role": "kv_producer", "engine_id": "prefill-0",
                           "kv_connector_extra_config": {"mode": "push"}}'

Every key is optional. The side channel (our control port) defaults to the same variables
vLLM's NIXL connectors use, so operators need to learn nothing new:
VLLM_NIXL_SIDE_CHANNEL_HOST / VLLM_NIXL_SIDE_CHANNEL_PORT (+ the worker's TP rank).
KVPUSH_FAULTS enables test hooks (`kvpush.node.faults`); never set it in production.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kvpush.core.protocol import MODES
from kvpush.node.address import check_advertised
from kvpush.node.faults import ENV as FAULTS_ENV
from kvpush.node.faults import Faults

# vLLM's kv_role -> the side kvpush plays.
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}


@dataclass(frozen=True, slots=True)
class KvpushConfig:
    mode: str = "push"
    # The control port's address advertised to peers (Hello, registrations, pull
    # coordinates) and the one it listens on ("": host); see kvpush.node.address.
    host: str = "127.0.0.1"
    port: int = 5600
    bind_host: str = ""
    # How long a decode waits for prefill's KV before failing the request; also how long
    # prefill may still start a WRITE after a registration arrived, and how long a posted
    # transfer may take before it is cancelled.
    transfer_timeout_s: float = 30.0
    # How long prefill keeps finished blocks for decode: push, for a registration that has
    # not arrived; pull, for a READ (decode renews the lease every lease_s / 2 until done).
    lease_s: float = 30.0
    # After a failed transfer decode reuses its blocks once every prefill rank confirmed
    # that no WRITE can land (or is gone); a rank that stays silent (frozen, partitioned)
    # is waited for until fence_s past the transfer's deadline.
    fence_s: float = 5.0
    # Shared secret that authenticates control messages between instances (None: off).
    secret: bytes | None = None
    backend: str = "UCX"
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"kv_connector_extra_config.mode must be one of {MODES}, got {self.mode!r}"
            )
        if self.transfer_timeout_s <= 0 or self.lease_s <= 0 or self.fence_s < 0:
            raise ValueError(
                "transfer_timeout_s and lease_s must be positive seconds, fence_s not negative"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"side-channel port {self.port} is out of range")
        check_advertised(self.host)

    @property
    def listen_host(self) -> str:
        return self.bind_host or self.host

    @classmethod
    def from_extra(cls, extra: dict[str, Any], env: dict[str, str] | None = None) -> KvpushConfig:
        env = dict(os.environ) if env is None else env
        known = {
            "mode",
            "host",
            "bind_host",
            "port",
            "transfer_timeout_s",
            "lease_s",
            "fence_s",
            "secret_env",
            "backend",
        }
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
            bind_host=str(extra.get("bind_host", "")),
            transfer_timeout_s=float(extra.get("transfer_timeout_s", 30.0)),
            lease_s=float(extra.get("lease_s", 30.0)),
            fence_s=float(extra.get("fence_s", 5.0)),
            secret=secret.encode() if secret else None,
            backend=str(extra.get("backend", "UCX")),
            faults=Faults.parse(env.get(FAULTS_ENV, "")),
        )
