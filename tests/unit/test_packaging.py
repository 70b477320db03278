"""Packaging: the environment checks the connector runs at start."""

from __future__ import annotations

import logging
import sys

import pytest

from kvpush.vllm import preflight
from kvpush.vllm.preflight import ALLOW_ENV, SUPPORTED_VLLM, EnvironmentProblem

# -- what the connector checks when it starts ------------------------------------------


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.3.dev12+g1a2b3c", "v0.32.1"])
def test_supported_vllm_versions_pass(version: str) -> None:
    preflight.check_vllm(version, env={})


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "0.33.0rc1", "1.0", "unknown", ""])
def test_unsupported_vllm_is_one_line_naming_the_range_and_the_escape_hatch(
    version: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(EnvironmentProblem) as refused:
        preflight.check_vllm(version, env={ALLOW_ENV: "0"})
    message = str(refused.value)
    assert "\n" not in message and SUPPORTED_VLLM in message and f"{ALLOW_ENV}=1" in message
    with caplog.at_level(logging.WARNING, logger="kvpush.vllm.preflight"):
        preflight.check_vllm(version, env={ALLOW_ENV: "1"})
    assert "UNSUPPORTED vLLM" in caplog.text and SUPPORTED_VLLM in caplog.text


def test_missing_nixl_is_one_line_naming_pip_install_nixl() -> None:
    def no_nixl(name: str) -> object:
        raise ModuleNotFoundError("No module named 'nixl'\n(more)", name="nixl")

    with pytest.raises(EnvironmentProblem) as refused:
        preflight.check_nixl(no_nixl)
    message = str(refused.value)
    assert "\n" not in message and message.endswith("pip install nixl")
    assert "No module named 'nixl' (more)" in message
    preflight.check_nixl()  # the locked stack has it


def test_resolving_the_connector_runs_the_checks_first(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpush.vllm

    def refuse() -> None:
        raise EnvironmentProblem("no")

    monkeypatch.setattr(preflight, "preflight", refuse)
    monkeypatch.delitem(sys.modules, "kvpush.vllm.connector", raising=False)
    with pytest.raises(EnvironmentProblem):
        kvpush.vllm.KvpushConnector  # noqa: B018
    assert "kvpush.vllm.connector" not in sys.modules, "checked before vLLM's classes load"
