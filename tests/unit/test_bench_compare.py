"""`kvpush bench compare`'s pure parts: statistics, stream parsing, prompts, load, the table."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.bench.compare import (
    LoadSpec,
    RequestResult,
    SetupReport,
    failure_reason,
    make_prompts,
    parse_event,
    percentile,
    render_table,
    root_cause,
    run_load,
    setups_to_run,
    summarise,
    text_agreement,
    token_timing,
)
from kvpush.cli import build_parser


def ok(index: int, text: str = "t", ttft: float = 0.1, tpot: float = 0.01) -> RequestResult:
    return RequestResult(index, text, 32, ttft, tpot)


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="0..100"):
        percentile(values, 101)


def test_token_timing_spreads_the_decode_time_over_all_but_the_first_token() -> None:
    ttft, tpot = token_timing(10.0, [10.5, 10.6, 10.9], tokens=5)
    assert ttft == pytest.approx(0.5)
    assert tpot == pytest.approx(0.4 / 4)
    ttft, tpot = token_timing(10.0, [10.5], tokens=1)
    assert ttft == pytest.approx(0.5)
    assert tpot is None
    assert token_timing(10.0, [], tokens=0) == (None, None)


def test_summary_counts_failures_and_ignores_them_in_latencies() -> None:
    results = [ok(0, ttft=0.1, tpot=0.01), ok(1, ttft=0.3, tpot=0.03), RequestResult(2, error="x")]
    s = summarise(results)
    assert (s.done, s.failed) == (2, 1)
    assert s.ttft_p50_s == pytest.approx(0.2)
    assert s.tpot_p50_s == pytest.approx(0.02)
    empty = summarise([RequestResult(0, error="x")])
    assert (empty.done, empty.ttft_p50_s, empty.tpot_p50_s) == (0, None, None)


def test_parse_event_reads_data_lines_only() -> None:
    assert parse_event(b'data: {"choices": [{"text": "a"}]}\n') == {"choices": [{"text": "a"}]}
    assert parse_event(b"data: [DONE]\n") is None
    assert parse_event(b"\n") is None
    assert parse_event(b": keep-alive\n") is None
    with pytest.raises(ValueError):
        parse_event(b"data: [1, 2]\n")


def test_prompts_are_deterministic_and_long_enough() -> None:
    def words(text: str) -> int:
        return len(text.split())

    a = make_prompts(3, 50, seed=1, count_tokens=words)
    assert a == make_prompts(3, 50, seed=1, count_tokens=words)
    assert a != make_prompts(3, 50, seed=2, count_tokens=words)
    assert len(set(a)) == 3
    assert all(50 <= words(p) < 50 + 16 for p in a)


def test_text_agreement_compares_each_setup_with_the_first_that_answered() -> None:
    reports = [
        SetupReport("skipped-one", "skipped", "no module"),
        SetupReport("a", "ok", results=[ok(0, "x"), ok(1, "y")]),
        SetupReport("b", "ok", results=[ok(0, "x"), ok(1, "z")]),
        SetupReport("c", "failed", results=[ok(0, "x"), RequestResult(1, error="boom")]),
    ]
    column, differing = text_agreement(reports)
    assert column == {"skipped-one": "-", "a": "ref", "b": "1/2", "c": "1/1"}
    assert differing == [1]
    assert text_agreement(reports[:1]) == ({"skipped-one": "-"}, [])


def test_table_shows_every_setup_its_reason_and_the_text_verdict() -> None:
    load = LoadSpec(requests=2)
    reports = [
        SetupReport("vllm-pull", "ok", results=[ok(0, "x", 0.0205), ok(1, "y", 0.0405)]),
        SetupReport("vllm-push", "ok", results=[ok(0, "x"), ok(1, "y")]),
        SetupReport("kvpush-push", "stalled", "1 of 2 requests failed; first: no complete answer"),
        SetupReport("kvpush-pull", "skipped", "needs module kvpush.vllm"),
    ]
    table = render_table(reports, load)
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("setup"))
    assert header.split() == [
        "setup", "result", "requests", "ok", "TTFT", "p50", "TTFT", "p99", "TPOT", "p50",
        "same", "text",
    ]  # fmt: skip
    pull = next(line for line in lines if line.startswith("vllm-pull"))
    assert pull.split() == ["vllm-pull", "ok", "2/2", "30.5", "40.3", "10.0", "ref"]
    push = next(line for line in lines if line.startswith("vllm-push "))
    assert push.split()[-1] == "2/2"
    stalled = next(line for line in lines if line.startswith("kvpush-push "))
    assert stalled.split() == ["kvpush-push", "stalled", "0/2", "-", "-", "-", "-"]
    assert "kvpush-push: 1 of 2 requests failed" in table
    assert "kvpush-pull: needs module kvpush.vllm" in table
    assert "identical across vllm-pull, vllm-push (2 prompts answered by more" in table


def test_table_names_prompts_whose_text_differs() -> None:
    reports = [
        SetupReport("a", "ok", results=[ok(0, "x"), ok(1, "y")]),
        SetupReport("b", "ok", results=[ok(0, "x"), ok(1, "q")]),
    ]
    assert "differs across setups for prompts 1" in render_table(reports, LoadSpec(2))


async def test_load_runs_every_request_with_bounded_concurrency() -> None:
    running = peak = 0

    async def send(index: int) -> RequestResult:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001)
        running -= 1
        return ok(index)

    seen: list[int] = []
    results = await run_load(send, 10, 3, lambda r: seen.append(r.index))
    assert [r.index for r in results] == list(range(10))
    assert all(r.ok for r in results)
    assert peak == 3
    assert sorted(seen) == list(range(10))


async def test_load_stops_at_the_first_timeout_and_cancels_the_rest() -> None:
    started: list[int] = []

    async def send(index: int) -> RequestResult:
        started.append(index)
        if index == 1:
            return RequestResult(index, error="no complete answer", timed_out=True)
        await asyncio.sleep(0 if index == 0 else 3600)
        return ok(index)

    results = await asyncio.wait_for(run_load(send, 8, 2), timeout=5)
    assert len(results) == 8
    assert results[0].ok and results[1].timed_out
    assert all("request 1 stalled" in (r.error or "") for r in results[2:])
    assert len(started) < 8


def test_setups_default_to_all_and_unknown_names_are_refused() -> None:
    assert setups_to_run(None) == ["vllm-pull", "vllm-push", "kvpush-push", "kvpush-pull"]
    assert setups_to_run("vllm-push, vllm-pull") == ["vllm-push", "vllm-pull"]
    with pytest.raises(ValueError, match="unknown setup nccl"):
        setups_to_run("vllm-pull,nccl")


def test_bad_load_is_refused_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", "compare", "--concurrency", "0"])
    assert exit_.value.code == 2
    assert "argument --concurrency: must be at least 1" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "compare", "--setups", "nccl"])
    assert args.func(args) == 2
    assert capsys.readouterr().err.startswith("kvpush bench compare: --setups: unknown setup")


def test_root_cause_finds_the_first_exception_outside_warnings() -> None:
    log = "\n".join(
        [
            "(APIServer pid=1) WARNING [x.py:1] error: `OSError: [Errno 24] Too many`",
            "(Worker pid=2) ERROR [m.py:9]     raise ValueError(",
            "(Worker pid=2) ERROR [m.py:9] ValueError: kvpush needs kv_role 'kv_producer'",
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    assert root_cause(log) == "ValueError: kvpush needs kv_role 'kv_producer'"
    argparse_log = "usage: api_server.py ...\napi_server.py: error: unrecognized arguments: --x\n"
    assert root_cause(argparse_log) == "api_server.py: error: unrecognized arguments: --x"
    assert root_cause("starting\nKilled\n") == "Killed"
    assert root_cause("") == "(empty log)"


def test_root_cause_puts_kvpush_s_own_explanation_before_the_worker_s_death() -> None:
    # kvpush refuses a model in the worker's start; the worker dies of it, and vLLM says so
    # first in the engine's lines, then fails the API server's start
    why = "kvpush cannot transfer the KV cache of m: its layers keep a SlidingWindowSpec cache"
    log = "\n".join(
        [
            "(APIServer pid=1) WARNING [x.py:1] kvpush.vllm.plugin.Thing: kvpush warns",
            f"(Worker pid=2) ERROR [mp.py:9] kvpush.vllm.layout.UnsupportedKVCache: {why}. "
            + "x" * 400,
            "(EngineCore pid=1) ERROR [mp.py:3] Worker proc VllmWorker-0 died unexpectedly",
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    cause = root_cause(log)
    assert cause.startswith(f"UnsupportedKVCache: {why}. x")
    assert len(cause) > 300, "kvpush's messages are quoted whole"
    # a plain exception with kvpush's own message too, but not someone else's
    own = log.replace("kvpush.vllm.layout.UnsupportedKVCache", "ValueError")
    assert root_cause(own).startswith(f"ValueError: {why}")
    other = log.replace(f"kvpush.vllm.layout.UnsupportedKVCache: {why}", "ValueError: bad")
    assert root_cause(other).startswith("Worker proc VllmWorker-0 died unexpectedly")


def test_root_cause_names_the_signal_and_frame_that_killed_a_worker() -> None:
    # Python's fault handler (the testbed sets PYTHONFAULTHANDLER) names the signal, then
    # each thread's stack; the crashing one is "Current thread", most recent call first.
    site = "/v/lib/python3.11/site-packages"
    log = "\n".join(
        [
            "(Worker pid=2) INFO [worker.py:195] kvpush prefill worker 0/1: ...",
            "Fatal Python error: Illegal instruction",
            "Thread 0x00007f7f83ffe6c0 (most recent call first):",
            '  File "/work/kvpush/node/direct.py", line 254 in run',
            "Current thread 0x00007f80538b67c0 (most recent call first):",
            f'  File "{site}/torch/_ops.py", line 1279 in __call__',
            f'  File "{site}/vllm/_custom_ops.py", line 3927 in cpu_attention',
            "(EngineCore pid=1) ERROR [multiproc_executor.py:315] Worker proc VllmWorker-0 "
            "died unexpectedly (exit code: -4), shutting down executor.",
            "(EngineCore pid=1) ERROR [core.py:1512] RuntimeError: cancelled",
        ]
    )
    assert root_cause(log) == (
        "Fatal Python error: Illegal instruction in vllm/_custom_ops.py line 3927, cpu_attention"
    )
    # without the fault handler: vLLM's line about its worker, not the error it causes
    rest = log.split("\n")[-2:]
    assert root_cause("\n".join(rest)).startswith(
        "Worker proc VllmWorker-0 died unexpectedly (exit code: -4)"
    )


def test_failure_reason_tells_a_stall_from_failed_requests() -> None:
    stalled = [
        ok(0),
        RequestResult(1, error="no complete answer within 60 s", timed_out=True),
        RequestResult(2, error="not completed: request 1 stalled before"),
    ]
    status, reason = failure_reason(stalled, 3)
    assert status == "stalled"
    assert reason == "request 1: no complete answer within 60 s; 1 more not completed " + (
        "(timed out too, cancelled or never sent)"
    )
    failed = [ok(0), RequestResult(1, error="HTTP 502: boom"), RequestResult(2, error="x")]
    assert failure_reason(failed, 3) == (
        "failed",
        "2 of 3 requests failed; first, 1: HTTP 502: boom",
    )
