"""Each server's whole process tree on its own cores: the plan, the spawn, and /proc."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpush.testbed import pinning, topology
from kvpush.testbed.pinning import (
    OWN_GROUP,
    check_confined,
    confined,
    parse_cpu_list,
    pin_preexec,
    plan_cores,
    tree_affinity,
)
from kvpush.testbed.topology import (
    PairSettings,
    Parallel,
    Topology,
    TopologyConfig,
    build_specs,
)


def test_two_cores_give_each_server_one_and_leave_the_proxy_floating() -> None:
    plan = plan_cores(1, 1, [0, 1])
    assert plan.servers == ((0,), (1,))
    assert plan.rest == (0, 1) and not plan.rest_is_own


def test_a_spare_core_goes_to_the_proxy_and_load_generator() -> None:
    plan = plan_cores(1, 1, [0, 1, 2])
    assert (plan.servers, plan.rest, plan.rest_is_own) == (((0,), (1,)), (2,), True)
    big = plan_cores(1, 1, list(range(16)))
    assert big.servers == (tuple(range(7)), tuple(range(7, 14)))
    assert big.rest == (14, 15) and big.rest_is_own
    crowded = plan_cores(1, 2, [0, 1])  # more servers than cores: phases split, as before
    assert crowded.servers == ((0,), (1,), (1,)) and not crowded.rest_is_own


def test_without_pinning_the_split_is_as_before_and_nothing_is_kept_back() -> None:
    plan = plan_cores(1, 1, [0, 1, 2, 3], pin=False)
    assert plan.servers == ((0, 1), (2, 3))
    assert plan.rest == (0, 1, 2, 3) and not plan.pinned and not plan.rest_is_own


def test_the_single_server_gets_every_core_the_pair_would_have() -> None:
    assert plan_cores(1, 1, [0, 1], single=True).servers == ((0, 1),)
    three = plan_cores(1, 1, [0, 1, 2], single=True)
    assert three.servers == ((0, 1),) and three.rest == (2,)
    assert plan_cores(1, 1, [0, 1, 2], pin=False, single=True).servers == ((0, 1, 2),)


def test_specs_carry_their_cores_and_whether_they_are_pinned(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    config = TopologyConfig(model=tmp_path, setup="kvpush-push", workdir=tmp_path / "w")
    specs = build_specs(config, cores=[0, 1])
    assert [(s.name, s.cores, s.pinned) for s in specs] == [
        ("prefill-0", [0], True),
        ("decode-0", [1], True),
    ]
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs] == ["0", "1"]
    loose = build_specs(TopologyConfig(model=tmp_path, setup="kvpush-push", pin=False), [0, 1])
    assert [(s.cores, s.pinned) for s in loose] == [([0], False), ([1], False)]
    record = Topology(config, cores=[0, 1, 2]).pinning()
    assert record == {
        "pinned": True,
        "servers": {
            "prefill-0": {"cores": "0", "confined": "every process"},
            "decode-0": {"cores": "1", "confined": "every process"},
        },
        "proxy_and_client": "2",
    }
    assert Topology(config, cores=[0, 1]).client_cores is None
    assert "no core left" in Topology(config, cores=[0, 1]).pinning()["proxy_and_client"]


def test_the_benchmark_pair_passes_no_pin_through(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert PairSettings(tmp_path).topology("vllm-pull", "sweep").pin
    assert not PairSettings(tmp_path, pin=False).topology("vllm-pull", "sweep").pin


class FakePopen:
    started: list[dict[str, Any]] = []

    def __init__(self, argv: list[str], **kwargs: Any) -> None:
        self.pid = 0
        FakePopen.started.append({"argv": argv, **kwargs})


def test_each_server_is_spawned_with_its_cores_as_affinity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(topology.subprocess, "Popen", FakePopen)
    monkeypatch.setattr(topology, "port_in_use", lambda port, host="127.0.0.1": False)
    # Naming the code asks git in a process of its own: only the servers' spawns are counted
    monkeypatch.setattr(topology.source, "code_version", lambda: {"source": "test"})
    FakePopen.started = []
    for pin in (True, False):
        work = tmp_path / ("pinned" if pin else "loose")
        config = TopologyConfig(model=tmp_path, setup="kvpush-pull", workdir=work, pin=pin)
        Topology(config, cores=[0, 1]).start()
    pinned, loose = FakePopen.started[:2], FakePopen.started[2:]
    for spawn, core in zip(pinned, (0, 1), strict=True):
        preexec = spawn["preexec_fn"]
        assert isinstance(preexec, functools.partial)
        assert (preexec.func, preexec.args) == (os.sched_setaffinity, (0, frozenset({core})))
    for spawn in FakePopen.started:
        assert spawn["process_group"] == 0 and "start_new_session" not in spawn
    assert [s["preexec_fn"] for s in loose] == [None, None]
    assert (tmp_path / "pinned/logs/decode-0.log").read_text().startswith("$ (on cores 1) /")
    assert (tmp_path / "loose/logs/decode-0.log").read_text().startswith("$ /")


def test_a_server_gets_its_own_process_group_in_the_callers_session() -> None:
    """One signal reaches a server's whole tree, but the server shares the caller's session
    and so its autogroup: a session per server would let Linux starve the one whose TP
    rank shares a core with another server (see OWN_GROUP)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], **OWN_GROUP)
    try:
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
        assert os.getsid(child.pid) == os.getsid(0)
        os.killpg(child.pid, signal.SIGTERM)
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()


CHILD = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
print("ready", flush=True)
time.sleep(30)
"""


def test_a_real_process_tree_inherits_the_affinity() -> None:
    """Every thread of a child and of its own child runs on the one core it was given."""
    core = min(os.sched_getaffinity(0))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        preexec_fn=pin_preexec([core]),
        **OWN_GROUP,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 5
        while len({t.pid for t in tree_affinity(child.pid)}) < 2:
            assert time.monotonic() < deadline, "the grandchild did not start"
            time.sleep(0.05)
        threads, problems = check_confined(child.pid, [core])
        assert problems == []
        assert len({t.pid for t in threads}) == 2 and len(threads) >= 3
        assert all(t.cores == {core} for t in threads)
        assert pinning.summary(threads)["processes"][0]["cores"] == [core]
    finally:
        os.killpg(child.pid, 9)
        child.wait()
    if len(os.sched_getaffinity(0)) > 1:  # a process left alone may run anywhere
        assert check_confined(os.getpid(), [core])[1]


def test_confined_holds_the_calling_thread_only_while_inside() -> None:
    before = os.sched_getaffinity(0)
    core = min(before)
    seen: list[set[int]] = []
    with confined([core]):
        assert os.sched_getaffinity(0) == {core}
        thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join()
    assert seen == [{core}]  # threads started inside inherit it
    assert os.sched_getaffinity(0) == before
    with confined(None):
        assert os.sched_getaffinity(0) == before


def test_cpu_lists_read_as_proc_writes_them() -> None:
    assert parse_cpu_list("0-2,5,7-8\n") == {0, 1, 2, 5, 7, 8}
    assert parse_cpu_list("3") == {3}


def test_a_server_with_more_workers_than_cores_is_pinned_to_every_core_its_ranks_use(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text("{}")
    config = TopologyConfig(
        model=tmp_path,
        setup="kvpush-push",
        workdir=tmp_path / "w",
        parallel={"prefill": Parallel(tp=2)},
    )
    prefill, decode = build_specs(config, cores=[0, 1])
    # TP2 on a 2-core box: its ranks run on cores 0 and 1, so its tree may use both
    assert prefill.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and prefill.cores == [0, 1]
    assert decode.cores == [1] and prefill.pinned and decode.pinned
    # with a core kept for the proxy, the borrowed one is a server's, never the proxy's
    prefill, decode = build_specs(config, cores=[0, 1, 2])
    assert prefill.cores == [0, 1] and decode.cores == [1]
    assert Topology(config, cores=[0, 1, 2]).client_cores == [2]
