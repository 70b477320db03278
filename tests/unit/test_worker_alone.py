"""Threads put where a pinned server's cores say once it is up: what vLLM's NixlConnector
moved off them goes back, and with `kvpush bench hooks --worker-alone ROLE` one server's
model worker gets a core of its own, every other thread of that server (API server,
engine core, connector threads) moved off it, as vLLM's CPU backend lays a server out
when it has the cores."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpush.bench.cli import sweep_spec
from kvpush.cli import build_parser, main
from kvpush.testbed import topology
from kvpush.testbed.pinning import (
    OWN_GROUP,
    check_confined,
    describe_moved,
    isolate_worker,
    pin_preexec,
    reconfine,
    tree_affinity,
)
from kvpush.testbed.topology import (
    PairSettings,
    Topology,
    TopologyConfig,
    build_specs,
    worker_alone_cores,
)
from tests.unit.test_pinning import FakePopen

CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores")

# A stand-in for a vLLM server: an API server process with a thread, and below it a model
# worker (titled as vLLM titles it) that, as vLLM's NixlConnector does on the CPU backend,
# binds its own thread to another core, then starts a thread (which inherits that) and,
# when asked, one more.
WORKER = """
import os, sys, threading, time
early = threading.Thread(target=time.sleep, args=(60,), daemon=True)
early.start()
os.sched_setaffinity(0, [{moved_to}])
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
if sys.stdin.readline():
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    print("again", flush=True)
time.sleep(60)
"""
API_SERVER = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
subprocess.run(["VLLM::Worker", "-c", sys.argv[1]], executable=sys.executable)
"""


def start_server(cores: list[int], moved_to: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", API_SERVER, WORKER.format(moved_to=moved_to)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        preexec_fn=pin_preexec(cores),
        **OWN_GROUP,
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def worker_pid(root: int) -> int:
    return next(t.pid for t in tree_affinity(root) if t.process == "VLLM::Worker")


@two_cores
def test_only_the_workers_thread_stays_on_its_core() -> None:
    worker, aside = CORES[:1], CORES[1:]
    proc = start_server(CORES, moved_to=aside[0])  # vLLM moved it to the other core
    assert proc.stdin is not None and proc.stdout is not None
    try:
        before = tree_affinity(proc.pid)
        pid = worker_pid(proc.pid)
        assert len({t.pid for t in before}) == 2 and len(before) >= 5
        moved = isolate_worker(proc.pid, worker, aside)
        after = tree_affinity(proc.pid)
        assert [t.tid for t in after if t.cores == set(worker)] == [pid]  # put back alone
        assert all(t.cores == set(aside) for t in after if t.tid != pid)
        target = {t.tid: set(worker if t.tid == pid else aside) for t in before}
        assert moved == sum(t.cores != target[t.tid] for t in before) >= 3
        assert isolate_worker(proc.pid, worker, aside) == 0  # nothing new
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"again\n"
        assert isolate_worker(proc.pid, worker, aside) == 1  # the thread started since
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@two_cores
def test_a_pinned_server_gets_back_what_vllm_moved_off_its_cores() -> None:
    mine, other = CORES[:1], CORES[1]
    proc = start_server(mine, moved_to=other)
    try:
        assert check_confined(proc.pid, mine)[1]  # the worker's threads are on the other
        moved = reconfine(proc.pid, mine)
        pid = worker_pid(proc.pid)
        assert {t.pid for t in moved} == {pid} and len(moved) == 2  # main + the one it began
        assert describe_moved(moved) == [f"VLLM::Worker {pid}: 2 threads from cores {other}"]
        assert check_confined(proc.pid, mine)[1] == []
        assert reconfine(proc.pid, mine) == []
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@two_cores
def test_a_tree_without_a_vllm_worker_is_refused() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        preexec_fn=pin_preexec(CORES),
        **OWN_GROUP,
    )
    try:
        with pytest.raises(ValueError, match="no vLLM model worker"):
            isolate_worker(proc.pid, CORES[:1], CORES[1:])
        assert all(t.cores == set(CORES) for t in tree_affinity(proc.pid))  # nothing moved
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_the_lone_worker_gets_its_servers_share_and_the_rest_goes_aside(tmp_path: Path) -> None:
    config = TopologyConfig(model=model(tmp_path), setup="kvpush-push", worker_alone="prefill")
    prefill, decode = build_specs(config, cores=[0, 1])
    assert (prefill.cores, prefill.aside, prefill.env["VLLM_CPU_OMP_THREADS_BIND"]) == (
        [0],
        [1],
        "0",
    )
    assert (decode.cores, decode.aside) == ([1], [])
    top = Topology(config, cores=[0, 1])
    assert top.client_cores == [1]  # never on the lone worker's core
    record = top.pinning()["servers"]
    assert record["prefill-0"]["confined"] == "model worker alone; every other thread on 1"
    assert record["decode-0"]["confined"] == "every process"
    # with cores to spare, the rest goes to the proxy's and client's, not to decode's
    decode_alone = TopologyConfig(model=tmp_path, setup="vllm-pull", worker_alone="decode")
    prefill, decode = build_specs(decode_alone, cores=[0, 1, 2, 3])
    assert (prefill.aside, decode.cores, decode.aside) == ([], [1], [2, 3])
    assert worker_alone_cores("decode", [0, 1, 2, 3]) == ([1], [2, 3])
    assert worker_alone_cores("prefill", [4, 5]) == ([4], [5])


def test_the_lone_workers_server_starts_on_both_its_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started on both, so that vLLM's binding leaves only the worker on its own; the rest
    is moved aside once the server is up."""
    monkeypatch.setattr(topology.subprocess, "Popen", FakePopen)
    monkeypatch.setattr(topology, "port_in_use", lambda port, host="127.0.0.1": False)
    monkeypatch.setattr(topology.source, "code_version", lambda: {"source": "test"})  # no git
    FakePopen.started = []
    work = tmp_path / "work"
    config = TopologyConfig(
        model=model(tmp_path), setup="kvpush-pull", workdir=work, worker_alone="decode"
    )
    Topology(config, cores=[0, 1]).start()
    prefill, decode = (s["preexec_fn"] for s in FakePopen.started)
    assert isinstance(prefill, functools.partial) and isinstance(decode, functools.partial)
    assert prefill.args == (0, frozenset({0}))
    assert decode.args == (0, frozenset({0, 1}))
    log = (work / "logs/decode-0.log").read_text()
    assert log.startswith("$ (on cores 1: model worker alone; every other thread on 0) /")


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"worker_alone": "proxy"}, "is 'prefill' or 'decode'"),
        ({"worker_alone": "prefill", "pin": False}, "needs pinning"),
        ({"worker_alone": "prefill", "setup": None}, "for a 1P1D pair"),
        ({"worker_alone": "decode", "n_decode": 2}, "for a 1P1D pair"),
    ],
)
def test_a_layout_it_cannot_give_is_refused(
    tmp_path: Path, settings: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        TopologyConfig(**{"model": model(tmp_path), "setup": "kvpush-push", **settings})
    with pytest.raises(ValueError, match="give it 2 cores or more"):
        worker_alone_cores("prefill", [0])


def test_single_is_never_given_a_lone_worker(tmp_path: Path) -> None:
    pair = PairSettings(model(tmp_path), worker_alone="prefill")
    assert pair.topology("single", "bench-hooks").worker_alone == ""
    assert pair.topology("kvpush-push", "bench-hooks").worker_alone == "prefill"


@pytest.mark.parametrize("tool", ["hooks", "sweep"])
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--worker-alone", "prefill", "--no-pin"], "--worker-alone needs pinning"),
        (["--worker-alone", "router"], "invalid choice: 'router'"),
    ],
)
def test_the_command_refuses_before_starting_anything(
    tool: str, argv: list[str], says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    workdir = ["--workdir", str(tmp_path / "w")]
    if tool == "sweep":
        workdir += ["--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exit_:
        sys.exit(main(["bench", tool, *workdir, *argv]))
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and captured.out == ""
    assert says in captured.err and "Traceback" not in captured.err
    assert not (tmp_path / "w").exists(), "nothing built before the refusal"


@two_cores
def test_a_sweep_gives_the_lone_worker_to_every_pair_but_single(tmp_path: Path) -> None:
    argv = ["bench", "sweep", "--workdir", str(tmp_path / "w"), "--worker-alone", "decode"]
    args = build_parser().parse_args([*argv, "--model", str(model(tmp_path))])
    pair = sweep_spec(args).pair
    assert pair.topology("kvpush-pull", "sweep").worker_alone == "decode"
    assert pair.topology("single", "sweep").worker_alone == ""
