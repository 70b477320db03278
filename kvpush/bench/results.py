"""Result files of `kvpush bench sweep`: naming, parsing `vllm bench serve` output, loading.

One run is one connector setup at one request rate, input length, output length and
iteration. It is written to `<out>/<setup>_qps<rate>_in<in>_out<out>_iter<i>.json` (and the
log of the run next to it, `.log`), whatever happened: a run that stalled, errored or whose
servers never started is a result too, with `status` and `reason` saying so. A sweep that
finds a run's file already there does not redo it, which is how an interrupted sweep resumes.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "kvpush.bench.run/1"
# What a run can end as. Only "ok" runs give latency numbers; the rest give a reason.
STATUSES = ("ok", "failed", "stalled", "not started", "server died", "error")
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True, order=True)
class Point:
    """One run of a sweep."""

    iteration: int
    setup: str
    input_len: int
    rate: float
    output_len: int

    @property
    def stem(self) -> str:
        return (
            f"{self.setup}_qps{self.rate:g}_in{self.input_len}_out{self.output_len}"
            f"_iter{self.iteration}"
        )

    def path(self, out: Path) -> Path:
        return out / f"{self.stem}.json"

    def seed(self, base: int) -> int:
        """The dataset seed of this run: the same for every setup and iteration at this
        point (every setup gets the same prompts), different for every other point. One
        start of the servers runs all of a setup's points, so with one seed for all of them
        every run after the first would send prompts the servers already cached (both
        prefill's and decode's prefix caches are on, as vLLM's default): decode would
        compute them itself and no KV would move."""
        return (base + zlib.crc32(f"in{self.input_len}/qps{self.rate:g}".encode())) % 2**31

    def log_path(self, out: Path) -> Path:
        return out / f"{self.stem}.log"


def plan(
    setups: Sequence[str],
    rates: Sequence[float],
    input_lens: Sequence[int],
    output_len: int,
    iterations: int,
) -> list[tuple[int, str, list[Point]]]:
    """Groups of runs in the order a sweep makes them: (iteration, setup, points).

    Setups are interleaved across iterations, so drift of the machine over the sweep
    hits every setup alike, and each iteration starts one setup later (A B C, B C A,
    C A B, ...), so no setup always runs first, right after the previous group's servers
    stopped (measured: a fixed order favoured the later setup). One group shares one
    start of the servers.
    """
    groups = []
    for iteration in range(1, iterations + 1):
        turn = (iteration - 1) % max(len(setups), 1)
        for setup in [*setups[turn:], *setups[:turn]]:
            points = [
                Point(iteration, setup, input_len, rate, output_len)
                for input_len in input_lens
                for rate in rates
            ]
            groups.append((iteration, setup, points))
    return groups


def read_result(path: Path) -> dict[str, Any] | None:
    """A run's result, or None when the file is missing, torn or not one of ours."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return None
    return data


def read_raw(path: Path) -> dict[str, Any] | None:
    """The JSON `vllm bench serve --save-result` wrote, or None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_done(point: Point, out: Path, retry_failed: bool = False) -> bool:
    """Whether a resumed sweep may skip this run."""
    result = read_result(point.path(out))
    if result is None:
        return False
    return result.get("status") == "ok" or not retry_failed


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Atomically: a sweep killed mid-write leaves the old file or none, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


class ResultError(ValueError):
    """A result file of ours that cannot be used; the message names the file and field."""


# What `aggregate` and the planner's check need of a result, beyond its schema.
REQUIRED_FIELDS: dict[str, tuple[type, ...]] = {
    "setup": (str,),
    "input_len": (int,),
    "rate": (int, float),
    "status": (str,),
}
NUMBER_FIELDS = ("completed", "num_prompts", "request_throughput")  # each may be absent


def check_result(path: Path, result: dict[str, Any]) -> dict[str, Any]:
    """`result` if every field the tables use is there with its type, else ResultError."""

    def fail(problem: str) -> ResultError:
        return ResultError(
            f"{path}: {problem}; remove the file (a sweep with the same options redoes that run)"
        )

    for name, kinds in REQUIRED_FIELDS.items():
        if name not in result:
            raise fail(f"field {name!r} is missing")
        if not isinstance(result[name], kinds) or isinstance(result[name], bool):
            raise fail(f"field {name!r} is {result[name]!r}, not a {kinds[0].__name__}")
    for name in NUMBER_FIELDS:
        if result.get(name) is not None and _finite(result[name]) is None:
            raise fail(f"field {name!r} is {result[name]!r}, not a number")
    for metric in METRICS:
        stats = result.get(metric)
        if stats is not None and (
            not isinstance(stats, dict)
            or any(v is not None and _finite(v) is None for v in stats.values())
        ):
            raise fail(f"field {metric!r} is {stats!r}, not {{'p50': ms, 'p99': ms, ...}}")
    return result


def load_results(directory: Path) -> list[dict[str, Any]]:
    """Every run result under `directory` (other JSON files are ignored); ResultError for
    one of ours that lacks a field the tables need."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory of sweep results")
    results = []
    for path in sorted(directory.glob("*.json")):
        result = read_result(path)
        if result is not None:
            results.append(check_result(path, result))
    return results


def _finite(value: Any) -> float | None:
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def summarise_bench(raw: dict[str, Any], engine_step_ms: float | None = None) -> dict[str, Any]:
    """The numbers we keep from one `vllm bench serve --save-result` JSON.

    Latencies in ms as mean / p50 / p99 for TTFT, TPOT, ITL and E2E latency; requests
    completed and failed; throughputs; the most common error messages; and how well the
    answers streamed (`one_burst`, `late_tokens`; `engine_step_ms`: decode's mean time
    between a request's tokens in the engine over the run, see `late_tokens`).
    """
    summary: dict[str, Any] = {}
    for metric in METRICS:
        summary[metric] = {
            "mean": _finite(raw.get(f"mean_{metric}_ms")),
            "p50": _finite(raw.get(f"median_{metric}_ms", raw.get(f"p50_{metric}_ms"))),
            "p99": _finite(raw.get(f"p99_{metric}_ms")),
        }
    completed = int(raw.get("completed") or 0)
    failed = raw.get("failed")
    if failed is None and raw.get("num_prompts") is not None:
        failed = int(raw["num_prompts"]) - completed
    summary["completed"] = completed
    summary["failed"] = int(failed or 0)
    summary["duration_s"] = _finite(raw.get("duration"))
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        summary[key] = _finite(raw.get(key))
    errors = [e for e in raw.get("errors") or [] if e]
    summary["errors"] = [
        {"error": text[:300], "count": n} for text, n in Counter(errors).most_common(3)
    ]
    summary["one_burst"] = one_burst_share(raw)
    summary["tt2t"] = second_token(raw)
    summary.update(late_tokens(raw, engine_step_ms))
    if completed == 0:
        # vLLM reports 0 for every latency when nothing completed; that is no measurement.
        for metric in (*METRICS, "tt2t"):
            summary[metric] = {"mean": None, "p50": None, "p99": None}
    return summary


def second_token(raw: dict[str, Any]) -> dict[str, float | None]:
    """Time to the second token, ms (mean / p50 / p99 over requests with two or more).

    Where the first token comes from prefill (kvpush's proxy), TTFT is prefill's leg alone
    and the handoff shows here: the second token is decode's first."""
    ttfts, itls = raw.get("ttfts"), raw.get("itls")
    times: list[float] = []
    if isinstance(ttfts, list) and isinstance(itls, list):
        for ttft, gaps in zip(ttfts, itls, strict=False):
            if isinstance(ttft, int | float) and ttft > 0 and isinstance(gaps, list) and gaps:
                times.append((ttft + float(gaps[0])) * 1e3)
    if not times:
        return {"mean": None, "p50": None, "p99": None}
    times.sort()
    p99 = times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)]
    return {"mean": sum(times) / len(times), "p50": median(times), "p99": p99}


ONE_BURST_MS = 1.0


def one_burst_share(raw: dict[str, Any]) -> float | None:
    """Share of the completed requests whose whole answer reached the client in one burst.

    A request counts when its last token came less than `ONE_BURST_MS` after its first
    although it has more than one token: something on the way (the server's front end, the
    proxy, the client, a process waiting for a core) held the stream and let it go at once.
    Its TTFT then carries the whole decode and its TPOT is ~0, so p50s of both mislead
    where the share is large; E2E latency is unaffected. None without `--save-detailed`
    data."""
    ttfts, latencies = raw.get("ttfts"), raw.get("latencies")
    outputs = raw.get("output_lens")
    if not isinstance(ttfts, list) or not isinstance(latencies, list) or not ttfts:
        return None
    if not isinstance(outputs, list) or len(outputs) != len(ttfts):
        outputs = [2] * len(ttfts)
    done = [
        (ttft, latency)
        for ttft, latency, tokens in zip(ttfts, latencies, outputs, strict=False)
        if ttft and latency and tokens and tokens > 1
    ]
    if not done:
        return None
    bursts = sum(1 for ttft, latency in done if (latency - ttft) * 1e3 < ONE_BURST_MS)
    return bursts / len(done)


LATE_STEPS = 2


def token_arrivals(ttft: float, itls: Sequence[float], tokens: int) -> list[float]:
    """When each of a request's `tokens` reached the client (s after it was sent), from its
    TTFT and the gaps between its chunks; a chunk holding several tokens (fewer chunks than
    tokens) is counted as the last one holding all that are left."""
    chunks = [ttft]
    for gap in itls:
        chunks.append(chunks[-1] + gap)
    return [chunks[min(i, len(chunks) - 1)] for i in range(max(tokens, len(chunks)))]


def late_count(arrivals: Sequence[float], step: float, steps: float = LATE_STEPS) -> int:
    """How many tokens reached the client more than `steps` decode steps after they were
    produced, a step being `step` (the same unit as `arrivals`).

    The engine makes a request's tokens at most one per step, so a token was produced at the
    latest one step before the next one was, and never after it arrived: going backwards,
    produced[i] = min(arrived[i], produced[i + 1] - step). A token's delay is arrived -
    produced, the least it can have been: a stream that keeps up has none, an answer sent in
    one burst of n tokens delays its k-th token by n - 1 - k steps."""
    late = 0
    produced = float("inf")
    limit = (steps + 1e-6) * step  # exactly `steps` steps (rounding aside) is not late
    for arrived in reversed(arrivals):
        produced = min(arrived, produced - step)
        if arrived - produced > limit:
            late += 1
    return late


def engine_step_ms(deltas: dict[str, float] | None) -> float | None:
    """Decode's mean time between a request's tokens in the engine over a run (ms)."""
    return histogram_mean_ms(deltas, "vllm:inter_token_latency_seconds")


def host_cpu(cpuinfo: str | None = None) -> dict[str, Any]:
    """The machine a run measured: CPU model, cores this process may use, and the widest
    vector extension vLLM's CPU kernels use (`amx`: AVX-512 with AMX tiles, `avx512`,
    `avx2`, else `other`). vLLM's CPU backend runs several times faster with AVX-512, and
    faster again with AMX, so runs on different hosts compare
    only through ratios measured in the same run. `cpuinfo`: /proc/cpuinfo's text (read
    when None; empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = "unknown", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    if isa == "avx512" and "amx_tile" in flags:
        isa = "amx"  # vLLM's CPU attention runs bf16 on AMX tiles: faster again
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity outside Linux
        cores = os.cpu_count() or 0
    return {"cpu": model, "cores": cores, "isa": isa}


def describe_host(host: dict[str, Any] | None) -> str:
    """One line for a result's `host` ('-' for runs recorded before it was kept)."""
    if not host:
        return "-"
    isa = {"amx": "AVX-512 and AMX", "avx512": "AVX-512", "avx2": "AVX2, no AVX-512"}.get(
        host.get("isa", ""), "no AVX2"
    )
    return f"{host.get('cpu', 'unknown')}, {host.get('cores', '?')} cores, {isa}"


def histogram_mean_ms(deltas: dict[str, float] | None, name: str) -> float | None:
    """The mean of histogram `name` over a run (ms) from its _sum and _count deltas."""
    if not deltas:
        return None
    count = delta_total(deltas, f"{name}_count")
    total = delta_total(deltas, f"{name}_sum")
    return total / count * 1e3 if count > 0 else None


def servers_ttft_ms(result: dict[str, Any]) -> float | None:
    """The servers' own share of a run's TTFT (ms, means over its requests), from vLLM's
    front-end histograms (arrival to first token, arrival to end) scraped around it.

    Where the first token comes from: single, its TTFT; prefill (kvpush's default), prefill's
    TTFT; decode in push mode, decode's TTFT (which holds the wait for the KV); decode in
    pull mode, prefill's whole one-token leg and then decode's TTFT, which the proxy runs one
    after the other. The client's mean TTFT less this is the proxy's and the client's share:
    their time on the way in and out and any wait for a core. None for runs recorded without
    these histograms."""
    metrics = result.get("metrics") or {}
    ttft = "vllm:time_to_first_token_seconds"
    alone = _one_server_first(result)
    if alone is not None:
        return histogram_mean_ms(metrics.get(alone), ttft)
    decode = histogram_mean_ms(metrics.get("decode"), ttft)
    from kvpush.testbed.topology import SETUPS  # here: only this case needs the setups

    setup = SETUPS.get(str(result.get("setup")))
    if decode is None or setup is None or setup.proxy_mode == "push":
        return decode
    leg = histogram_mean_ms(metrics.get("prefill"), "vllm:e2e_request_latency_seconds")
    return None if leg is None else leg + decode


def _one_server_first(result: dict[str, Any]) -> str | None:
    """The server whose own TTFT is the servers' share of a run's first token: the single
    server, or prefill where it sends the first token; None where two servers share it."""
    if "single" in (result.get("metrics") or {}):
        return "single"
    return "prefill" if result.get("first_token") == "prefill" else None


def engine_split_ms(result: dict[str, Any]) -> tuple[float | None, float | None]:
    """Where the first-token server's TTFT went inside its engine core (ms, means over a
    run's requests): waiting to be scheduled, and scheduled to the end of the step that
    produced the first token (the forward, and the connector's hooks called on the way
    out of that step). The rest of `servers_ttft_ms` is the front end and its IPC. Given
    for a single server and for the first token from prefill, where that one server's
    TTFT is the servers' share; (None, None) otherwise and for runs recorded without
    these histograms."""
    server = _one_server_first(result)
    if server is None:
        return None, None
    deltas = (result.get("metrics") or {}).get(server)
    return (
        histogram_mean_ms(deltas, "vllm:request_queue_time_seconds"),
        histogram_mean_ms(deltas, "vllm:request_prefill_time_seconds"),
    )


def first_token_split(result: dict[str, Any]) -> tuple[int, int]:
    """(streams whose first token the proxy took from prefill, streams that could take it)
    over a run; (0, 0) where not recorded or without a proxy."""
    sources = result.get("first_token_sources") or {}
    return sources.get("prefill", 0), sources.get("prefill", 0) + sources.get("decode", 0)


def from_prefill(result: dict[str, Any]) -> float | None:
    """The share of a run's streams whose first token the proxy took from prefill (None:
    not recorded, no proxy, or no stream that could take it)."""
    prefill, streams = first_token_split(result)
    return prefill / streams if streams else None


def delta_total(deltas: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a run's deltas for metric `name` whose labels include `labels`."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for key, value in deltas.items():
        metric, _, rest = key.partition("{")
        if metric == name and all(w in rest.rstrip("}").split(",") for w in wanted):
            total += value
    return total


def late_tokens(raw: dict[str, Any], engine_step_ms: float | None) -> dict[str, Any]:
    """`late_tokens`: the share of the completed requests' output tokens that reached the
    client more than LATE_STEPS decode steps after they were produced (`late_count`), from
    `--save-detailed` data; `late_step_ms`: the step used, with where it came from
    (`late_step_from`). None without per-request data.

    `late_count` needs a step no longer than any real one: with a longer one, a stream
    whose cadence speeds up (a smaller batch, a core freed) looks as if it had been held
    back. Decode's mean step over the run (`engine_step_ms`, from its engine's
    inter-token histogram) is no such bound, so the step is the shorter of it and the
    fastest cadence the run's streams showed: the 10th percentile of the gaps between a
    request's chunks at the client, leaving out those under ONE_BURST_MS (coalesced)."""
    none: dict[str, Any] = {"late_tokens": None, "late_step_ms": None, "late_step_from": None}
    ttfts, itls = raw.get("ttfts"), raw.get("itls")
    outputs = raw.get("output_lens")
    if not isinstance(ttfts, list) or not isinstance(itls, list) or len(itls) != len(ttfts):
        return none
    if not isinstance(outputs, list) or len(outputs) != len(ttfts):
        outputs = [len(gaps) + 1 for gaps in itls]
    done = [
        (ttft, gaps, int(n))
        for ttft, gaps, n in zip(ttfts, itls, outputs, strict=True)
        if ttft and isinstance(gaps, list) and n and n > 1
    ]
    gaps_ms = sorted(g * 1e3 for _, gaps, _ in done for g in gaps if g * 1e3 >= ONE_BURST_MS)
    candidates = [
        (step, source)
        for step, source in (
            (engine_step_ms, "decode engine mean"),
            (gaps_ms[len(gaps_ms) // 10] if gaps_ms else None, "client gaps p10"),
        )
        if step is not None and step > 0
    ]
    if not done or not candidates:
        return none
    step_ms, source = min(candidates, key=lambda c: c[0])
    total = sum(n for _, _, n in done)
    late = sum(late_count(token_arrivals(t, g, n), step_ms / 1e3) for t, g, n in done)
    return {"late_tokens": late / total, "late_step_ms": step_ms, "late_step_from": source}


def classify(summary: dict[str, Any], num_prompts: int) -> tuple[str, str | None]:
    """(status, reason) of a run whose `vllm bench serve` finished."""
    failed = summary["failed"]
    if failed == 0 and summary["completed"] >= num_prompts:
        return "ok", None
    errors = summary.get("errors") or []
    top = errors[0]["error"] if errors else "no error message"
    timed_out = any(_is_timeout(e["error"]) for e in errors)
    status = "stalled" if timed_out else "failed"
    what = "timed out" if timed_out else "failed"
    return status, f"{failed} of {num_prompts} requests {what}; most common error: {top}"


def _is_timeout(error: str) -> bool:
    lowered = error.lower()
    return "timeout" in lowered or "timed out" in lowered or "504" in lowered


@dataclass(slots=True)
class Aggregate:
    """The runs of one setup at one point, over iterations."""

    setup: str
    input_len: int
    rate: float
    runs: int
    ok: int
    statuses: list[str]
    reasons: list[str]
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    throughput: float | None
    completed: int = 0  # requests that finished, over all runs
    requests: int = 0  # requests sent, over all runs
    # No run was ok, so the latencies are those of the requests that did finish in the
    # runs that stalled or failed: biased low (the slowest requests are the missing ones).
    partial: bool = False
    one_burst: float | None = None  # median share of answers sent in one burst
    late_tokens: float | None = None  # median share of tokens late (`late_tokens()`)
    tt2t_p50: float | None = None  # time to the second token (`second_token()`)
    # decode's engine's mean time per token (`engine_step_ms`): TPOT less proxy and client
    decode_step_ms: float | None = None
    # the client's mean TTFT and the servers' share of it (`servers_ttft_ms`), medians
    ttft_mean: float | None = None
    servers_ttft_ms: float | None = None
    first_from_prefill: float | None = None  # median share (`from_prefill`)
    # the first-token server's queueing and scheduled-to-first-token (`engine_split_ms`)
    queued_ms: float | None = None
    to_first_token_ms: float | None = None

    @property
    def status(self) -> str:
        """'ok' when every iteration was; else the worst thing that happened."""
        if self.ok == self.runs:
            return "ok"
        for status in ("not started", "server died", "stalled", "error", "failed"):
            if status in self.statuses:
                return status
        return self.statuses[0]


def median(values: Iterable[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2


def aggregate(results: Sequence[dict[str, Any]]) -> list[Aggregate]:
    """Medians over iterations of the ok runs, per (setup, input length, rate).

    Where no run was ok but some requests finished, their latencies are given instead,
    flagged `partial`.
    """
    groups: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
    for result in results:
        key = (result["setup"], int(result["input_len"]), float(result["rate"]))
        groups.setdefault(key, []).append(result)
    rows = []
    for (setup, input_len, rate), runs in sorted(groups.items()):
        ok_runs = [r for r in runs if r["status"] == "ok"]
        partial = not ok_runs and any(r.get("completed") for r in runs)
        good = ok_runs or [r for r in runs if r.get("completed")]
        splits = [engine_split_ms(r) for r in good]

        def mid(metric: str, stat: str, good: list[dict[str, Any]] = good) -> float | None:
            return median((r.get(metric) or {}).get(stat) for r in good)

        rows.append(
            Aggregate(
                setup,
                input_len,
                rate,
                len(runs),
                len(ok_runs),
                [r["status"] for r in runs],
                [r["reason"] for r in runs if r.get("reason")],
                mid("ttft", "p50"),
                mid("ttft", "p99"),
                mid("tpot", "p50"),
                mid("tpot", "p99"),
                median(r.get("request_throughput") for r in good),
                sum(int(r.get("completed") or 0) for r in runs),
                sum(int(r.get("num_prompts") or 0) for r in runs),
                partial,
                median(r.get("one_burst") for r in good),
                median(r.get("late_tokens") for r in good),
                mid("tt2t", "p50"),
                median(decode_step(r) for r in good),
                mid("ttft", "mean"),
                median(servers_ttft_ms(r) for r in good),
                median(from_prefill(r) for r in good),
                median(queued for queued, _ in splits),
                median(scheduled for _, scheduled in splits),
            )
        )
    return rows


def decode_step(result: dict[str, Any]) -> float | None:
    """Decode's engine's mean time per token over a run (the single server's for single),
    from the metrics the sweep scraped around it."""
    metrics = result.get("metrics") or {}
    return engine_step_ms(metrics.get("decode", metrics.get("single")))
