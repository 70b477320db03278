"""`kvpush proxy bench`: what the proxy itself adds to a request, against fast stub backends.

Three processes: the stub backends (one prefill, one decode; `kvpush/proxy/stub.py`), the
proxy (served as `kvpush proxy` serves it, on uvloop when installed) and the load generator
(this process), so the client's own work is not counted as the proxy's. They share this
machine's cores, so other load on it shows in the numbers; the load average is printed.

N streams = N client connections with a request open on each, as N users would have:
- N-1 load streams send streaming completions back to back; the decode stub answers each
  with --tokens chunks --token-gap-ms apart (a decode at that TPOT);
- 1 probe stream sends one-token streaming completions, at most one per --probe-every-ms,
  and times each to its first byte (TTFT). The probe gives the latency figures (many
  samples, even at N=1); the load streams give the time to the end of a long stream.
Each run lasts --seconds after a short warm-up, first without the proxy, then through it.
Without the proxy means what a client would do itself: in pull mode a one-token prefill to
the prefill stub and then the request to the decode stub, in push mode the request straight
to the decode stub (push's prefill leg runs beside decode's, off the critical path). Added
latency = through the proxy minus direct, per statistic, each the median over --repeats
pairs of runs. A last pair of runs sends one-token non-streaming requests back to back on
--throughput-streams streams: the most requests per second each way.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import multiprocessing
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpush.core.protocol import MODES
from kvpush.report import format_table

if TYPE_CHECKING:
    import aiohttp

EXAMPLES = """\
examples:
  kvpush proxy bench                                  # 1, 64 and 256 streams, pull mode
  kvpush proxy bench --mode push --streams 64 --seconds 5 --repeats 5
  kvpush proxy bench --tokens 64 --token-gap-ms 10    # longer streams, more chunks to relay
"""


@dataclass(frozen=True, slots=True)
class BenchSpec:
    mode: str = "pull"
    streams: tuple[int, ...] = (1, 64, 256)
    seconds: float = 4.0
    warmup: float = 0.5
    repeats: int = 3
    tokens: int = 16
    token_gap: float = 0.02
    probe_every: float = 0.005
    throughput_streams: int = 64

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be push or pull, got {self.mode!r}")
        if not self.streams or min(self.streams) < 1 or self.throughput_streams < 1:
            raise ValueError("stream counts must be positive, e.g. --streams 1,64,256")
        if self.seconds <= 0 or self.warmup < 0 or self.repeats < 1:
            raise ValueError("--seconds must be positive and --repeats at least 1")
        if self.tokens < 1 or self.token_gap < 0 or self.probe_every < 0:
            raise ValueError(
                "--tokens must be positive, --token-gap-ms and --probe-every-ms 0 or more"
            )


DEFAULT = BenchSpec()


@dataclass(frozen=True, slots=True)
class Run:
    """One run of one path at one concurrency."""

    ttft: list[float]  # the probe's requests
    total: list[float]  # the load streams' requests, start to last byte
    completed: int  # within the measured window
    seconds: float
    errors: int
    finished: int  # all requests done, warm-up included
    proxy_cpu: float = math.nan  # CPU seconds the proxy process used during the run

    @property
    def rps(self) -> float:
        return self.completed / self.seconds

    @property
    def cpu_per_request(self) -> float:
        return self.proxy_cpu / self.finished if self.finished else math.nan

    def stat(self, values: str, q: int) -> float:
        data = getattr(self, values)
        if not data:
            return math.nan
        if q == 50 or len(data) < 2:
            return float(statistics.median(data))
        return float(statistics.quantiles(data, n=100, method="inclusive")[q - 1])


@dataclass(frozen=True, slots=True)
class Row:
    streams: int
    direct: list[Run]
    proxy: list[Run]

    def median(self, side: str, stat: Callable[[Run], float]) -> float:
        return statistics.median(stat(run) for run in getattr(self, side))

    def added(self, stat: Callable[[Run], float]) -> float:
        """The median over repeats of (proxy - direct), each pair measured back to back."""
        return statistics.median(
            stat(p) - stat(d) for p, d in zip(self.proxy, self.direct, strict=True)
        )


# -- the load generator ------------------------------------------------------------------


async def _timed(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], first_leg: str | None = None
) -> tuple[float, float, float] | None:
    """(start, first byte, last byte) of one request; None if it failed.

    With `first_leg`, the request is what a pull-mode client without a proxy sends: a
    one-token prefill to `first_leg` first, then the request to `url`, timed from the start.
    """
    import aiohttp

    started = time.perf_counter()
    try:
        if first_leg is not None:
            prefill = {**body, "max_tokens": 1, "stream": False}
            async with session.post(first_leg, json=prefill) as resp:
                await resp.read()
                if resp.status != 200:
                    return None
        async with session.post(url, json=body) as resp:
            await resp.content.readany()
            first = time.perf_counter()
            await resp.read()
            ok = resp.status == 200
    except aiohttp.ClientError:
        return None
    return (started, first, time.perf_counter()) if ok else None


async def drive(
    url: str, streams: int, spec: BenchSpec, throughput: bool = False, first_leg: str | None = None
) -> Run:
    """One run against `url`: a probe and streams-1 load streams, or (`throughput`)
    `streams` clients sending one-token requests back to back; `first_leg`: see _timed."""
    import aiohttp

    base = {"model": "stub", "prompt": "hi"}
    probe_body = {**base, "max_tokens": 1, "stream": not throughput}
    load_body = {**base, "max_tokens": spec.tokens, "stream": True}
    ttft: list[float] = []
    total: list[float] = []
    counts = {"completed": 0, "errors": 0, "finished": 0}
    record_from = time.perf_counter() + spec.warmup
    stop_at = record_from + spec.seconds

    def record(timing: tuple[float, float, float] | None, into: list[float], first: bool) -> None:
        if timing is None:
            counts["errors"] += time.perf_counter() > record_from
            return
        started, first_byte, done = timing
        counts["finished"] += 1
        if started >= record_from and done <= stop_at:
            counts["completed"] += 1
            into.append((first_byte if first else done) - started)

    async def probe(session: aiohttp.ClientSession, pace: float) -> None:
        while (started := time.perf_counter()) < stop_at:
            record(await _timed(session, url, probe_body, first_leg), ttft, True)
            await asyncio.sleep(max(0.0, started + pace - time.perf_counter()))

    async def load(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < stop_at:
            record(await _timed(session, url, load_body, first_leg), total, False)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        if throughput:
            await asyncio.gather(*(probe(session, 0.0) for _ in range(streams)))
        else:
            await asyncio.gather(
                probe(session, spec.probe_every), *(load(session) for _ in range(streams - 1))
            )
    return Run(ttft, total, counts["completed"], spec.seconds, counts["errors"], counts["finished"])


# -- the servers, each in its own process ------------------------------------------------


def _serve_stubs(conn: Connection, tokens: int, token_gap: float) -> None:
    from kvpush.proxy.server import run_proxy_loop

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    run_proxy_loop(_stubs(conn, tokens, token_gap))


async def _stubs(conn: Connection, tokens: int, token_gap: float) -> None:
    from kvpush.proxy.stub import StubBackend, StubBehaviour, serve_stub

    behaviour = StubBehaviour(tokens=tuple(f" t{i}" for i in range(tokens)), token_gap=token_gap)
    _, prefill_url = await serve_stub(StubBackend("prefill-0", record=False))
    _, decode_url = await serve_stub(StubBackend("decode-0", behaviour, record=False))
    conn.send((prefill_url, decode_url))
    await asyncio.Event().wait()


def _serve_proxy(conn: Connection, mode: str, prefill_url: str, decode_url: str) -> None:
    from kvpush.proxy.server import run_proxy_loop

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_proxy_loop(_proxy(conn, mode, prefill_url, decode_url))


async def _proxy(conn: Connection, mode: str, prefill_url: str, decode_url: str) -> None:
    from kvpush.proxy.config import ProxyConfig
    from kvpush.proxy.rewrite import Backend
    from kvpush.proxy.server import start_proxy

    config = ProxyConfig(
        mode=mode,
        prefill=[Backend(prefill_url, "prefill-0", "127.0.0.1", 5600)],
        decode=[Backend(decode_url)],
    )
    runner = await start_proxy(config, "127.0.0.1", 0)
    conn.send(f"http://127.0.0.1:{runner.addresses[0][1]}")
    await asyncio.Event().wait()


class _Child:
    """A server process that reports what it serves through a pipe."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=target, args=(child_conn, *args), daemon=True)
        self.process.start()

    def answer(self, timeout: float = 60.0) -> Any:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"a benchmark server did not start within {timeout:g} s")
        return self.conn.recv()

    def stop(self) -> None:
        self.process.terminate()
        self.process.join(10)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process so far (Linux /proc), NaN where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return math.nan


# -- the whole benchmark -----------------------------------------------------------------


def measure(spec: BenchSpec, progress: Callable[[str], None]) -> tuple[list[Row], Row]:
    """Start stubs and proxy, run every concurrency both ways; the last row is throughput."""
    from kvpush.proxy.server import run_proxy_loop  # the load runs on the proxy's loop too

    children: list[_Child] = []
    try:
        stubs = _Child(_serve_stubs, spec.tokens, spec.token_gap)
        children.append(stubs)
        prefill_url, decode_url = stubs.answer()
        proxy = _Child(_serve_proxy, spec.mode, prefill_url, decode_url)
        children.append(proxy)
        proxy_url = proxy.answer()
        direct = decode_url + "/v1/completions"
        through = proxy_url + "/v1/completions"
        # Pull mode's direct path does both legs in turn, as a client without a proxy would,
        # so the difference is the proxy's own work; push's legs run side by side.
        first_leg = prefill_url + "/v1/completions" if spec.mode == "pull" else None

        def row(streams: int, throughput: bool) -> Row:
            what = "throughput" if throughput else "latency"
            runs: dict[str, list[Run]] = {"direct": [], "proxy": []}
            for repeat in range(spec.repeats):
                for side, url in (("direct", direct), ("proxy", through)):
                    cpu = cpu_seconds(proxy.process.pid)
                    leg = first_leg if side == "direct" else None
                    run = run_proxy_loop(drive(url, streams, spec, throughput, leg))
                    if side == "proxy":
                        run = dataclasses.replace(
                            run, proxy_cpu=cpu_seconds(proxy.process.pid) - cpu
                        )
                    runs[side].append(run)
                    progress(
                        f"  {what} {streams:>4} streams, {side:<6} run {repeat + 1}/"
                        f"{spec.repeats}: {run.rps:7.0f} req/s, TTFT p50 "
                        f"{run.stat('ttft', 50) * 1e3:.2f} ms"
                        + (f", {run.errors} errors" if run.errors else "")
                    )
            return Row(streams, runs["direct"], runs["proxy"])

        rows = [row(n, False) for n in spec.streams]
        return rows, row(spec.throughput_streams, True)
    finally:
        for child in children:
            child.stop()


def render(spec: BenchSpec, rows: Sequence[Row], throughput: Row, load: float) -> str:
    def ms(value: float) -> str:
        return "-" if math.isnan(value) else f"{value * 1e3:.2f}"

    def p(values: str, q: int) -> Callable[[Run], float]:
        return lambda run: run.stat(values, q)

    def rps(run: Run) -> float:
        return run.rps

    def cpu(run: Run) -> float:
        return run.cpu_per_request

    headers = [
        "streams",
        "direct TTFT p50",
        "proxy TTFT p50",
        "added p50",
        "added p99",
        "added to stream end p50",
        "direct req/s",
        "proxy req/s",
        "proxy CPU/req",
        "probes",
        "errors",
    ]
    table = [
        [
            str(r.streams),
            ms(r.median("direct", p("ttft", 50))),
            ms(r.median("proxy", p("ttft", 50))),
            ms(r.added(p("ttft", 50))),
            ms(r.added(p("ttft", 99))),
            ms(r.added(p("total", 50))),
            f"{r.median('direct', rps):.0f}",
            f"{r.median('proxy', rps):.0f}",
            ms(r.median("proxy", cpu)),
            str(sum(len(run.ttft) for run in r.proxy)),
            str(sum(run.errors for run in r.proxy + r.direct)),
        ]
        for r in rows
    ]
    per_request = throughput.median("proxy", cpu)
    gap = f"{spec.token_gap * 1e3:g} ms apart" if spec.token_gap else "back to back"
    return "\n".join(
        [
            f"kvpush proxy bench: {spec.mode} mode; stubs, proxy and load generator in 3 "
            f"processes on {os.cpu_count()} cores (load average {load:.2f} before the start)",
            f"load streams: {spec.tokens} tokens {gap} each; the probe: one-token requests, "
            f"at most one per {spec.probe_every * 1e3:g} ms",
            f"{spec.seconds:g} s per run, median of {spec.repeats} runs each way; times in ms; "
            "added = through the proxy - direct; proxy CPU/req: the proxy process's CPU time "
            "per request",
            "",
            format_table(headers, table),
            "",
            f"throughput ({throughput.streams} streams, one-token non-streaming requests back "
            f"to back): direct {throughput.median('direct', rps):.0f} req/s, through the proxy "
            f"{throughput.median('proxy', rps):.0f} req/s; the proxy's CPU time "
            f"{ms(per_request)} ms per request, {1 / per_request:.0f} req/s per core it gets",
        ]
    )


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1,64,256, got {text!r}"
        ) from None


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure the latency the proxy adds and its requests per second",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mode", choices=MODES, default="pull", help="default %(default)s")
    parser.add_argument(
        "--streams",
        metavar="N,N,...",
        type=_ints,
        default=DEFAULT.streams,
        help="concurrent streams, comma-separated (default 1,64,256)",
    )
    parser.add_argument(
        "--seconds",
        metavar="S",
        type=float,
        default=DEFAULT.seconds,
        help="per run (default %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        metavar="N",
        type=int,
        default=DEFAULT.repeats,
        help="runs per side (default %(default)s)",
    )
    parser.add_argument(
        "--tokens",
        metavar="N",
        type=int,
        default=DEFAULT.tokens,
        help="chunks per streamed answer (default %(default)s)",
    )
    parser.add_argument(
        "--token-gap-ms",
        metavar="MS",
        type=float,
        default=DEFAULT.token_gap * 1e3,
        help="ms between streamed chunks, as a decode's TPOT (default %(default)s)",
    )
    parser.add_argument(
        "--probe-every-ms",
        metavar="MS",
        type=float,
        default=DEFAULT.probe_every * 1e3,
        help="least time between the probe's requests (default %(default)s)",
    )
    parser.add_argument(
        "--throughput-streams",
        metavar="N",
        type=int,
        default=DEFAULT.throughput_streams,
        help="streams for the requests-per-second runs (default %(default)s)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        spec = BenchSpec(
            mode=args.mode,
            streams=args.streams,
            seconds=args.seconds,
            repeats=args.repeats,
            tokens=args.tokens,
            token_gap=args.token_gap_ms / 1e3,
            probe_every=args.probe_every_ms / 1e3,
            throughput_streams=args.throughput_streams,
        )
    except ValueError as exc:
        print(f"kvpush proxy bench: {exc}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    runs = (len(spec.streams) + 1) * 2 * spec.repeats
    print(
        f"kvpush proxy bench: {runs} runs of {spec.seconds + spec.warmup:g} s; starting the "
        "stubs and the proxy",
        flush=True,
    )
    started = time.monotonic()
    rows, throughput = measure(spec, lambda line: print(line, flush=True))
    print(f"done in {time.monotonic() - started:.0f} s\n", flush=True)
    print(render(spec, rows, throughput, load))
    return 0
