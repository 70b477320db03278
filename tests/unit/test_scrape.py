"""The Prometheus text reader the tests and benchmarks use on servers' /metrics."""

from __future__ import annotations

from kvpush.testbed import scrape

TEXT = """\
# HELP vllm:num_requests_waiting Requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running_extra{engine="0"} 9.0
kvpush:failures_total{kind="peer_gone",note="a \\"quoted\\" value"} 4.0
vllm:garbage{engine="0"} not-a-number
"""


def test_samples_are_summed_by_name_and_labels() -> None:
    samples = scrape.parse(TEXT)
    assert scrape.total(samples, "vllm:num_requests_waiting") == 4.0
    assert scrape.total(samples, "vllm:num_requests_waiting", engine="1") == 1.0
    assert scrape.total(samples, "kvpush:failures_total", kind="peer_gone") == 4.0
    assert scrape.total(samples, "vllm:garbage") == 0.0  # an unreadable value is skipped
    assert scrape.total(samples, "absent") == 0.0


def test_only_keeps_the_named_samples_and_parses_nothing_else() -> None:
    names = ("vllm:num_requests_waiting", "vllm:num_requests_running")
    samples = scrape.parse(TEXT, only=names)
    assert {name for name, _ in samples} == {*names, "vllm:num_requests_running_extra"}
    assert samples[("vllm:num_requests_running", (("engine", "0"), ("model_name", "m")))] == 2.0
    assert scrape.total(samples, "kvpush:failures_total") == 0.0
