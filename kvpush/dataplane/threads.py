"""How kvpush's background threads share a core with vLLM's engine loop.

Every kvpush thread in a vLLM process (a part's loop, the control server, the target's
NIXL progress, the pools of handshakes and messages, the stall watchdog) calls
`background()` first, which applies the process's `thread_policy`:

- "normal" (the default): the OS's default policy. A woken kvpush thread may preempt the
  thread running vLLM's step, runs its short work and gives the core back.
- "batch": Linux's SCHED_BATCH, same CPU share, but waking one never preempts the running
  thread; it runs when that thread blocks or its slice ends (a few ms at most on a busy
  core). Less time shows inside the hooks that wake kvpush's threads (measured on a
  one-core server: 20-35 us at the 90th percentile of the hand-off against 0.6-2 ms),
  but on servers whose processes share one or two cores decode stepped slower and TTFT
  and TPOT were higher with it: TPOT higher in 19 of 24 paired benchmark runs
  (docs/benchmarks.md, "Connector hooks on the engine loop"). On a push prefill alone it
  halved the hooks' time and made push's first and second tokens later at 1,024 tokens
  (docs/benchmarks.md, '"batch" on push's prefill only').

Where a free core is at hand, as on a GPU host, a woken thread runs on it at once under
either policy. Elsewhere than Linux both policies are the default.

`background()` also gives the thread its name in the OS (`native_name`: "kv:writer",
"kv:control", ...), so that `top -H`, `ps -L`, `perf` and `/proc/PID/task/TID/comm` tell
kvpush's threads from vLLM's: unnamed, every thread of a process shows the process's name
("VLLM::Worker").
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading

log = logging.getLogger("kvpush.worker")

POLICIES = ("batch", "normal")

_policy = "normal"  # per process: set once by the node when it starts (`configure`)


def configure(policy: str) -> None:
    """The policy the threads started from now on take (one of POLICIES)."""
    global _policy
    if policy not in POLICIES:
        raise ValueError(f"thread_policy must be one of {POLICIES}, got {policy!r}")
    _policy = policy


# Linux's prctl option that names the calling thread (its `comm`, at most 15 bytes)
_PR_SET_NAME = 15
_COMM_MAX = 15


def native_name(name: str) -> str:
    """The OS name of kvpush thread `name` (Python's): "kv:" and the thread's role, within
    Linux's 15 bytes. A worker process runs one part, so the role is enough: the mode
    and the control port are left out, and the part's NIXL progress thread is
    "kv:progress"."""
    role = name.removeprefix("kvpush-")
    if role.endswith("-target-progress"):
        role = "progress"
    for mode in ("push-", "pull-"):
        role = role.removeprefix(mode)
    if role.startswith("control-"):
        role = "control"
    return ("kv:" + role)[:_COMM_MAX]


@functools.cache
def _this_program() -> ctypes.CDLL:
    """The symbols of this process, libc's among them (no search for libc's file)."""
    return ctypes.CDLL(None)


def _set_native_name(name: str) -> None:
    """Name the calling thread in the OS (Linux; elsewhere nothing). Best effort: a name
    is for people reading `top`, never worth an error."""
    if not sys.platform.startswith("linux"):
        return
    try:
        _this_program().prctl(_PR_SET_NAME, native_name(name).encode(errors="replace"), 0, 0, 0)
    except (OSError, AttributeError) as exc:
        log.debug("kvpush threads keep the process's name: %s", exc)


def background() -> str:
    """Called first by each kvpush thread: name it in the OS (`native_name`) and apply the
    process's policy to it. Returns the policy in force ("normal" where the OS has no
    SCHED_BATCH)."""
    _set_native_name(threading.current_thread().name)
    if _policy != "batch" or not hasattr(os, "SCHED_BATCH"):
        return "normal"
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: this thread
    except OSError as exc:  # a seccomp profile may forbid it: run as before, say so once
        log.debug("kvpush threads keep the default scheduling policy: %s", exc)
        return "normal"
    return "batch"
