"""What decode does on top of prefill's first token, both modes: it drafts tokens
(speculative decoding), it constrains them (structured outputs), and it runs LoRA
adapters. Answers equal a single server's.

kvpush touches the first decode step: decode's first token is prefill's (kvpush's logits
processor forces it). Production decodes often speculate (MTP, EAGLE, n-gram), and the
drafts of the following steps are verified against KV that came by transfer; vLLM's
n-gram drafter is the one its CPU backend runs, and the prompts repeat themselves so that
it finds something to propose. On this random-weight model its drafts are rejected
(greedy answers here do not repeat the prompt), so what is shown is that every decode
step from the first verifies drafts over transferred KV and the answer is the single
server's, not that accepted drafts are. Structured outputs (a choice, a regex, a JSON
schema) run a grammar over every token, prefill's first included: decode's grammar must
accept the token it did not choose, and go on from there. A LoRA adapter's KV is not
the base model's for the same prompt: prefill computes it with the adapter, and decode
must take it by transfer, not from its prefix cache's blocks of the base model's answer
to the same prompt. All of it runs on the same servers (decode drafting, both serving
the adapter), as a production decode would.

The reference is push's prefill server asked directly with a cache salt of its own (as in
test_model_shapes.py): one server, no drafting, no transfer.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.testbed import scrape
from kvpush.testbed.model import build_tiny_lora
from tests.e2e.conftest import (
    BASE_PORT,
    KV_PORT,
    Deployment,
    first_token_counts,
    launch,
    ports_free,
    post,
    post_stream,
    wait_ready,
)

pytestmark = pytest.mark.e2e
DRAFTS = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
          "prompt_lookup_max": 4}  # fmt: skip
PROMPTS = (
    "the cat sat on the mat and the cat sat on the mat and the cat sat on the",
    " ".join(["water", "light", "mountain", "story"] * 30),
    "one two three four five six seven one two three four five six seven one two",
)
MAX_TOKENS = 120
ADAPTER = "fish"  # the LoRA adapter's name on both servers
# clear of the shared deployments (BASE_PORT); other modules have stopped theirs by now
MODE_PORTS = {"kvpush-push": (BASE_PORT + 60, KV_PORT + 60),
              "kvpush-pull": (BASE_PORT + 70, KV_PORT + 70)}  # fmt: skip


@pytest.fixture(scope="module")
def deployments(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Deployment]]:
    work = tmp_path_factory.mktemp("decode-features")
    adapter = build_tiny_lora(tiny_model, work / "adapter")
    both = f"--enable-lora --max-lora-rank 8 --lora-modules {ADAPTER}={adapter}"
    decode_args = f"--speculative-config '{json.dumps(DRAFTS)}'"
    started = {
        setup: launch(setup, tiny_model, work / setup, "--vllm-args", both,
                      "--decode-args", decode_args, port=port, kv_port=kv)  # fmt: skip
        for setup, (port, kv) in MODE_PORTS.items()
    }
    try:
        yield {setup: wait_ready(d) for setup, d in started.items()}
    finally:
        for d in started.values():
            d.stop()
    for d in started.values():
        assert ports_free(d.ports), f"{d.setup}: ports still bound {d.ports}"


def body(model: Path, prompt: str) -> dict[str, object]:
    return {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}  # fmt: skip


def drafts(deployment: Deployment) -> tuple[float, float]:
    """Decode's drafted and accepted tokens so far (vLLM's counters)."""
    samples = scrape.scrape(deployment.decode)
    return (scrape.total(samples, "vllm:spec_decode_num_draft_tokens_total"),
            scrape.total(samples, "vllm:spec_decode_num_accepted_tokens_total"))  # fmt: skip


@pytest.mark.parametrize("setup", sorted(MODE_PORTS))
def test_a_drafting_decode_answers_as_a_single_server(
    deployments: dict[str, Deployment], tiny_model: Path, setup: str
) -> None:
    deployment = deployments[setup]
    before = drafts(deployment)
    for prompt in PROMPTS:
        request = body(tiny_model, prompt)
        reference = post(deployment.prefill + "/v1/completions",
                         {**request, "cache_salt": "reference"})  # fmt: skip
        want = reference["choices"][0]["text"]
        answer = post(deployment.proxy + "/v1/completions", request)
        assert answer["choices"][0]["text"] == want, (setup, prompt)
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS
        assert post_stream(deployment.proxy + "/v1/completions", request) == want, setup
    drafted, accepted = (b - a for a, b in zip(before, drafts(deployment), strict=True))
    assert drafted > 0, f"{setup}: decode drafted nothing; the test proves nothing"
    for side in (deployment.prefill, deployment.decode):
        assert scrape.total(scrape.scrape(side), "kvpush:failures_total") == 0
    print(f"\n{setup}: {drafted:.0f} draft tokens, {accepted:.0f} accepted")


@pytest.mark.parametrize("setup", sorted(MODE_PORTS))
def test_a_drafting_decode_says_it_gives_its_own_first_token_and_streams_start_with_it(
    deployments: dict[str, Deployment], tiny_model: Path, setup: str
) -> None:
    """vLLM loads no custom logits processor with speculative decoding, so a drafting
    decode cannot continue from prefill's first token. It says so on /metrics, and the
    proxy streams decode's own first token instead of prefill's (which, sampled, would
    differ and leave the client a token the answer does not continue from)."""
    deployment = deployments[setup]
    decode = scrape.scrape(deployment.decode)
    assert scrape.total(decode, "kvpush:info", first_token="own") == 1
    assert scrape.total(scrape.scrape(deployment.prefill), "kvpush:info", first_token="-") == 1
    before = first_token_counts(deployment.proxy)
    sampled = {**body(tiny_model, PROMPTS[0]), "temperature": 1.0, "max_tokens": 8}
    for seed in range(4):
        assert post_stream(deployment.proxy + "/v1/completions", {**sampled, "seed": seed})
    after = first_token_counts(deployment.proxy)
    grown = {source: after[source] - before[source] for source in after}
    assert grown == {"prefill": 0, "decode": 4, "mismatch": 0}, grown


MESSAGES = [{"role": "user", "content": "Give me a JSON object about a fish"}]
CHOICES = ["alpha beta", "gamma delta", "omega"]
PATTERN = "[a-z]{3,8} [0-9]{2,4}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}  # fmt: skip
CONSTRAINTS: dict[str, dict[str, object]] = {
    "choice": {"structured_outputs": {"choice": CHOICES}},
    "regex": {"structured_outputs": {"regex": PATTERN}},
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "fish", "schema": SCHEMA}}},
}  # fmt: skip


def chat_stream(url: str, body: dict[str, object]) -> str:
    """A streamed chat answer's text (post_stream reads completions' chunks)."""
    request = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    text = []
    with urllib.request.urlopen(request, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


@pytest.mark.parametrize("constraint", sorted(CONSTRAINTS))
@pytest.mark.parametrize("setup", sorted(MODE_PORTS))
def test_structured_outputs_go_on_from_prefills_first_token(
    deployments: dict[str, Deployment], tiny_model: Path, setup: str, constraint: str
) -> None:
    deployment = deployments[setup]
    request = {"model": str(tiny_model), "messages": MESSAGES, "max_tokens": 40,
               "temperature": 0, **CONSTRAINTS[constraint]}  # fmt: skip
    path = "/v1/chat/completions"
    reference = post(deployment.prefill + path, {**request, "cache_salt": "reference"})
    want = reference["choices"][0]["message"]["content"]
    if constraint == "choice":
        assert want in CHOICES, want
    elif constraint == "regex":
        assert re.fullmatch(PATTERN, want), want
    answer = post(deployment.proxy + path, request)
    assert answer["choices"][0]["message"]["content"] == want, (setup, constraint)
    assert chat_stream(deployment.proxy + path, request) == want, (setup, constraint)
    for side in (deployment.prefill, deployment.decode):
        assert scrape.total(scrape.scrape(side), "kvpush:failures_total") == 0


@pytest.mark.parametrize("setup", sorted(MODE_PORTS))
def test_a_lora_adapter_answers_as_a_single_server_with_its_own_kv(
    deployments: dict[str, Deployment], tiny_model: Path, setup: str
) -> None:
    deployment = deployments[setup]
    prompt = f"{setup}: " + PROMPTS[1]  # one prompt per mode: no prefill cache hit across
    texts = {}
    for model in (str(tiny_model), ADAPTER):  # the base model's first, then the adapter's
        request = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        reference = post(deployment.prefill + "/v1/completions",
                         {**request, "cache_salt": "reference"})  # fmt: skip
        want = texts[model] = reference["choices"][0]["text"]
        before = deployment.external_tokens()
        answer = post(deployment.proxy + "/v1/completions", request)
        assert answer["choices"][0]["text"] == want, (setup, model)
        assert deployment.external_tokens() - before == answer["usage"]["prompt_tokens"], model
        assert post_stream(deployment.proxy + "/v1/completions", request) == want, setup
    assert texts[ADAPTER] != texts[str(tiny_model)], "the adapter changes nothing"
    for side in (deployment.prefill, deployment.decode):
        assert scrape.total(scrape.scrape(side), "kvpush:failures_total") == 0
