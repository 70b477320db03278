"""vLLM's `kv_load_failure_policy: recompute` with kvpush: a transfer that fails becomes a
slower answer, computed by decode, instead of an error.

One deployment per mode and model (`kvpush up --kv-load-failure-policy recompute`, with
the test hooks on): the e2e model, and one whose layers alternate sliding-window and full
attention (two KV cache groups, whose failed loads vLLM takes by request). A transfer
failed on purpose - NIXL's error state on the WRITE (push) or READ (pull), a registration
prefill never got (push) - must still be answered, as the same request is answered when
nothing fails, streamed and not; decode counts the failure, and both servers' KV is free
afterwards. Safe because kvpush reports a failed transfer to vLLM only once no WRITE can
land in its blocks any more.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpush.testbed import scrape
from kvpush.testbed.model import TinyModelSpec, ensure_tiny_model
from tests.e2e.conftest import (
    BASE_PORT,
    KV_PORT,
    PROMPTS,
    Deployment,
    kv_idle_after,
    launch,
    wait_ready,
)

pytestmark = pytest.mark.e2e

PORT, KV = BASE_PORT + 45, KV_PORT + 45  # clear of the other modules' deployments
FAULTS = "nixl_error,drop_registration"
# Layers alternating a sliding window and full attention: vLLM's hybrid KV cache manager
# keeps two KV cache groups, and takes a failed load by request (`failed_recving`)
HYBRID = TinyModelSpec(arch="llama", layers=4, heads=4, kv_heads=2, head_dim=64,
                       sliding_window=32)  # fmt: skip
# short, so that a lost registration fails within seconds
SETTINGS = {"transfer_timeout_s": 3.0, "prefill_timeout_s": 3.0, "fence_s": 1.0}


@dataclass
class Pair:
    mode: str
    model: Path
    deployment: Deployment

    @property
    def servers(self) -> dict[str, str]:
        return {"prefill": self.deployment.prefill, "decode": self.deployment.decode}


@pytest.fixture(
    scope="module",
    params=[(mode, model) for model in ("gqa4", "swa-hybrid") for mode in ("push", "pull")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def pair(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    """`kvpush up` as a user starts it, with vLLM's recompute policy and the test hooks."""
    mode, name = request.param
    model = tiny_model
    if name == "swa-hybrid":
        model = ensure_tiny_model(tmp_path_factory.mktemp("models") / name, HYBRID)
    workdir = tmp_path_factory.mktemp(f"recompute-{mode}-{name}")
    extra = ("--kv-load-failure-policy", "recompute", "--kv-extra-config", json.dumps(SETTINGS))
    deployment = launch(
        f"kvpush-{mode}", model, workdir, *extra,
        port=PORT, kv_port=KV, env={"KVPUSH_FAULTS": FAULTS},
    )  # fmt: skip
    try:
        yield Pair(mode, model, wait_ready(deployment))
    finally:
        deployment.stop()


def answer(pair: Pair, request_id: str, stream: bool) -> str:
    """The text of one completion through the proxy (which retries nothing here)."""
    body = {"model": str(pair.model), "prompt": PROMPTS[1], "max_tokens": 12,
            "temperature": 0, "stream": stream}  # fmt: skip
    request = urllib.request.Request(
        pair.deployment.proxy + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        raw = resp.read().decode()
    if not stream:
        return str(json.loads(raw)["choices"][0]["text"])
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", raw
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def failed_transfers(url: str) -> float:
    return scrape.total(scrape.scrape(url), "kvpush:failures_total", kind="receive_failed")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("fault", ["nixl_error", "drop_registration"])
def test_a_failed_transfer_is_answered_by_decode_computing_the_prompt(
    pair: Pair, fault: str, stream: bool
) -> None:
    if fault == "drop_registration" and pair.mode == "pull":
        pytest.skip("pull has no registration")
    want = answer(pair, f"ok-{fault}-{stream}", stream)
    before = failed_transfers(pair.deployment.decode)
    got = answer(pair, f"r-{fault}-{stream}-fault-{fault}", stream)
    assert got == want
    assert failed_transfers(pair.deployment.decode) == before + 1, "it failed, once"
    idle = kv_idle_after(pair.servers, 20.0)
    print(f"\n{pair.mode} {fault} {'streamed' if stream else 'whole'}: answered; idle {idle:.1f} s")
