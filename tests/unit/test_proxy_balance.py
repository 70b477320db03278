"""The proxy's choice, load accounting and health state, with time passed in (no I/O)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush.proxy import rewrite
from kvpush.proxy.balance import (
    POLICIES,
    Change,
    HealthRules,
    NoBackend,
    Pool,
    Reported,
    check_policy,
    parse_vllm_metrics,
)
from kvpush.proxy.fleet import Fleet, check_fleet, read_fleet
from kvpush.proxy.rewrite import Backend

A, B, C = (Backend(f"http://10.0.0.{i}:8000") for i in (1, 2, 3))


def pool(*backends: Backend, policy: str = "least_loaded", **rules: int) -> Pool:
    p = Pool("decode", policy, HealthRules(**rules))
    for backend in backends:
        p.add(backend)
    return p


def learn(p: Pool, backend: Backend, seconds: float, now: float = 0.0) -> None:
    """One finished leg of one unit that took `seconds` on `backend`."""
    state = p.find(backend.url)
    assert state is not None
    leg = p.begin(state, 1, 1, now)
    p.first_byte(leg, now + seconds)
    p.end(leg)


def test_least_loaded_goes_where_fewer_units_are_queued() -> None:
    p = pool(A, B)
    a, b = p.states
    p.begin(a, 1000, 1000, 0.0)  # one long prompt on A
    p.begin(b, 10, 10, 0.0)
    p.begin(b, 10, 10, 0.0)  # two short ones on B
    assert p.pick(100, 0.0) is b


def test_a_data_parallel_server_works_through_its_queue_an_engine_each() -> None:
    """dp=2: two legs queued there wait as long as one on a one-engine server, so with
    equal speeds a leg goes to the DP server until it holds twice the other's queue."""
    wide = Backend("http://10.0.0.9:8000", dp_size=2)
    p = pool(A, wide)
    a, w = p.states
    p.begin(a, 100, 100, 0.0)
    p.begin(w, 100, 100, 0.0)
    assert p.pick(100, 0.0) is w
    p.begin(w, 100, 100, 0.0)
    assert p.cost(w, 100, 0.0) == p.cost(a, 100, 0.0)
    p.begin(w, 100, 100, 0.0)
    assert p.pick(100, 0.0) is a


def test_a_backend_known_to_be_slow_is_avoided_until_the_fast_one_is_far_busier() -> None:
    p = pool(A, B)
    learn(p, A, 0.200)
    learn(p, B, 0.005)
    a, b = p.states
    for _ in range(20):
        p.begin(b, 1, 1, 1.0)
    assert p.pick(1, 1.0) is b  # 21 x 5 ms < 200 ms
    for _ in range(30):
        p.begin(b, 1, 1, 1.0)
    assert p.pick(1, 1.0) is a


def test_a_leg_waiting_longer_than_the_estimate_raises_it_at_once() -> None:
    p = pool(A, B)
    learn(p, A, 0.050)
    learn(p, B, 0.005)
    a, b = p.states
    p.begin(b, 1, 1, 0.0)  # B stopped answering: this leg is still waiting at t=5
    assert p.pick(1, 0.004) is b  # 2 x 5 ms: nothing suspicious yet
    assert p.pick(1, 5.0) is a


def test_an_idle_slow_backend_drifts_back_to_the_pool_best_and_is_tried_again() -> None:
    p = pool(A, B)
    learn(p, A, 0.200)
    learn(p, B, 0.005)
    a, b = p.states
    for _ in range(3):
        p.begin(b, 1, 1, 0.0)
    assert p.pick(1, 0.0) is b
    # Ten half-lives later A's 200 ms has decayed to ~5.2 ms; B's legs answered meanwhile.
    for leg_start in (99.99,) * 3:
        leg = p.begin(b, 1, 1, leg_start)
        p.first_byte(leg, leg_start + 0.005)
    assert p.cost(a, 1, 100.0) < 0.006
    assert p.pick(1, 100.0) is a


def test_what_a_backend_reports_beyond_the_proxys_own_legs_counts_as_queued() -> None:
    p = pool(A, B)
    a, b = p.states
    p.begin(a, 1, 1, 0.0)
    a.reported = Reported(running=1, waiting=0, kv_usage=0.1)  # only our own leg
    b.reported = Reported(running=4, waiting=6, kv_usage=0.1)  # other clients' load
    assert p.pick(1, 0.0) is a


def test_a_backend_with_a_full_kv_cache_is_chosen_only_if_all_are_full() -> None:
    p = pool(A, B)
    a, b = p.states
    for _ in range(5):
        p.begin(b, 1, 1, 0.0)
    a.reported = Reported(running=0, waiting=0, kv_usage=0.97)
    assert p.pick(1, 0.0) is b
    b.reported = Reported(running=5, waiting=0, kv_usage=0.99)
    assert p.pick(1, 0.0) is a


def test_ties_go_round_in_turn_and_round_robin_ignores_load() -> None:
    p = pool(A, B, C)
    assert [p.pick(1, 0.0).url for _ in range(3)] == [A.url, B.url, C.url]
    rr = pool(A, B, policy="round_robin")
    learn(rr, A, 0.5)
    learn(rr, B, 0.001)
    assert [rr.pick(1, 0.0).url for _ in range(4)] == [A.url, B.url, A.url, B.url]


def test_accounting_returns_to_zero_and_failed_legs_teach_nothing() -> None:
    p = pool(A)
    (a,) = p.states
    leg = p.begin(a, 30, 50, 0.0)
    assert (a.in_flight, a.units, a.tokens) == (1, 30, 50)
    p.end(leg)  # failed before answering
    assert (a.in_flight, a.units, a.tokens, a.estimate) == (0, 0, 0, None)
    assert not a.waiting


def test_ejected_after_consecutive_failed_checks_and_back_after_passing_ones() -> None:
    p = pool(A, B, unhealthy_after=2, healthy_after=2)
    a, _ = p.states
    learn(p, A, 0.1)
    a.first_token = "own"  # what it said of its first tokens, asked again once back
    assert p.checked(a, False, "HTTP 503") is None
    assert p.checked(a, True) is None  # a pass resets the count
    assert p.checked(a, False, "HTTP 503") is None
    assert p.checked(a, False, "HTTP 503") is Change.EJECTED
    assert not a.healthy and "2 health checks failed: HTTP 503" in a.reason
    assert all(p.pick(1, 0.0).url == B.url for _ in range(4))
    assert p.checked(a, False, "still down") is None  # counted once
    assert p.checked(a, True) is None
    assert p.checked(a, True) is Change.RETURNED
    assert a.healthy and a.ejections == 1 and a.estimate is None  # relearned from scratch
    assert a.first_token is None


def test_when_no_backend_can_take_a_leg_the_error_says_why_for_each() -> None:
    p = pool(A, B)
    a, b = p.states
    p.eject(a, "cannot connect (refused)")
    with pytest.raises(NoBackend) as failure:
        p.pick(1, 0.0, exclude={B.url})
    message = str(failure.value)
    assert "no healthy decode backend" in message and "cannot connect (refused)" in message
    assert "already failed for this request" in message and "passing health checks" in message
    with pytest.raises(NoBackend, match="POST /admin/backends"):
        pool().pick(1, 0.0)


def test_pool_membership_errors_name_the_pool() -> None:
    p = pool(A)
    with pytest.raises(ValueError, match="already in the pool"):
        p.add(A)
    with pytest.raises(ValueError, match=f"the decode pool has: {A.url}"):
        p.remove(B.url)
    with pytest.raises(ValueError, match="least_loaded, round_robin"):
        Pool("decode", "random")


def test_policies_are_spelled_as_vllm_and_sglang_routers_spell_them() -> None:
    assert POLICIES == ("least_loaded", "round_robin")
    assert Pool("decode", "round-robin").policy == "round_robin"  # the old spelling still works
    assert check_policy("least-loaded") == "least_loaded"


def test_vllm_metrics_are_summed_over_engines() -> None:
    text = (
        "# HELP vllm:num_requests_waiting Number of requests waiting.\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 8.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n'
        'vllm:num_requests_waiting_by_reason{reason="x"} 99\n'
    )
    assert parse_vllm_metrics(text) == Reported(running=8, waiting=5, kv_usage=0.75)
    assert parse_vllm_metrics("vllm:gpu_cache_usage_perc 0.2\n") == Reported(0, 0, 0.2)
    assert parse_vllm_metrics("kvpush:info 1\n") is None


def test_prompt_size_is_estimated_from_text_token_ids_and_chat() -> None:
    assert rewrite.estimate_prompt_tokens({"prompt": "x" * 400}) == 100
    assert rewrite.estimate_prompt_tokens({"prompt": list(range(37))}) == 37
    assert rewrite.estimate_prompt_tokens({"prompt": [list(range(5)), list(range(7))]}) == 12
    assert rewrite.estimate_prompt_tokens({"prompt": ["abcd", list(range(3))]}) == 4
    assert rewrite.estimate_prompt_tokens({"prompt": ["abcd", "efgh"]}) == 2
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 80}]}]}
    assert rewrite.estimate_prompt_tokens(chat) == 20
    assert rewrite.estimate_prompt_tokens({}) == 1
    assert rewrite.requested_output_tokens({"max_tokens": 64}) == 64
    assert rewrite.requested_output_tokens({"max_completion_tokens": 9}) == 9
    assert rewrite.requested_output_tokens({}) == 16


PUSH_PREFILL = "http://10.0.0.1:8100,engine=prefill-0,kv=10.0.0.1:5600,tp=8"


def test_fleet_files_in_toml_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text(f'prefill = ["{PUSH_PREFILL}"]\ndecode = ["{A.url}", "{B.url}"]\n')
    fleet = read_fleet(toml)
    assert fleet.prefill[0].tp_size == 8 and fleet.decode == (A, B)
    json_file = tmp_path / "fleet.json"
    json_file.write_text(f'{{"prefill": ["{PUSH_PREFILL}"], "decode": ["{C.url}"]}}')
    assert read_fleet(json_file).decode == (C,)


@pytest.mark.parametrize(
    ("name", "text", "complaint"),
    [
        ("f.toml", "prefill = [", "not valid TOML"),
        ("f.json", "prefill = []", "not valid JSON (name it .toml for TOML)"),
        ("f.json", '{"prefill": [], "decodes": []}', "expected only 'prefill' and 'decode'"),
        ("f.json", '{"decode": "http://h:1"}', "'decode' must be a list of backend strings"),
        ("f.json", '{"decode": ["h:1"]}', "expected a URL like"),
    ],
)
def test_bad_fleet_files_are_refused_naming_the_file_and_the_fix(
    tmp_path: Path, name: str, text: str, complaint: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as failure:
        read_fleet(path)
    assert str(path) in str(failure.value) and complaint in str(failure.value)
    with pytest.raises(ValueError, match="cannot read fleet file"):
        read_fleet(tmp_path / "missing.toml")


def test_a_fleet_is_checked_for_duplicates_and_push_coordinates() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        check_fleet("pull", Fleet((A,), (B, B)))
    with pytest.raises(ValueError, match=r"URL,engine=ID,kv=HOST:PORT\[,tp=N\]"):
        check_fleet("push", Fleet((A,), (B,)))
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        check_fleet("pull", Fleet((A,), ()))
