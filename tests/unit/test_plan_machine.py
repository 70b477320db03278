"""Measured machine profiles: fits, derived simulator parameters, and the check's plumbing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpush.cli import main
from kvpush.plan.machine import (
    HOPS,
    Line,
    MachineProfile,
    PointProbe,
    SetupProbe,
    StepFit,
    check,
    derive,
    load_profile,
    measured_points,
    save_profile,
    sim_params,
)
from kvpush.plan.measure import MeasureSpec, histogram_mean_ms, submit_beyond_idle
from kvpush.plan.model import PlannerError
from kvpush.plan.simulate import simulate
from kvpush.testbed.topology import PairSettings


def probe(
    setup: str = "kvpush-push",
    mode: str = "push",
    prefill: tuple[float, float] = (2.0, 0.01),  # ms fixed, ms per token
    front: tuple[float, float] = (5.0, 0.002),
    step: tuple[float, float, float] = (1.5, 0.1, 0.0005),  # base, per seq, per ctx token (ms)
    submit_ms_per_token: float | None = None,
    transfer_ms: float | None = None,
) -> SetupProbe:
    points = []
    for n in (256, 1024):
        steps = {b: step[0] + step[1] * b + step[2] * b * n for b in (1, 8)}
        submit = None if submit_ms_per_token is None else submit_ms_per_token * n
        points.append(
            PointProbe(
                input_len=n,
                prefill_ms=prefill[0] + prefill[1] * n,
                front_end_ms=front[0] + front[1] * n,
                step_ms=steps,
                submit_ms=submit,
                transfer_ms=None if transfer_ms is None else transfer_ms + n * 512 / 12.5e6,
            )
        )
    return SetupProbe(setup, mode, tuple(points))  # type: ignore[arg-type]


def profile(*probes: SetupProbe) -> MachineProfile:
    return MachineProfile(
        kv_bytes_per_token=512,
        max_num_seqs=8,
        link_gbps=12.5,
        memory_gbps=19.8,
        proxy_added_ms={"pull": 3.0, "push": 4.0},
        setups={p.setup: p for p in probes or (probe(),)},
        provenance={"command": "test"},
    )


def test_line_fit_is_exact_through_two_points() -> None:
    line = Line.fit([256, 1024], [4.56, 12.24])
    assert line.intercept == pytest.approx(2.0)
    assert line.slope == pytest.approx(0.01)


def test_step_fit_recovers_the_plane_and_drops_negative_terms() -> None:
    samples = [(b, n, 1.5 + 0.1 * b + 0.0005 * b * n) for b in (1, 8) for n in (256, 1024)]
    fit = StepFit.fit(samples)
    assert fit.base_ms == pytest.approx(1.5)
    assert fit.per_seq_ms == pytest.approx(0.1)
    assert fit.per_context_token_us == pytest.approx(0.5)
    # longer contexts measured faster: noise, so that term goes and the rest is refitted
    noisy = [(1, 256, 2.0), (8, 256, 3.0), (1, 1024, 1.9), (8, 1024, 2.9)]
    fit = StepFit.fit(noisy)
    assert fit.per_context_token_us == 0.0
    assert fit.per_seq_ms == pytest.approx(1.0 / 7)


def test_derive_turns_measurements_into_parameters() -> None:
    d = derive(
        profile(probe(setup="vllm-pull", mode="pull", submit_ms_per_token=0.004)), "vllm-pull"
    )
    assert d.prefill.intercept == pytest.approx(2.0)
    assert d.prefill.slope == pytest.approx(0.01)
    assert d.front_end.intercept == pytest.approx(5.0)
    assert d.submit_us_per_token == pytest.approx(4.0)
    assert d.hop_ms == pytest.approx(3.0 / HOPS["pull"])
    assert d.transfer_setup_ms == 0.0  # vLLM's connectors report no transfer times
    # kvpush's metrics: each transfer took 0.05 ms beyond moving its bytes at 12.5 GB/s
    assert derive(profile(probe(transfer_ms=0.05)), "kvpush-push").transfer_setup_ms == (
        pytest.approx(0.05)
    )


def test_noisy_measurements_are_refused_or_flattened() -> None:
    flat = probe(prefill=(10.0, -0.001))
    with pytest.raises(PlannerError, match="does not grow with prompt length"):
        derive(profile(flat), "kvpush-push")
    # a front end faster for longer prompts is noise: its mean, no per-token term
    d = derive(profile(probe(front=(6.0, -0.001))), "kvpush-push")
    assert d.front_end.slope == 0.0
    assert d.front_end.intercept == pytest.approx(6.0 - 0.001 * 640)


def test_one_push_request_costs_the_measured_path() -> None:
    prof = profile()
    params = sim_params(prof, "kvpush-push", output_len=4, num_prompts=1)
    n = 1024
    # client -> proxy -> front end -> prefill -> WRITE -> one decode step -> front end out
    expected_ms = (
        4.0  # the proxy's added latency, one hop in push
        + 0.002 * n  # front end per token, before the engine sees the prompt
        + 2.0
        + 0.01 * n  # prefill
        + n * 512 / 12.5e9 * 1e3  # transfer
        + params.step_s(1, n) * 1e3
        + 5.0  # front end per response, on the first token's way out
    )
    result = simulate(params, "push", 1.0, n)
    assert result.ttft_ms.mean == pytest.approx(expected_ms)
    assert params.step_s(1, n) * 1e3 == pytest.approx(
        1.5 + 0.1 + 0.0005 * n + n * 512 / 19.8e9 * 1e3
    )


def test_one_pull_request_pays_decode_front_end_and_submission_after_prefill() -> None:
    prof = profile(probe(setup="vllm-pull", mode="pull", submit_ms_per_token=0.004))
    params = sim_params(prof, "vllm-pull", output_len=4, num_prompts=1)
    n = 256
    hop = 1.0
    expected_ms = (
        hop + 0.002 * n + 2.0 + 0.01 * n  # to prefill, through it
        + 5.0 + 2 * hop  # prefill's answer out, via the proxy to decode
        + 0.002 * n  # decode's front end
        + 0.004 * n  # inline submission
        + n * 512 / 12.5e9 * 1e3
        + params.step_s(1, n) * 1e3
        + 5.0
    )  # fmt: skip
    assert simulate(params, "pull", 1.0, n).ttft_ms.mean == pytest.approx(expected_ms)


def test_profile_round_trips_and_bad_files_name_the_fix(tmp_path: Path) -> None:
    prof = profile(probe(), probe(setup="vllm-pull", mode="pull", submit_ms_per_token=0.01))
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert load_profile(path) == prof
    (tmp_path / "other.json").write_text('{"schema": "x"}')
    with pytest.raises(PlannerError, match="kvpush plan measure"):
        load_profile(tmp_path / "other.json")
    with pytest.raises(PlannerError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(PlannerError, match="run `kvpush plan measure --setups vllm-push`"):
        prof.setup("vllm-push")


def record(
    setup: str, rate: float, ttft: float | None, tpot: float | None, **kw: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "schema": "kvpush.bench.run/1",
        "setup": setup,
        "rate": rate,
        "input_len": 256,
        "output_len": 32,
        "iteration": 1,
        "num_prompts": 24,
        "max_num_seqs": 8,
        "status": "ok" if ttft is not None else "stalled",
        "ttft": {"p50": ttft},
        "tpot": {"p50": tpot},
    }
    body.update(kw)
    return body


def test_measured_points_take_medians_of_ok_iterations() -> None:
    results = [
        record("kvpush-push", 1.0, 30.0, 2.0, iteration=1),
        record("kvpush-push", 1.0, 50.0, 4.0, iteration=2),
        record("kvpush-push", 1.0, 40.0, 3.0, iteration=3),
        record("kvpush-push", 1.0, None, None, iteration=4),
    ]
    (point,) = measured_points(results)
    assert (point.ttft_p50, point.tpot_p50, point.runs) == (40.0, 3.0, 4)
    assert point.status == "stalled"


def test_check_predicts_each_point_of_known_setups() -> None:
    results = [record("kvpush-push", r, 30.0, 2.0) for r in (1.0, 4.0)]
    results.append(record("vllm-push", 1.0, 30.0, 2.0))
    rows = check(profile(), results, seeds=2)
    assert [(r.measured.setup, r.measured.rate) for r in rows] == [
        ("kvpush-push", 1.0),
        ("kvpush-push", 4.0),
    ]
    assert all(r.error("ttft") is not None and r.error("tpot") is not None for r in rows)
    assert all(r.error("e2el") is None for r in rows)  # these records have no e2el
    with pytest.raises(PlannerError, match="no result is of a setup the profile measured"):
        check(profile(), [record("vllm-push", 1.0, 30.0, 2.0)])


def test_check_simulates_the_first_token_where_the_sweep_took_it() -> None:
    """A sweep's records say where the proxy took the first token from; older ones,
    without the field, took it from decode."""
    old = record("kvpush-push", 1.0, 30.0, 2.0)
    new = record("kvpush-push", 1.0, 30.0, 2.0, first_token="prefill", input_len=1024)
    (then, now) = check(profile(), [old, new], seeds=2)
    assert (then.measured.first_token, now.measured.first_token) == ("decode", "prefill")
    prof = profile()
    alone = sim_params(prof, "kvpush-push", output_len=32, num_prompts=24, first_token="prefill")
    assert alone.first_token == "prefill"
    from_decode = check(profile(), [{**new, "first_token": "decode"}], seeds=2)[0]
    assert now.ttft_p50 < from_decode.ttft_p50  # prefill's answer, before the handoff


def test_check_cli_prints_errors_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "sweep"
    results.mkdir()
    for rate in (1.0, 2.0):
        name = f"kvpush-push_qps{rate:g}_in256_out32_iter1.json"
        (results / name).write_text(json.dumps(record("kvpush-push", rate, 30.0, 2.0)))
    prof = tmp_path / "profile.json"
    save_profile(profile(), prof)
    assert main(["plan", "check", str(results), "--profile", str(prof), "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "front end ms" in out and "TTFT p50" in out
    assert "kvpush-push: TTFT within 25% at" in out
    argv = ["plan", "check", str(results), "--profile", str(prof), "--seeds", "1", "--json"]
    assert main(argv) == 0
    body = json.loads(capsys.readouterr().out)
    assert len(body["rows"]) == 2
    assert body["rows"][0]["measured"] == {"ttft_p50": 30.0, "tpot_p50": 2.0, "e2el_p50": None}
    assert main(["plan", "check", str(tmp_path / "none"), "--profile", str(prof)]) == 2
    assert "pass a `kvpush bench sweep --out` folder" in capsys.readouterr().err


def test_simulate_with_a_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "profile.json"
    save_profile(profile(), prof)
    argv = (
        f"plan simulate --profile {prof} --setup kvpush-push --rates 1,2 --input-lens 256 "
        "--output-len 32 --num-prompts 10 --json"
    )
    assert main(argv.split()) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["params"]["tp"] == 1
    assert body["params"]["api_fixed_ms"] == pytest.approx(5.0)
    assert {r["mode"] for r in body["results"]} == {"push"}
    assert main(["plan", "simulate", "--preset", "articles", "--setup", "kvpush-push"]) == 2
    assert "pass --profile too" in capsys.readouterr().err
    assert main(f"plan simulate --profile {prof}".split()) == 2
    assert "--profile needs --setup, one of: kvpush-push" in capsys.readouterr().err


def test_measure_helpers() -> None:
    before = {("vllm:x_sum", ()): 1.0, ("vllm:x_count", ()): 2.0}
    after = {("vllm:x_sum", ()): 1.5, ("vllm:x_count", ()): 7.0}
    assert histogram_mean_ms(before, after, "vllm:x") == pytest.approx(100.0)
    with pytest.raises(PlannerError, match="recorded no vllm:x"):
        histogram_mean_ms(before, before, "vllm:x")
    # 10 handed-off requests: 30 ms over 110 calls, where an idle call costs 0.1 ms
    assert submit_beyond_idle((0.030, 110), (0.010, 100), 10) == pytest.approx(1.9)
    with pytest.raises(PlannerError, match="--setups: unknown setup nope"):
        MeasureSpec(PairSettings(Path("m")), ["nope"], [256], Path("o.json"))
    with pytest.raises(PlannerError, match="--output-lens"):
        MeasureSpec(
            PairSettings(Path("m")), ["kvpush-push"], [256], Path("o.json"), output_lens=(8, 8)
        )
