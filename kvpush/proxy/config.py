"""The proxy's settings, checked when made: what `kvpush proxy`'s flags set, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvpush.core.protocol import MODES
from kvpush.proxy import first_token, rewrite
from kvpush.proxy.balance import HealthRules, check_policy
from kvpush.proxy.fleet import Fleet, check_fleet
from kvpush.proxy.rewrite import Backend


@dataclass(slots=True)
class ProxyConfig:
    mode: str
    prefill: list[Backend]
    decode: list[Backend]
    request_timeout: float = 300.0
    connect_timeout: float = 5.0
    api_key: str | None = None  # what clients must send
    backend_api_key: str | None = None  # what the proxy sends its backends (their --api-key)
    max_body_bytes: int = 8 * 1024 * 1024
    policy: str = "least_loaded"  # both roles, unless one has its own below
    prefill_policy: str | None = None
    decode_policy: str | None = None
    retries: int = 1
    health_interval: float = 2.0
    health_timeout: float = 5.0
    eject_after: int = 3
    return_after: int = 2
    scrape_interval: float = 0.0  # 0: do not read the backends' /metrics
    admin_token: str | None = None
    fleet_file: Path | None = None  # re-read when it changes
    access_log: bool = False  # one line per request on the kvpush.proxy.access logger
    first_token: str = "prefill"  # where a streamed answer's first token comes from
    health: HealthRules = field(init=False)
    policies: dict[str, str] = field(init=False)  # role -> policy, as balance.POLICIES spells it

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        check_fleet(self.mode, Fleet(tuple(self.prefill), tuple(self.decode)))
        if self.request_timeout <= 0 or self.connect_timeout <= 0 or self.health_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if self.health_interval <= 0 or self.scrape_interval < 0:
            raise ValueError("--health-interval must be positive and --scrape-interval >= 0")
        if self.first_token not in first_token.SOURCES:
            raise ValueError(f"--first-token must be one of {first_token.SOURCES}")
        if self.retries < 0:
            raise ValueError("--retries must be 0 or more")
        if self.max_body_bytes < 1:
            raise ValueError("--max-body-mb must be above 0")
        if self.backend_api_key is not None and not rewrite.usable_header(self.backend_api_key):
            raise ValueError("--backend-api-key must be printable ASCII (it is sent in a header)")
        self.health = HealthRules(self.eject_after, self.return_after)
        both = check_policy(self.policy)
        self.policies = {
            "prefill": check_policy(self.prefill_policy or both),
            "decode": check_policy(self.decode_policy or both),
        }
