"""A short `kvpush bench soak`: a minute of steady load through the proxy with a secret set.

The full soak (30 minutes, README "Failures and security") is run by hand; this one shows
the command works end to end and that a minute of load fails nothing and leaks no
descriptors on either server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import BASE_PORT, KV_PORT, ports_free

pytestmark = pytest.mark.e2e
PORT, KV = BASE_PORT + 60, KV_PORT + 60  # clear of the other e2e deployments


def test_a_minute_of_load_fails_nothing_and_leaks_nothing(
    tiny_model: Path, tmp_path: Path
) -> None:
    assert ports_free((PORT, PORT + 100, PORT + 200, KV, KV + 1))
    command = [
        sys.executable, "-m", "kvpush.cli", "bench", "soak",
        "--setup", "kvpush-push", "--duration", "60", "--warmup", "20",
        "--sample-every", "5", "--rate", "2", "--input-len", "128", "--output-len", "8",
        "--model", str(tiny_model), "--workdir", str(tmp_path / "work"),
        "--out", str(tmp_path / "out"), "--port", str(PORT), "--kv-port", str(KV),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    record = json.loads((tmp_path / "out" / "soak.json").read_text())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert record["failed"] == 0 and record["requests"] >= 60, record["errors"]
    assert record["verdict"]["passed"], record["verdict"]["problems"]
    servers = record["verdict"]["servers"]
    assert {"prefill-0", "decode-0"} <= set(servers), servers
    for name in ("prefill-0", "decode-0"):
        # descriptors may wobble by a connection or two, never climb with the load
        assert servers[name]["fds_last"] <= servers[name]["fds_first"] + 8, servers[name]
    last = record["samples"][-1]["servers"]
    assert last["prefill-0"]["failures"] == 0 and last["decode-0"]["failures"] == 0, last
    # once the load has drained, no registration and no transfer is left waiting
    waiting = {**last["prefill-0"]["waiting"], **last["decode-0"]["waiting"]}
    assert waiting.get("prefill_waiting_registrations") == 0, waiting
    assert waiting.get("decode_waiting_transfers") == 0, waiting
