"""`kvpush bench sweep` / `plot` without servers: naming, parsing, resume, aggregation, plots."""

from __future__ import annotations

import http.server
import json
import resource
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpush.bench import plot, results, sweep
from kvpush.bench.results import Point
from kvpush.cli import main
from kvpush.testbed.topology import PairSettings

DATA = Path(__file__).parent.parent / "data"


def raw() -> dict[str, Any]:
    """A real `vllm bench serve --save-result` file (kvpush-push, 16 prompts, trimmed)."""
    data: dict[str, Any] = json.loads((DATA / "vllm_bench_serve.json").read_text())
    return data


def record(point: Point, status: str = "ok", ttft: float = 10.0, tpot: float = 2.0) -> dict:
    base = {
        "schema": results.SCHEMA,
        "setup": point.setup,
        "rate": point.rate,
        "input_len": point.input_len,
        "output_len": point.output_len,
        "iteration": point.iteration,
        "num_prompts": 16,
        "status": status,
        "reason": None if status == "ok" else f"{status} for a test",
    }
    if status == "ok":
        summary = results.summarise_bench(raw())
        summary["ttft"] = {"mean": ttft, "p50": ttft, "p99": 3 * ttft}
        summary["tpot"] = {"mean": tpot, "p50": tpot, "p99": 2 * tpot}
        base.update(summary)
        # decode's engine: 31 gaps of (tpot - 0.5) ms each, the rest was proxy and client
        itl = 'vllm:inter_token_latency_seconds_{}{{engine="0",model_name="m"}}'
        step = {itl.format("sum"): 31 * (tpot - 0.5) / 1e3, itl.format("count"): 31.0}
        base["metrics"] = {"decode": step, "prefill": {}}
    return base


def spec(tmp_path: Path, **kw: Any) -> sweep.SweepSpec:
    (tmp_path / "model").mkdir(exist_ok=True)
    args: dict[str, Any] = {
        "setups": ["kvpush-push", "vllm-pull"],
        "rates": [1.0, 4.0],
        "input_lens": [256],
        "output_len": 32,
        "num_prompts": 16,
        "iterations": 2,
        "out": tmp_path / "out",
        "pair": PairSettings(tmp_path / "model"),
    }
    args.update(kw)
    return sweep.SweepSpec(**args)


def test_run_files_are_named_as_the_issue_says() -> None:
    point = Point(3, "kvpush-push", 4096, 0.5, 128)
    assert point.stem == "kvpush-push_qps0.5_in4096_out128_iter3"
    assert point.path(Path("r")) == Path("r/kvpush-push_qps0.5_in4096_out128_iter3.json")
    assert Point(1, "vllm-pull", 1024, 8.0, 128).stem == "vllm-pull_qps8_in1024_out128_iter1"


def test_setups_are_interleaved_across_iterations_and_take_turns_first() -> None:
    """A fixed order ran the same setup first in every iteration; measured on a 2-core
    host, whichever kvpush mode ran first had the higher TTFT (docs/benchmarks.md)."""
    groups = results.plan(["A", "B", "C"], [1.0, 2.0], [128, 512], 16, 4)
    assert [(i, s) for i, s, _ in groups] == [
        (1, "A"), (1, "B"), (1, "C"), (2, "B"), (2, "C"), (2, "A"),
        (3, "C"), (3, "A"), (3, "B"), (4, "A"), (4, "B"), (4, "C"),
    ]  # fmt: skip
    first = groups[0][2]
    assert [(p.input_len, p.rate) for p in first] == [
        (128, 1.0),
        (128, 2.0),
        (512, 1.0),
        (512, 2.0),
    ]
    assert len({p for _, _, ps in groups for p in ps}) == 3 * 2 * 2 * 4


def test_vllm_bench_output_is_summarised() -> None:
    summary = results.summarise_bench(raw())
    assert summary["completed"] == 16 and summary["failed"] == 0
    assert summary["ttft"]["p50"] == pytest.approx(31.684, abs=1e-3)
    assert summary["ttft"]["p99"] == pytest.approx(264.869, abs=1e-3)
    assert summary["tpot"]["mean"] == pytest.approx(2.620, abs=1e-3)
    assert summary["e2el"]["p50"] == pytest.approx(125.014, abs=1e-3)
    assert summary["itl"]["p99"] == pytest.approx(11.590, abs=1e-3)
    assert summary["request_throughput"] == pytest.approx(3.874, abs=1e-3)
    assert results.classify(summary, 16) == ("ok", None)
    assert summary["one_burst"] is None  # recorded without --save-detailed


def test_answers_that_arrive_in_one_burst_are_counted() -> None:
    data = raw()
    # four 32-token answers: two streamed, one whole at once, one failed (zeros)
    data.update(
        ttfts=[0.040, 0.035, 0.139, 0.0],
        latencies=[0.140, 0.130, 0.1392, 0.0],
        output_lens=[32, 32, 32, 0],
    )
    summary = results.summarise_bench(data)
    assert summary["one_burst"] == pytest.approx(1 / 3)
    line = sweep.describe({"status": "ok", **summary})
    assert "33% of answers in one burst" in line
    # one-token answers cannot tell
    data.update(output_lens=[1, 1, 1, 0])
    assert results.summarise_bench(data)["one_burst"] is None
    assert "burst" not in sweep.describe({"status": "ok", **results.summarise_bench(raw())})


def test_failed_and_timed_out_requests_are_classified_with_their_reason() -> None:
    data = raw()
    data.update(completed=13, failed=3, errors=["HTTP 504: request timed out"] * 2 + ["boom"])
    status, reason = results.classify(results.summarise_bench(data), 16)
    assert status == "stalled"
    assert reason is not None and "3 of 16 requests timed out" in reason and "504" in reason
    data.update(errors=["HTTP 502: prefill refused"] * 3)
    assert results.classify(results.summarise_bench(data), 16)[0] == "failed"
    data.update(completed=0, failed=16)
    summary = results.summarise_bench(data)
    assert summary["ttft"] == {"mean": None, "p50": None, "p99": None}  # no fake zeros


def test_resume_skips_finished_runs_and_redoes_torn_ones(tmp_path: Path) -> None:
    s = spec(tmp_path)
    points = s.points()
    assert len(points) == 2 * 2 * 2
    done, torn, failed = points[0], points[1], points[2]
    results.write_result(done.path(s.out), record(done))
    torn.path(s.out).write_text('{"schema": "kvpush.bench.run/1", "status"')
    results.write_result(failed.path(s.out), record(failed, "stalled"))
    assert results.is_done(done, s.out)
    assert not results.is_done(torn, s.out)
    assert results.is_done(failed, s.out)
    assert not results.is_done(failed, s.out, retry_failed=True)
    assert not results.is_done(points[3], s.out)


def test_a_finished_sweep_starts_nothing(tmp_path: Path) -> None:
    s = spec(tmp_path)
    for point in s.points():
        results.write_result(point.path(s.out), record(point))
    said: list[str] = []
    assert sweep.run_sweep(s, said.append) == []  # would fail trying to start vLLM otherwise
    assert "8 already in" in said[0]


def test_sweep_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown setup nccl"):
        spec(tmp_path, setups=["nccl"])
    with pytest.raises(ValueError, match="--rates"):
        spec(tmp_path, rates=[0.0])
    with pytest.raises(ValueError, match="--input-lens"):
        spec(tmp_path, input_lens=[])
    s = spec(tmp_path, num_prompts=40, request_timeout=30.0)
    assert s.deadline(Point(1, "kvpush-push", 256, 4.0, 32)) == 40 / 4 + 30 + 90
    assert spec(tmp_path, run_timeout=5.0).deadline(Point(1, "x", 1, 1.0, 1)) == 5.0


def test_metric_deltas_keep_our_counters_and_vllms_token_sources() -> None:
    before = {
        ("kvpush:transfer_bytes_total", ()): 100.0,
        ("vllm:prompt_tokens_by_source_total", (("source", "external_kv_transfer"),)): 10.0,
        ("vllm:num_requests_running", ()): 2.0,
    }
    after = {
        ("kvpush:transfer_bytes_total", ()): 612.0,
        ("kvpush:write_seconds_bucket", (("le", "0.1"),)): 4.0,
        ("vllm:prompt_tokens_by_source_total", (("source", "external_kv_transfer"),)): 266.0,
        ("vllm:num_requests_running", ()): 5.0,
    }
    assert sweep.metric_deltas(before, after) == {
        "kvpush:transfer_bytes_total": 512.0,
        'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}': 256.0,
    }


def test_delta_total_sums_over_the_other_labels() -> None:
    deltas = {
        'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"}': 256.0,
        'vllm:prompt_tokens_by_source_total{engine="1",source="external_kv_transfer"}': 44.0,
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"}': 7.0,
        "kvpush:transfer_bytes_total": 512.0,
    }
    name = "vllm:prompt_tokens_by_source_total"
    assert sweep.delta_total(deltas, name, source="external_kv_transfer") == 300.0
    assert sweep.delta_total(deltas, name) == 307.0
    assert sweep.delta_total(deltas, "kvpush:transfer_bytes_total") == 512.0
    assert sweep.delta_total(deltas, "kvpush:missing") == 0.0


def test_every_point_of_a_server_start_gets_prompts_it_has_not_cached() -> None:
    """One start of a setup's servers runs all its points; a seed shared between them made
    every run after the first a prefix-cache hit on decode, with no KV moved."""
    groups = results.plan(["kvpush-push", "single"], [1, 2, 4], [256, 1024], 32, 2)
    per_start = [{p.seed(0) for p in points} for _, _, points in groups]
    assert all(len(seeds) == 6 for seeds in per_start), "distinct within a start"
    assert len(set().union(*per_start)) == 6, "the same prompts for every setup and iteration"
    assert Point(1, "x", 256, 1.0, 32).seed(1) != Point(1, "x", 256, 1.0, 32).seed(0)
    spec_point = Point(1, "kvpush-push", 256, 2.0, 32)
    spec = sweep.SweepSpec(
        pair=PairSettings(model=Path("m")), setups=["kvpush-push"], rates=[2.0],
        input_lens=[256], output_len=32, num_prompts=4, iterations=1, out=Path("o"),
    )  # fmt: skip
    command = sweep.bench_command(spec, spec_point, "http://x", Path("raw"))
    assert command[command.index("--seed") + 1] == str(spec_point.seed(0))


def test_a_run_where_decode_computed_its_prompts_itself_is_flagged() -> None:
    name = "vllm:prompt_tokens_by_source_total"
    moved = {f'{name}{{source="external_kv_transfer"}}': 6144.0}
    cached = {
        f'{name}{{source="local_cache_hit"}}': 3712.0,
        f'{name}{{source="local_compute"}}': 2441.0,
    }
    assert sweep.handed_off(moved) == 1.0
    assert sweep.handed_off(cached) == 0.0
    assert sweep.handed_off({}) is None
    ok = {"status": "ok", "ttft": {"p50": 0.01}, "tpot": {"p50": 0.002}}
    assert "WARNING" in sweep.describe({**ok, "kv_handed_off": 0.0})
    assert "WARNING" not in sweep.describe({**ok, "kv_handed_off": 0.99})


class ResetServer:
    """A real HTTP server on loopback answering POST /reset_prefix_cache as vLLM does: it
    refuses (success false) the first `busy` times, as vLLM does while blocks are held."""

    def __init__(self, busy: int = 0, status: int = 200) -> None:
        self.calls = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                outer.calls += 1
                body = json.dumps({"success": outer.calls > busy}).encode()
                self.send_response(status if self.path == "/reset_prefix_cache" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_every_servers_prefix_cache_is_emptied_before_a_run_retrying_while_busy() -> None:
    """vllm bench serve's random prompts are consecutive token ids from a random offset; with
    the tiny model's 1,024-token vocabulary later runs of one server start would hit the
    prefix caches (14 % of decode's prompt tokens by a start's sixth 48-prompt run)."""
    idle, busy = ResetServer(), ResetServer(busy=2)
    try:
        assert sweep.reset_prefix_caches([idle.url, busy.url], timeout=5.0) is None
        assert (idle.calls, busy.calls) == (1, 3)
    finally:
        idle.close()
        busy.close()
    stuck = ResetServer(busy=10**6)
    try:
        why = sweep.reset_prefix_caches([stuck.url], timeout=0.5)
        assert why is not None and "still held KV blocks" in why
    finally:
        stuck.close()
    closed = ResetServer(status=404)  # a server started without VLLM_SERVER_DEV_MODE=1
    try:
        why = sweep.reset_prefix_caches([closed.url], timeout=1.0)
        assert why is not None and "HTTP 404" in why and "VLLM_SERVER_DEV_MODE=1" in why
    finally:
        closed.close()
    ok = {"status": "ok", "ttft": {"p50": 0.01}, "tpot": {"p50": 0.002}}
    assert "WARNING: " + why in sweep.describe({**ok, "prefix_cache_not_reset": why})


def write_recorded_sweep(out: Path) -> None:
    """Two iterations of three setups at two rates; vLLM push stalls at the high rate."""
    for it in (1, 2):
        for rate in (1.0, 4.0):
            for setup, ttft, tpot in (
                ("kvpush-push", 30.0 + it, 2.0),
                ("vllm-pull", 300.0 + it, 4.0),
                ("vllm-push", 200.0 + it, 5.0),
            ):
                point = Point(it, setup, 256, rate, 32)
                status = "stalled" if (setup, rate) == ("vllm-push", 4.0) else "ok"
                results.write_result(point.path(out), record(point, status, ttft * rate, tpot))
    (out / "notes.json").write_text('{"something": "else"}')  # not a result: ignored


def test_aggregate_takes_medians_of_ok_runs_and_keeps_failures(tmp_path: Path) -> None:
    write_recorded_sweep(tmp_path)
    rows = results.aggregate(results.load_results(tmp_path))
    assert len(rows) == 6
    ours = next(r for r in rows if (r.setup, r.rate) == ("kvpush-push", 4.0))
    assert (ours.runs, ours.ok, ours.status) == (2, 2, "ok")
    assert ours.ttft_p50 == pytest.approx(4 * 31.5)
    assert ours.decode_step_ms == pytest.approx(1.5)
    stalled = next(r for r in rows if (r.setup, r.rate) == ("vllm-push", 4.0))
    assert stalled.status == "stalled" and stalled.ttft_p50 is None
    assert stalled.decode_step_ms is None
    assert stalled.reasons == ["stalled for a test"] * 2


def test_table_gives_ratios_to_the_best_vllm_connector(tmp_path: Path) -> None:
    write_recorded_sweep(tmp_path)
    text = plot.table(results.aggregate(results.load_results(tmp_path)))
    rows = {tuple(line.split()[:3]): line.split() for line in text.splitlines()[1:7]}
    # at 1 qps the best vLLM TTFT is vllm-push's 201.5 ms: ours is 31.5 / 201.5
    assert rows["256", "1", "kvpush-push"][-2:] == [f"{31.5 / 201.5:.2f}x", f"{2 / 4:.2f}x"]
    # at 4 qps vllm-push stalled, so the reference is vllm-pull
    assert rows["256", "4", "kvpush-push"][-2] == f"{31.5 / 301.5:.2f}x"
    header = text.splitlines()[0].split("  ")
    column = [h.strip() for h in header if h.strip()].index("decode step")
    assert rows["256", "1", "vllm-pull"][column + 1] == "3.5"  # "ok 2/2" is two words
    assert rows["256", "4", "vllm-push"][3:5] == ["stalled", "0/2"]
    assert "vllm-push at 4 qps, 256 in: stalled (stalled for a test)" in text


def test_plot_writes_a_png_with_failed_points(tmp_path: Path, capsys: Any) -> None:
    write_recorded_sweep(tmp_path)
    assert main(["bench", "plot", str(tmp_path)]) == 0
    png = tmp_path / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "kvpush-push" in out and f"figure: {png}" in out
    assert main(["bench", "plot", str(tmp_path / "missing")]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["bench", "plot", str(empty)]) == 1


def test_progress_bar_counts_and_estimates() -> None:
    bar = sweep.Progress(total=4, done=1)
    assert "1/4 runs" in bar.bar() and "ETA ?" in bar.bar()
    bar.advance()
    assert "2/4 runs" in bar.bar() and "ETA ?" not in bar.bar()
    assert sweep.format_duration(3725) == "1h02m" and sweep.format_duration(65) == "1m05s"


def test_nospin_agents_do_not_spin() -> None:
    """The *-nospin setups' agent: vLLM's class and progress thread, but paced, not spinning."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    from kvpush.bench import nospin

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    binding = nospin.install()
    assert nospin.install() is binding  # idempotent: one wrapper, not a chain
    agent = base_worker.NixlWrapper("kvpush-nospin-test", None)  # type: ignore[attr-defined]
    before = cpu()
    time.sleep(0.5)
    assert cpu() - before < 0.2  # an unpaced progress thread burns ~0.5 s of CPU here
    assert "UCX" in agent.backends
    assert nospin.NixlConnector is KVConnectorFactory.get_connector_class_by_name("NixlConnector")
    with pytest.raises(AttributeError):
        nospin.SomethingElse  # noqa: B018


def test_a_setup_that_never_ran_clean_shows_what_did_finish_flagged(tmp_path: Path) -> None:
    point = Point(1, "vllm-pull", 256, 4.0, 32)
    stalled = record(point, "ok", ttft=900.0)
    stalled.update(status="stalled", reason="1 of 16 requests timed out", completed=15, failed=1)
    results.write_result(point.path(tmp_path), stalled)
    ours = Point(1, "kvpush-push", 256, 4.0, 32)
    results.write_result(ours.path(tmp_path), record(ours, ttft=90.0))
    rows = results.aggregate(results.load_results(tmp_path))
    theirs = next(r for r in rows if r.setup == "vllm-pull")
    assert theirs.partial and theirs.status == "stalled" and theirs.ttft_p50 == 900.0
    assert (theirs.completed, theirs.requests) == (15, 16)
    text = plot.table(rows)
    line = next(x for x in text.splitlines() if x.startswith("256") and "vllm-pull" in x)
    assert "stalled (15/16 done)" in line and "900.0*" in line
    ours_line = next(x for x in text.splitlines() if "kvpush-push" in x)
    assert "0.10x~" in ours_line  # against a reference that was not ok in every run
    assert "understate" in text


def test_no_ratio_against_a_coalesced_stream(tmp_path: Path) -> None:
    theirs = Point(1, "vllm-pull", 256, 4.0, 32)
    results.write_result(theirs.path(tmp_path), record(theirs, ttft=500.0, tpot=0.0))
    ours = Point(1, "kvpush-push", 256, 4.0, 32)
    results.write_result(ours.path(tmp_path), record(ours, ttft=50.0, tpot=2.0))
    text = plot.table(results.aggregate(results.load_results(tmp_path)))
    line = next(x for x in text.splitlines() if "kvpush-push" in x).split()
    assert line[-2:] == ["0.10x", "-"]
    assert "chunks coalesced" in text


def test_the_time_to_the_second_token_is_read_from_each_requests_gaps() -> None:
    """With the first token from prefill, TTFT is prefill's leg: the handoff shows in the
    time to the second token, which is decode's first."""
    data = {"ttfts": [0.010, 0.020, 0.030], "itls": [[0.005, 0.001], [0.010], []]}
    assert results.second_token(data) == pytest.approx({"mean": 22.5, "p50": 22.5, "p99": 30.0})
    assert results.second_token({"ttfts": [], "itls": []})["p50"] is None
    assert set(results.summarise_bench(raw())["tt2t"]) == {"mean", "p50", "p99"}


def test_each_run_records_where_its_first_tokens_came_from() -> None:
    before = {"prefill": 10, "decode": 2}
    after = {"prefill": 31, "decode": 5, "mismatch": 1}
    sources = sweep.first_token_sources(before, after)
    assert sources == {"prefill": 21, "decode": 3, "mismatch": 1}
    assert sweep.first_token_sources(None, None) is None  # single: no proxy
    assert results.from_prefill({"first_token_sources": sources}) == pytest.approx(21 / 24)
    assert results.from_prefill({"first_token_sources": {"prefill": 0, "decode": 0}}) is None
    assert results.from_prefill({}) is None  # recorded before the sweep kept them
    ok = {"status": "ok", "ttft": {"p50": 0.01}, "tpot": {"p50": 0.002}}
    line = sweep.describe({**ok, "first_token": "prefill", "first_token_sources": sources})
    assert "first token from prefill in 21 of 24 (1 not reproduced by decode)" in line
    assert "first token" not in sweep.describe({**ok, "first_token": "decode"})


CPUINFO_AMD = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n\n"
CPUINFO_INTEL = "model name\t: Intel Xeon\nflags\t: avx2 avx512f avx512bw\n"
CPUINFO_AMX = "model name\t: Intel Xeon\nflags\t: avx2 avx512f amx_bf16 amx_tile amx_int8\n"


def test_each_run_names_its_host_and_plot_warns_when_hosts_differ(
    tmp_path: Path, capsys: Any
) -> None:
    amd, intel = results.host_cpu(CPUINFO_AMD), results.host_cpu(CPUINFO_INTEL)
    assert (amd["cpu"], amd["isa"], intel["isa"]) == ("AMD EPYC", "avx2", "avx512")
    assert amd["cores"] >= 1
    assert results.host_cpu("")["isa"] == "other"
    amx = results.host_cpu(CPUINFO_AMX)
    assert amx["isa"] == "amx"  # vLLM's attention on AMX tiles: another host class
    assert results.describe_host(amx).endswith("cores, AVX-512 and AMX")
    assert results.describe_host(amd) == f"AMD EPYC, {amd['cores']} cores, AVX2, no AVX-512"
    assert results.describe_host(None) == "-"  # recorded before hosts were kept
    write_recorded_sweep(tmp_path)
    paths = sorted(tmp_path.glob("*_iter*.json"))
    for path in paths:
        data = json.loads(path.read_text())
        results.write_result(path, {**data, "host": amd})
    assert main(["bench", "plot", str(tmp_path), "--png", str(tmp_path / "a.png")]) == 0
    assert f"host: {results.describe_host(amd)}" in capsys.readouterr().out
    results.write_result(paths[0], {**json.loads(paths[0].read_text()), "host": intel})
    assert main(["bench", "plot", str(tmp_path), "--png", str(tmp_path / "b.png")]) == 0
    out = capsys.readouterr().out
    assert "WARNING: runs from different hosts" in out and "Intel Xeon" in out


def test_plot_names_the_code_and_warns_when_runs_mix_versions(tmp_path: Path, capsys: Any) -> None:
    write_recorded_sweep(tmp_path)
    paths = sorted(tmp_path.glob("*_iter*.json"))
    code = {"version": "0.1.0", "source": "a" * 16, "commit": "b" * 12, "dirty": False}
    for path in paths:
        results.write_result(path, {**json.loads(path.read_text()), "code": code})
    assert main(["bench", "plot", str(tmp_path), "--png", str(tmp_path / "a.png")]) == 0
    assert f"code: kvpush 0.1.0 at {'b' * 12}, source {'a' * 16}" in capsys.readouterr().out
    edited = {**code, "source": "c" * 16, "dirty": True}
    results.write_result(paths[-1], {**json.loads(paths[-1].read_text()), "code": edited})
    assert main(["bench", "plot", str(tmp_path), "--png", str(tmp_path / "b.png")]) == 0
    out = capsys.readouterr().out
    assert "WARNING: runs of different kvpush code" in out and "with changes" in out
