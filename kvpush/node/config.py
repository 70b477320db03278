"""kvpush's settings, read from vLLM's `kv_connector_extra_config` (and the environment).

    --kv-transfer-config '{"kv_connector": "KvpushConnector",
                           "kv_connector_module_path": "kvpush.vllm",
                           "kv_role": "kv_producer", "engine_id": "prefill-0",
                           "kv_connector_extra_config": {"mode": "push"}}'

Every key is optional. The side channel (our control port) defaults to the same variables
vLLM's NIXL connectors use, so operators need to learn nothing new:
VLLM_NIXL_SIDE_CHANNEL_HOST / VLLM_NIXL_SIDE_CHANNEL_PORT (+ the worker's TP rank).
KVPUSH_FAULTS enables test hooks (`kvpush.node.faults`); never set it in production.

Fail closed: `from_extra` refuses a configuration without a shared secret (KVPUSH_SECRET,
or the variable `secret_env` names) unless `insecure: true` says so explicitly. The
`control_*` keys bound the control channel (`kvpush.dataplane.control.Limits`), the
`tls_*` keys put it inside mutual TLS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kvpush.core.protocol import MODES
from kvpush.dataplane.control import Limits
from kvpush.dataplane.threads import POLICIES
from kvpush.node.address import check_advertised
from kvpush.node.faults import ENV as FAULTS_ENV
from kvpush.node.faults import Faults

# vLLM's kv_role -> the side kvpush plays.
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}
# kv_connector_extra_config key -> (Limits field, type) of the control channel's bounds.
CONTROL_LIMITS: dict[str, tuple[str, type]] = {
    "control_greeting_timeout_s": ("greeting_timeout_s", float),
    "control_idle_timeout_s": ("idle_timeout_s", float),
    "control_max_connections": ("max_connections", int),
    "control_max_connections_per_host": ("max_connections_per_host", int),
    "control_max_unauthenticated": ("max_unauthenticated", int),
    "control_max_unauthenticated_per_host": ("max_unauthenticated_per_host", int),
    "control_unauthenticated_frame_bytes": ("unauthenticated_frame", int),
}
TLS_KEYS = ("tls_cert", "tls_key", "tls_ca")


@dataclass(frozen=True, slots=True)
class KvpushConfig:
    mode: str = "push"
    # The control port's address advertised to peers (Hello, registrations, pull
    # coordinates) and the one it listens on ("": host); see kvpush.node.address.
    host: str = "127.0.0.1"
    port: int = 5600
    bind_host: str = ""
    # How long a posted transfer (push's WRITE, pull's READ) may take before it is
    # cancelled; pull: how long decode waits for prefill's KV once it has blocks (prefill
    # finished before decode got the request); a handshake's budget.
    transfer_timeout_s: float = 30.0
    # Push: how long decode waits for prefill's KV after it allocated the blocks and
    # registered them, which covers prefill's queue and forward as well as the WRITE; also
    # how long prefill keeps a registration and may still start its WRITE. A request that
    # waits behind others on a busy prefill must not fail for that alone, so this is the
    # proxy's default request timeout, not the transfer's.
    prefill_timeout_s: float = 300.0
    # How long prefill keeps finished blocks for decode: push, for a registration that has
    # not arrived; pull, for a READ (decode renews the lease every lease_s / 2 until done).
    lease_s: float = 30.0
    # After a failed transfer decode reuses its blocks once every prefill rank confirmed
    # that no WRITE can land (or is gone); a rank that stays silent (frozen, partitioned)
    # is waited for until fence_s past the transfer's deadline.
    fence_s: float = 5.0
    # Shared secret that authenticates control messages between instances (None: off,
    # which `from_extra` allows only with insecure=True).
    secret: bytes | None = None
    insecure: bool = False
    backend: str = "UCX"
    faults: Faults = field(default_factory=Faults)
    # Bounds on the control channel: greeting and idle deadlines, connection counts.
    control: Limits = field(default_factory=Limits)
    # Mutual TLS for the control channel: this node's certificate and key, and the CA
    # that signed every peer's (all three or none).
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # How kvpush's threads share a core with the engine loop (kvpush.dataplane.threads):
    # "normal" (the OS's default) or "batch" (Linux SCHED_BATCH: waking them never
    # preempts vLLM's threads).
    thread_policy: str = "normal"
    # Decode, after a prefix-cache hit: an uncached prompt tail of at most this many tokens
    # is computed by decode itself, as one server would; a longer one comes from prefill.
    # In tokens, not blocks: a full hit leaves up to a block (128 tokens on vLLM's CPU
    # backend, 16-64 on GPUs), too long to compute inside decode's batch.
    local_tail_tokens: int = 16

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"kv_connector_extra_config.mode must be one of {MODES}, got {self.mode!r}"
            )
        if (
            self.transfer_timeout_s <= 0
            or self.prefill_timeout_s <= 0
            or self.lease_s <= 0
            or self.fence_s < 0
        ):
            raise ValueError(
                "transfer_timeout_s, prefill_timeout_s and lease_s must be positive seconds, "
                "fence_s not negative"
            )
        if self.thread_policy not in POLICIES:
            raise ValueError(
                f"kv_connector_extra_config.thread_policy must be one of {POLICIES}, "
                f"got {self.thread_policy!r}"
            )
        if self.local_tail_tokens < 0:
            raise _tail_error(self.local_tail_tokens)
        if not 0 < self.port < 65536:
            raise ValueError(f"side-channel port {self.port} is out of range")
        check_advertised(self.host)
        tls = [bool(getattr(self, key)) for key in TLS_KEYS]
        if any(tls) and not all(tls):
            raise ValueError(
                "kv_connector_extra_config: set all of tls_cert, tls_key and tls_ca for TLS on "
                "the control channel, or none"
            )

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def client_idle_s(self) -> float:
        """A control client replaces a connection unused this long, so that a peer with
        the same idle timeout never closes it under a frame in flight."""
        return self.control.idle_timeout_s / 2

    @property
    def listen_host(self) -> str:
        return self.bind_host or self.host

    @classmethod
    def from_extra(
        cls,
        extra: dict[str, Any],
        env: dict[str, str] | None = None,
        require_secret: bool = True,
    ) -> KvpushConfig:
        """The settings from vLLM's `kv_connector_extra_config` and `env` (default: the
        process environment). Without a secret and without `insecure: true` it raises,
        unless `require_secret` is False (for reading the settings, not for running)."""
        env = dict(os.environ) if env is None else env
        known = {
            "mode",
            "host",
            "bind_host",
            "port",
            "transfer_timeout_s",
            "prefill_timeout_s",
            "lease_s",
            "fence_s",
            "secret_env",
            "insecure",
            "backend",
            "thread_policy",
            "local_tail_tokens",
            *CONTROL_LIMITS,
            *TLS_KEYS,
        }
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}; kvpush knows {sorted(known)}"
            )
        secret_env = str(extra.get("secret_env", "KVPUSH_SECRET"))
        secret = env.get(secret_env) or None
        insecure = extra.get("insecure", False)
        if not isinstance(insecure, bool):
            raise ValueError(
                f"kv_connector_extra_config.insecure must be true or false, got {insecure!r}"
            )
        limits: dict[str, Any] = {}
        for key, (name, kind) in CONTROL_LIMITS.items():
            if key not in extra:
                continue
            value = extra[key]
            try:
                limits[name] = kind(value)
                ok = not isinstance(value, bool) and limits[name] > 0
            except (TypeError, ValueError):
                ok = False
            if not ok:
                what = "seconds" if kind is float else "integer"
                raise ValueError(
                    f"kv_connector_extra_config.{key} must be a positive {what}, got {value!r}"
                )
        tail = extra.get("local_tail_tokens", 16)
        if isinstance(tail, bool) or not isinstance(tail, int):
            raise _tail_error(tail)
        config = cls(
            mode=str(extra.get("mode", "push")),
            host=str(extra.get("host", env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"))),
            port=int(extra.get("port", env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))),
            bind_host=str(extra.get("bind_host", "")),
            transfer_timeout_s=float(extra.get("transfer_timeout_s", 30.0)),
            prefill_timeout_s=float(extra.get("prefill_timeout_s", 300.0)),
            lease_s=float(extra.get("lease_s", 30.0)),
            fence_s=float(extra.get("fence_s", 5.0)),
            secret=secret.encode() if secret else None,
            insecure=insecure and secret is None,
            backend=str(extra.get("backend", "UCX")),
            thread_policy=str(extra.get("thread_policy", "normal")),
            local_tail_tokens=tail,
            faults=Faults.parse(env.get(FAULTS_ENV, "")),
            control=Limits(**limits),
            **{key: str(extra.get(key, "")) for key in TLS_KEYS},
        )
        if secret is None and not insecure and require_secret:
            raise ValueError(
                f"kvpush refuses to start without a shared secret: set {secret_env} to the same "
                "value on every prefill and decode (e.g. from `openssl rand -hex 32`; "
                "kv_connector_extra_config.secret_env names another variable), or set "
                '"insecure": true in kv_connector_extra_config for a private test network'
            )
        return config


def _tail_error(value: object) -> ValueError:
    return ValueError(
        "kv_connector_extra_config.local_tail_tokens must be a whole number of tokens, 0 or "
        f"more (how long an uncached prompt tail decode computes itself), got {value!r}"
    )
