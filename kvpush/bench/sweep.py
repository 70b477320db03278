"""`kvpush bench sweep`: the articles' method, against vLLM's own connectors, in one run.

For every setup the sweep starts a 1P1D topology with the code `kvpush up` uses (prefill and
decode vLLM servers, prefix caching on as vLLM's default, our proxy in front), warms it up, and
runs `vllm bench serve` (random dataset, fixed seed, `--ignore-eos`) at every request rate x
input length, with a fixed output length and prompt count. Setups are interleaved across
iterations, each starting one setup later (A B C, B C A, C A B ...). Around each run it
scrapes both servers' /metrics (our connector's counters, vLLM's external-KV token counter)
and samples decode's waiting queue twice a second.

Each run ends in a result file, `OUT/<setup>_qps<q>_in<in>_out<out>_iter<i>.json`, plus its
log. A run that stalls, errors or cannot start is recorded as such with the reason, and the
sweep goes on: every request has the proxy's deadline (--request-timeout) and every run a
wall-clock deadline. Files already in OUT are not redone, so an interrupted sweep resumes
where it stopped (--retry-failed also redoes the runs that were not ok).

Before each run every server's prefix cache is emptied (vLLM's `POST /reset_prefix_cache`,
which vLLM serves only with VLLM_SERVER_DEV_MODE=1, set on the sweep's servers; vLLM's own
`vllm bench sweep` does the same). Prefix caching stays on, but one start of the servers runs
all of a setup's points, and `vllm bench serve`'s random prompts are runs of consecutive token
ids from a random offset: with a small vocabulary (the tiny model's 1,024) a later run's prompt
often starts where an earlier one did, and both servers would serve it from their caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.bench import compare, trace
from kvpush.bench import results as res
from kvpush.bench.results import Point, delta_total, engine_step_ms
from kvpush.testbed import scrape, source
from kvpush.testbed.pinning import OWN_GROUP, confined, pin_preexec
from kvpush.testbed.topology import (
    PairSettings,
    StartupError,
    StartupProgress,
    Topology,
    check_setups,
    first_token_of,
)
from kvpush.testbed.topology_proxy import local_url, start_topology_proxy, warm_up

# Below this share of decode's prompt tokens moved by KV transfer a run is flagged.
HANDED_OFF_LOW = 0.9
# What vLLM needs to serve POST /reset_prefix_cache (the sweep's servers only: a deployment's
# servers keep vLLM's development endpoints shut)
DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
# How long a reset may be retried while a server still holds blocks (a WRITE's release)
RESET_TIMEOUT_S = 10.0
# the sources of the proxy's first-token counter, recorded per run
FIRST_SOURCES = ("prefill", "decode", "mismatch")

# Counters kept as deltas over a run, besides every kvpush:* sample.
VLLM_COUNTERS = (
    "vllm:prompt_tokens_by_source_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
    # time between a request's tokens as the engine made them: decode's step, which the
    # streaming quality (`late_tokens`) is measured against
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    # arrival to first token and to the end, as each server's front end measured them:
    # the servers' share of TTFT (`results.servers_ttft_ms`), the rest is proxy and client
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    # the engine core's split of a server's TTFT: waiting to be scheduled, then scheduled
    # to the step that produced the first token (the forward, and the connector's hooks
    # on the way out of that step); the rest of TTFT is the front end and its IPC
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_count",
)


@dataclass(slots=True)
class SweepSpec:
    setups: list[str]
    rates: list[float]
    input_lens: list[int]
    output_len: int
    num_prompts: int
    iterations: int
    out: Path
    pair: PairSettings
    seed: int = 0
    request_timeout: float = 60.0
    run_timeout: float | None = None
    retry_failed: bool = False
    # Write OUT/trace/<run>.json per run (kvpush.bench.trace); runs the hook timer
    trace: bool = False
    # Where the proxy takes a streamed answer's first token from (None: each setup's own)
    first_token: str | None = None

    def __post_init__(self) -> None:
        check_setups(self.setups)
        for setup in self.setups:
            first_token_of(setup, self.first_token)  # a ValueError before anything starts
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError("--rates: give one or more request rates > 0 (requests/s)")
        if not self.input_lens or any(n < 1 for n in self.input_lens):
            raise ValueError("--input-lens: give one or more prompt lengths >= 1 (tokens)")
        if self.output_len < 1 or self.num_prompts < 1 or self.iterations < 1:
            raise ValueError("--output-len, --num-prompts and --iterations must be >= 1")
        if self.request_timeout <= 0 or (self.run_timeout is not None and self.run_timeout <= 0):
            raise ValueError("--request-timeout and --run-timeout must be > 0 seconds")

    def deadline(self, point: Point) -> float:
        """Wall-clock limit of one run: arrivals + the slowest request + start-up slack."""
        if self.run_timeout is not None:
            return self.run_timeout
        return self.num_prompts / point.rate + self.request_timeout + 90.0

    def points(self) -> list[Point]:
        return [p for _, _, ps in self.groups() for p in ps]

    def groups(self) -> list[tuple[int, str, list[Point]]]:
        return res.plan(self.setups, self.rates, self.input_lens, self.output_len, self.iterations)


def bench_command(spec: SweepSpec, point: Point, url: str, raw_dir: Path) -> list[str]:
    """The `vllm bench serve` command line of one run."""
    return [
        sys.executable,
        "-m",
        "kvpush.bench.vllm_cli",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        str(spec.pair.model),
        "--tokenizer",
        str(spec.pair.model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(point.input_len),
        "--random-output-len",
        str(point.output_len),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(spec.num_prompts),
        "--request-rate",
        f"{point.rate:g}",
        "--seed",
        str(point.seed(spec.seed)),
        "--ignore-eos",
        "--temperature",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--ready-check-timeout-sec",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(raw_dir),
        "--result-filename",
        f"{point.stem}.vllm.json",
    ]


# -- the proxy, in a thread of this process ------------------------------------------------


class Direct:
    """In place of the proxy for the single setup: the load goes straight to its server (a
    deployment that does not disaggregate has no proxy to pay for)."""

    native_id = None

    def __init__(self, topology: Topology) -> None:
        self.url = topology.specs[0].url

    def log_chunks(self) -> None:
        return None

    def logged_chunks(self) -> dict[str, list[tuple[float, int]]] | None:
        return None  # no proxy: the client's own timestamps are all there is

    def first_tokens(self) -> dict[str, int] | None:
        return None  # one server sends every token

    def __enter__(self) -> Direct:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def front(
    topology: Topology, port: int, request_timeout: float, first_token: str | None = None
) -> ProxyThread | Direct:
    """Where a run's load is sent: the proxy in front of a pair (`first_token`: where it
    takes a streamed answer's first token from, None: the setup's own), or the single
    server."""
    if topology.config.setup is None:
        return Direct(topology)
    return ProxyThread(topology, port, request_timeout, first_token)


class ProxyThread:
    """Our proxy on its own event loop, for the duration of one group of runs."""

    def __init__(
        self,
        topology: Topology,
        port: int,
        request_timeout: float,
        first_token: str | None = None,
    ) -> None:
        self.topology, self.port, self.request_timeout = topology, port, request_timeout
        self.first_token = first_token_of(topology.config.setup or "", first_token)
        # The proxy's own log (failed requests, ejections) goes next to the servers' logs,
        # not into the sweep's progress output.
        self.log_path = topology.config.workdir / "logs" / "proxy.log"
        self.logger = logging.getLogger("kvpush.proxy")
        self.handler: logging.Handler | None = None
        from kvpush.proxy.server import new_event_loop  # imported when used: see topology_proxy

        self.loop = new_event_loop()  # the loop `kvpush proxy` serves on
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.runner: Any = None
        self.native_id: int | None = None  # the thread's id in /proc, for --trace
        self.thread = threading.Thread(target=self._main, name="kvpush-proxy", daemon=True)

    @property
    def url(self) -> str:
        return local_url(self.port)

    def _proxy(self) -> Any:
        from kvpush.proxy.server import PROXY_KEY

        return self.runner.app[PROXY_KEY]

    def log_chunks(self) -> None:
        """From now on, keep when each chunk of decode's answers reached the proxy."""
        self._proxy().chunk_logs = {}

    def logged_chunks(self) -> dict[str, list[tuple[float, int]]] | None:
        """What was kept since `log_chunks`, by request id; and stop keeping it."""
        proxy = self._proxy()
        logs, proxy.chunk_logs = proxy.chunk_logs, None
        return dict(logs) if logs is not None else None

    def first_tokens(self) -> dict[str, int]:
        """How many streamed first tokens the proxy took from each source so far."""
        counts: dict[str, int] = self._proxy().metrics.first_token_counts()
        return counts

    def __enter__(self) -> ProxyThread:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.handler = logging.FileHandler(self.log_path)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        self.thread.start()
        self.ready.wait()
        if self.error is not None:
            raise StartupError(f"the proxy did not start on port {self.port}: {self.error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if self.handler is not None:
            self.logger.removeHandler(self.handler)
            self.handler.close()
        self.logger.propagate = True

    def _main(self) -> None:
        self.native_id = threading.get_native_id()
        with confined(self.topology.client_cores):  # this thread only
            self._serve()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            starting = start_topology_proxy(
                self.topology,
                self.port,
                request_timeout=self.request_timeout,
                # A vLLM server on a saturated CPU can take seconds to answer /health;
                # ejecting it would abort the very requests being measured. Only a server
                # silent for over a minute (or refusing connections) is ejected here.
                health_timeout=10.0,
                eject_after=10,
                first_token=self.first_token,
            )
            self.runner = self.loop.run_until_complete(starting)
        except Exception as exc:  # reported by __enter__, in the sweep's own thread
            self.error = exc
        finally:
            self.ready.set()
        if self.error is None:
            self.loop.run_forever()
        self.loop.close()


# -- metrics around a run ------------------------------------------------------------------


WAITING, RUNNING = QUEUES = ("vllm:num_requests_waiting", "vllm:num_requests_running")


class QueueSampler:
    """Samples decode's waiting and running queues twice a second during a run."""

    def __init__(self, url: str, every: float = 0.5) -> None:
        self.url, self.every = url, every
        self.times: list[float] = []  # time.monotonic() of each sample
        self.waiting: list[float] = []
        self.running: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="kvpush-sampler", daemon=True)

    def __enter__(self) -> QueueSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)

    def _loop(self) -> None:
        while not self.stop.wait(self.every):
            with contextlib.suppress(OSError, ValueError):
                # only the two gauges parsed: this thread shares the GIL with the proxy's
                samples = scrape.scrape(self.url, timeout=2.0, only=QUEUES)
                self.waiting.append(scrape.total(samples, WAITING))
                self.running.append(scrape.total(samples, RUNNING))
                self.times.append(time.monotonic())

    def summary(self) -> dict[str, Any]:
        def stats(values: list[float]) -> dict[str, float | None]:
            if not values:
                return {"max": None, "mean": None}
            return {"max": max(values), "mean": sum(values) / len(values)}

        return {
            "samples": len(self.waiting),
            "waiting": stats(self.waiting),
            "running": stats(self.running),
        }


def safe_scrape(url: str) -> dict[scrape.Sample, float]:
    try:
        return scrape.scrape(url, timeout=3.0)
    except (OSError, ValueError):
        return {}


def reset_prefix_caches(urls: Iterable[str], timeout: float = RESET_TIMEOUT_S) -> str | None:
    """Empty the prefix cache of every server in `urls`, retrying while one still holds
    blocks (vLLM refuses then); None when all were emptied, else what went wrong."""
    for url in urls:
        deadline = time.monotonic() + timeout
        while True:
            try:
                request = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    body = response.read()
            except urllib.error.HTTPError as exc:
                hint = " (is VLLM_SERVER_DEV_MODE=1 set?)" if exc.code == 404 else ""
                return f"{url}/reset_prefix_cache answered HTTP {exc.code}{hint}"
            except OSError as exc:
                return f"{url}/reset_prefix_cache failed: {exc}"
            with contextlib.suppress(ValueError):
                if json.loads(body).get("success") is True:
                    break
            if time.monotonic() >= deadline:
                return f"{url} still held KV blocks after {timeout:g} s, so its prefix cache stayed"
            time.sleep(0.2)
    return None


def metric_deltas(
    before: dict[scrape.Sample, float], after: dict[scrape.Sample, float]
) -> dict[str, float]:
    """Changes of our counters and a few of vLLM's over a run, as 'name{labels}': delta."""
    deltas = {}
    for (name, labels), value in after.items():
        if not (name.startswith("kvpush:") or name in VLLM_COUNTERS):
            continue
        if name.startswith("kvpush:") and (name.endswith("_bucket") or name == "kvpush:info"):
            continue
        delta = value - before.get((name, labels), 0.0)
        if delta:
            label_text = ",".join(f'{k}="{v}"' for k, v in labels)
            deltas[f"{name}{{{label_text}}}" if labels else name] = round(delta, 6)
    return deltas


def first_token_sources(
    before: dict[str, int] | None, after: dict[str, int] | None
) -> dict[str, int] | None:
    """Where the proxy took the streamed first tokens of one run from, by source (prefill,
    decode; mismatch: decode did not reproduce prefill's token), from its counter before
    and after. None without a proxy (the single setup)."""
    if before is None or after is None:
        return None
    return {source: after.get(source, 0) - before.get(source, 0) for source in FIRST_SOURCES}


def handed_off(deltas: dict[str, float] | None) -> float | None:
    """The share of decode's prompt tokens that came by KV transfer over a run (None: no
    decode, or no prompt tokens counted). Below 1 decode computed the rest itself: prompts
    it had cached, or a last partial block; a run that measures the handoff needs ~1."""
    if not deltas:
        return None
    name = "vllm:prompt_tokens_by_source_total"
    total = delta_total(deltas, name)
    if total <= 0:
        return None
    return round(delta_total(deltas, name, source="external_kv_transfer") / total, 4)


# -- one run ---------------------------------------------------------------------------------


def run_point(
    spec: SweepSpec, point: Point, topology: Topology, proxy: ProxyThread | Direct
) -> dict[str, Any]:
    """Run `vllm bench serve` once through `proxy` and return the run's result record
    (with `spec.trace`, also write its trace: the proxy thread's CPU and the chunks it
    relayed among what it holds)."""
    proxy_url = proxy.url
    raw_dir = spec.out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    raw_path = raw_dir / f"{point.stem}.vllm.json"
    raw_path.unlink(missing_ok=True)
    command = bench_command(spec, point, proxy_url, raw_dir)
    servers = server_urls(topology)
    decode_url = servers.get("decode") or servers["single"]
    not_reset = reset_prefix_caches(servers.values())
    before = {role: safe_scrape(url) for role, url in servers.items()}
    firsts_before = proxy.first_tokens()
    deadline = spec.deadline(point)
    started = time.time()
    status: str | None = None
    reason: str | None = None
    log_path = point.log_path(spec.out)
    client = topology.client_cores
    tracer = trace.Tracer(topology, proxy_tid=proxy.native_id) if spec.trace else None
    with open(log_path, "wb") as log, QueueSampler(decode_url) as sampler:
        log.write(("$ " + " ".join(command) + "\n").encode())
        log.flush()
        if tracer is not None:
            tracer.start()
            proxy.log_chunks()
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            **OWN_GROUP,
            preexec_fn=None if client is None else pin_preexec(client),
        )
        if tracer is not None:
            tracer.watch_client(proc.pid)
        try:
            code = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = None
            status = "stalled"
            reason = (
                f"vllm bench serve was still running at the run's {deadline:.0f} s deadline "
                "(requests never finished); killed"
            )
    elapsed = time.time() - started
    if tracer is not None:
        tracer.stop()
    after = {role: safe_scrape(url) for role, url in servers.items()}
    deltas = {role: metric_deltas(before[role], after[role]) for role in servers}
    firsts = first_token_sources(firsts_before, proxy.first_tokens())
    summary: dict[str, Any] = {}
    raw = res.read_raw(raw_path)
    if raw is not None:
        summary = res.summarise_bench(
            raw, engine_step_ms(deltas.get("decode", deltas.get("single")))
        )
        if status is None:
            status, reason = res.classify(summary, spec.num_prompts)
    elif status is None:
        status = "error"
        reason = f"vllm bench serve exited with code {code} and wrote no result: " + (
            _last_error(log_path) or f"see {log_path}"
        )
    try:
        topology.check_alive()
    except StartupError as exc:
        status, reason = "server died", str(exc).splitlines()[0]
    handed = handed_off(deltas.get("decode"))
    if handed is not None:
        summary["kv_handed_off"] = handed
    traced: dict[str, Any] = {}
    if tracer is not None:
        record = tracer.result(
            raw, sampler.times, sampler.waiting, sampler.running, proxy.logged_chunks()
        )
        trace_path = spec.out / "trace" / f"{point.stem}.json"
        trace.write(trace_path, record)
        traced = {
            "trace": str(trace_path.relative_to(spec.out)),
            "trace_summary": record["summary"],
        }
    return {
        **record_head(spec, point, topology),
        "status": status,
        "reason": reason,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "wall_s": round(elapsed, 2),
        "deadline_s": round(deadline, 1),
        **summary,
        "decode_queue": sampler.summary(),
        # every server's prefix cache emptied before the run (else why not)
        "prefix_cache_reset": not_reset is None,
        **({} if not_reset is None else {"prefix_cache_not_reset": not_reset}),
        "metrics": deltas,
        "first_token_sources": firsts,
        "command": command,
        "log": log_path.name,
        **traced,
    }


def server_urls(topology: Topology) -> dict[str, str]:
    """The servers scraped around a run, by role: decode and prefill, or single."""
    if not topology.decode:
        return {"single": topology.specs[0].url}
    return {"decode": topology.decode[0].url, "prefill": topology.prefill[0].url}


def record_head(spec: SweepSpec, point: Point, topology: Topology) -> dict[str, Any]:
    return {
        "schema": res.SCHEMA,
        "setup": point.setup,
        "rate": point.rate,
        "input_len": point.input_len,
        "output_len": point.output_len,
        "iteration": point.iteration,
        "num_prompts": spec.num_prompts,
        "max_num_seqs": spec.pair.max_num_seqs,
        "prefix_caching": spec.pair.prefix_caching,
        "model": str(spec.pair.model),
        "seed": point.seed(spec.seed),
        "host": res.host_cpu(),  # CPU model, cores, AVX-512 or AMX or not: numbers differ by host
        # the kvpush code the servers ran (its source hash tells edits apart, committed or not)
        "code": topology.code or source.code_version(),
        # which cores each server ran on, and whether its whole process tree was held there
        "pinning": topology.pinning(),
        # where the proxy took a streamed answer's first token from (None: no proxy)
        "first_token": first_token_of(point.setup, spec.first_token),
    }


def not_run(
    spec: SweepSpec, point: Point, topology: Topology, status: str, reason: str
) -> dict[str, Any]:
    """The record of a run that could not happen (servers did not start, warm-up failed)."""
    return {
        **record_head(spec, point, topology),
        "status": status,
        "reason": reason,
        "completed": 0,
    }


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
            return


def _last_error(log_path: Path) -> str | None:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line.strip()[:300]
    return None


# -- the sweep -------------------------------------------------------------------------------


class Progress:
    """A one-line bar after each run: where the sweep is, and an ETA from its pace so far."""

    def __init__(self, total: int, done: int, width: int = 24) -> None:
        self.total, self.done, self.width = total, done, width
        self.started = time.monotonic()
        self.ran = 0

    def eta(self) -> str:
        if self.ran == 0:
            return "?"
        left = (self.total - self.done) * (time.monotonic() - self.started) / self.ran
        return format_duration(left)

    def advance(self, ran: bool = True) -> None:
        self.done += 1
        self.ran += int(ran)

    def bar(self) -> str:
        filled = round(self.width * self.done / self.total) if self.total else self.width
        return (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} runs, "
            f"{format_duration(time.monotonic() - self.started)} elapsed, ETA {self.eta()}"
        )


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def describe(result: dict[str, Any]) -> str:
    if result["status"] != "ok":
        return f"{result['status']}: {result.get('reason')}"
    ttft, tpot = result.get("ttft") or {}, result.get("tpot") or {}
    second = (result.get("tt2t") or {}).get("p50")
    line = (
        f"ok, TTFT p50 {_ms(ttft.get('p50'))} p99 {_ms(ttft.get('p99'))}"
        + (f" (2nd token {_ms(second)})" if second is not None else "")
        + f", TPOT p50 {_ms(tpot.get('p50'))} ms, {result.get('request_throughput') or 0:.2f} req/s"
    )
    burst = result.get("one_burst")
    if burst:
        line += f", {burst:.0%} of answers in one burst (TTFT holds their decode)"
    late = result.get("late_tokens")
    if late is not None:
        line += f", {late:.0%} of tokens late (>{res.LATE_STEPS} steps)"
    prefill, streams = res.first_token_split(result)
    if result.get("first_token") == "prefill" and streams:
        line += f", first token from prefill in {prefill} of {streams}"
        mismatch = result["first_token_sources"].get("mismatch")
        if mismatch:
            line += f" ({mismatch} not reproduced by decode)"
    if result.get("prefix_cache_not_reset"):
        line += f"; WARNING: {result['prefix_cache_not_reset']}"
    handed = result.get("kv_handed_off")
    if handed is not None and handed < HANDED_OFF_LOW:
        line += (
            f"; WARNING: only {handed:.0%} of decode's prompt tokens came by KV transfer "
            "(decode computed the rest: prompts it had cached?), so this run hardly "
            "measures the handoff"
        )
    return line


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


Say = Callable[[str], None]


def run_sweep(spec: SweepSpec, say: Say = print) -> list[dict[str, Any]]:
    """Run every group not already done; returns the results written this time."""
    spec.out.mkdir(parents=True, exist_ok=True)
    points = spec.points()
    todo = [p for p in points if not res.is_done(p, spec.out, spec.retry_failed)]
    say(
        f"kvpush bench sweep: {len(points)} runs ({len(spec.setups)} setups x "
        f"{len(spec.rates)} rates x {len(spec.input_lens)} input lengths x "
        f"{spec.iterations} iterations), {len(points) - len(todo)} already in {spec.out}; "
        f"host: {res.describe_host(res.host_cpu())}"
    )
    code = source.describe_code(source.code_version())
    say(f"code: {code}")
    progress = Progress(len(points), len(points) - len(todo))
    written: list[dict[str, Any]] = []
    warned = False
    for iteration, setup, group in spec.groups():
        pending = [p for p in group if p in todo]
        if not pending:
            continue
        say(f"\n== iteration {iteration}, {setup}: {len(pending)} runs")
        ran = run_group(spec, setup, pending, progress, say)
        written += ran
        others = {source.describe_code(r.get("code")) for r in ran} - {code}
        if others and not warned:
            warned = True
            say(
                f"WARNING: kvpush's source changed while the sweep ran ({'; '.join(sorted(others))}"
                f"): its results mix code versions; run the sweep again into a new --out "
                f"without editing the checkout meanwhile"
            )
    say(f"\nsweep finished: {progress.bar()}")
    return written


def run_group(
    spec: SweepSpec, setup: str, points: Sequence[Point], progress: Progress, say: Say
) -> list[dict[str, Any]]:
    """One start of the servers for a setup's runs; restarted after a stall or a crash."""
    written: list[dict[str, Any]] = []
    queue = list(points)
    while queue:
        pair = spec.pair
        config = pair.topology(setup, "sweep", timed_hooks=spec.trace)
        config.extra_env.update(DEV_MODE_ENV)
        topology = Topology(config)
        try:
            topology.start()
            took = topology.wait_healthy(pair.startup_timeout, StartupProgress(f"[{setup}] "))
            say(f"  [{setup}] servers healthy after {took:.0f} s{topology.moved_back_note()}")
            with front(topology, pair.port, spec.request_timeout, spec.first_token) as proxy:
                error = asyncio.run(warm_up(proxy.url, str(pair.model)))
                reason = f"warm-up through the proxy failed: {error}" if error else None
                if reason is not None and (why := compare.trouble(topology)) is not None:
                    reason += f"; {why}"
                if reason is None and topology.config.worker_alone:
                    # the first contact may have started threads on the lone worker's core
                    reason = _isolate(topology, setup, say)
                if reason:
                    say(f"  [{setup}] {reason}")
                    written += _record_all(spec, queue, topology, "failed", reason, progress, say)
                    return written
                while queue:
                    point = queue.pop(0)
                    say(
                        f"  [{setup}] qps {point.rate:g}, {point.input_len} in / "
                        f"{point.output_len} out, {spec.num_prompts} prompts ..."
                    )
                    result = run_point(spec, point, topology, proxy)
                    res.write_result(point.path(spec.out), result)
                    written.append(result)
                    progress.advance()
                    say(f"  [{setup}] {describe(result)}\n  {progress.bar()}")
                    if "trace_summary" in result:
                        say(f"  [{setup}] {trace.describe({'summary': result['trace_summary']})}")
                    if result["status"] in ("stalled", "server died") and queue:
                        say(f"  [{setup}] restarting the servers for the next runs")
                        break
        except StartupError as exc:
            reason = str(exc).splitlines()[0]
            say(f"  [{setup}] did not start: {reason}")
            written += _record_all(spec, queue, topology, "not started", reason, progress, say)
            return written
        finally:
            topology.stop()
    return written


def _isolate(topology: Topology, setup: str, say: Say) -> str | None:
    """Move what runs next to the lone worker aside again; the error, if it cannot."""
    try:
        moved = topology.confine()
    except ValueError as exc:
        return f"could not give the model worker its core alone: {exc}"
    say(f"  [{setup}] {moved} threads moved off the lone worker's core after the warm-up")
    return None


def _record_all(
    spec: SweepSpec,
    points: list[Point],
    topology: Topology,
    status: str,
    reason: str,
    progress: Progress,
    say: Say,
) -> list[dict[str, Any]]:
    written = []
    for point in points:
        record = not_run(spec, point, topology, status, reason)
        res.write_result(point.path(spec.out), record)
        written.append(record)
        progress.advance(ran=False)
    points.clear()
    say(f"  {progress.bar()}")
    return written
