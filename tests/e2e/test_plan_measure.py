"""A short real `kvpush plan measure`: one setup's servers probed, the profile written,
read back by the simulator, and a second run that resumes (measures nothing again)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.plan.machine import derive, load_profile, sim_params
from kvpush.plan.simulate import simulate
from tests.e2e.conftest import BASE_PORT, KV_PORT, ports_free

pytestmark = pytest.mark.e2e
PORT, KV = BASE_PORT + 60, KV_PORT + 60  # clear of the other e2e deployments


def measure(model: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "kvpush.cli", "plan", "measure",
        "--model", str(model), "--setups", "kvpush-push", "--input-lens", "64,256",
        "--prefill-requests", "5", "--decode-rounds", "2", "--hook-requests", "2",
        "--output-lens", "4,12", "--port", str(PORT), "--kv-port", str(KV),
        "--workdir", str(tmp / "work"), "--out", str(tmp / "profile.json"),
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def test_measure_probes_real_servers_and_resumes(tiny_model: Path, tmp_path: Path) -> None:
    assert ports_free((PORT, PORT + 100, PORT + 200, KV, KV + 1))
    first = measure(tiny_model, tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "servers stopped" in first.stdout
    profile = load_profile(tmp_path / "profile.json")
    probe = profile.setup("kvpush-push")
    assert probe.mode == "push" and [p.input_len for p in probe.points] == [64, 256]
    for point in probe.points:
        assert 0 < point.prefill_ms < 5_000, point
        # client latency minus engine time: HTTP and tokenisation, never minus seconds
        assert -5 < point.front_end_ms < 5_000, point
        assert set(point.step_ms) == {1, 8} and all(0 < ms < 1_000 for ms in point.step_ms.values())
        assert point.submit_ms is not None and point.submit_ms >= 0
        # kvpush times its own transfers: the prompt's KV moved over NIXL
        assert point.transfer_ms is not None and point.transfer_ms > 0
    extra = probe.extra
    assert extra["hook_totals"]["handoff_start_load_kv_256"][1] > 0  # the hook was timed
    assert len(extra["load_average_before"]) == 3
    # what it measured drives the simulator
    derive(profile, "kvpush-push")
    params = sim_params(profile, "kvpush-push", output_len=8, num_prompts=20)
    run = simulate(params, "push", 1.0, 256)
    assert run.ttft_ms.p50 > 0 and run.tpot_ms.p50 > 0

    again = measure(tiny_model, tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "already in" in again.stdout and "starting" not in again.stdout
