"""Each server's IPC socket directory: short, removed when its run is gone, kept while it lives."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.testbed import ipc


@pytest.fixture
def base() -> Iterator[Path]:
    """A short base directory (pytest's tmp_path is too long for a socket path)."""
    path = Path(tempfile.mkdtemp(prefix="kvpt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_servers_directory_is_named_after_this_process_and_holds_sockets(base: Path) -> None:
    path = ipc.make_rpc_dir(base)
    assert path.parent == base and path.name.startswith(f"{ipc.PREFIX}{os.getpid()}-")
    # a socket path as vLLM makes it (base + "/" + uuid4) binds there
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path / "0c4d1f2e-6b7a-4c1d-9e8f-0123456789ab"))
    assert ipc.remove_stale(base) == []  # this process is alive


def test_what_a_dead_run_left_is_removed_and_the_rest_kept(tmp_path: Path) -> None:
    gone = tmp_path / f"{ipc.PREFIX}{dead_pid()}-abc_12"
    gone.mkdir()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(gone / "s"))  # libzmq leaves such files behind
    live = tmp_path / f"{ipc.PREFIX}{os.getpid()}-xyz"
    live.mkdir()
    others = [tmp_path / f"{ipc.PREFIX}notapid-x", tmp_path / "0c4d1f2e-6b7a"]
    for other in others:
        other.mkdir()
    loose = tmp_path / f"{ipc.PREFIX}{dead_pid()}-file"
    loose.write_text("not a directory of ours")
    assert ipc.remove_stale(tmp_path) == [gone]
    assert not gone.exists() and live.exists() and loose.exists()
    assert all(other.exists() for other in others)


def test_a_base_too_long_for_a_socket_path_is_refused_with_the_fix(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    with pytest.raises(ValueError, match="VLLM_RPC_BASE_PATH or TMPDIR"):
        ipc.make_rpc_dir(deep)
    assert list(deep.iterdir()) == []  # nothing left behind


def test_the_base_is_the_operators_vllm_rpc_base_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    assert ipc.base_dir() == tmp_path
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "t"))  # what TMPDIR sets
    assert ipc.base_dir() == tmp_path / "t"
