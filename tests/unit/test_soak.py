"""The soak's judgement: memory growth after warm-up, failed requests, its settings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpush.bench.soak import Sample, SoakSpec, format_sample, growth, tree_use, verdict


def samples(rss: list[float], every: float = 10.0, failed: int = 0) -> list[Sample]:
    out = []
    for i, value in enumerate(rss):
        sample = Sample(i * every, i, i, failed, 0)
        sample.servers["decode-0"] = {"rss_mib": value, "fds": 40, "processes": 3}
        out.append(sample)
    return out


def test_growth_compares_the_medians_of_the_first_and_last_three() -> None:
    assert growth([100, 100, 100, 100, 100, 100]) == 0.0
    assert growth([100, 90, 110, 200, 104, 105, 103]) == pytest.approx(4.0)
    assert growth([100, 100, 100]) is None  # too few to judge


def test_flat_memory_and_no_failure_pass() -> None:
    spec = SoakSpec(duration=100, warmup=20, sample_every=10)
    judged = verdict(spec, samples([500, 900, 1000, 1001, 1002, 1000, 1003, 1001, 1002]), 0)
    assert judged["passed"], judged
    # the climb during warm-up (500 -> 1000 MiB) is not judged
    assert judged["servers"]["decode-0"]["rss_mib_first"] == 1000


def test_memory_that_keeps_growing_fails_and_says_by_how_much() -> None:
    spec = SoakSpec(duration=100, warmup=20, sample_every=10)
    judged = verdict(spec, samples([1000, 1000, 1000, 1020, 1040, 1060, 1080, 1100, 1120]), 0)
    assert not judged["passed"]
    assert "decode-0: memory grew" in judged["problems"][0]
    assert judged["servers"]["decode-0"]["rss_growth_pct"] > 5


def test_one_failed_request_fails_the_soak() -> None:
    spec = SoakSpec(duration=100, warmup=20, sample_every=10)
    judged = verdict(spec, samples([1000] * 9), failed=1)
    assert not judged["passed"] and judged["problems"] == ["1 request(s) failed"]


def test_too_few_samples_after_warm_up_cannot_pass() -> None:
    spec = SoakSpec(duration=100, warmup=20, sample_every=10)
    judged = verdict(spec, samples([1000] * 4), 0)
    assert not judged["passed"] and "too few memory samples" in judged["problems"][0]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"setup": "nonsense"}, "nonsense"),
        ({"duration": 60, "warmup": 60}, "must be shorter than --duration"),
        ({"duration": 60, "warmup": 30, "sample_every": 10}, "fewer than 6 samples"),
    ],
)
def test_settings_that_cannot_give_a_verdict_are_refused(
    kwargs: dict[str, object], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        SoakSpec(**kwargs)  # type: ignore[arg-type]


def test_tree_use_counts_children_too() -> None:
    alone = tree_use(os.getpid())
    assert alone is not None and alone.rss_mib > 0 and alone.fds > 0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with_child = tree_use(os.getpid())
        assert with_child is not None and with_child.processes == alone.processes + 1
        assert with_child.rss_mib > alone.rss_mib
    finally:
        child.kill()
        child.wait()
    assert tree_use(child.pid) is None  # gone: nothing to read


def test_a_sample_line_names_each_server() -> None:
    sample = Sample(12.0, 40, 38, 0, 2)
    sample.servers = {
        "prefill-0": {"rss_mib": 900.0, "fds": 50, "processes": 3, "kv_cache_usage": 0.25,
                      "waiting": {"registrations": 1.0, "prefill_tombstones": 40.0}},  # fmt: skip
        "decode-0": {},
    }
    line = format_sample(sample)
    assert "sent 40 done 38 failed 0 in flight 2" in line
    assert "prefill-0 900 MiB 50 fds kv 25% waiting 1" in line
    assert "decode-0 gone" in line
