"""A short real `kvpush bench sweep`: one point, two setups, real servers and `vllm bench serve`.

Then the same command again, which must resume (start nothing), and the plot.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.bench import results
from kvpush.bench.sweep import delta_total
from tests.e2e.conftest import BASE_PORT, KV_PORT, ports_free

pytestmark = pytest.mark.e2e
PORT, KV = BASE_PORT + 40, KV_PORT + 40  # clear of the other e2e deployments
PROMPTS = 6


def sweep(model: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "kvpush.cli", "bench", "sweep",
        "--setups", "kvpush-push,vllm-pull",
        "--rates", "2", "--input-lens", "128", "--output-len", "8",
        "--num-prompts", str(PROMPTS), "--request-timeout", "45",
        "--model", str(model), "--workdir", str(tmp / "work"), "--out", str(tmp / "out"),
        "--port", str(PORT), "--kv-port", str(KV),
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=900)


def test_a_short_sweep_records_both_setups_resumes_and_plots(
    tiny_model: Path, tmp_path: Path
) -> None:
    assert ports_free((PORT, PORT + 100, PORT + 200, KV, KV + 1))
    first = sweep(tiny_model, tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = tmp_path / "out"
    ours = results.read_result(out / "kvpush-push_qps2_in128_out8_iter1.json")
    theirs = results.read_result(out / "vllm-pull_qps2_in128_out8_iter1.json")
    assert ours is not None and theirs is not None, sorted(p.name for p in out.iterdir())
    assert ours["status"] == "ok", ours.get("reason")
    assert ours["completed"] == PROMPTS and ours["failed"] == 0
    assert 0 < ours["ttft"]["p50"] <= ours["ttft"]["p99"] and ours["tpot"]["p50"] > 0
    assert ours["decode_queue"]["samples"] > 0
    # both servers' prefix caches were emptied before the run (vLLM's dev endpoint, on)
    assert ours["prefix_cache_reset"] is True, ours.get("prefix_cache_not_reset")
    decode = ours["metrics"]["decode"]
    external = delta_total(
        decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    assert external >= PROMPTS * 100  # the prompts' KV came over the wire
    prefill = ours["metrics"]["prefill"]  # push: prefill's writer counts what it sent
    assert delta_total(prefill, "kvpush:transfer_bytes_count") == PROMPTS
    assert delta_total(prefill, "kvpush:transfer_bytes_sum") >= PROMPTS * 100 * 512
    assert (out / "kvpush-push_qps2_in128_out8_iter1.log").stat().st_size > 0
    # vLLM's pull connector is a measurement, not a pass/fail: a stall is a recorded result.
    assert theirs["status"] in results.STATUSES
    assert theirs["status"] == "ok" or theirs["reason"]
    assert "TTFT/vLLM" in first.stdout and (out / "sweep.png").stat().st_size > 0

    again = sweep(tiny_model, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "2 already in" in again.stdout and "servers healthy" not in again.stdout
