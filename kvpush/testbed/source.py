"""Which kvpush code a server runs, and which a measurement measured.

vLLM loads kvpush's connector by module name in every process it starts, from that
process's `sys.path`. A server started as `python -m vllm...` puts its working directory
first there, so a benchmark run from one checkout could measure another checkout's
connector, or a source tree edited between two of its servers' starts. `server_env` puts
the checkout this process imports kvpush from at the head of the servers' PYTHONPATH, and
`code_version` names that code in each result file, with a hash of its source taken when
the run starts, so that results of different code cannot pass for one another.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

import kvpush

PACKAGE = Path(kvpush.__file__).resolve().parent


@functools.cache
def checkout() -> Path | None:
    """The source checkout kvpush is imported from (with its pyproject.toml), or None for
    an installed wheel, whose site-packages is already on every server's path."""
    root = PACKAGE.parent
    return root if (root / "pyproject.toml").is_file() else None


def server_env() -> dict[str, str]:
    """The PYTHONPATH a server needs to import the kvpush this process runs ({} for an
    installed wheel); an inherited PYTHONPATH stays behind it. PYTHONSAFEPATH keeps
    `python -m` from putting the working directory first, where another checkout's
    kvpush (a benchmark of an old commit started from the new one's root) would win."""
    root = checkout()
    if root is None:
        return {}
    inherited = os.environ.get("PYTHONPATH")
    path = os.pathsep.join(p for p in (str(root), inherited) if p)
    return {"PYTHONPATH": path, "PYTHONSAFEPATH": "1"}


def source_hash(package: Path = PACKAGE) -> str:
    """A hash over the name and bytes of every Python file of the package (16 hex digits):
    equal for the same code, whether or not it is committed."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_version() -> dict[str, Any]:
    """The kvpush a run measured: version, source hash, and for a git checkout its commit
    and whether the package differs from it (`dirty`)."""
    out: dict[str, Any] = {"version": kvpush.__version__, "source": source_hash()}
    root = checkout()
    if root is None:
        return out
    commit = _git(root, "rev-parse", "HEAD")
    if commit:
        status = _git(root, "status", "--porcelain", "--", PACKAGE.name)
        out["commit"] = commit[:12]
        out["dirty"] = bool(status) if status is not None else None
    return out


def describe_code(code: dict[str, Any] | None) -> str:
    """One line for a result's `code` ('-' for runs recorded before it was kept)."""
    if not code:
        return "-"
    commit = code.get("commit")
    where = f" at {commit}{' with changes' if code.get('dirty') else ''}" if commit else ""
    return f"kvpush {code.get('version', '?')}{where}, source {code.get('source', '?')}"
