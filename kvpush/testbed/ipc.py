"""A private directory for each server's IPC socket files, removed when the server stops.

vLLM's processes talk over ZeroMQ IPC sockets it names `<VLLM_RPC_BASE_PATH>/<uuid>` (the
temp dir by default), and libzmq does not unlink a socket's file when it closes, so every
server start leaves half a dozen files in /tmp for good: thousands after a day of tests or
sweeps. Each server a topology starts is given its own `VLLM_RPC_BASE_PATH`, a short
directory under the same base, removed with everything in it when the topology stops; and
a topology that starts removes what runs whose process is gone (killed, not stopped) left.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

PREFIX = "kvpush-rpc-"
# PREFIX, the creating process's pid, "-", mkdtemp's random tail
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-[A-Za-z0-9_]+$")
# AF_UNIX path limit (108 bytes with the NUL) less the "/<uuid4>" vLLM appends
_LONGEST_BASE = 107 - 37


def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one we may not signal counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def base_dir() -> Path:
    """Where vLLM would put its sockets: the operator's VLLM_RPC_BASE_PATH, else the temp dir."""
    return Path(os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir())


def make_rpc_dir(base: Path | None = None) -> Path:
    """A new directory for one server's sockets, under `base` (default `base_dir()`)."""
    base = base or base_dir()
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
    if len(str(path).encode()) > _LONGEST_BASE:
        shutil.rmtree(path, ignore_errors=True)
        raise ValueError(
            f"{base} is too long a directory for vLLM's IPC sockets (a socket path holds at "
            f"most 107 bytes); set VLLM_RPC_BASE_PATH or TMPDIR to a shorter one, e.g. /tmp"
        )
    return path


def remove_stale(base: Path | None = None) -> list[Path]:
    """Remove the socket directories of earlier runs whose process is gone; what was removed."""
    removed = []
    with os.scandir(base or base_dir()) as entries:
        for entry in entries:
            match = _NAME.match(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            if not process_alive(int(match.group(1))):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
    return removed
