"""Which backends serve each role: checked the same way from the command line, a fleet file
and the admin API, so every way in gives the same errors.

A fleet file lists backends in the command line's syntax, as JSON or TOML (by suffix):

    # fleet.toml
    prefill = ["http://10.0.0.1:8100,engine=prefill-0,kv=10.0.0.1:5600,tp=8"]
    decode = ["http://10.0.0.2:8200", "http://10.0.0.3:8200"]

The proxy re-reads it when it changes; the pools then become the file's lists (backends
no longer listed stop getting new requests and finish the ones they have).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.proxy.rewrite import Backend, parse_backend

ROLES = ("prefill", "decode")
PUSH_PREFILL_SYNTAX = "URL,engine=ID,kv=HOST:PORT[,tp=N][,pp=N][,dp=N]"
EXAMPLE = '{"prefill": ["http://10.0.0.1:8100,engine=prefill-0,kv=10.0.0.1:5600"], "decode": ["http://10.0.0.2:8200"]}'


@dataclass(frozen=True, slots=True)
class Fleet:
    prefill: tuple[Backend, ...]
    decode: tuple[Backend, ...]

    def of(self, role: str) -> tuple[Backend, ...]:
        return self.prefill if role == "prefill" else self.decode


def check_role(role: Any) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    return str(role)


def check_backend(mode: str, role: str, backend: Backend) -> Backend:
    """Refuse a backend this mode cannot use; the message says how to write it."""
    if mode == "push" and role == "prefill" and not backend.has_kv_coordinates:
        raise ValueError(
            f"push mode needs KV coordinates for every prefill backend ({backend.url}): "
            f"write it as {PUSH_PREFILL_SYNTAX}"
        )
    return backend


def check_fleet(mode: str, fleet: Fleet) -> Fleet:
    if not fleet.prefill or not fleet.decode:
        raise ValueError("the proxy needs at least one prefill and one decode backend")
    for role in ROLES:
        seen: set[str] = set()
        for backend in fleet.of(role):
            check_backend(mode, role, backend)
            if backend.url in seen:
                raise ValueError(f"{role} backend {backend.url} is listed twice")
            seen.add(backend.url)
    return fleet


def read_fleet(path: Path) -> Fleet:
    """Parse a fleet file (JSON or TOML by suffix); errors name the file and what to fix."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read fleet file {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON (name it .toml for TOML)"
        raise ValueError(f"fleet file {path} is not valid {kind}: {exc}") from None
    if not isinstance(data, dict) or set(data) - set(ROLES):
        raise ValueError(
            f"fleet file {path}: expected only 'prefill' and 'decode' lists, e.g. {EXAMPLE}"
        )
    lists: dict[str, tuple[Backend, ...]] = {}
    for role in ROLES:
        specs = data.get(role, [])
        if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
            raise ValueError(
                f"fleet file {path}: {role!r} must be a list of backend strings, e.g. {EXAMPLE}"
            )
        try:
            lists[role] = tuple(parse_backend(s) for s in specs)
        except ValueError as exc:
            raise ValueError(f"fleet file {path}: {exc}") from None
    return Fleet(lists["prefill"], lists["decode"])
