"""`kvpush bench soak`: hours of steady load on one 1P1D pair; does anything leak or fail?

A soak starts one setup's pair (prefill + decode, eager, with the deployment's shared
secret, as `kvpush up` would) and the proxy in-process, then sends streaming completions
at a steady rate (Poisson arrivals, seeded) for --duration seconds. Every prompt starts
with its own request number, so no request is a prefix-cache hit of another and every one
moves its KV. Every --sample-every seconds it records, for each server's whole process
tree (API server, engine core, workers), the resident memory and open file descriptors,
and from the server's /metrics vLLM's KV cache usage, kvpush's `kvpush:waiting` gauges
and `kvpush:failures_total`; the proxy's process too.

It passes (exit 0) when no request failed and, after --warmup seconds, no server's memory
grew by more than --max-growth percent (the median of the last three samples against
the median of the first three after warm-up); the open descriptors are reported the same
way. Samples and the verdict go to OUT/soak.json, one line per sample to the terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvpush.args import at_least, cannot_write, positive
from kvpush.bench.compare import (
    RequestResult,
    add_pair_options,
    bench_model,
    model_prompts,
    pair_settings,
    stream_completion,
)
from kvpush.testbed import scrape
from kvpush.testbed.topology import (
    MAIN_SETUPS,
    PairSettings,
    StartupError,
    StartupProgress,
    Topology,
    check_setups,
)
from kvpush.testbed.topology_proxy import with_warm_proxy

EPILOG = """\
examples:
  kvpush bench soak                                  # kvpush-push, 30 minutes at 4 req/s
  kvpush bench soak --setup kvpush-pull --duration 600
  kvpush bench soak --duration 60 --warmup 20 --sample-every 5   # a quick check
"""


@dataclass(frozen=True, slots=True)
class SoakSpec:
    setup: str = "kvpush-push"
    duration: float = 1800.0
    rate: float = 4.0  # requests per second, the demo's heaviest point
    input_len: int = 256
    output_len: int = 32
    warmup: float = 120.0
    sample_every: float = 30.0
    max_growth: float = 5.0  # percent
    max_in_flight: int = 64
    request_timeout: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_setups([self.setup])
        if self.warmup >= self.duration:
            raise ValueError(
                f"--warmup ({self.warmup:g} s) must be shorter than --duration "
                f"({self.duration:g} s): memory is judged on the samples after warm-up"
            )
        if self.sample_every * 6 > self.duration - self.warmup:
            raise ValueError(
                f"--sample-every {self.sample_every:g} s leaves fewer than 6 samples after "
                f"warm-up in {self.duration - self.warmup:g} s; sample more often or soak longer"
            )


@dataclass(slots=True)
class ProcessUse:
    rss_mib: float
    fds: int
    processes: int


@dataclass(slots=True)
class Sample:
    at_s: float
    sent: int
    done: int
    failed: int
    in_flight: int
    servers: dict[str, dict[str, Any]] = field(default_factory=dict)


def tree_use(pid: int, children: bool = True) -> ProcessUse | None:
    """Resident memory (MiB) and open descriptors of `pid` and (unless `children` is
    False) all its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *(root.children(recursive=True) if children else ())]
    except psutil.Error:
        return None
    rss = fds = count = 0
    for proc in procs:
        try:
            rss += proc.memory_info().rss
            fds += proc.num_fds()
            count += 1
        except psutil.Error:
            continue  # it exited between listing and reading
    return ProcessUse(rss / 2**20, fds, count)


def server_metrics(url: str) -> dict[str, Any]:
    """What a soak watches on one server's /metrics; `error` if it cannot be read."""
    try:
        samples = scrape.scrape(url)
    except OSError as exc:
        return {"error": str(exc)}
    waiting = {
        dict(labels).get("what", "?"): value
        for (name, labels), value in samples.items()
        if name == "kvpush:waiting"
    }
    return {
        "kv_cache_usage": scrape.total(samples, "vllm:kv_cache_usage_perc"),
        "waiting": waiting,
        "failures": scrape.total(samples, "kvpush:failures_total"),
    }


def growth(values: Sequence[float]) -> float | None:
    """Percent change from the median of the first three values to that of the last three."""
    if len(values) < 6:
        return None
    first, last = statistics.median(values[:3]), statistics.median(values[-3:])
    return 100.0 * (last - first) / first if first else None


def verdict(spec: SoakSpec, samples: Sequence[Sample], failed: int) -> dict[str, Any]:
    """Per server: memory and descriptor growth after warm-up; whether the soak passed."""
    after = [s for s in samples if s.at_s >= spec.warmup]
    names = sorted({name for s in after for name in s.servers})
    servers: dict[str, dict[str, Any]] = {}
    problems = []
    for name in names:
        rss = [s.servers[name]["rss_mib"] for s in after if "rss_mib" in s.servers.get(name, {})]
        fds = [float(s.servers[name]["fds"]) for s in after if "fds" in s.servers.get(name, {})]
        mem, fd = growth(rss), growth(fds)
        servers[name] = {
            "rss_mib_first": rss[0] if rss else None,
            "rss_mib_last": rss[-1] if rss else None,
            "rss_growth_pct": mem,
            "fds_first": fds[0] if fds else None,
            "fds_last": fds[-1] if fds else None,
            "fds_growth_pct": fd,
        }
        if mem is None:
            problems.append(f"{name}: too few memory samples after warm-up")
        elif mem > spec.max_growth:
            problems.append(
                f"{name}: memory grew {mem:.1f}% after warm-up (limit {spec.max_growth:g}%)"
            )
    if failed:
        problems.append(f"{failed} request(s) failed")
    return {"passed": not problems, "problems": problems, "servers": servers}


def format_sample(sample: Sample) -> str:
    parts = [
        f"{sample.at_s:6.0f}s sent {sample.sent} done {sample.done} failed {sample.failed} "
        f"in flight {sample.in_flight}"
    ]
    for name, use in sample.servers.items():
        if "rss_mib" not in use:
            parts.append(f"{name} gone")
            continue
        text = f"{name} {use['rss_mib']:.0f} MiB {use['fds']} fds"
        if "kv_cache_usage" in use:
            # tombstones remember finished transfers (bounded): nothing waits on them
            waiting = use.get("waiting", {})
            busy = sum(n for what, n in waiting.items() if "tombstones" not in what)
            text += f" kv {100 * use['kv_cache_usage']:.0f}% waiting {busy:g}"
        parts.append(text)
    return " | ".join(parts)


# -- the run -------------------------------------------------------------------------------


async def soak(
    spec: SoakSpec,
    topology: Topology,
    url: str,
    prompts: Sequence[str],
    say: Callable[[str], None] = print,
) -> tuple[list[Sample], list[RequestResult]]:
    """Steady Poisson load for spec.duration seconds, sampled every spec.sample_every."""
    import os

    import aiohttp

    model = str(topology.config.model)
    rng = random.Random(spec.seed)
    results: list[RequestResult] = []
    samples: list[Sample] = []
    in_flight: set[asyncio.Task[None]] = set()
    sent = 0
    started = time.monotonic()

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        body = {
            "model": model,
            "prompt": f"request {index}: {prompts[index % len(prompts)]}",
            "max_tokens": spec.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        result = await stream_completion(session, url, body, index, spec.request_timeout)
        results.append(result)
        if not result.ok:
            say(f"  request {index} failed: {result.error}")

    def sample() -> Sample:
        failed = sum(not r.ok for r in results)
        now = Sample(time.monotonic() - started, sent, len(results), failed, len(in_flight))
        for server in topology.specs:
            proc = topology.procs.get(server.name)
            use = tree_use(proc.pid) if proc is not None and proc.poll() is None else None
            entry: dict[str, Any] = asdict(use) if use else {}
            if use:
                entry.update(server_metrics(server.url))
            now.servers[server.name] = entry
        mine = tree_use(os.getpid(), children=False)  # the servers are our children
        if mine:
            now.servers["proxy+load"] = asdict(mine)
        return now

    async def sampler() -> None:
        while True:
            now = await asyncio.to_thread(sample)
            samples.append(now)
            say(format_sample(now))
            await asyncio.sleep(spec.sample_every)

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        watch = asyncio.ensure_future(sampler())
        try:
            next_at = started
            while time.monotonic() - started < spec.duration:
                next_at += rng.expovariate(spec.rate)
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                while len(in_flight) >= spec.max_in_flight:  # overloaded: do not pile up
                    await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                task = asyncio.ensure_future(one(session, sent))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                sent += 1
                if sent % 50 == 0:
                    await asyncio.to_thread(topology.check_alive)
            if in_flight:
                await asyncio.wait(in_flight, timeout=spec.request_timeout + 5)
        finally:
            watch.cancel()
            for task in list(in_flight):
                task.cancel()
    final = await asyncio.to_thread(sample)
    samples.append(final)
    say(format_sample(final))
    return samples, results


def run_soak(spec: SoakSpec, pair: PairSettings, prompts: Sequence[str], out: Path) -> int:
    config = pair.topology(spec.setup, "soak")
    topology = Topology(config)
    for server in topology.specs:
        print(f"  {server.name} on {server.url}, log {server.log_path}", flush=True)
    try:
        topology.start()
        took = topology.wait_healthy(pair.startup_timeout, StartupProgress("  "))
        print(
            f"  servers healthy after {took:.0f} s; {spec.rate:g} req/s for "
            f"{spec.duration:g} s, a sample every {spec.sample_every:g} s",
            flush=True,
        )
        samples, results = asyncio.run(
            with_warm_proxy(
                topology,
                pair.port,
                lambda url: soak(spec, topology, url, prompts),
                request_timeout=spec.request_timeout + 10,
            )
        )
    except StartupError as exc:
        print(f"kvpush bench soak: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        topology.stop()
    failed = [r for r in results if not r.ok]
    judged = verdict(spec, samples, len(failed))
    record = {
        "spec": asdict(spec),
        "requests": len(results),
        "failed": len(failed),
        "errors": sorted({r.error or "" for r in failed})[:20],
        "verdict": judged,
        "samples": [asdict(s) for s in samples],
    }
    path = out / "soak.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"\n{len(results)} requests, {len(failed)} failed; samples in {path}")
    for name, use in judged["servers"].items():
        mem = use["rss_growth_pct"]
        fds = use["fds_growth_pct"]
        print(
            f"  {name}: memory {use['rss_mib_first']:.0f} -> {use['rss_mib_last']:.0f} MiB "
            f"({'n/a' if mem is None else f'{mem:+.1f}%'}), open fds {use['fds_first']:.0f} -> "
            f"{use['fds_last']:.0f} ({'n/a' if fds is None else f'{fds:+.1f}%'})"
        )
    if judged["passed"]:
        print("soak passed: no failed request, memory flat after warm-up")
        return 0
    print("soak FAILED: " + "; ".join(judged["problems"]))
    return 1


# -- command line --------------------------------------------------------------------------


def register(tools: Any) -> None:
    parser = tools.add_parser(
        "soak",
        help="steady load for a long time: failed requests, memory and fds of every server",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = SoakSpec()
    parser.add_argument(
        "--setup",
        default=defaults.setup,
        help=f"one of {', '.join(MAIN_SETUPS)} (default %(default)s)",
    )
    parser.add_argument(
        "--duration",
        type=positive(),
        default=defaults.duration,
        help="seconds of load (default %(default)s)",
    )
    parser.add_argument(
        "--rate", type=positive(), default=defaults.rate, help="requests per second"
    )
    parser.add_argument("--input-len", type=at_least(1), default=defaults.input_len)
    parser.add_argument("--output-len", type=at_least(1), default=defaults.output_len)
    parser.add_argument(
        "--warmup", type=positive(), default=defaults.warmup,
        help="seconds before memory is judged (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--sample-every", type=positive(), default=defaults.sample_every)
    parser.add_argument(
        "--max-growth", type=positive(), default=defaults.max_growth,
        help="percent of memory growth after warm-up that fails the soak (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-in-flight", type=at_least(1), default=defaults.max_in_flight,
        help="requests in flight before the load waits instead of piling up",
    )  # fmt: skip
    parser.add_argument("--request-timeout", type=positive(), default=defaults.request_timeout)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    add_pair_options(parser)
    parser.add_argument(
        "--out", type=Path, default=None, help="result directory (default results/soak/<time>)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        spec = SoakSpec(**{f.name: getattr(args, f.name) for f in fields(SoakSpec)})
    except ValueError as exc:
        print(f"{args.prog}: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path("results/soak") / time.strftime("%Y%m%d-%H%M%S")
    try:
        out.mkdir(parents=True, exist_ok=True)
        model = bench_model(args)
    except ValueError as exc:
        print(f"{args.prog}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{args.prog}: {cannot_write(exc, Path(exc.filename or out))}", file=sys.stderr)
        return 2
    prompts = model_prompts(model, 64, spec.input_len, spec.seed)
    pair = pair_settings(model, args)
    print(f"kvpush bench soak: {spec.setup}, results in {out}", flush=True)
    return run_soak(spec, pair, prompts, out)
