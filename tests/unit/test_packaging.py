"""Packaging: extras vs. imports, the version, the CLI's one-line hints, the environment
checks the connector runs at start, and the vLLM plugin.

The built wheel in a fresh venv is tests/install/test_wheel.py.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import json
import logging
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import kvpush
from kvpush import cli, extras
from kvpush.vllm import plugin, preflight
from kvpush.vllm.preflight import ALLOW_ENV, SUPPORTED_VLLM, EnvironmentProblem

REPO = Path(__file__).resolve().parents[2]
FIND_SPEC = importlib.util.find_spec
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def requirement(text: str) -> tuple[str, list[str]]:
    """("kvpush", ["proxy"]) for "kvpush[proxy]"; ("uvloop", []) for "uvloop; marker"."""
    match = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?", text)
    assert match is not None, text
    wanted = [e.strip() for e in (match.group(2) or "").split(",") if e.strip()]
    return normalise(match.group(1)), wanted


# -- what pip installs ----------------------------------------------------------------


def test_dependencies_and_extras_match_the_table_the_cli_uses() -> None:
    assert sorted(normalise(requirement(r)[0]) for r in PYPROJECT["dependencies"]) == sorted(
        extras.BASE
    )
    declared = PYPROJECT["optional-dependencies"]
    assert set(declared) == set(extras.EXTRAS) | set(extras.INCLUDES)
    for extra, requirements in declared.items():
        own, included = set(), set()
        for text in requirements:
            name, wanted = requirement(text)
            if name == "kvpush":
                included |= set(wanted)
            else:
                own.add(name)
        assert own == set(extras.EXTRAS.get(extra, ())), extra
        assert included == set(extras.INCLUDES.get(extra, ())), extra
    assert extras.modules("all") == {m for mods in extras.EXTRAS.values() for m in mods}


@functools.cache
def third_party_imports() -> dict[str, set[str]]:
    """Top-level modules imported anywhere in the package -> the files importing them."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "kvpush").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names = [node.args[0].value]
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top not in ("kvpush", "__future__"):
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_third_party_import_is_declared_or_comes_with_vllm() -> None:
    imported = third_party_imports()
    assert {"vllm", "msgpack", "aiohttp", "prometheus_client"} <= set(imported)  # the scan works
    known = set(extras.BASE) | extras.modules("all") | set(extras.ENVIRONMENT)
    undeclared = {name: files for name, files in imported.items() if name not in known}
    assert not undeclared, f"add these to pyproject.toml and kvpush/extras.py: {undeclared}"


def test_the_connector_imports_only_the_base_and_the_vllm_environment() -> None:
    imported = third_party_imports()
    connector_side = ("kvpush/vllm/", "kvpush/core/", "kvpush/dataplane/")
    for name, files in imported.items():
        if any(f.startswith(connector_side) for f in files):
            assert name in extras.BASE or name in extras.ENVIRONMENT, (name, files)


def test_one_version_source() -> None:
    assert "version" in PYPROJECT["dynamic"] and "version" not in PYPROJECT
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["dynamic"]["version"] == {"attr": "kvpush.__version__"}


def test_readme_states_the_supported_vllm_and_the_install_line() -> None:
    readme = (REPO / "README.md").read_text()
    assert f"vLLM {SUPPORTED_VLLM}" in readme and ALLOW_ENV in readme
    assert "pip install '.[proxy]'" in readme and "pip install nixl" in readme


# -- the command line ------------------------------------------------------------------


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    version = f"kvpush {kvpush.__version__} (supports vLLM {SUPPORTED_VLLM})\n"
    assert capsys.readouterr().out == version


def hide(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make `find_spec` report `names` as not installed."""

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name in names else FIND_SPEC(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_a_command_without_its_extra_says_which_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hide(monkeypatch, "prometheus_client")
    assert cli.main(["proxy", "--mode", "pull"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "kvpush proxy: needs the 'proxy' extra (missing prometheus_client): "
        "pip install 'kvpush[proxy]'\n"
    )
    hide(monkeypatch, "aiohttp", "transformers")
    assert cli.main(["up", "--connector", "vllm-pull", "--model", "m"]) == 1
    err = capsys.readouterr().err
    assert "(missing aiohttp, transformers): pip install 'kvpush[testbed]'" in err


@pytest.mark.parametrize(
    ("command", "missing", "hint"),
    [
        ("plan", "matplotlib", "kvpush plan: needs the 'bench' extra (missing matplotlib): "),
        ("plan", "aiohttp", "pip install 'kvpush[bench]'"),
        (None, "aiohttp", "kvpush: needs the 'proxy' extra (missing aiohttp)"),
        (
            "up",
            "prometheus_client.core",
            "(missing prometheus_client): pip install 'kvpush[testbed]'",
        ),
        ("bench", "vllm", "kvpush bench: needs vLLM, which kvpush does not install"),
        ("model", "torch", "kvpush model: needs torch, which kvpush does not install"),
        ("plan", "nixl", "kvpush plan: needs NIXL: pip install nixl (no module 'nixl')"),
        ("plan", "msgpack", "kvpush plan: kvpush's own dependency 'msgpack' is missing"),
        ("plan", "vllm.v1.nowhere", "has no module 'vllm.v1.nowhere'; kvpush supports vLLM >="),
    ],
)
def test_missing_module_hints(command: str | None, missing: str, hint: str) -> None:
    text = extras.missing_module_hint(command, ModuleNotFoundError(name=missing))
    assert text is not None and hint in text and "\n" not in text


@pytest.mark.parametrize("missing", ["cbor2", "torch._nowhere", None])
def test_modules_kvpush_does_not_know_get_no_hint(missing: str | None) -> None:
    assert extras.missing_module_hint("plan", ModuleNotFoundError(name=missing)) is None


def test_a_module_missing_while_running_is_one_line_else_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpush.plan import cli as plan_cli

    def run_plan(args: Any, name: str = "matplotlib") -> int:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(plan_cli, "run_plan", run_plan)
    assert cli.main(["plan"]) == 1
    assert capsys.readouterr().err == (
        "kvpush plan: needs the 'bench' extra (missing matplotlib): pip install 'kvpush[bench]'\n"
    )
    monkeypatch.setattr(plan_cli, "run_plan", lambda args: run_plan(args, "cbor2"))
    with pytest.raises(ModuleNotFoundError):
        cli.main(["plan"])


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


# -- the vLLM plugin -------------------------------------------------------------------


def test_the_plugin_is_declared_for_vllm() -> None:
    target = PYPROJECT["entry-points"]["vllm.general_plugins"]["kvpush"]
    assert target == "kvpush.vllm.plugin:register"
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is plugin.register


def test_plugin_registers_the_connector_with_vllms_factory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvpush.vllm.connector import KvpushConnector

    # A copy of vLLM's registry for this test, so the registration does not outlive it.
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    by_name = KVTransferConfig(kv_connector="KvpushConnector", kv_role="kv_producer")
    with pytest.raises(ValueError, match="Unsupported connector type"):
        KVConnectorFactory.get_connector_class(by_name)

    plugin.register()
    plugin.register()  # vLLM refuses a second registration; the plugin must not fail
    assert KVConnectorFactory.get_connector_class(by_name) is KvpushConnector
    by_path = KVTransferConfig(
        kv_connector="KvpushConnector",
        kv_connector_module_path="kvpush.vllm",
        kv_role="kv_producer",
    )
    assert KVConnectorFactory.get_connector_class(by_path) is KvpushConnector


# A fresh interpreter reports whether it may use the AMX tile state (Linux's
# ARCH_GET_XCOMP_PERM, bit 18: XTILEDATA), before and after the plugin's register().
_TILE_STATE = """
import ctypes, json, platform, sys
libc = ctypes.CDLL(None, use_errno=True)

def tiles():
    mask = ctypes.c_ulong(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0  # arch_prctl, GET_XCOMP_PERM
    return bool(mask.value >> 18 & 1)

before = tiles()
from kvpush.vllm import plugin
plugin.register()
print(json.dumps([before, tiles()]))
"""


def _amx_cpu() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_tile" in flags


@pytest.mark.skipif(
    not (sys.platform == "linux" and platform.machine() == "x86_64" and _amx_cpu()),
    reason="needs Linux on a CPU with AMX tiles",
)
def test_plugin_gives_each_vllm_process_the_amx_tile_state_its_attention_needs() -> None:
    # vLLM's CPU attention runs AMX tile instructions and never asks for the state: a
    # process that has not asked dies of SIGILL on its first eager forward.
    out = subprocess.run(
        [sys.executable, "-c", _TILE_STATE], capture_output=True, text=True, timeout=120,
        cwd=REPO, check=True,
    ).stdout  # fmt: skip
    before, after = json.loads(out.strip().splitlines()[-1])
    assert (before, after) == (False, True)
