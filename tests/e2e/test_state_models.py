"""A model with state layers (Qwen3-Next's gated delta nets) across TP ranks, both modes.

Each TP rank keeps its own heads' share of every state, so kvpush moves a state rank to
rank, between sides of the same TP size, and refuses others at first contact. Here a
kvpush deployment with TP 2 on both sides answers as vLLM's own connector does with the
same split (`vllm-pull-nospin`, TP 2 on both sides: its answer to each prompt, its
servers stopped again), every prompt token but the last arriving by transfer (decode
computes the last itself, test_model_shapes.py says why); and prefill TP 1 -> decode TP 2
fails every request at once, the logs naming the fix.

Four TP 2 servers on a 2-core machine take minutes, so this module runs when asked:
KVPUSH_STATE_TP=1 (the TP 1 case runs in every suite, test_model_shapes.py `gdn-hybrid`).
"""

from __future__ import annotations

import os
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.testbed import scrape
from kvpush.testbed.model import TinyModelSpec, ensure_tiny_model
from tests.e2e.conftest import (
    BASE_PORT,
    KV_PORT,
    PROMPTS,
    completion,
    launch,
    ports_free,
    post,
    wait_ready,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("KVPUSH_STATE_TP") != "1", reason="runs with KVPUSH_STATE_TP=1 (minutes)"
    ),
]
SPEC = TinyModelSpec(arch="qwen3_next", layers=4, heads=4, kv_heads=2, head_dim=64)
TP2 = ("--prefill-tp", "2", "--decode-tp", "2", "--no-pin")
PORTS = {"vllm-pull-nospin": 60, "kvpush-push": 70, "kvpush-pull": 80, "mismatch": 90}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "gdn", SPEC)


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """vLLM's own connector's answers, TP 2 on both sides."""
    setup = "vllm-pull-nospin"
    offset = PORTS[setup]
    deployment = launch(setup, model, tmp_path_factory.mktemp(setup), *TP2,
                        port=BASE_PORT + offset, kv_port=KV_PORT + offset, kv_ports=4)  # fmt: skip
    try:
        wait_ready(deployment, timeout=600)
        yield {p: post(deployment.proxy + "/v1/completions", completion(model, p))
               ["choices"][0]["text"] for p in PROMPTS}  # fmt: skip
    finally:
        deployment.stop()


@pytest.mark.parametrize("setup", ["kvpush-push", "kvpush-pull"])
def test_tp2_to_tp2_answers_as_vllms_connector_with_the_state_moved_rank_to_rank(
    setup: str, model: Path, reference: dict[str, str], tmp_path: Path
) -> None:
    offset = PORTS[setup]
    deployment = launch(setup, model, tmp_path, *TP2, port=BASE_PORT + offset,
                        kv_port=KV_PORT + offset, kv_ports=4)  # fmt: skip
    try:
        wait_ready(deployment, timeout=600)
        for prompt in PROMPTS:
            before = deployment.external_tokens()
            answer = post(deployment.proxy + "/v1/completions", completion(model, prompt))
            assert answer["choices"][0]["text"] == reference[prompt], (setup, prompt)
            moved = deployment.external_tokens() - before
            assert moved == answer["usage"]["prompt_tokens"] - 1, (setup, prompt)
        for side in (deployment.prefill, deployment.decode):
            assert scrape.total(scrape.scrape(side), "kvpush:failures_total") == 0
    finally:
        deployment.stop()
    assert ports_free(deployment.ports), deployment.ports


def test_a_state_model_between_tp_sizes_fails_at_once_naming_the_fix(
    model: Path, tmp_path: Path
) -> None:
    offset = PORTS["mismatch"]
    deployment = launch("kvpush-push", model, tmp_path, "--decode-tp", "2", "--no-pin",
                        port=BASE_PORT + offset, kv_port=KV_PORT + offset, kv_ports=3)  # fmt: skip
    try:
        wait_ready(deployment, timeout=600)
        with pytest.raises(urllib.error.HTTPError) as failed:
            post(deployment.proxy + "/v1/completions", completion(model, PROMPTS[0]), timeout=60)
        assert failed.value.code >= 500
        logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("**/logs/*.log"))
        assert "serve both sides with the same --tensor-parallel-size" in logs
        assert scrape.total(scrape.scrape(deployment.decode), "kvpush:failures_total") > 0
    finally:
        deployment.stop()
    assert ports_free(deployment.ports), deployment.ports
