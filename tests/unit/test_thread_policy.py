"""Every kvpush thread takes the process's `thread_policy`: the OS's default policy, or
with "batch" SCHED_BATCH (Linux), so that waking it never preempts the engine loop; and
its name in the OS ("kv:..."), so that `top -H` tells it from vLLM's threads. Read back
from the kernel, per thread."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpush.dataplane import threads
from kvpush.dataplane.control import ControlServer
from kvpush.node.config import KvpushConfig
from kvpush.node.loop import Loop, _Watchdog
from kvpush.node.peers import Peers
from kvpush.node.progress import TargetProgress
from kvpush.node.results import Results
from tests.control_peers import Recorder

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux only")


@pytest.fixture(autouse=True)
def default_policy() -> Iterator[None]:
    yield
    threads.configure(KvpushConfig().thread_policy)


class Idle(Loop):
    """A part's loop with nothing to do."""

    def next_deadline(self) -> float | None:
        return None

    def handle(self, item: object, at: float) -> None:
        return None

    def tick(self) -> None:
        return None


@dataclass(frozen=True)
class Started:
    """One running thread of each kind kvpush starts in a vLLM process."""

    loop: Loop
    progress: TargetProgress
    control: threading.Thread
    pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor]  # handshakes, messages


@contextlib.contextmanager
def every_kind_of_thread(loop_name: str) -> Iterator[Started]:
    """A part's loop named `loop_name`, its target progress, a control server and a
    peer set's two pools (the stall watchdog comes with the first loop)."""
    loop = Idle(Results(), loop_name)
    loop.start()
    progress = TargetProgress(lambda: None, lambda: False, f"{loop_name}-target-progress")
    progress.start()
    peers: Peers[object] = Peers(None, queue.SimpleQueue(), "decode")  # type: ignore[arg-type]
    try:
        with ControlServer("127.0.0.1", 0, Recorder()) as server:
            assert server._thread is not None
            yield Started(loop, progress, server._thread, (peers.handshakes, peers.messages))
    finally:
        loop.stop()
        progress.stop()
        peers.handshakes.shutdown()
        peers.messages.shutdown()


def policy_of(thread: threading.Thread) -> int:
    deadline = time.monotonic() + 5
    while thread.native_id is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread.native_id is not None
    time.sleep(0.05)  # the thread sets its policy first thing in run()
    return os.sched_getscheduler(thread.native_id)


@pytest.mark.parametrize(
    ("policy", "expected"), [("batch", "SCHED_BATCH"), ("normal", "SCHED_OTHER")]
)
def test_every_kind_of_kvpush_thread_takes_the_policy(policy: str, expected: str) -> None:
    threads.configure(policy)
    want = getattr(os, expected)
    with every_kind_of_thread("kvpush-test-loop") as started:
        for thread in (started.control, started.loop, started.progress):
            assert policy_of(thread) == want
        # the pools of handshakes and of messages that may block on a peer
        for pool in started.pools:
            assert pool.submit(os.sched_getscheduler, 0).result(timeout=5) == want
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread: untouched


def test_the_stall_watchdog_takes_the_policy_too() -> None:
    """One per process, started with the first loop (with the policy then in force); it
    wakes every second."""
    loop = Idle(Results(), "kvpush-test-loop")
    loop.start()
    try:
        watchdog = _Watchdog._instance
        assert watchdog is not None
        kernel = policy_of(watchdog)  # waits for the thread to have set it
        assert watchdog.policy in threads.POLICIES
        assert kernel == (os.SCHED_BATCH if watchdog.policy == "batch" else os.SCHED_OTHER)
    finally:
        loop.stop()


def test_the_setting_is_checked_and_defaults_to_normal() -> None:
    assert KvpushConfig().thread_policy == "normal"
    assert KvpushConfig.from_extra({"insecure": True}, env={}).thread_policy == "normal"
    config = KvpushConfig.from_extra({"thread_policy": "batch", "insecure": True}, env={})
    assert config.thread_policy == "batch"
    with pytest.raises(ValueError, match=r"thread_policy must be one of \('batch', 'normal'\)"):
        KvpushConfig.from_extra({"thread_policy": "fifo", "insecure": True}, env={})
    with pytest.raises(ValueError, match="thread_policy"):
        threads.configure("idle")


def comm_of(thread: threading.Thread) -> str:
    policy_of(thread)  # waits for the thread to have started and set itself up
    assert thread.native_id is not None
    return Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip()


@pytest.mark.parametrize(
    ("name", "native"),
    [
        ("kvpush-push-writer", "kv:writer"),
        ("kvpush-pull-leases", "kv:leases"),
        ("kvpush-pull-reader", "kv:reader"),
        ("kvpush-push-receiver", "kv:receiver"),
        ("kvpush-pull-leases-target-progress", "kv:progress"),
        ("kvpush-push-receiver-target-progress", "kv:progress"),
        ("kvpush-control-25100", "kv:control"),
        ("kvpush-message_1", "kv:message_1"),
        ("kvpush-handshake_0", "kv:handshake_0"),
        ("kvpush-direct", "kv:direct"),
        ("kvpush-watchdog", "kv:watchdog"),
        ("kvpush-a-name-longer-than-linux-keeps", "kv:a-name-longe"),
    ],
)
def test_a_thread_s_name_in_the_os_is_its_role_in_15_bytes(name: str, native: str) -> None:
    assert threads.native_name(name) == native
    assert len(native.encode()) <= 15


def test_every_kind_of_kvpush_thread_is_named_in_the_os() -> None:
    """What `top -H` and /proc show for each: its role, not the process's name."""
    with every_kind_of_thread("kvpush-push-writer") as started:
        assert comm_of(started.control) == "kv:control"
        assert comm_of(started.loop) == "kv:writer"
        assert comm_of(started.progress) == "kv:progress"
        assert _Watchdog._instance is not None
        assert comm_of(_Watchdog._instance) == "kv:watchdog"
        own = Path("/proc/thread-self/comm")
        for pool, prefix in zip(started.pools, ("kv:handshake_", "kv:message_"), strict=True):
            assert pool.submit(own.read_text).result(timeout=5).startswith(prefix)
    # the caller's thread keeps its name
    assert not Path("/proc/thread-self/comm").read_text().startswith("kv:")
