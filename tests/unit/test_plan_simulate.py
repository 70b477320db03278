"""The pull vs push simulator: exact timelines, determinism, and the articles check."""

from __future__ import annotations

import pytest

from kvpush.plan.model import PlannerError, PrefillSpeed
from kvpush.plan.simulate import (
    H200_BF16_DENSE_TFLOPS,
    PUBLISHED_TTFT_MS,
    QWEN3_32B_FLOPS,
    RunResult,
    SimParams,
    articles_params,
    simulate,
)


def single_request(**overrides: object) -> SimParams:
    values: dict[str, object] = {"num_prompts": 1, "output_len": 4}
    values.update(overrides)
    return articles_params(**values)


def params_step_ms(params: SimParams) -> float:
    return params.step_s(1, 0) * 1e3


def test_single_pull_request_pays_every_serial_step() -> None:
    params = single_request()
    n = 16384
    hop = params.hop_ms / 1e3
    expected = (
        3 * hop  # proxy -> prefill, prefill -> proxy -> decode
        + params.prefill.seconds(n)
        + params.submit_s(n)
        + params.transfer_s(n)
        + params.step_s(1, n)
    )
    result = simulate(params, "pull", 1.0, n)
    assert result.ttft_ms.mean == pytest.approx(expected * 1e3)
    first_steps = [params.step_s(1, n + k) for k in (1, 2, 3)]
    assert result.tpot_ms.mean == pytest.approx(sum(first_steps) / 3 * 1e3)


def test_single_push_request_leaves_only_the_transfer_after_prefill() -> None:
    params = single_request()
    n = 16384
    expected = (
        params.hop_ms / 1e3 + params.prefill.seconds(n) + params.transfer_s(n) + params.step_s(1, n)
    )
    result = simulate(params, "push", 1.0, n)
    assert result.ttft_ms.mean == pytest.approx(expected * 1e3)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_first_token_from_prefill_is_prefills_answer_and_the_handoff_moves_to_the_second(
    mode: str,
) -> None:
    n = 16384
    before = single_request(output_len=4, api_fixed_ms=2.0)
    from_decode = simulate(before, mode, 1.0, n)  # type: ignore[arg-type]
    params = single_request(output_len=4, first_token="prefill", api_fixed_ms=2.0)
    result = simulate(params, mode, 1.0, n)  # type: ignore[arg-type]
    prefill_answer = params.hop_ms / 1e3 + params.prefill.seconds(n)
    # the client's first token is prefill's, out through prefill's front end: no handoff
    assert result.ttft_ms.mean == pytest.approx(prefill_answer * 1e3 + 2.0)
    # decode's second step is the second token whichever leg sent the first; the handoff
    # is in it
    assert result.tt2t_ms == from_decode.tt2t_ms
    assert result.tt2t_ms.mean - result.ttft_ms.mean > params.transfer_s(n) * 1e3
    # TPOT now spans the handoff too: (last - prefill's token) / (output_len - 1)
    assert result.tpot_ms.mean > from_decode.tpot_ms.mean


def test_first_token_from_prefill_gives_both_modes_the_same_ttft_and_push_the_earlier_second() -> (
    None
):
    params = articles_params(num_prompts=60, first_token="prefill")
    pull, push = (simulate(params, mode, 4.0, 2048) for mode in ("pull", "push"))
    assert pull.ttft_ms == push.ttft_ms  # prefill's leg is the same in both modes
    assert push.tt2t_ms.p50 < pull.tt2t_ms.p50  # push's head start shows at the second


def test_prefill_concurrency_shares_throughput() -> None:
    fifo = articles_params(num_prompts=2, output_len=2, prefill=PrefillSpeed(1000.0))
    shared = articles_params(
        num_prompts=2, output_len=2, prefill=PrefillSpeed(1000.0), prefill_concurrency=2
    )
    # both requests arrive within nanoseconds: FIFO finishes them at 1 s and 2 s,
    # sharing finishes both at 2 s (give or take a decode step the second one waits for)
    gap = simulate(shared, "push", 1e9, 1000).ttft_ms.mean
    gap -= simulate(fifo, "push", 1e9, 1000).ttft_ms.mean
    assert gap == pytest.approx(500.0, abs=params_step_ms(fifo))


def test_pull_inline_submission_stretches_running_sequences() -> None:
    params = articles_params(num_prompts=60, prefill=PrefillSpeed(1e9))
    pull = simulate(params, "pull", 4.0, 16384)
    push = simulate(params, "push", 4.0, 16384)
    no_stall = simulate(
        articles_params(num_prompts=60, prefill=PrefillSpeed(1e9), pull_submit_us_per_token=0),
        "pull",
        4.0,
        16384,
    )
    assert pull.tpot_ms.mean > push.tpot_ms.mean + 2.0
    assert no_stall.tpot_ms.mean == pytest.approx(push.tpot_ms.mean, rel=0.02)
    assert pull.ttft_ms.mean > push.ttft_ms.mean


def test_same_seed_same_result_other_seed_other_result() -> None:
    params = articles_params(num_prompts=50)
    first = simulate(params, "pull", 8.0, 2048)
    assert simulate(params, "pull", 8.0, 2048) == first
    other = simulate(articles_params(num_prompts=50, seed=1), "pull", 8.0, 2048)
    assert other.ttft_ms.mean != first.ttft_ms.mean


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"output_len": 1}, "--output-len must be at least 2"),
        ({"hop_ms": -1.0}, "--hop-ms"),
        ({"tp": 0}, "--tp"),
        ({"max_num_seqs": True}, "--max-num-seqs"),
        ({"link_gbps": 0.0}, "--link-gbps"),
        ({"base_tpot_ms": 0.0}, "a decode step takes time"),
        ({"seed": -1}, "--seed"),
        ({"first_token": "proxy"}, "--first-token must be one of decode, prefill"),
    ],
)
def test_sim_params_reject_bad_values(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(PlannerError, match=message):
        articles_params(**overrides)


def test_simulate_rejects_bad_grid_points() -> None:
    with pytest.raises(PlannerError, match="--rates"):
        simulate(articles_params(), "push", 0.0, 1024)
    with pytest.raises(PlannerError, match="unknown mode"):
        simulate(articles_params(), "both", 1.0, 1024)  # type: ignore[arg-type]


# The articles check. Parameters come from the articles' stated setup (see the
# simulate module docstring), never from the published TTFTs; where the simulator misses
# a published point, the test pins the error it actually makes.


@pytest.fixture(scope="module")
def articles_runs() -> dict[tuple[str, float, int], RunResult]:
    params = articles_params()
    return {
        (mode, rate, n): simulate(params, mode, rate, n)
        for mode in ("pull", "push")
        for rate, n in ((1.0, 1024), (8.0, 16384))
    }


def test_articles_low_load_short_prompts(
    articles_runs: dict[tuple[str, float, int], RunResult],
) -> None:
    pull = articles_runs[("pull", 1.0, 1024)]
    push = articles_runs[("push", 1.0, 1024)]
    # published: TPOT 5.6-5.8 ms for both modes
    for run in (pull, push):
        assert 5.6 <= run.tpot_ms.mean <= 5.8
    # published: "nearly identical" TTFT. Simulated pull is 12 ms (40 %) above push: two
    # more proxy hops, 7.4 ms of inline submission and one more decode step boundary.
    # Small next to the chart's 1.7 s scale, but more than 25 %, because the simulator
    # leaves out the fixed per-request time both modes share (tokenisation, API server,
    # proxy streaming), which would shrink the ratio.
    assert pull.ttft_ms.mean - push.ttft_ms.mean == pytest.approx(11.7, abs=1.0)
    assert pull.ttft_ms.mean / push.ttft_ms.mean == pytest.approx(1.40, abs=0.05)


def test_articles_high_load_long_prompts_error_is_pinned(
    articles_runs: dict[tuple[str, float, int], RunResult],
) -> None:
    pull = articles_runs[("pull", 8.0, 16384)]
    push = articles_runs[("push", 8.0, 16384)]
    # published: pull ~1,744 ms, push ~540 ms. Not reproduced: prefill is offered 3.3 x
    # its FLOPs-derived capacity, so both modes wait behind the prefill backlog (~55 s)
    # and differ by only the handoff (~120 ms).
    assert pull.prefill_load == pytest.approx(3.30, abs=0.01)
    pull_error = pull.ttft_ms.mean / PUBLISHED_TTFT_MS[("pull", 8.0, 16384)]
    push_error = push.ttft_ms.mean / PUBLISHED_TTFT_MS[("push", 8.0, 16384)]
    assert pull_error == pytest.approx(31.4, rel=0.05)
    assert push_error == pytest.approx(101.1, rel=0.05)
    assert pull.ttft_ms.mean - push.ttft_ms.mean == pytest.approx(120.6, abs=5.0)
    # published TPOT: pull ~10.4 ms, push ~7 ms; simulated 26 % and 17 % lower, since
    # decode only sees the rate prefill manages to deliver (~2.4 req/s)
    assert pull.tpot_ms.mean == pytest.approx(7.74, abs=0.05)
    assert push.tpot_ms.mean == pytest.approx(5.81, abs=0.05)


def test_articles_high_load_point_exceeds_peak_prefill_flops() -> None:
    """No honest prefill speed reaches the published point: even 100 % of the dense BF16
    peak of 8 x H200 is offered more than its capacity at 8 QPS x 16,384 tokens."""
    peak = QWEN3_32B_FLOPS.prefill_speed(8, H200_BF16_DENSE_TFLOPS, 1.0)
    assert 8.0 * peak.seconds(16384) == pytest.approx(1.32, abs=0.01)
