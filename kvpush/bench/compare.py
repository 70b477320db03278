"""`kvpush bench compare`: every setup 1P1D, the same prompts, one table; the text must agree.

For each setup the demo starts the servers (eager mode, to start faster) and the proxy
in-process, warms the pair up, streams a bounded load through the proxy, and stops
everything again. Each request has a deadline; the first one that misses it marks the
setup as stalled and the rest are not sent, so a stuck setup costs one deadline, not one
per request. A setup that fails to start or stalls is reported with its reason and the
demo moves on to the next.

TTFT is the client's time to the first streamed token; TPOT is
(last token time - first token time) / (output tokens - 1). Both are measured at the
client, through the proxy; timings on shared CPU machines are noisy, so compare setups
within one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.args import at_least, cannot_write, port_number, positive
from kvpush.bench.timed import read_ledgers, subtract_ledgers
from kvpush.report import format_table
from kvpush.testbed.logcause import FATAL_SIGNS, root_cause
from kvpush.testbed.model import TinyModelSpec, ensure_tiny_model, synthetic_corpus
from kvpush.testbed.pinning import NO_PIN_HELP, confined
from kvpush.testbed.topology import (
    BENCH_SETUPS,
    MAIN_SETUPS,
    SINGLE,
    PairSettings,
    StartupError,
    StartupProgress,
    Topology,
    check_setups,
    hook_dir,
    log_cause,
    resolve_setup,
    worker_alone_cores,
)
from kvpush.testbed.topology_proxy import cannot_listen, local_url, start_topology_proxy, warm_up


@dataclass(frozen=True, slots=True)
class LoadSpec:
    requests: int = 16
    concurrency: int = 4
    input_len: int = 200
    output_len: int = 32
    request_timeout: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("requests", "concurrency", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if not self.request_timeout > 0:
            raise ValueError("--request-timeout must be positive")


@dataclass(slots=True)
class RequestResult:
    index: int
    text: str = ""
    tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    error: str | None = None
    timed_out: bool = False
    prompt_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class SetupReport:
    """What one setup did. `status`: ok, failed, stalled, not started, skipped."""

    setup: str
    status: str
    reason: str = ""
    startup_s: float | None = None
    results: list[RequestResult] = field(default_factory=list)
    # With timed hooks: per server name, {"scheduler"|"worker": {"seconds": .., "calls": ..}}
    # over the load after the warm-up (steady state), and the warm-up request's alone
    # (first contact between the servers: handshakes, first registrations)
    hooks: dict[str, dict[str, Any]] = field(default_factory=dict)
    hooks_warm_up: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def texts(self) -> dict[int, str]:
        return {r.index: r.text for r in self.results if r.ok}


@dataclass(frozen=True, slots=True)
class Summary:
    done: int
    failed: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None


# -- pure parts: statistics, stream parsing, prompts, the table ---------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolating linearly between ranks; None if empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(results: Sequence[RequestResult]) -> Summary:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    return Summary(
        done=len(ok),
        failed=len(results) - len(ok),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        tpot_p50_s=percentile(tpots, 50),
    )


def token_timing(
    started: float, token_times: Sequence[float], tokens: int
) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) in seconds from the arrival times of the streamed chunks."""
    if not token_times:
        return None, None
    ttft = token_times[0] - started
    if tokens < 2:
        return ttft, None
    return ttft, (token_times[-1] - token_times[0]) / (tokens - 1)


def parse_event(line: bytes) -> dict[str, Any] | None:
    """One server-sent-events line: its JSON payload, or None for anything else."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return None
    payload = json.loads(data)
    if not isinstance(payload, dict):
        raise ValueError(f"stream chunk is not a JSON object: {data[:100]!r}")
    return payload


def make_prompts(
    count: int, input_len: int, seed: int, count_tokens: Callable[[str], int]
) -> list[str]:
    """`count` prompts of random words, each at least `input_len` tokens long."""
    rng = random.Random(seed)
    words = [w for line in synthetic_corpus(seed + 1, lines=400) for w in line.split()]
    prompts = []
    for _ in range(count):
        chosen: list[str] = []
        while True:
            chosen += rng.choices(words, k=16)
            if count_tokens(" ".join(chosen)) >= input_len:
                break
        prompts.append(" ".join(chosen))
    return prompts


def add_pair_options(parser: argparse.ArgumentParser) -> None:
    """The pair's ports, work directory, model and start-up deadline (`kvpush bench soak`,
    `kvpush bench turns`); read back with `bench_model` and `pair_settings`."""
    parser.add_argument("--port", type=port_number(), default=8000, help="proxy port")
    parser.add_argument("--kv-port", type=port_number(), default=5600, help="first kvpush port")
    parser.add_argument("--workdir", type=Path, default=Path(".kvpush"))
    parser.add_argument(
        "--model", type=Path, default=None,
        help="model directory (default: the tiny model, built under WORKDIR/models/tiny)",
    )  # fmt: skip
    parser.add_argument("--startup-timeout", type=positive(), default=300.0)
    parser.add_argument("--no-pin", dest="pin", action="store_false", help=NO_PIN_HELP)


def bench_model(args: argparse.Namespace) -> Path:
    """--model if given (it must hold a model: ValueError), else the tiny model under
    WORKDIR/models/tiny, built on first use (OSError if WORKDIR cannot be written)."""
    if args.model is not None:
        if not (args.model / "tokenizer.json").exists():
            raise ValueError(f"--model {args.model} holds no model (no tokenizer.json)")
        return Path(args.model)
    model = Path(args.workdir) / "models" / "tiny"
    ensure_tiny_model(model, TinyModelSpec())
    return model


def model_prompts(model: Path, count: int, input_len: int, seed: int) -> list[str]:
    """`make_prompts` with lengths counted by `model`'s own tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    return make_prompts(count, input_len, seed, lambda text: len(tokenizer.encode(text).ids))


def pair_settings(model: Path, args: argparse.Namespace) -> PairSettings:
    """The 1P1D pair from the --workdir, --port, --kv-port, --startup-timeout and --no-pin
    options."""
    return PairSettings(
        model,
        workdir=args.workdir,
        port=args.port,
        kv_port=args.kv_port,
        startup_timeout=args.startup_timeout,
        pin=args.pin,
        worker_alone=getattr(args, "worker_alone", ""),
    )


def failure_reason(results: Sequence[RequestResult], total: int) -> tuple[str, str]:
    """(status, reason) of a load in which some request failed."""
    stalled = next((r for r in results if r.timed_out), None)
    failed = [r for r in results if not r.ok]
    if stalled is not None:
        others = len(failed) - 1
        return "stalled", (
            f"request {stalled.index}: {stalled.error}; "
            f"{others} more not completed (timed out too, cancelled or never sent)"
        )
    first = failed[0]
    return (
        "failed",
        f"{len(failed)} of {total} requests failed; first, {first.index}: {first.error}",
    )


def text_agreement(reports: Sequence[SetupReport]) -> tuple[dict[str, str], list[int]]:
    """Per setup, how many answers equal the reference setup's; and the prompts that differ.

    The reference is the first setup that answered anything. A prompt differs when any two
    setups that answered it returned different text.
    """
    answered = [r for r in reports if r.texts]
    column: dict[str, str] = {r.setup: "-" for r in reports}
    if not answered:
        return column, []
    reference = answered[0].texts
    column[answered[0].setup] = "ref"
    for report in answered[1:]:
        common = [i for i in report.texts if i in reference]
        same = sum(report.texts[i] == reference[i] for i in common)
        column[report.setup] = f"{same}/{len(common)}"
    prompts = sorted({i for r in answered for i in r.texts})
    differing = [i for i in prompts if len({r.texts[i] for r in answered if i in r.texts}) > 1]
    return column, differing


def format_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def render_table(reports: Sequence[SetupReport], load: LoadSpec) -> str:
    same, differing = text_agreement(reports)
    headers = ["setup", "result", "requests ok", "TTFT p50", "TTFT p99", "TPOT p50", "same text"]
    rows = []
    for report in reports:
        s = summarise(report.results)
        done = f"{s.done}/{load.requests}" if report.status != "skipped" else "-"
        rows.append(
            [
                report.setup,
                report.status,
                done,
                format_ms(s.ttft_p50_s),
                format_ms(s.ttft_p99_s),
                format_ms(s.tpot_p50_s),
                same[report.setup],
            ]
        )
    lines = [
        f"{load.requests} streaming completions per setup, concurrency {load.concurrency}, "
        f"~{load.input_len}-token prompts, {load.output_len} output tokens, temperature 0",
        format_table(headers, rows),
        "(times in ms, measured at the client through the proxy; 'same text': answers equal "
        "to the reference setup's, 'ref')",
    ]
    lines += [f"{r.setup}: {r.reason}" for r in reports if r.reason]
    answered = [r for r in reports if r.texts]
    shared = [i for i in range(load.requests) if sum(i in r.texts for r in answered) > 1]
    if differing:
        shown = ", ".join(str(i) for i in differing[:10])
        lines.append(f"text at temperature 0 differs across setups for prompts {shown}")
    elif shared:
        lines.append(
            f"text at temperature 0 identical across {', '.join(r.setup for r in answered)} "
            f"({len(shared)} prompts answered by more than one setup)"
        )
    return "\n".join(lines)


def setups_to_run(requested: str | None, default: Sequence[str] = MAIN_SETUPS) -> list[str]:
    """The setups to run, in order; raises ValueError naming an unknown one."""
    names = [n.strip() for n in (requested or ",".join(default)).split(",") if n.strip()]
    check_setups(names)
    return names


# -- the load ------------------------------------------------------------------------------


async def run_load(
    send: Callable[[int], Awaitable[RequestResult]],
    count: int,
    concurrency: int,
    on_done: Callable[[RequestResult], None] = lambda _: None,
) -> list[RequestResult]:
    """Send requests 0..count-1, `concurrency` at a time; stop at the first timeout.

    After a timeout the setup is stalled: requests in flight are cancelled and the rest
    are not sent; both come back as failed results saying so.
    """
    results: dict[int, RequestResult] = {}
    pending = iter(range(count))
    stalled = asyncio.Event()

    async def worker() -> None:
        for index in pending:
            result = await send(index)
            results[index] = result
            on_done(result)
            if result.timed_out:
                stalled.set()
                return

    workers = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, count))]
    stall = asyncio.ensure_future(stalled.wait())
    try:
        while not all(w.done() for w in workers) and not stalled.is_set():
            await asyncio.wait([*workers, stall], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (*workers, stall):
            task.cancel()
        outcomes = await asyncio.gather(*workers, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    first_stall = min((r.index for r in results.values() if r.timed_out), default=None)
    for index in range(count):
        if index not in results:
            results[index] = RequestResult(
                index, error=f"not completed: request {first_stall} stalled before"
            )
    return [results[i] for i in range(count)]


async def stream_completion(
    session: Any,
    url: str,
    body: dict[str, Any],
    index: int,
    timeout: float,
    path: str = "/v1/completions",
) -> RequestResult:
    """One streaming completion (or, with `path` /v1/chat/completions, chat completion)
    with a deadline; never raises for a failed request."""
    import aiohttp

    started = time.perf_counter()
    token_times: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url + path, json=body) as resp:
                if resp.status != 200:
                    detail = (await resp.text(errors="replace"))[:300]
                    return RequestResult(index, error=f"HTTP {resp.status}: {detail}")
                async for line in resp.content:
                    event = parse_event(line)
                    if event is None:
                        continue
                    if "error" in event:
                        return RequestResult(index, error=f"in-stream error: {event['error']}")
                    usage = event.get("usage") or usage
                    choices = event.get("choices") or []
                    if not choices:
                        continue
                    if "text" in choices[0]:
                        texts = [c.get("text") or "" for c in choices]
                    else:  # chat: a delta; the first one may carry the role only
                        texts = [(c.get("delta") or {}).get("content") or "" for c in choices]
                        if not any(texts):
                            continue
                    token_times.append(time.perf_counter())
                    pieces.append("".join(texts))
    except TimeoutError:
        return RequestResult(
            index, error=f"no complete answer within {timeout:g} s", timed_out=True
        )
    except (aiohttp.ClientError, ValueError) as exc:
        return RequestResult(index, error=f"{type(exc).__name__}: {exc}")
    counted = usage.get("completion_tokens")
    tokens = counted if counted is not None else len(token_times)
    ttft, tpot = token_timing(started, token_times, tokens)
    if ttft is None:
        return RequestResult(index, error="the stream ended without a token")
    prompt = int(usage.get("prompt_tokens") or 0)
    return RequestResult(index, "".join(pieces), tokens, ttft, tpot, prompt_tokens=prompt)


# -- one setup -----------------------------------------------------------------------------


def run_setup(
    setup: str,
    pair: PairSettings,
    load: LoadSpec,
    prompts: list[str],
    timed_hooks: bool = False,
    label: str = "compare",
) -> SetupReport:
    try:
        if setup != SINGLE:
            resolve_setup(setup)
    except ValueError as exc:
        print(f"\n== {setup}: skipped ({exc})", flush=True)
        return SetupReport(setup, "skipped", str(exc))
    servers = "one plain server" if setup == SINGLE else "1 prefill + 1 decode"
    print(f"\n== {setup}: starting {servers} (eager mode)", flush=True)
    config = pair.topology(setup, label, timed_hooks)
    topology = Topology(config)
    pinning = topology.pinning()
    for spec in topology.specs:
        cores = pinning["servers"][spec.name]
        print(
            f"  [{setup}] {spec.name} on {spec.url}, cores {cores['cores']} "
            f"({cores['confined']}), log {spec.log_path}",
            flush=True,
        )
    print(f"  [{setup}] proxy and client: {pinning['proxy_and_client']}", flush=True)
    try:
        topology.start()
        took = topology.wait_healthy(pair.startup_timeout, StartupProgress(f"[{setup}] "))
        print(f"  [{setup}] servers healthy after {took:.0f} s{topology.moved_back_note()}")

        def ledgers() -> dict[str, dict[str, Any]]:
            time.sleep(1.0)  # the ledgers are written every half second
            return {spec.name: read_ledgers(hook_dir(config, spec.name)) for spec in topology.specs}

        warmed: dict[str, dict[str, Any]] = {}

        def after_warm_up() -> None:
            if config.worker_alone:  # the first contact may have started threads
                isolate(topology, setup, "after the warm-up")
            warmed.update(ledgers())

        with confined(topology.client_cores):
            from kvpush.proxy.server import run_proxy_loop

            report = run_proxy_loop(
                _drive(
                    topology,
                    setup,
                    pair.port,
                    load,
                    prompts,
                    after_warm_up if config.timed_hooks else None,
                )
            )
        report.startup_s = took
        if config.worker_alone:
            isolate(topology, setup, "after the load")
        if config.timed_hooks:  # not for single, which has no connector
            total = ledgers()
            report.hooks_warm_up = warmed
            report.hooks = {
                name: subtract_ledgers(ledger, warmed.get(name, {}))
                for name, ledger in total.items()
            }
        return report
    except StartupError as exc:
        reason = _startup_failure(topology, exc)
        print(f"  [{setup}] did not start: {reason}", flush=True)
        return SetupReport(setup, "not started", reason)
    finally:
        topology.stop()
        print(f"  [{setup}] servers stopped", flush=True)


def isolate(topology: Topology, setup: str, when: str) -> None:
    """Move whatever of the server with a worker alone on its core runs on that core aside
    (threads started since the last time), and say how many did."""
    try:
        moved = topology.confine()
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    print(f"  [{setup}] {moved} threads moved off the lone worker's core {when}", flush=True)


def trouble(topology: Topology) -> str | None:
    """The first server whose log says its engine is gone, with the root cause and the
    log's path; None if no log says so."""
    for spec in topology.specs:
        try:
            log = spec.log_path.read_text(errors="replace")
        except OSError:
            continue
        if any(sign in log for sign in FATAL_SIGNS):
            return f"{spec.name}: {root_cause(log)} (log {spec.log_path})"
    return None


def _startup_failure(topology: Topology, exc: StartupError) -> str:
    """One line: which server died and the root cause from its log, else the error."""
    for spec in topology.specs:
        proc = topology.procs.get(spec.name)
        if proc is not None and proc.poll() is not None:
            cause = log_cause(spec.log_path)
            return f"{spec.name} exited with code {proc.returncode}: {cause} (log {spec.log_path})"
    return str(exc).splitlines()[0]


async def _drive(
    topology: Topology,
    setup: str,
    port: int,
    load: LoadSpec,
    prompts: list[str],
    after_warm_up: Callable[[], None] | None = None,
) -> SetupReport:
    import aiohttp

    runner: Any = None
    if topology.config.setup is None:  # single: straight to the server, as in a sweep
        url = topology.specs[0].url
    else:
        try:
            runner = await start_topology_proxy(
                topology,
                port,
                # Later than the client's deadline, so a stall shows as the client's timeout.
                request_timeout=load.request_timeout + 10,
            )
        except OSError as exc:
            raise cannot_listen(port, exc) from None
        url = local_url(port)
    model = str(topology.config.model)
    try:
        error = await warm_up(url, model)
        if error:
            print(f"  [{setup}] warm-up failed: {error}", flush=True)
            return SetupReport(setup, "failed", f"warm-up through the proxy failed: {error}")
        if after_warm_up is not None:
            await asyncio.to_thread(after_warm_up)
        print(f"  [{setup}] warm-up ok; sending {load.requests} requests", flush=True)
        done: list[RequestResult] = []

        def on_done(result: RequestResult) -> None:
            done.append(result)
            failed = sum(not r.ok for r in done)
            if len(done) % load.concurrency == 0 or not result.ok:
                note = f" (request {result.index}: {result.error})" if result.error else ""
                print(
                    f"  [{setup}] {len(done)}/{load.requests} requests done, {failed} failed{note}",
                    flush=True,
                )

        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        ) as session:

            def send(index: int) -> Awaitable[RequestResult]:
                body = {
                    "model": model,
                    "prompt": prompts[index],
                    "max_tokens": load.output_len,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                return stream_completion(session, url, body, index, load.request_timeout)

            results = await run_load(send, load.requests, load.concurrency, on_done)
            topology.check_alive()
    except StartupError as exc:
        return SetupReport(setup, "failed", f"a server died: {str(exc).splitlines()[0]}")
    finally:
        if runner is not None:
            await runner.cleanup()
    failures = [r for r in results if not r.ok]
    if not failures:
        return SetupReport(setup, "ok", results=results)
    return SetupReport(setup, *failure_reason(results, load.requests), results=results)


# -- command line --------------------------------------------------------------------------


def add_arguments(
    parser: argparse.ArgumentParser,
    default_setups: Sequence[str],
    choices: Sequence[str] = BENCH_SETUPS,
) -> None:
    """The setup, port and load options of `kvpush bench compare` and `kvpush bench hooks`."""
    others = [s for s in choices if s not in default_setups]
    single = (
        f"; {SINGLE} is one plain vLLM server on the pair's cores, no connector, the load "
        "sent straight to it"
        if SINGLE in choices
        else ""
    )
    parser.add_argument(
        "--setups",
        default=",".join(default_setups),
        help=f"comma-separated setups (default: {','.join(default_setups)}; also "
        f"{', '.join(others)}{single}; setups whose connector module is not installed are "
        "skipped)",
    )
    parser.add_argument(
        "--port", type=port_number(), default=8000, help="proxy port (default 8000)"
    )
    parser.add_argument(
        "--kv-port",
        type=port_number(),
        default=5600,
        help="first NIXL side-channel port (default 5600)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(".kvpush"),
        help="model, logs and caches (default .kvpush; the model goes to WORKDIR/models/tiny)",
    )
    defaults = LoadSpec()
    parser.add_argument("--requests", type=at_least(1), default=defaults.requests)
    parser.add_argument("--concurrency", type=at_least(1), default=defaults.concurrency)
    parser.add_argument(
        "--input-len", type=at_least(1), default=defaults.input_len, help="prompt tokens (at least)"
    )
    parser.add_argument("--output-len", type=at_least(1), default=defaults.output_len)
    parser.add_argument(
        "--request-timeout",
        type=positive(),
        default=defaults.request_timeout,
        help="deadline per request in seconds; the first miss marks the setup stalled",
    )
    parser.add_argument("--startup-timeout", type=positive(), default=300.0)
    parser.add_argument("--seed", type=int, default=defaults.seed, help="prompt RNG seed")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help=NO_PIN_HELP)


def run(args: argparse.Namespace) -> int:
    measured = run_all(args)
    if isinstance(measured, int):
        return measured
    reports, load = measured
    print(render_table(reports, load))
    # vLLM's own connectors failing or stalling is a measured result, not a demo failure;
    # kvpush's failing, or any setup answering different text, is.
    ran = [r for r in reports if r.status != "skipped"]
    ours_ok = all(r.status == "ok" for r in ran if r.setup.startswith("kvpush"))
    return 0 if ran and ours_ok and not text_agreement(reports)[1] else 1


def run_all(
    args: argparse.Namespace, timed_hooks: bool = False, label: str = "compare"
) -> tuple[list[SetupReport], LoadSpec] | int:
    """Run every requested setup in turn; an int is an exit code for bad arguments."""
    try:
        setups = setups_to_run(args.setups)
        load = LoadSpec(
            requests=args.requests,
            concurrency=args.concurrency,
            input_len=args.input_len,
            output_len=args.output_len,
            request_timeout=args.request_timeout,
            seed=args.seed,
        )
        if getattr(args, "worker_alone", ""):
            if not args.pin:
                raise ValueError("--worker-alone needs pinning: drop --no-pin")
            worker_alone_cores(args.worker_alone)
    except ValueError as exc:
        print(f"{args.prog}: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    model = args.workdir / "models" / "tiny"
    print(f"kvpush {label}: setups {', '.join(setups)}; model {model} (built on first use)")
    try:
        ensure_tiny_model(model, TinyModelSpec())
    except OSError as exc:
        why = cannot_write(exc, model)
        print(f"{args.prog}: {why}; give a --workdir you can write", file=sys.stderr)
        return 2
    prompts = model_prompts(model, load.requests, load.input_len, load.seed)
    pair = pair_settings(model, args)
    reports = [run_setup(setup, pair, load, prompts, timed_hooks, label) for setup in setups]
    print(f"\nkvpush {label}: done in {time.monotonic() - started:.0f} s\n")
    return reports, load
