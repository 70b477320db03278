"""The proxy's request rewriting: what each leg receives in push and pull mode."""

from __future__ import annotations

import pytest

from kvpush.proxy import rewrite
from kvpush.proxy.rewrite import Backend, RequestError

PREFILL = Backend("http://127.0.0.1:8100", "prefill-0", "127.0.0.1", 5600, 2)


def test_parse_backend_plain_and_with_coordinates() -> None:
    assert rewrite.parse_backend("http://127.0.0.1:8200/") == Backend("http://127.0.0.1:8200")
    spec = "http://127.0.0.1:8100,engine=prefill-0,kv=127.0.0.1:5600,tp=2"
    assert rewrite.parse_backend(spec) == PREFILL
    assert rewrite.format_backend(PREFILL) == spec
    assert rewrite.parse_backend(rewrite.format_backend(PREFILL)) == PREFILL


def test_a_data_parallel_prefill_names_each_engine_as_vllm_and_kvpush_do() -> None:
    """dp=N: engine r is vLLM's "<engine>_dp<r>", its TP ranks' control ports follow the
    previous engine's; dp=1 is written as before."""
    spec = "http://127.0.0.1:8100,engine=prefill-0,kv=127.0.0.1:5600,tp=2,dp=3"
    backend = rewrite.parse_backend(spec)
    assert backend.dp_size == 3 and rewrite.format_backend(backend) == spec
    assert [backend.engine(r) for r in range(3)] == [
        ("prefill-0_dp0", 5600), ("prefill-0_dp1", 5602), ("prefill-0_dp2", 5604)
    ]  # fmt: skip
    assert PREFILL.engine(0) == ("prefill-0", 5600)
    params = rewrite.push_decode_params(backend, "t1", dp_rank=2)
    assert (params["remote_engine_id"], params["remote_port"], params["tp_size"]) == (
        "prefill-0_dp2", 5604, 2
    )  # fmt: skip
    prefill = rewrite.push_prefill_params("t1", "prefill-0_dp2")
    assert prefill["kvpush_engine_id"] == "prefill-0_dp2" and prefill["transfer_id"] == "t1"
    plain = rewrite.parse_backend("http://h:1,dp=2")  # a decode's or pull prefill's engines
    assert plain.dp_size == 2 and rewrite.format_backend(plain) == "http://h:1,dp=2"


def test_a_pipeline_parallel_prefill_takes_tp_times_pp_control_ports_per_engine() -> None:
    """pp=N: each engine's ranks take TP x PP control ports, so engine r's first port
    follows the previous engine's last; decode is told the stages to register with."""
    spec = "http://127.0.0.1:8100,engine=prefill-0,kv=127.0.0.1:5600,tp=2,pp=2,dp=2"
    backend = rewrite.parse_backend(spec)
    assert (backend.tp_size, backend.pp_size, backend.dp_size) == (2, 2, 2)
    assert rewrite.format_backend(backend) == spec
    assert backend.engine(1) == ("prefill-0_dp1", 5604)
    params = rewrite.push_decode_params(backend, "t1", dp_rank=1)
    assert (params["remote_port"], params["tp_size"], params["pp_size"]) == (5604, 2, 2)
    assert rewrite.push_decode_params(PREFILL, "t1")["pp_size"] == 1
    with pytest.raises(ValueError, match="pp='0' must be a positive integer"):
        rewrite.parse_backend("http://h:1,engine=p,kv=h:2,pp=0")


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ("127.0.0.1:8100", "expected a URL"),
        ("http://h:1,engine", "not KEY=VALUE"),
        ("http://h:1,kv=nohostport", "HOST:PORT"),
        ("http://h:1,tp=0", "positive integer"),
        ("http://h:1,engine=p,kv=h:2,dp=0", "positive integer"),
        ("http://h:1,color=red", "unknown option"),
    ],
)
def test_parse_backend_rejects_with_a_reason(spec: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        rewrite.parse_backend(spec)


def test_prefill_leg_is_one_token_non_streaming_and_keeps_sampling() -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": 3,
    }
    leg = rewrite.prefill_body(body, rewrite.pull_prefill_params())
    assert leg["max_tokens"] == 1 and leg["stream"] is False
    assert "stream_options" not in leg
    assert (leg["temperature"], leg["top_p"], leg["seed"]) == (0.7, 0.9, 3)
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 64 and body["stream"] is True, "client body must not change"


def test_chat_prefill_caps_max_completion_tokens_too() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "max_completion_tokens": 9,
    }
    leg = rewrite.prefill_body(body, rewrite.pull_prefill_params())
    assert leg["max_completion_tokens"] == 1 and leg["max_tokens"] == 1


def test_prefill_keeps_a_minimum_of_one_token_so_its_first_is_not_eos() -> None:
    """Decode reproduces prefill's first token: one prefill could not sample, neither."""
    leg = rewrite.prefill_body({"prompt": "x", "min_tokens": 5}, rewrite.pull_prefill_params())
    assert leg["min_tokens"] == 1
    assert "min_tokens" not in rewrite.prefill_body({"prompt": "x"}, {})


def test_decode_leg_is_the_client_request_plus_params() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True}
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    leg = rewrite.decode_body(body, params)
    assert leg == {**body, "kv_transfer_params": params}
    assert "kv_transfer_params" not in body


def test_push_decode_params_name_prefill_and_share_the_transfer_id() -> None:
    params = rewrite.push_decode_params(PREFILL, "tid")
    assert params["do_remote_prefill"] is True
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == (
        "prefill-0",
        "127.0.0.1",
        5600,
    )
    assert params["tp_size"] == 2
    assert params["transfer_id"] == rewrite.push_prefill_params("tid")["transfer_id"] == "tid"


def test_push_without_prefill_coordinates_names_the_fix() -> None:
    with pytest.raises(ValueError, match="engine=ID,kv=HOST:PORT"):
        rewrite.push_decode_params(Backend("http://127.0.0.1:8100"), "tid")


def test_pull_decode_params_come_from_prefill_answer() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [3], "remote_engine_id": "p"}
    assert rewrite.pull_decode_params({"kv_transfer_params": params}, PREFILL) == params
    with pytest.raises(ValueError, match="no kv_transfer_params"):
        rewrite.pull_decode_params({"choices": []}, PREFILL)


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        ([], "JSON object"),
        ({"prompt": "x", "kv_transfer_params": {}}, "set by the proxy"),
        ({"prompt": "x", "max_tokens": 0}, "positive integer"),
        ({"prompt": "x", "max_tokens": "5"}, "positive integer"),
        ({"prompt": "x", "n": 2}, "n and best_of"),
        ({"prompt": "x", "vllm_xargs": {"kvpush_first_token": 1}}, "are the proxy's"),
    ],
)
def test_validate_body_rejects_with_a_reason(body: object, complaint: str) -> None:
    with pytest.raises(RequestError, match=complaint):
        rewrite.validate_body(body)


def test_a_client_id_is_answered_as_sent_and_legs_get_it_made_unique() -> None:
    a, b = rewrite.answer_id(None), rewrite.answer_id(None)
    assert a != b and rewrite.leg_id(a, None) == a  # the proxy's own id is unique already
    assert rewrite.answer_id("client-7") == "client-7"
    legs = {rewrite.leg_id("client-7", "client-7") for _ in range(2)}
    assert len(legs) == 2 and all(leg.startswith("client-7-") for leg in legs)
    for unusable in ("bad\nid", "x" * 129, "caf\u00e9"):
        answered = rewrite.answer_id(unusable)
        assert answered != unusable and rewrite.leg_id(answered, unusable) == answered


def test_only_a_usable_trace_context_is_passed_on() -> None:
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    headers = {"traceparent": parent, "tracestate": "caf\u00e9=1", "cookie": "c"}
    assert rewrite.trace_headers(headers) == {"traceparent": parent}


INFO = 'kvpush:info{engine="0",mode="%s",model_name="m",role="%s"} 1.0\n'


def test_kvpush_mode_is_read_from_metrics_text() -> None:
    text = "# HELP kvpush:info x\n" + INFO % ("pull", "prefill") + "vllm:other 3.0\n"
    assert rewrite.kvpush_mode(text) == "pull"
    assert rewrite.kvpush_mode("vllm:kv_cache_usage_perc 0.0\n") is None


def test_mode_conflicts_name_both_values_and_the_fix() -> None:
    decode = Backend("http://127.0.0.1:8200")
    between = rewrite.mode_conflict("push", PREFILL, "pull", decode, "push")
    assert between is not None
    assert "prefill http://127.0.0.1:8100 runs kvpush in pull mode" in between
    assert "decode http://127.0.0.1:8200 in push mode" in between
    assert "set the same kv_connector_extra_config.mode" in between
    with_proxy = rewrite.mode_conflict("pull", PREFILL, "push", decode, "push")
    assert with_proxy is not None and "--mode pull" in with_proxy and "push mode" in with_proxy
    assert rewrite.mode_conflict("push", PREFILL, "push", decode, "push") is None
    assert rewrite.mode_conflict("push", PREFILL, None, decode, None) is None


def test_kvpush_failures_are_read_by_kind_and_growth_is_named() -> None:
    text = (
        "# HELP kvpush:failures_total Failed transfers by cause\n"
        'kvpush:failures_total{engine="0",kind="peer_gone",model_name="m"} 3.0\n'
        'kvpush:failures_total{engine="1",kind="peer_gone",model_name="m"} 1.0\n'
        'kvpush:failures_total{engine="0",kind="transfer_timeout",model_name="m"} 0.0\n'
        'kvpush:failures_created{engine="0",kind="peer_gone"} 1.7e9\n'
    )
    counts = rewrite.kvpush_failures(text)
    assert counts == {"peer_gone": 4.0, "transfer_timeout": 0.0}
    assert rewrite.failure_growth(None, counts) == "peer_gone +4"
    later = {"peer_gone": 4.0, "transfer_timeout": 2.0}
    assert rewrite.failure_growth(counts, later) == "transfer_timeout +2"
    assert rewrite.failure_growth(later, later) == ""


def test_a_decode_says_whether_it_continues_from_prefills_first_token() -> None:
    from kvpush.proxy.rewrite import decode_first_token

    line = 'kvpush:info{auth="on",engine="0",first_token="%s",mode="push",role="decode"} 1.0\n'
    assert decode_first_token("# HELP x\n" + line % "own") == "own"
    assert decode_first_token(line % "pinned") == "pinned"
    assert decode_first_token(line % "-") is None  # a prefill's line
    assert decode_first_token(INFO % ("push", "decode")) is None  # a kvpush from before
    assert decode_first_token("vllm:num_requests_running 1.0\n") is None
