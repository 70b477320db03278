"""`kvpush plan measure`: this machine's simulator parameters, from probes without a handoff.

For each connector setup it starts that setup's 1P1D servers exactly as `kvpush bench
sweep` does (`kvpush/testbed/topology.py`, eager, vLLM's prefix caching on), with the
connector's hooks timed (`kvpush.bench.timed`), and measures, per prompt length:

1. prefill: `--prefill-requests` prompts, one at a time, straight to the prefill server
   with max_tokens 1, the server scraped after each. vLLM's own histograms give each
   request's engine queue and prefill time; the client's latency minus those is the
   front end's time (HTTP, tokenisation, the engine's queues in and out). Both are the
   median over the prompts, so one request that lost its core for a while does not move
   them.
2. decode step: on the decode server, `--decode-rounds` rounds of 1 and then
   `--max-num-seqs` local streamed requests at once; the median of their TPOT as the
   client sees it ((last token - first token) / (tokens - 1), as `vllm bench serve`
   computes it) is one decode step at that batch. That is the engine's step plus what
   each token costs on its way out (detokenising and streaming in the front end), which
   on a CPU machine is a large share: the engine-side step (vLLM's decode time at two
   output lengths, differenced) is kept in the profile for the record, not used.
3. pull's inline submission: `--hook-requests` handed-off requests through an in-process
   proxy, one at a time; the decode worker's main-thread time in the hooks that take a
   step's loads (`LOAD_HOOKS`) beyond what they cost in a step with nothing to load, per
   request. Only this hook time is kept, not the latency of those requests (that is what
   the simulator predicts).

The servers are stopped after each setup. What the setup's connector runs in the
background (NIXL's progress thread, spinning or paced) is running during all of it, so it
shows in that setup's engine numbers. None of this uses a TTFT or TPOT of a handed-off
request. The proxy's added latency and NIXL's bandwidth are not measured here: they come
from `--proxy-added-ms` (default: what `kvpush proxy bench` measured on this machine) and
`--link-gbps` / `--memory-gbps` (defaults: the bandwidths below, measured once).
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpush.bench.results import ONE_BURST_MS
from kvpush.core.protocol import Mode
from kvpush.plan.machine import (
    MachineProfile,
    PointProbe,
    SetupProbe,
    load_profile,
    save_profile,
)
from kvpush.plan.model import PlannerError
from kvpush.plan.model_config import read_model

if TYPE_CHECKING:
    import aiohttp

    from kvpush.testbed.topology import PairSettings, Topology

Say = Callable[[str], None]

# `kvpush proxy bench --mode pull|push --streams 1` on this machine, 2026-11-29 16:48,
# load average 1.2-1.4: p50 TTFT through the proxy minus without it (pull: prefill then
# decode stub, push: the decode stub alone).
PROXY_ADDED_MS = {"pull": 1.05, "push": 0.97}
# Measured on a 2-core x86 VM (UCX over loopback): NIXL DRAM->DRAM WRITE 12-13 GB/s between
# two processes (READ is faster, 16-17); one-process memcpy 19.8 GB/s.
NIXL_DRAM_GBPS = 12.5
MEMCPY_GBPS = 19.8
KEEPALIVE_S = 2.0  # below uvicorn's 5 s keep-alive: never reuse a connection as it closes


@dataclass(slots=True)
class MeasureSpec:
    pair: PairSettings
    setups: list[str]
    input_lens: list[int]
    out: Path
    output_lens: tuple[int, int] = (16, 80)
    prefill_requests: int = 16
    decode_rounds: int = 5
    hook_requests: int = 6
    proxy_port: int | None = None
    request_timeout: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        from kvpush.testbed.topology import SINGLE, check_setups

        try:
            check_setups(self.setups)
        except ValueError as exc:
            raise PlannerError(str(exc)) from None
        if SINGLE in self.setups:
            raise PlannerError(f"--setups: {SINGLE} has no handoff to measure; leave it out")
        if not self.input_lens or any(n < 1 for n in self.input_lens):
            raise PlannerError("--input-lens: give one or more prompt lengths >= 1")
        short, long = self.output_lens
        if not 2 <= short < long:
            raise PlannerError("--output-lens: two lengths, the first >= 2 and below the second")
        if self.pair.max_num_seqs < 1:
            raise PlannerError("--max-num-seqs must be at least 1")
        for name in ("prefill_requests", "decode_rounds", "hook_requests"):
            if getattr(self, name) < 1:
                raise PlannerError(f"--{name.replace('_', '-')} must be at least 1")


def metric_delta(before: dict[Any, float], after: dict[Any, float], name: str) -> float:
    from kvpush.testbed import scrape

    return scrape.total(after, name) - scrape.total(before, name)


def histogram_mean_ms(before: dict[Any, float], after: dict[Any, float], name: str) -> float:
    """Mean of a Prometheus histogram's new observations between two scrapes, in ms."""
    count = metric_delta(before, after, f"{name}_count")
    if count <= 0:
        raise PlannerError(f"vLLM recorded no {name} during the probe; is this vLLM too old?")
    return metric_delta(before, after, f"{name}_sum") / count * 1e3


# The worker hooks that take a step's loads: vLLM's connectors submit them in
# `start_load_kv`, kvpush hands them to its threads in `bind_connector_metadata`; each
# is called once a step, so their sum per step is one figure for every connector.
LOAD_HOOKS = ("bind_connector_metadata", "start_load_kv")


def hook_seconds(ledgers: dict[str, dict[str, Any]], hooks: tuple[str, ...]) -> tuple[float, int]:
    """(seconds, steps) of the worker's `hooks` together (steps: calls of the last)."""
    worker = ledgers.get("worker", {})
    seconds = sum(float(worker.get("seconds", {}).get(hook, 0.0)) for hook in hooks)
    return seconds, int(worker.get("calls", {}).get(hooks[-1], 0))


def submit_beyond_idle(busy: tuple[float, int], idle: tuple[float, int], requests: int) -> float:
    """ms per request of the load hooks' time beyond their cost in steps with nothing to load.

    `busy` and `idle` are (seconds, calls) over the handoff probe and the local probes."""
    seconds, calls = busy
    idle_per_call = idle[0] / idle[1] if idle[1] else 0.0
    return max(seconds - calls * idle_per_call, 0.0) / requests * 1e3


async def _answered(resp: aiohttp.ClientResponse, url: str) -> None:
    """Raise PlannerError naming the server's answer unless a probe request succeeded."""
    if resp.status != 200:
        text = await resp.text()
        raise PlannerError(f"probe request to {url} failed: HTTP {resp.status}: {text[:300]}")


class Prober:
    """The probes of one setup, on its running topology."""

    def __init__(self, spec: MeasureSpec, topology: Topology, say: Say) -> None:
        self.spec, self.topology, self.say = spec, topology, say
        self.model = str(spec.pair.model)
        self.prefill_url = topology.prefill[0].url
        self.decode_url = topology.decode[0].url
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(spec.pair.model))

    def prompts(self, count: int, input_len: int, salt: int) -> list[str]:
        """Prompts of exactly `input_len` tokens, made as `vllm bench serve --dataset-name
        random` makes them (its own sampler), so the prompts' shape matches the sweep's."""
        from vllm.benchmarks.datasets import RandomDataset

        # it notes every prompt whose re-encoding is a token off; the sweep's prompts are too
        logging.getLogger("vllm.benchmarks.datasets").setLevel(logging.ERROR)
        dataset = RandomDataset(random_seed=self.spec.seed + 1000 * salt + input_len)
        samples = dataset.sample(
            self.tokenizer, num_requests=count, input_len=input_len, output_len=2, range_ratio=0
        )
        return [str(sample.prompt) for sample in samples]

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        """A greedy completion of exactly `max_tokens` tokens."""
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }

    async def complete(
        self, session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
    ) -> float:
        body = self.body(prompt, max_tokens)
        started = time.perf_counter()
        async with session.post(url + "/v1/completions", json=body) as resp:
            await _answered(resp, url)
            await resp.read()
        return time.perf_counter() - started

    def scrape(self, url: str) -> dict[Any, float]:
        from kvpush.testbed import scrape

        return scrape.scrape(url, timeout=10.0)

    def hooks(self, server: str) -> dict[str, dict[str, Any]]:
        from kvpush.bench.timed import read_ledgers
        from kvpush.testbed.topology import hook_dir

        time.sleep(1.2)  # ledgers are written every half second
        return read_ledgers(hook_dir(self.topology.config, server))

    def scrape_after(
        self, url: str, before: dict[Any, float], name: str, count: int
    ) -> dict[Any, float]:
        """A scrape that shows `count` new observations of histogram `name` since `before`.

        vLLM records a request's histograms as its output is processed, which can be just
        after the client has its answer; wait up to a second for them."""
        deadline = time.monotonic() + 1.0
        while True:
            after = self.scrape(url)
            if metric_delta(before, after, f"{name}_count") >= count:
                return after
            if time.monotonic() > deadline:
                raise PlannerError(
                    f"vLLM at {url} recorded fewer than {count} new {name}; is this vLLM "
                    "too old, or did another client use the server during the probe?"
                )
            time.sleep(0.02)

    async def prefill(self, session: aiohttp.ClientSession, input_len: int) -> tuple[float, float]:
        """(engine prefill ms, front-end ms), the medians over prompts sent one at a time.

        Each request is scraped on its own, so one slow request (a page fault, a moment
        without a core) moves the result no more than any other: medians, not means."""
        prompts = self.prompts(self.spec.prefill_requests + 1, input_len, salt=1)
        await self.complete(session, self.prefill_url, prompts[0], 1)
        name = "vllm:request_prefill_time_seconds"
        engine, front = [], []
        await asyncio.sleep(0.2)  # let the warm-up's histograms land first
        before = self.scrape(self.prefill_url)
        for prompt in prompts[1:]:
            latency = await self.complete(session, self.prefill_url, prompt, 1)
            after = self.scrape_after(self.prefill_url, before, name, 1)
            prefill = histogram_mean_ms(before, after, name)
            queue = histogram_mean_ms(before, after, "vllm:request_queue_time_seconds")
            engine.append(prefill)
            front.append(latency * 1e3 - prefill - queue)
            before = after
        return statistics.median(engine), statistics.median(front)

    async def stream(
        self, session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
    ) -> float | None:
        """Stream one completion; its TPOT as `vllm bench serve` computes it, (last token -
        first token) / (tokens - 1), in ms. None when every token came in one burst."""
        body = {**self.body(prompt, max_tokens), "stream": True}
        first = last = 0.0
        async with session.post(url + "/v1/completions", json=body) as resp:
            await _answered(resp, url)
            async for chunk in resp.content.iter_any():
                if b'"text"' in chunk:
                    last = time.perf_counter()
                    first = first or last
        if (last - first) * 1e3 < ONE_BURST_MS:
            return None
        return (last - first) * 1e3 / (max_tokens - 1)

    async def decode_step(
        self, session: aiohttp.ClientSession, input_len: int, batch: int
    ) -> tuple[float, float]:
        """One decode step (ms) at `batch` running requests with prompts of `input_len`:
        (as the client sees it, as the engine sees it).

        The client's: `--decode-rounds` rounds of `batch` streamed local requests of the
        longer output length at once; the median over them of each one's TPOT. It holds
        what every token costs on its way out (the front end's detokenising and
        streaming), which is what a benchmark's TPOT measures. The engine's, for the
        record: vLLM's engine-side decode time at both output lengths (median over
        rounds), differenced and divided by the token difference."""
        short, long = self.spec.output_lens
        name = "vllm:request_decode_time_seconds"
        per_request: dict[int, float] = {}
        client: list[float] = []
        for salt, tokens in enumerate((short, long), start=2):
            rounds = []
            await asyncio.sleep(0.2)
            before = self.scrape(self.decode_url)
            for round_ in range(self.spec.decode_rounds):
                prompts = self.prompts(batch, input_len, salt=10 * salt + round_)
                tpots = await asyncio.gather(
                    *(self.stream(session, self.decode_url, p, tokens) for p in prompts)
                )
                if tokens == long:
                    client += [t for t in tpots if t is not None]
                after = self.scrape_after(self.decode_url, before, name, batch)
                rounds.append(histogram_mean_ms(before, after, name))
                before = after
            per_request[tokens] = statistics.median(rounds)
        engine = (per_request[long] - per_request[short]) / (long - short)
        if not client:
            raise PlannerError(
                f"every probe answer on {self.decode_url} arrived in one burst, so no TPOT "
                "could be measured; the machine is too busy, run `kvpush plan measure` again"
            )
        return statistics.median(client), engine

    async def handoffs(
        self, session: aiohttp.ClientSession, proxy_url: str, input_len: int
    ) -> tuple[tuple[float, int], float | None]:
        """Over handed-off requests: decode worker's load hooks (seconds, steps), and
        kvpush's own mean transfer time (ms; None for vLLM's connectors, which have none)."""
        prompts = self.prompts(self.spec.hook_requests, input_len, salt=50)
        before = hook_seconds(self.hooks("decode-0"), LOAD_HOOKS)
        metrics = [self.scrape(url) for url in (self.prefill_url, self.decode_url)]
        for prompt in prompts:
            await self.complete(session, proxy_url, prompt, 2)
        after = hook_seconds(self.hooks("decode-0"), LOAD_HOOKS)
        now = [self.scrape(url) for url in (self.prefill_url, self.decode_url)]
        transfer = None
        # whoever starts the transfer records it: prefill's writer, decode's reader
        for name, then, later in (
            ("kvpush:write_seconds", metrics[0], now[0]),
            ("kvpush:read_seconds", metrics[1], now[1]),
        ):
            if metric_delta(then, later, f"{name}_count") > 0:
                transfer = histogram_mean_ms(then, later, name)
        return (after[0] - before[0], after[1] - before[1]), transfer

    async def run(self, setup: str) -> SetupProbe:
        import aiohttp

        from kvpush.testbed.topology import SETUPS
        from kvpush.testbed.topology_proxy import local_url, start_topology_proxy, warm_up

        spec, say = self.spec, self.say
        mode: Mode = "pull" if SETUPS[setup].proxy_mode == "pull" else "push"
        timeout = aiohttp.ClientTimeout(total=spec.request_timeout)
        prefill: dict[int, tuple[float, float]] = {}
        steps: dict[int, dict[int, float]] = {}
        engine_steps: dict[str, float] = {}
        # uvicorn closes a connection idle for 5 s; one the pool reused just then fails the
        # probe ("Can not write request body"), so the pool drops idle ones sooner
        connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            for url in (self.prefill_url, self.decode_url):
                await self.complete(session, url, "warm up", 4)
            idle_before = hook_seconds(self.hooks("decode-0"), LOAD_HOOKS)
            for n in spec.input_lens:
                prefill[n] = await self.prefill(session, n)
                say(
                    f"  [{setup}] {n} tokens: prefill {prefill[n][0]:.2f} ms in the engine, "
                    f"front end {prefill[n][1]:.2f} ms"
                )
                steps[n] = {}
                for batch in sorted({1, spec.pair.max_num_seqs}):
                    steps[n][batch], engine_steps[f"{n}x{batch}"] = await self.decode_step(
                        session, n, batch
                    )
                    say(
                        f"  [{setup}] {n} tokens: decode step {steps[n][batch]:.2f} ms at "
                        f"the client ({engine_steps[f'{n}x{batch}']:.2f} in the engine) at "
                        f"batch {batch}"
                    )
            idle_after = hook_seconds(self.hooks("decode-0"), LOAD_HOOKS)
            idle = (idle_after[0] - idle_before[0], idle_after[1] - idle_before[1])
            port = spec.proxy_port or spec.pair.port
            runner = await start_topology_proxy(
                self.topology,
                port,
                request_timeout=spec.request_timeout,
                # a server whose core a spinning NIXL thread shares can miss /health for
                # seconds; the probe sends one request at a time and needs no ejection
                health_interval=3600.0,
                health_timeout=spec.request_timeout,
            )
            submits: dict[int, float] = {}
            transfers: dict[int, float | None] = {}
            # (the keys keep their first name, so that profiles measured before compare)
            hook_totals: dict[str, Any] = {"idle_start_load_kv": idle}
            try:
                proxy_url = local_url(port)
                error = await warm_up(proxy_url, self.model)
                if error:
                    raise PlannerError(f"{setup}: a handoff through the proxy failed: {error}")
                for n in spec.input_lens:
                    busy, transfers[n] = await self.handoffs(session, proxy_url, n)
                    submits[n] = submit_beyond_idle(busy, idle, spec.hook_requests)
                    hook_totals[f"handoff_start_load_kv_{n}"] = busy
                    say(
                        f"  [{setup}] {n} tokens: load hooks {submits[n]:.3f} ms per "
                        "handed-off request beyond idle"
                    )
            finally:
                await runner.cleanup()
        points = tuple(
            PointProbe(n, prefill[n][0], prefill[n][1], steps[n], submits[n], transfers[n])
            for n in spec.input_lens
        )
        extra = {"hook_totals": hook_totals, "engine_step_ms": engine_steps}
        return SetupProbe(setup, mode, points, extra)


def measure_setup(spec: MeasureSpec, setup: str, say: Say) -> SetupProbe:
    from kvpush.testbed.pinning import confined
    from kvpush.testbed.topology import StartupError, StartupProgress, Topology

    config = spec.pair.topology(setup, "plan-measure", timed_hooks=True)
    import aiohttp

    topology = Topology(config)
    logs = config.workdir / "logs"
    say(f"\n== {setup}: starting 1 prefill + 1 decode, logs in {logs}")
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    try:
        topology.start()
        took = topology.wait_healthy(spec.pair.startup_timeout, StartupProgress(f"[{setup}] "))
        say(f"  [{setup}] servers healthy after {took:.0f} s{topology.moved_back_note()}")
        with confined(topology.client_cores):
            from kvpush.proxy.server import run_proxy_loop

            probe = run_proxy_loop(Prober(spec, topology, say).run(setup))
    except StartupError as exc:
        raise PlannerError(f"{setup}: servers did not start: {str(exc).splitlines()[0]}") from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise PlannerError(
            f"{setup}: a probe request failed ({type(exc).__name__}: {exc}); see {logs}"
        ) from None
    finally:
        topology.stop()
        say(f"  [{setup}] servers stopped")
    probe.extra.update(
        pinning=topology.pinning(),
        measured_at=started,
        load_average_before=[round(v, 2) for v in load_before],
        load_average_after=[round(v, 2) for v in os.getloadavg()],
    )
    return probe


def measure(
    spec: MeasureSpec,
    proxy_added_ms: dict[str, float],
    link_gbps: float,
    memory_gbps: float,
    command: Sequence[str],
    say: Say = print,
    redo: bool = False,
) -> MachineProfile:
    """Measure every setup not already in `spec.out` (all of them with `redo`), saving the
    profile after each one, so an interrupted run resumes where it stopped."""
    profile = MachineProfile(
        kv_bytes_per_token=read_model(spec.pair.model).shape.kv_bytes_per_token,
        max_num_seqs=spec.pair.max_num_seqs,
        link_gbps=link_gbps,
        memory_gbps=memory_gbps,
        proxy_added_ms=dict(proxy_added_ms),
        setups={},
        provenance={
            "command": " ".join(command),
            "cores": len(os.sched_getaffinity(0)),
            "model": str(spec.pair.model),
            "proxy_added_ms": "kvpush proxy bench --streams 1 (p50 added TTFT), unless "
            "--proxy-added-ms was given",
            "link_gbps": "NIXL DRAM->DRAM WRITE between two processes, measured on a 2-core x86 VM",
            "memory_gbps": "one-process memcpy, measured on a 2-core x86 VM",
        },
    )
    if spec.out.exists() and not redo:
        done = load_profile(spec.out)
        if done.max_num_seqs != spec.pair.max_num_seqs or done.proxy_added_ms != proxy_added_ms:
            raise PlannerError(
                f"{spec.out} was measured with other settings; pass --redo or another --out"
            )
        profile.setups.update(done.setups)
        if profile.setups:
            names = ", ".join(sorted(profile.setups))
            say(f"already in {spec.out}: {names} (--redo measures them again)")
    for setup in spec.setups:
        if setup in profile.setups:
            continue
        profile.setups[setup] = measure_setup(spec, setup, say)
        save_profile(profile, spec.out)
    return profile
