"""How kvpush's background threads share a core with vLLM's engine loop.

Every kvpush thread in a vLLM process (a part's loop, the control server, the target's
NIXL progress, the pools of handshakes and messages, the stall watchdog) calls
`background()` first. By default it moves the calling thread to
Linux's SCHED_BATCH: same CPU share as before, but waking it never preempts the thread
that is running. The engine loop wakes kvpush's threads itself (a step's specs handed
over in `bind_connector_metadata`), and so do control messages and timers; on a core the
engine already fills, each such wake used to switch to our thread at once, and the
worker lost its core, sometimes for another process's whole time slice, in the middle of
vLLM's step (measured on a one-core server: 0.6-2 ms at the 90th percentile of the
hand-off, 20-35 us with SCHED_BATCH; docs/benchmarks.md). Where a core is free, as on a
GPU host, the woken thread runs on it at once, as before; on a busy core it runs when the
engine thread blocks or its slice ends (a few ms at most).

`thread_policy: "normal"` in kv_connector_extra_config keeps the scheduler's default.
Elsewhere than Linux both policies are the default.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvpush.worker")

POLICIES = ("batch", "normal")

_policy = "batch"  # per process: set once by the node when it starts (`configure`)


def configure(policy: str) -> None:
    """The policy the threads started from now on take (one of POLICIES)."""
    global _policy
    if policy not in POLICIES:
        raise ValueError(f"thread_policy must be one of {POLICIES}, got {policy!r}")
    _policy = policy


def background() -> str:
    """Called first by each kvpush thread: apply the process's policy to the calling
    thread. Returns the policy in force ("normal" where the OS has no SCHED_BATCH)."""
    if _policy != "batch" or not hasattr(os, "SCHED_BATCH"):
        return "normal"
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: this thread
    except OSError as exc:  # a seccomp profile may forbid it: run as before, say so once
        log.debug("kvpush threads keep the default scheduling policy: %s", exc)
        return "normal"
    return "batch"
