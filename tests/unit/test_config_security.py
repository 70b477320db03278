"""Settings that decide who may talk to a worker: fail closed without a secret, the control
channel's bounds and TLS files, and what `kvpush:info` says about authentication."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpush.dataplane.control import Limits
from kvpush.node.config import KvpushConfig

SECRET_ENV = {"KVPUSH_SECRET": "s3cret-for-tests"}


def test_without_a_secret_the_connector_refuses_to_start_naming_both_fixes() -> None:
    with pytest.raises(ValueError) as refused:
        KvpushConfig.from_extra({"mode": "push"}, env={})
    message = str(refused.value)
    assert "\n" not in message
    assert "set KVPUSH_SECRET to the same value on every prefill and decode" in message
    assert '"insecure": true' in message
    with pytest.raises(ValueError, match="set KV_TOKEN to the same value"):
        KvpushConfig.from_extra({"secret_env": "KV_TOKEN"}, env=SECRET_ENV)
    assert KvpushConfig.from_extra({"secret_env": "KV_TOKEN"}, env={"KV_TOKEN": "x"}).secret == b"x"
    unchecked = KvpushConfig.from_extra({}, env={"KVPUSH_SECRET": ""}, require_secret=False)
    assert unchecked.secret is None


def test_insecure_must_be_said_explicitly_and_a_secret_wins_over_it() -> None:
    config = KvpushConfig.from_extra({"insecure": True}, env={})
    assert config.secret is None and config.insecure
    with pytest.raises(ValueError, match="insecure must be true or false"):
        KvpushConfig.from_extra({"insecure": "yes"}, env={})
    config = KvpushConfig.from_extra({"insecure": True}, env=SECRET_ENV)
    assert config.secret == b"s3cret-for-tests" and not config.insecure


def test_control_limits_are_settings_with_defaults() -> None:
    default = KvpushConfig.from_extra({}, env=SECRET_ENV)
    assert default.control == Limits()
    assert (default.control.greeting_timeout_s, default.control.idle_timeout_s) == (5.0, 600.0)
    assert default.client_idle_s == 300.0
    config = KvpushConfig.from_extra(
        {
            "control_greeting_timeout_s": 2,
            "control_idle_timeout_s": 60,
            "control_max_connections": 64,
            "control_max_connections_per_host": 16,
            "control_max_unauthenticated": 8,
            "control_max_unauthenticated_per_host": 2,
            "control_unauthenticated_frame_bytes": 65536,
        },
        env=SECRET_ENV,
    )
    assert config.control == Limits(
        greeting_timeout_s=2.0,
        idle_timeout_s=60.0,
        max_connections=64,
        max_connections_per_host=16,
        max_unauthenticated=8,
        max_unauthenticated_per_host=2,
        unauthenticated_frame=65536,
    )
    for key, bad in (
        ("control_idle_timeout_s", 0),
        ("control_max_connections", -1),
        ("control_max_connections_per_host", "many"),
        ("control_greeting_timeout_s", True),
    ):
        with pytest.raises(ValueError, match=f"{key} must be a positive"):
            KvpushConfig.from_extra({key: bad}, env=SECRET_ENV)


def test_tls_needs_all_three_files() -> None:
    config = KvpushConfig.from_extra(
        {"tls_cert": "a.crt", "tls_key": "a.key", "tls_ca": "ca.crt"}, env=SECRET_ENV
    )
    assert config.tls and (config.tls_cert, config.tls_key, config.tls_ca) == (
        "a.crt",
        "a.key",
        "ca.crt",
    )
    with pytest.raises(ValueError, match="all of tls_cert, tls_key and tls_ca"):
        KvpushConfig.from_extra({"tls_cert": "a.crt"}, env=SECRET_ENV)
    assert not KvpushConfig.from_extra({}, env=SECRET_ENV).tls


@pytest.mark.parametrize(
    ("extra", "env", "auth"),
    [({}, SECRET_ENV, "on"), ({"insecure": True}, {}, "off")],
)
def test_kvpush_info_says_whether_control_messages_are_authenticated(
    monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any], env: dict[str, str], auth: str
) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvpush.vllm.stats import KvpushPromMetrics

    monkeypatch.delenv("KVPUSH_SECRET", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    registry = prometheus_client.CollectorRegistry()
    types = {
        cls: functools.partial(cls, registry=registry)
        for cls in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)
    }
    transfer = SimpleNamespace(kv_connector_extra_config=extra, kv_role="kv_producer")
    KvpushPromMetrics(SimpleNamespace(kv_transfer_config=transfer), types, ["engine"], {0: ["0"]})
    text = prometheus_client.generate_latest(registry).decode()
    assert (
        f'kvpush:info{{auth="{auth}",engine="0",first_token="-",mode="push",role="prefill"}} 1.0'
        in text
    )


def test_every_testbed_deployment_gets_its_own_secret_on_all_its_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvpush up`, the benchmark and the end-to-end tests start servers through
    `TopologyConfig`: one random secret per deployment, or the operator's."""
    from kvpush.testbed.topology import TopologyConfig, build_specs

    monkeypatch.delenv("KVPUSH_SECRET", raising=False)
    (tmp_path / "config.json").write_text("{}")

    def deployment(**over: Any) -> TopologyConfig:
        return TopologyConfig(model=tmp_path, setup="kvpush-push", n_decode=2, **over)

    first, second = deployment(), deployment()
    assert len(first.secret) == 64 and first.secret != second.secret
    assert first.secret not in repr(first)
    specs = build_specs(first, cores=[0, 1])
    assert {spec.env["KVPUSH_SECRET"] for spec in specs} == {first.secret}
    assert build_specs(first, cores=[0, 1])[0].env["KVPUSH_SECRET"] == first.secret, "restarts"
    mine = deployment(extra_env={"KVPUSH_SECRET": "chosen"})
    assert {spec.env["KVPUSH_SECRET"] for spec in build_specs(mine, cores=[0, 1])} == {"chosen"}
    monkeypatch.setenv("KVPUSH_SECRET", "from-the-operator")
    assert deployment().secret == "from-the-operator"
