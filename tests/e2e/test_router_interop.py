"""kvpush's pull mode behind vllm-router, a P/D router that kvpush's authors did not write.

vllm-router (Rust; PyPI `vllm-router`, pinned in requirements-router.txt) in P/D mode with
`--kv-connector nixl` sends the prompt to prefill with max_tokens=1 and
`kv_transfer_params: {"do_remote_decode": true, ...}`, then sends the client's request to
decode with the `kv_transfer_params` prefill answered, unchanged. That is all kvpush's pull
mode needs from a router: the coordinates (transfer id, engine, side channel, block ids)
are prefill's own. Here it stands in front of the two vLLM servers of a `kvpush up`
deployment; kvpush's proxy is started by `kvpush up` but never used.

Push mode does not work behind it: push needs the router to choose decode before prefill
runs and to send both legs at once, decode told where prefill lives and both carrying one
transfer id, so that decode registers its blocks for prefill to write into. vllm-router's
nixl mode runs the legs one after the other and passes on only what prefill returned,
which in push mode is nothing. Tried by hand with 0.1.17: the answer is still right, but
decode computes the whole prompt itself (`local_compute`, no `external_kv_transfer`), and
prefill holds the prompt's blocks for a decode that never registers until the lease ends
(`kvpush:failures_total{kind="lease_expired"}`). Push needs kvpush's proxy.

The router comes from the wheelhouse `make setup` fills (no network at test time) and is
installed into a venv of its own (about 3 s).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpush.testbed import scrape
from kvpush.testbed.pinning import OWN_GROUP
from kvpush.testbed.topology import http_ok
from tests.e2e.conftest import (
    BASE_PORT,
    KV_PORT,
    PROMPTS,
    Deployment,
    Reference,
    chat,
    completion,
    launch,
    post,
    post_stream,
    wait_ready,
)

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
WHEELHOUSE = Path(os.environ.get("KVPUSH_WHEELHOUSE", Path(sys.prefix) / "wheelhouse"))
PORT, KV = BASE_PORT + 90, KV_PORT + 90  # clear of the other modules' deployments
ROUTER_PORT, ROUTER_METRICS_PORT = PORT + 1, PORT + 2


def router_args(prefill: str, decode: str) -> list[str]:
    """vllm-router's command line, as README.md gives it."""
    return [
        "--vllm-pd-disaggregation",
        "--kv-connector", "nixl",
        "--prefill", prefill,
        "--decode", decode,
        "--host", "127.0.0.1",
        "--port", str(ROUTER_PORT),
        "--prometheus-port", str(ROUTER_METRICS_PORT),  # its default, 29000, may be taken
    ]  # fmt: skip


def install_router(venv: Path) -> Path:
    """A new venv with vllm-router, from the wheelhouse only; returns the binary."""
    if not any(WHEELHOUSE.glob("vllm_router-*.whl")):
        pytest.fail(
            f"no vllm-router wheel in {WHEELHOUSE}: `make setup` downloads it "
            f"(remove {sys.prefix}/.kvpush-setup-* to make it run again)"
        )
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    pip = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "-q"]
    done = subprocess.run(
        [*pip, "--python", venv / "bin" / "python", "install", "--no-compile", "--no-index",
         "--find-links", WHEELHOUSE, "-c", REPO / "requirements.lock",
         "-r", REPO / "requirements-router.txt"],
        capture_output=True, text=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull},
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"installing vllm-router from {WHEELHOUSE} failed:\n{done.stderr}")
    return venv / "bin" / "vllm-router"


@contextlib.contextmanager
def running_router(binary: Path, deployment: Deployment, log: Path) -> Iterator[str]:
    """vllm-router in front of the deployment's servers; yields its URL."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, *router_args(deployment.prefill, deployment.decode)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            **OWN_GROUP,
        )
    url = f"http://127.0.0.1:{ROUTER_PORT}"
    try:
        deadline = time.monotonic() + 60
        while not http_ok(url + "/readiness"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vllm-router did not get ready:\n{log.read_text()[-4000:]}")
            time.sleep(0.3)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass(frozen=True)
class Routed:
    deployment: Deployment
    router: str
    model: Path

    def ask(self, path: str, body: dict[str, Any]) -> tuple[Any, float]:
        """POST through the router; the answer and how many prompt tokens decode read."""
        before = self.external_tokens()
        answer = post(self.router + path, body)
        return answer, self.external_tokens() - before

    def external_tokens(self) -> float:
        return self.deployment.external_tokens()


@pytest.fixture(scope="session")  # before the session's `reference`
def vllm_router(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_router(tmp_path_factory.mktemp("router-venv"))


@pytest.fixture(scope="module")
def routed(
    vllm_router: Path,
    tiny_model: Path,
    reference: Reference,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Routed]:
    # The router first, so that a wheelhouse without it fails at once; then `reference`:
    # the single server must be gone before the pair starts.
    work = tmp_path_factory.mktemp("router")
    deployment = wait_ready(launch("kvpush-pull", tiny_model, work, port=PORT, kv_port=KV))
    try:
        with running_router(vllm_router, deployment, work / "vllm-router.log") as url:
            yield Routed(deployment, url, tiny_model)
    finally:
        deployment.stop()


def test_completions_equal_single_server_and_decode_reads_the_prompt(
    routed: Routed, reference: Reference
) -> None:
    for prompt in PROMPTS:
        answer, read = routed.ask("/v1/completions", completion(routed.model, prompt))
        assert answer["choices"][0]["text"] == reference.completions[prompt], prompt
        assert read == answer["usage"]["prompt_tokens"] > 0, prompt


def test_streaming_completion_equals_single_server(routed: Routed, reference: Reference) -> None:
    prompt = PROMPTS[1]
    text = post_stream(routed.router + "/v1/completions", completion(routed.model, prompt))
    assert text == reference.completions[prompt]


def test_chat_equals_single_server(routed: Routed, reference: Reference) -> None:
    answer, read = routed.ask("/v1/chat/completions", chat(routed.model))
    assert answer["choices"][0]["message"]["content"] == reference.chat
    assert read == answer["usage"]["prompt_tokens"] > 0
    assert post_stream(routed.router + "/v1/chat/completions", chat(routed.model)) == reference.chat


def test_kvpush_reports_no_failures(routed: Routed) -> None:
    prefill = scrape.scrape(routed.deployment.prefill)
    decode = scrape.scrape(routed.deployment.decode)
    # decode READ for each of the six requests the tests above sent through the router
    assert scrape.total(decode, "kvpush:read_seconds_count") >= len(PROMPTS) + 3
    for side in (prefill, decode):
        assert scrape.total(side, "kvpush:failures_total") == 0
