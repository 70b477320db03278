"""Which kvpush code the servers run and a result names (`kvpush.testbed.source`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpush.testbed import source


def test_source_hash_tells_edits_apart_and_ignores_other_files(tmp_path: Path) -> None:
    package = tmp_path / "kvpush"
    (package / "node").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "node" / "push.py").write_text("X = 1\n")
    first = source.source_hash(package)
    assert len(first) == 16 and first == source.source_hash(package)
    (package / "README.txt").write_text("not code")
    assert source.source_hash(package) == first
    (package / "node" / "push.py").write_text("X = 2\n")
    edited = source.source_hash(package)
    assert edited != first
    # the same bytes under another name are other code
    (package / "node" / "push.py").rename(package / "node" / "pull.py")
    assert source.source_hash(package) not in (first, edited)


def test_this_checkout_is_named_by_commit_and_hash() -> None:
    code = source.code_version()
    assert code["source"] == source.source_hash()
    root = source.checkout()
    assert root is not None and (root / "kvpush" / "__init__.py").is_file()
    head = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if head.returncode != 0:  # a copy without its history: no commit to name
        assert "commit" not in code
        return
    assert code["commit"] == head.stdout.strip()[:12]
    assert isinstance(code["dirty"], bool)
    line = source.describe_code(code)
    assert line.startswith(f"kvpush {code['version']} at {code['commit']}")
    assert line.endswith(f"source {code['source']}")


def test_describe_code() -> None:
    assert source.describe_code(None) == "-"  # recorded before the code was kept
    code = {"version": "0.1.0", "source": "ab" * 8, "commit": "c" * 12, "dirty": True}
    assert (
        source.describe_code(code) == f"kvpush 0.1.0 at {'c' * 12} with changes, source {'ab' * 8}"
    )
    wheel = {"version": "0.1.0", "source": "ab" * 8}
    assert source.describe_code(wheel) == f"kvpush 0.1.0, source {'ab' * 8}"


def test_servers_import_the_checkout_this_process_runs(monkeypatch: Any, tmp_path: Path) -> None:
    root = source.checkout()
    assert root is not None
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert source.server_env() == {"PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"}
    monkeypatch.setenv("PYTHONPATH", "/opt/extra")
    extra = {"PYTHONPATH": f"{root}{os.pathsep}/opt/extra", "PYTHONSAFEPATH": "1"}
    assert source.server_env() == extra
    # A Python started elsewhere with that environment imports this very package, even
    # from the root of another checkout (which `python -m` would otherwise put first).
    (tmp_path / "kvpush").mkdir()
    (tmp_path / "kvpush" / "__init__.py").write_text("")
    done = subprocess.run(
        [sys.executable, "-c", "import kvpush; print(kvpush.__file__)"],
        cwd=tmp_path,
        env={**os.environ, **source.server_env()},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(done.stdout.strip()).resolve() == source.PACKAGE / "__init__.py"


def test_an_installed_wheel_needs_no_path(monkeypatch: Any, tmp_path: Path) -> None:
    monkeypatch.setattr(source, "checkout", lambda: None)
    assert source.server_env() == {}
    monkeypatch.setattr(source, "PACKAGE", tmp_path / "kvpush")
    (tmp_path / "kvpush").mkdir()
    assert "commit" not in source.code_version()


@pytest.mark.parametrize("dirty", [False, True])
def test_dirty_is_about_the_package_only(tmp_path: Path, monkeypatch: Any, dirty: bool) -> None:
    repo = tmp_path / "repo"
    package = repo / "kvpush"
    package.mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    (package / "__init__.py").write_text("")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    (repo / "notes.md").write_text("a file outside the package")
    if dirty:
        (package / "__init__.py").write_text("X = 1\n")
    monkeypatch.setattr(source, "PACKAGE", package)
    monkeypatch.setattr(source, "checkout", lambda: repo)
    code = source.code_version()
    assert code["dirty"] is dirty and len(code["commit"]) == 12
