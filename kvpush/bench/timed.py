"""Time the engine-loop hooks of any KV connector class, ours or vLLM's.

Load it in place of the connector: the class name is "Timed" + the connector's name, the
module is this one, for example
    "kv_connector": "TimedNixlConnector", "kv_connector_module_path": "kvpush.bench.timed"
Every hook vLLM calls on its scheduler or worker main thread is wrapped with a timer
(nested calls, e.g. get_transfer_results -> get_finished, count once). With
KVPUSH_HOOK_CPU=1 in the server's environment it also reads the calling thread's CPU clock
around each hook (`kvpush bench hooks --cpu-time`): wall time less CPU time is what the
hook spent waiting (for the GIL, or off the core while another thread ran). Off by default:
each reading is a system call (read outside the wall clock, see `_wrap`). Totals are written
as JSON to $KVPUSH_HOOK_DIR/<role>-<pid>.json by a daemon thread every half second while
they change, so a benchmark can read what each process spent without touching the
connector's own metrics.
"""

from __future__ import annotations

import bisect
import functools
import importlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from kvpush.dataplane import threads

# Every connector method vLLM's scheduler and worker call on their main threads (some on
# both sides), base-class ones included: what the engine loop pays is all of them.
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "request_finished_all_groups",
    "update_connector_output",
    "has_pending_push_work",
    "has_pending_block_frees",
    "on_new_request",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    "take_events",
    "get_kv_connector_stats",
)
WORKER_HOOKS = (
    "bind_connector_metadata",
    "clear_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "handle_preemptions",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
)
_OWN = {"KvpushConnector": "kvpush.vllm", "NullConnector": "kvpush.bench.null"}
STEP_START = "bind_connector_metadata"  # vLLM calls it first in every worker step
_cache: dict[str, type] = {}


# Per-step totals (a worker's hooks from one bind_connector_metadata to the next, the
# first hook of each step) go into log buckets: bucket k holds totals up to
# STEP_BUCKET_S * STEP_BUCKET_GROWTH ** k, so a ledger stays small over hours of steps and
# two readings subtract bucket by bucket. A quantile read from it is the bucket's upper
# edge (at most 25 % above the true value).
STEP_BUCKET_S = 1e-6
STEP_BUCKET_GROWTH = 1.25
STEP_BUCKETS = 72  # up to ~9 s
_STEP_EDGES = [STEP_BUCKET_S * STEP_BUCKET_GROWTH**k for k in range(STEP_BUCKETS)]
TABLES = ("seconds", "calls", "steps", "cpu")
CPU_ENV = "KVPUSH_HOOK_CPU"


def step_bucket(seconds: float) -> int:
    return min(bisect.bisect_left(_STEP_EDGES, seconds), STEP_BUCKETS - 1)


def step_quantile(steps: dict[str, int], q: float) -> float | None:
    """The `q` quantile (0..1) of per-step totals in seconds, from a ledger's "steps"
    table (the upper edge of the bucket it falls in); None without steps."""
    counts = sorted((int(k), n) for k, n in steps.items() if n > 0)
    total = sum(n for _, n in counts)
    if not total:
        return None
    seen = 0
    for bucket, n in counts:
        seen += n
        if seen >= q * total:
            return _STEP_EDGES[bucket]
    return _STEP_EDGES[counts[-1][0]]


class HookLedger:
    """Per-process totals: seconds and calls per hook, (worker) the distribution of
    per-step totals, and with CPU_ENV set the thread CPU seconds per hook; written out
    now and then."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.steps: dict[str, int] = {}  # step_bucket(total) -> steps
        self.cpu: dict[str, float] = {}  # thread CPU seconds per hook (with CPU_ENV)
        self.cpu_on = os.environ.get(CPU_ENV, "") not in ("", "0")
        self._step = -1.0  # this step's total so far (< 0: no step begun yet)
        self.depth = threading.local()
        self.lock = threading.Lock()
        self.changed = False
        directory = os.environ.get("KVPUSH_HOOK_DIR")
        self.path = Path(directory) / f"{role}-{os.getpid()}.json" if directory else None
        if self.path is not None:
            threading.Thread(target=self._dump_loop, name="kvpush-hook-ledger", daemon=True).start()

    def record(self, hook: str, seconds: float, cpu: float | None = None) -> None:
        with self.lock:
            self.seconds[hook] = self.seconds.get(hook, 0.0) + seconds
            if cpu is not None:
                self.cpu[hook] = self.cpu.get(hook, 0.0) + cpu
            self.calls[hook] = self.calls.get(hook, 0) + 1
            if hook == STEP_START:  # a new step: the last one is complete
                if self._step >= 0:
                    key = str(step_bucket(self._step))
                    self.steps[key] = self.steps.get(key, 0) + 1
                self._step = 0.0
            if self._step >= 0:
                self._step += seconds
            self.changed = True

    def _dump_loop(self) -> None:
        threads.background()  # as kvpush's own threads: its wake-ups never preempt vLLM's
        while True:
            time.sleep(0.5)
            if self.changed:
                self.dump()

    def dump(self) -> None:
        assert self.path is not None
        with self.lock:
            payload = {
                "role": self.role,
                "seconds": self.seconds,
                "calls": self.calls,
                "steps": self.steps,
                **({"cpu": self.cpu} if self.cpu_on else {}),
                "at": time.monotonic(),  # for rates: one clock for every process
            }
            text = json.dumps(payload)
            self.changed = False
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.path)


def _wrap(method: Any, hook: str) -> Any:
    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        ledger: HookLedger = self._kvpush_ledger
        depth = getattr(ledger.depth, "n", 0)
        ledger.depth.n = depth + 1
        cpu_on = ledger.cpu_on and depth == 0
        # The CPU clock is read outside the wall clock: each reading is a system call,
        # and a thread that returns from one may be switched out for another runnable
        # process on its core (vLLM's polling ones), which inside the wall clock would
        # count as the hook's time. So CPU time counts the wall clock's two readings too
        # (~1 us), and a hook that never waits shows a little more CPU than wall time.
        cpu_started = time.thread_time() if cpu_on else 0.0
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            took = time.perf_counter() - started  # the timer's own work stays outside
            cpu = time.thread_time() - cpu_started if cpu_on else None
            ledger.depth.n = depth
            if depth == 0:
                ledger.record(hook, took, cpu)

    return timed


def timed_class(base: type) -> type:
    """A subclass of `base` whose hooks are timed."""
    if base.__name__ in _cache:
        return _cache[base.__name__]

    def __init__(self: Any, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        role_name = "scheduler" if "SCHEDULER" in str(role) else "worker"
        self._kvpush_ledger = HookLedger(role_name)
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        if transfer is not None and (transfer.kv_connector_extra_config or {}).get("nospin"):
            from kvpush.bench.nospin import install

            install()  # a *-nospin setup, timed: quiet the agent before vLLM builds it
        super(cls, self).__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]

    namespace: dict[str, Any] = {"__init__": __init__}
    for hook in SCHEDULER_HOOKS + WORKER_HOOKS:
        method = getattr(base, hook, None)
        if method is not None:
            namespace[hook] = _wrap(method, hook)
    cls: type = type(f"Timed{base.__name__}", (base,), namespace)
    _cache[base.__name__] = cls
    return cls


def resolve(name: str) -> type:
    """A connector class by the name vLLM's config would use."""
    if name in _OWN:
        return getattr(importlib.import_module(_OWN[name]), name)  # type: ignore[no-any-return]
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class_by_name(name)


def __getattr__(name: str) -> Any:
    if name.startswith("Timed") and len(name) > 5:
        return timed_class(resolve(name[5:]))
    raise AttributeError(f"module 'kvpush.bench.timed' has no attribute {name!r}")


def read_ledgers(directory: Path) -> dict[str, dict[str, Any]]:
    """Sum the JSON files of every process by role: {"scheduler": {...}, "worker": {...}}."""
    totals: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        role = totals.setdefault(data["role"], {table: {} for table in TABLES})
        for table in TABLES:
            for hook, value in data.get(table, {}).items():
                role[table][hook] = role[table].get(hook, 0) + value
    return totals


def subtract_ledgers(
    after: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """`read_ledgers` totals of `after` less those of `before` (a reading taken earlier in
    the same run): what the hooks spent in between."""
    out: dict[str, dict[str, Any]] = {}
    for role, tables in after.items():
        earlier = before.get(role, {})
        out[role] = {
            table: {
                hook: value - earlier.get(table, {}).get(hook, 0)
                for hook, value in tables.get(table, {}).items()
            }
            for table in TABLES
            if table in tables or table in earlier
        }
    return out
