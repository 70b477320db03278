"""`kvpush up` with vLLM's connectors and ours: outputs match a single server, KV came by transfer.

Each setup is started once (as a user would, through the CLI) and shared by the checks.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpush.testbed import ipc, scrape
from tests.e2e.conftest import (
    BASE_PORT,
    KV_PORT,
    PROMPTS,
    Deployment,
    Reference,
    chat,
    completion,
    first_token_counts,
    kvpush_up,
    ports_free,
    post,
    post_stream,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["vllm-pull", "vllm-push", "kvpush-push", "kvpush-pull"])
def deployment(
    request: pytest.FixtureRequest,
    deployment_factory: Callable[..., Deployment],
    reference: Reference,
) -> Iterator[Deployment]:
    # `reference` first: the single server must be gone before the pair starts.
    deployment = deployment_factory(request.param)
    yield deployment
    deployment.stop()  # before the next setup starts, even if -k skipped the stop-signal test


def test_every_server_runs_on_its_own_core(deployment: Deployment) -> None:
    """As on separate hosts: vLLM's NixlConnector binds its worker's thread to the machine's
    last core (the CPU backend's "reserved core for KV transfer"), here decode's; `kvpush
    up` puts it back before any request, and says so."""
    text = "\n".join(deployment.output)
    assert "pinning read back from /proc:" in text and "NOT confined" not in text, text
    moved = "(vLLM had moved them): prefill-0: VLLM::Worker" in text
    assert moved == deployment.setup.startswith("vllm-"), text


def test_completions_equal_single_server(
    deployment: Deployment, reference: Reference, tiny_model: Path
) -> None:
    for prompt in PROMPTS:
        answer = deployment.ask(post, "/v1/completions", completion(tiny_model, prompt))
        assert answer["choices"][0]["text"] == reference.completions[prompt], prompt
        assert answer["usage"]["completion_tokens"] > 0


def test_streaming_equals_single_server(
    deployment: Deployment, reference: Reference, tiny_model: Path
) -> None:
    prompt = PROMPTS[1]
    text = deployment.ask(post_stream, "/v1/completions", completion(tiny_model, prompt))
    assert text == reference.completions[prompt]


def test_chat_equals_single_server(
    deployment: Deployment, reference: Reference, tiny_model: Path
) -> None:
    answer = deployment.ask(post, "/v1/chat/completions", chat(tiny_model))
    assert answer["choices"][0]["message"]["content"] == reference.chat
    assert deployment.ask(post_stream, "/v1/chat/completions", chat(tiny_model)) == reference.chat


def test_a_sampled_stream_continues_from_the_first_token_it_showed(
    deployment: Deployment, tiny_model: Path
) -> None:
    """With kvpush the client's first token comes from prefill, the moment it answers, and
    decode continues from that token. With sampling, decode's own first token would differ
    (the tiny model's distribution is nearly flat): the proxy checks the text decode
    produced for its first token against prefill's, and counts mismatches. Each prompt is
    sent twice: the second time decode's prefix cache holds it (vLLM's default), and its
    first token must still be prefill's."""
    if not deployment.setup.startswith("kvpush"):
        pytest.skip("vLLM's connectors: the first token comes from decode")

    before = first_token_counts(deployment.proxy)
    for i in range(8):
        body = {**completion(tiny_model, f"sample {i // 2}: {PROMPTS[2]}"), "temperature": 1.0}
        assert deployment.ask(post_stream, "/v1/completions", body)
    grown = {k: v - before[k] for k, v in first_token_counts(deployment.proxy).items()}
    assert grown["prefill"] + grown["decode"] == 8
    assert grown["prefill"] >= 4, grown
    assert grown["mismatch"] == 0, grown


def test_first_tokens_without_text_of_their_own_come_from_prefill_too(
    deployment: Deployment, tiny_model: Path
) -> None:
    """Prompts of random token ids make the tiny model (a vocabulary of byte pieces) start
    many answers with a token that has no text of its own yet, or odd bytes: the proxy
    still sends prefill's first token, and the streamed text equals the whole answer that
    decode sends unstreamed (which is decode's alone), nothing lost or doubled."""
    if not deployment.setup.startswith("kvpush"):
        pytest.skip("vLLM's connectors: the first token comes from decode")

    rng = random.Random(11)
    before = first_token_counts(deployment.proxy)
    for _ in range(12):
        ids = [rng.randrange(5, 1000) for _ in range(48)]
        body = {"model": str(tiny_model), "prompt": ids, "max_tokens": 6, "temperature": 0}
        whole = deployment.ask(post, "/v1/completions", body)["choices"][0]["text"]
        assert deployment.ask(post_stream, "/v1/completions", body) == whole, ids
    grown = {k: v - before[k] for k, v in first_token_counts(deployment.proxy).items()}
    assert grown["mismatch"] == 0, grown
    assert grown["prefill"] >= 10, grown  # only a text ending in U+FFFD is left to decode


def test_decode_got_every_prompt_token_by_kv_transfer(
    deployment: Deployment, tiny_model: Path
) -> None:
    # a prompt decode has not seen: with prefix caching on (vLLM's default) a repeated
    # one is decode's own, and only its uncached tail moves
    fresh = f"{deployment.setup} checks its transfer: " + PROMPTS[2]
    before = deployment.external_tokens()
    answer = deployment.ask(post, "/v1/completions", completion(tiny_model, fresh))
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert prompt_tokens > 100
    assert deployment.external_tokens() - before == prompt_tokens
    proxy_metrics = scrape.scrape(deployment.proxy)
    assert scrape.total(proxy_metrics, "kvpush_proxy_requests_total", outcome="ok") >= 1


def test_kvpush_reports_transfers_and_frees_prefill_blocks(
    deployment: Deployment, tiny_model: Path
) -> None:
    if not deployment.setup.startswith("kvpush"):
        pytest.skip("kvpush's own connector metrics")
    # The side that initiates the transfer observes it: prefill WRITEs, decode READs.
    if deployment.setup == "kvpush-push":
        initiator, duration = deployment.prefill, "kvpush:write_seconds_count"
    else:
        initiator, duration = deployment.decode, "kvpush:read_seconds_count"
    counters = {
        (initiator, "kvpush:transfer_bytes_count"),
        (initiator, "kvpush:transfer_descriptors_count"),
        (initiator, duration),
        (deployment.decode, "kvpush:decode_wait_seconds_count"),
        (deployment.prefill, "kvpush:main_thread_calls_total"),
        (deployment.decode, "kvpush:main_thread_calls_total"),
        (deployment.prefill, "kvpush:failures_total"),
        (deployment.decode, "kvpush:failures_total"),
    }
    if deployment.setup == "kvpush-push":  # prefill's share of the handoff
        counters.add((deployment.prefill, "kvpush:finish_to_write_seconds_count"))
        counters.add((deployment.prefill, "kvpush:finish_to_handoff_seconds_count"))
    before = {key: scrape.total(scrape.scrape(key[0]), key[1]) for key in counters}
    direct_before = direct_handoffs(deployment)
    fresh = [f"{deployment.setup} metrics {i}: {prompt}" for i, prompt in enumerate(PROMPTS)]
    for prompt in fresh:  # not seen before: decode's prefix cache holds none of them
        post(deployment.proxy + "/v1/completions", completion(tiny_model, prompt))
    grew = {key: scrape.total(scrape.scrape(key[0]), key[1]) - before[key] for key in counters}
    for (url, name), delta in grew.items():
        if name == "kvpush:failures_total":
            assert delta == 0, (url, name)
        else:
            assert delta >= len(fresh), (url, name, delta)
    if deployment.setup == "kvpush-push":
        # vLLM's CPU backend runs the model worker in a process of its own: a finished
        # prefill reaches it straight from the scheduler (kvpush.node.direct), which the
        # copy in the next engine step's metadata would not beat but by a lost race
        assert direct_handoffs(deployment) - direct_before >= len(fresh) - 1
    # Prefill frees its blocks once the transfer is done: usage goes back to zero.
    usage = [scrape.total(scrape.scrape(deployment.prefill), "vllm:kv_cache_usage_perc")]
    for _ in range(50):
        if usage[-1] == 0:
            break
        time.sleep(0.2)
        usage.append(scrape.total(scrape.scrape(deployment.prefill), "vllm:kv_cache_usage_perc"))
    assert usage[-1] == 0, f"prefill KV usage stayed at {usage[-1]}"


def direct_handoffs(deployment: Deployment) -> float:
    samples = scrape.scrape(deployment.prefill)
    return scrape.total(samples, "kvpush:handoffs_total", path="direct")


def test_a_stop_signal_stops_everything_and_frees_every_port(deployment: Deployment) -> None:
    """SIGTERM, or SIGINT (Ctrl-C) although `kvpush up` was started with it ignored, as a
    script's background command is (`launch`)."""
    # vLLM's IPC sockets are in one directory per server, not loose in the temp dir...
    rpc = sorted(ipc.base_dir().glob(f"{ipc.PREFIX}{deployment.proc.pid}-*"))
    assert len(rpc) == 2, rpc
    for path in rpc:
        assert any(p.is_socket() for p in path.iterdir()), f"no vLLM socket in {path}"
    sig = signal.SIGINT if deployment.setup in ("vllm-push", "kvpush-pull") else signal.SIGTERM
    assert deployment.stop(sig) == 0, "\n".join(deployment.output[-30:])
    assert "all servers stopped" in deployment.output
    assert ("stopping (Ctrl-C)" in deployment.output) == (sig == signal.SIGINT)
    assert ports_free(deployment.ports), f"ports still bound: {deployment.ports}"
    # ...and the stop removed them with the files libzmq leaves behind.
    assert not any(path.exists() for path in rpc), rpc


def test_a_server_that_fails_to_start_is_reported_and_the_rest_torn_down(
    tiny_model: Path, tmp_path: Path
) -> None:
    port, kv_port = BASE_PORT + 10, KV_PORT + 10  # clear of the shared deployments
    with pytest.raises(AssertionError) as failure:
        kvpush_up(
            "vllm-pull",
            tiny_model,
            tmp_path,
            "--port",
            str(port),
            "--kv-port",
            str(kv_port),
            "--vllm-args=--no-such-vllm-flag",
        )
    message = str(failure.value)
    assert "exited with code" in message and "no-such-vllm-flag" in message
    assert "all servers stopped" in message
    assert ports_free((port, port + 100, port + 200, kv_port, kv_port + 1))
