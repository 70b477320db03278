"""kvpush as a user gets it: the wheel, installed into fresh venvs without the lock file.

The wheel is built from a copy of the sources (`pip wheel`, build backend from the
wheelhouse), and each test installs it into a new venv of the base Python with pip, from
the wheelhouse only: `make setup` fills `$VENV/wheelhouse` (or $KVPUSH_WHEELHOUSE) with the
wheels of kvpush's declared dependencies at the lock's versions, and pip runs with no
index and no pip configuration, so a dependency pyproject.toml does not declare is missing
here as it would be for a user. Nothing reaches the network; the proxy listens on loopback.
The pip doing the installing is this venv's (`pip --python`), which saves seeding each new
venv with its own.

- `pip install kvpush` brings exactly msgpack and numpy, answers `--version`, and a tool
  whose extra is missing says which extra to install, in one line.
- `pip install 'kvpush[proxy]'`: `kvpush proxy --help`, and the proxy serves /metrics.
- The connector in an existing vLLM environment. vLLM, torch and NIXL are not installed
  from the wheelhouse (they are the CPU builds the lock pins): the new venv sees this
  venv's site-packages through a path line in a .pth file, as an operator's venv already
  has vLLM, torch and NIXL (and their dependencies) when kvpush is added to it. A path line
  runs none of the .pth files it adds, so this venv's editable kvpush stays off, and the
  test checks that kvpush, its entry point and the connector all come from the new venv.
  There vLLM's own plugin loader registers "KvpushConnector" and vLLM's connector factory
  resolves it, with and without kv_connector_module_path.

Marked `install` (35-60 s on 2 busy cores): `pytest -m "not install"` leaves it out.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvpush

pytestmark = pytest.mark.install

REPO = Path(__file__).resolve().parents[2]
WHEELHOUSE = Path(os.environ.get("KVPUSH_WHEELHOUSE", Path(sys.prefix) / "wheelhouse"))
VERSION_LINE = f"kvpush {kvpush.__version__} "


def clean_env() -> dict[str, str]:
    """This environment without what would let a subprocess see more than its venv."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_PLUGINS")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf: no index, find-links or constraints
    return env


def run(*args: str | Path, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=clean_env(), capture_output=True, text=True
    )
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr}")
    return done


def pip(*args: str | Path, cwd: Path) -> None:
    pip_args = ("-m", "pip", "--isolated", "--disable-pip-version-check", "-q")
    run(sys.executable, *pip_args, *args, "--no-index", "--find-links", WHEELHOUSE, cwd=cwd)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if not any(WHEELHOUSE.glob("*.whl")):
        pytest.fail(
            f"no wheels in {WHEELHOUSE}: `make setup` downloads them "
            f"(remove {sys.prefix}/.kvpush-setup-* to make it run again)"
        )
    work = tmp_path_factory.mktemp("build")
    source = work / "src"  # a copy, so the build leaves nothing in the checkout
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "kvpush", source / "kvpush", ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    pip("wheel", "--no-deps", "-w", work / "dist", source, cwd=work)
    (built,) = (work / "dist").glob("kvpush-*.whl")
    yield built


def new_venv(where: Path, see: list[Path] | None = None) -> Path:
    """A venv of the base Python; `see`: directories it finds packages in after its own."""
    run(sys.executable, "-m", "venv", "--without-pip", where, cwd=where.parent)
    python = where / "bin" / "python"
    if see:
        purelib = run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=where
        ).stdout.strip()
        (Path(purelib) / "existing-vllm-env.pth").write_text("".join(f"{p}\n" for p in see))
    return python


def install(python: Path, *what: str | Path) -> None:
    pip("--python", python, "install", "--no-compile", *what, cwd=python.parents[2])


def test_base_install_is_the_connector_needs_and_names_missing_extras(
    wheel: Path, tmp_path: Path
) -> None:
    python = new_venv(tmp_path / "venv")
    install(python, wheel)
    listing = "import importlib.metadata as m; print(sorted(d.name for d in m.distributions()))"
    names = run(python, "-c", listing, cwd=tmp_path).stdout
    assert names.strip() == "['kvpush', 'msgpack', 'numpy']"

    kvpush_cli = tmp_path / "venv" / "bin" / "kvpush"
    assert run(kvpush_cli, "--version", cwd=tmp_path).stdout.startswith(VERSION_LINE)
    for command in (["proxy", "--mode", "pull"], ["proxy", "bench"], ["model", "tiny", "m"]):
        done = run(kvpush_cli, *command, cwd=tmp_path, check=False)
        assert done.returncode == 1 and done.stdout == "", done.stderr
        extra = "proxy" if command[0] == "proxy" else "testbed"
        assert done.stderr.count("\n") == 1 and f"pip install 'kvpush[{extra}]'" in done.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_proxy_extra_runs_the_proxy(wheel: Path, tmp_path: Path) -> None:
    python = new_venv(tmp_path / "venv")
    install(python, f"kvpush[proxy] @ {wheel.as_uri()}")
    kvpush_cli = tmp_path / "venv" / "bin" / "kvpush"
    assert "--mode" in run(kvpush_cli, "proxy", "--help", cwd=tmp_path).stdout

    port = free_port()
    backends = ("--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9")
    args = [str(kvpush_cli), "proxy", "--mode", "pull", *backends, "--port", str(port)]
    proxy = subprocess.Popen(args, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout is not None
        assert "listening on" in proxy.stdout.readline()
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    assert r.status == 200 and b"kvpush_proxy_requests" in r.read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        proxy.terminate()
        assert proxy.wait(timeout=10) == 0


CONNECTOR_CHECK = """
import importlib.metadata as md, json, sys
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

load_general_plugins()
by_name = KVConnectorFactory.get_connector_class(
    KVTransferConfig(kv_connector="KvpushConnector", kv_role="kv_producer"))
by_path = KVConnectorFactory.get_connector_class(KVTransferConfig(
    kv_connector="KvpushConnector", kv_connector_module_path="kvpush.vllm", kv_role="kv_consumer"))
(plugin,) = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "kvpush"]
print(json.dumps({
    "class": f"{by_name.__module__}.{by_name.__qualname__}",
    "same": by_name is by_path,
    "module_file": sys.modules[by_name.__module__].__file__,
    "plugin": plugin.value,
    "plugin_dist": str(plugin.dist.locate_file("")),
}))
"""


def test_connector_in_an_existing_vllm_environment(wheel: Path, tmp_path: Path) -> None:
    paths = sysconfig.get_paths()
    existing = sorted({Path(paths["purelib"]), Path(paths["platlib"])})
    python = new_venv(tmp_path / "venv", see=existing)
    # pip sees this venv's editable kvpush too; it installs the wheel here all the same and
    # leaves that one alone ("outside environment"). Its dependencies are already there.
    install(python, wheel)

    done = run(python, "-c", CONNECTOR_CHECK, cwd=tmp_path)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    venv = str(tmp_path / "venv")
    assert found["class"] == "kvpush.vllm.connector.KvpushConnector" and found["same"]
    assert found["plugin"] == "kvpush.vllm.plugin:register"
    assert found["module_file"].startswith(venv) and found["plugin_dist"].startswith(venv)
