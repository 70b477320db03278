"""`kvpush bench sweep --trace`: where the CPU went during a run, and how the answers streamed.

One JSON per run, `OUT/trace/<run>.json`, to test what makes whole answers reach the client
in one burst (docs/benchmarks.md, "Why answers came in one burst"):

- `cpu`: CPU seconds over the run of every process of every server (API server, engine
  core, ...; the top threads of each by name), of the load generator and of the proxy's
  thread, read from /proc before and after, and how long each process's threads stood
  runnable without a core (`waited_s`, `threads_waited`: the scheduler's run-queue wait,
  what a server short of cores shows first); and `timeline`, CPU seconds per process every
  `every` seconds, so a burst can be matched with who had the CPU then;
- `steps`: each server's engine steps (calls of the connector's `start_load_kv`, from the
  hook timer, which --trace turns on) per interval, with decode's waiting and running
  queues sampled meanwhile: steps per second while requests wait for KV against while they
  run;
- `chunks`: when each streamed chunk reached the client, per request, in seconds from the
  start of the run (`vllm bench serve --save-detailed` data);
- `pinning`: each server's cores and every thread's affinity, read back from /proc.

All clocks are CLOCK_MONOTONIC (`time.monotonic`, `time.perf_counter` and the ledgers'
`at`), shared by every process on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpush.testbed.pinning import check_confined, command_name, descendants

if TYPE_CHECKING:
    from kvpush.testbed.topology import Topology

TICKS = os.sysconf("SC_CLK_TCK")
TOP_THREADS = 6


def _stat_fields(path: Path) -> tuple[str, list[str]] | None:
    """(command name, the fields after it) of a /proc stat file."""
    try:
        text = path.read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    return name, text[text.rindex(")") + 2 :].split()


def cpu_seconds(path: Path) -> float | None:
    """utime + stime of a /proc/PID/stat or /proc/PID/task/TID/stat file, in seconds."""
    parsed = _stat_fields(path)
    if parsed is None:
        return None
    fields = parsed[1]
    return (int(fields[11]) + int(fields[12])) / TICKS


def runqueue_wait_seconds(path: Path) -> float | None:
    """How long a thread has stood runnable without a core, in seconds: the second field
    of its /proc/PID/task/TID/schedstat (None where the kernel keeps no schedstat)."""
    try:
        return int(path.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def process_cpu(pid: int) -> dict[str, Any]:
    """One process's CPU seconds so far, in all and per thread (by `tid name`), and per
    thread the time it stood runnable waiting for a core (`waits`)."""
    threads: dict[str, float] = {}
    waits: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            parsed = _stat_fields(task / "stat")
            seconds = cpu_seconds(task / "stat")
            if parsed is not None and seconds is not None:
                name = f"{task.name} {parsed[0]}"
                threads[name] = seconds
                waited = runqueue_wait_seconds(task / "schedstat")
                if waited is not None:
                    waits[name] = waited
    total = cpu_seconds(Path(f"/proc/{pid}/stat"))
    return {"name": command_name(pid), "seconds": total, "threads": threads, "waits": waits}


def tree_cpu(root: int) -> dict[int, dict[str, Any]]:
    return {pid: process_cpu(pid) for pid in descendants(root)}


def cpu_delta(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]) -> list[Any]:
    """Per process (parents first), its CPU seconds between two `tree_cpu` readings and its
    busiest threads; and how long its threads stood runnable without a core (`waited_s`,
    all threads; `threads_waited`, the threads that waited longest)."""
    out = []
    for pid, now in after.items():
        then = before.get(pid, {"seconds": 0.0, "threads": {}})
        if now["seconds"] is None:
            continue
        threads = _deltas(now["threads"], then["threads"])
        waits = _deltas(now.get("waits", {}), then.get("waits", {}))
        out.append(
            {
                "pid": pid,
                "name": now["name"],
                "cpu_s": round(now["seconds"] - (then["seconds"] or 0.0), 3),
                "threads": _top(threads),
                "waited_s": round(sum(waits.values()), 3),
                "threads_waited": _top(waits),
            }
        )
    return out


def _deltas(now: dict[str, float], then: dict[str, float]) -> dict[str, float]:
    return {name: round(value - then.get(name, 0.0), 3) for name, value in now.items()}


def _top(values: dict[str, float]) -> dict[str, float]:
    """The TOP_THREADS largest positive values, largest first."""
    largest = sorted(values.items(), key=lambda kv: -kv[1])[:TOP_THREADS]
    return {name: value for name, value in largest if value > 0}


def read_ledger_steps(directory: Path) -> tuple[float, int] | None:
    """(when it was written, engine steps so far) from a server's worker hook ledgers."""
    at, steps, found = 0.0, 0, False
    for path in directory.glob("worker-*.json"):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            steps += int(data["calls"].get("start_load_kv", 0))
            at = max(at, float(data.get("at", 0.0)))
            found = True
    return (at, steps) if found else None


@dataclass
class Tracer:
    """Samples a topology's servers (and the client once it runs) every `every` seconds."""

    topology: Topology
    every: float = 0.5
    client_pid: int | None = None
    proxy_tid: int | None = None
    started: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    first: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    last: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    pinning: dict[str, Any] = field(default_factory=dict)
    _dirs: dict[str, Path] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def roots(self) -> dict[str, int]:
        roots = {name: proc.pid for name, proc in self.topology.procs.items()}
        if self.client_pid is not None:
            roots["client"] = self.client_pid
        return roots

    def read(self) -> dict[str, dict[int, dict[str, Any]]]:
        reading = {name: tree_cpu(pid) for name, pid in self.roots().items()}
        if self.proxy_tid is not None:
            stat = Path(f"/proc/{os.getpid()}/task/{self.proxy_tid}/stat")
            reading["proxy"] = {
                self.proxy_tid: {
                    "name": "proxy thread",
                    "seconds": cpu_seconds(stat),
                    "threads": {},
                }
            }
        return reading

    def start(self) -> None:
        from kvpush.testbed.topology import hook_dir

        self.started = time.monotonic()
        self.pinning = self.topology.pinning()
        self.pinning["read_back"] = {}
        for spec in self.topology.specs:
            proc = self.topology.procs.get(spec.name)
            if proc is not None:
                threads, problems = check_confined(proc.pid, spec.cores)
                self.pinning["read_back"][spec.name] = {
                    "processes": sorted({f"{t.pid} {t.process}" for t in threads}),
                    "threads": len(threads),
                    "cores_used": sorted({c for t in threads for c in t.cores}),
                    "off_its_cores": problems[:10],
                }
        self.first = self.read()
        self._dirs = {
            spec.name: hook_dir(self.topology.config, spec.name)
            for spec in self.topology.specs
            if self.topology.config.timed_hooks
        }
        self._tick()
        self._thread = threading.Thread(target=self._loop, name="kvpush-tracer", daemon=True)
        self._thread.start()

    def watch_client(self, pid: int) -> None:
        self.client_pid = pid

    def _tick(self) -> None:
        now = time.monotonic()
        reading = self.read()
        for role, procs in reading.items():
            self.first.setdefault(role, {})
            for pid, proc in procs.items():
                self.first[role].setdefault(
                    pid, {**proc, "seconds": 0.0, "threads": {}, "waits": {}}
                )
        for role, procs in reading.items():
            # merged, not replaced: a process that has exited (the load generator, at the
            # end of its run) keeps its last reading instead of dropping out of the totals
            kept = self.last.setdefault(role, {})
            kept.update((pid, proc) for pid, proc in procs.items() if proc["seconds"] is not None)
        self.samples.append(
            {
                "t": round(now - self.started, 3),
                "cpu_s": {
                    role: {
                        f"{pid} {proc['name']}": round(proc["seconds"] or 0.0, 3)
                        for pid, proc in procs.items()
                    }
                    for role, procs in reading.items()
                },
            }
        )
        for name, directory in self._dirs.items():
            steps = read_ledger_steps(directory)
            if steps is not None and (not self.steps.get(name) or self.steps[name][-1] != steps):
                self.steps.setdefault(name, []).append(steps)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            with contextlib.suppress(OSError, ValueError):
                self._tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with contextlib.suppress(OSError, ValueError):
            time.sleep(0.6)  # the ledgers' last write
            self._tick()

    def result(
        self, raw: dict[str, Any] | None, queue_times: Sequence[float], waiting: Sequence[float],
        running: Sequence[float], proxy_chunks: dict[str, list[tuple[float, int]]] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        cpu = {
            role: cpu_delta(self.first.get(role, {}), procs) for role, procs in self.last.items()
        }
        steps = {
            name: step_rates(points, self.started, queue_times, waiting, running)
            for name, points in self.steps.items()
        }
        at_proxy = proxy_chunk_times(proxy_chunks, self.started)
        return {
            "schema": "kvpush.bench.trace/1",
            "every_s": self.every,
            "duration_s": round(time.monotonic() - self.started, 3),
            "pinning": self.pinning,
            "cpu": cpu,
            "timeline": self.samples,
            "steps": steps,
            "chunks": chunk_times(raw, self.started),
            "proxy_chunks": at_proxy,
            "summary": {**summary(cpu, steps), **burst_shares(raw, at_proxy)},
        }


def step_rates(
    points: Sequence[tuple[float, int]],
    started: float,
    queue_times: Sequence[float],
    waiting: Sequence[float],
    running: Sequence[float],
) -> dict[str, Any]:
    """Engine steps per interval between ledger writes, each with decode's queues sampled
    in it; and the mean steps/s over intervals where requests waited (for KV or a slot),
    where they only ran, and where the server was idle."""
    intervals = []
    kinds: dict[str, list[float]] = {"waiting": [], "running": [], "idle": []}
    for (t0, s0), (t1, s1) in zip(points, points[1:], strict=False):
        if t1 <= t0:
            continue
        inside = [i for i, t in enumerate(queue_times) if t0 <= t <= t1]
        wait = max((waiting[i] for i in inside), default=None)
        run = max((running[i] for i in inside), default=None)
        rate = (s1 - s0) / (t1 - t0)
        intervals.append(
            {
                "from_s": round(t0 - started, 3),
                "to_s": round(t1 - started, 3),
                "steps": s1 - s0,
                "steps_per_s": round(rate, 1),
                "waiting": wait,
                "running": run,
            }
        )
        kind = "waiting" if wait else "running" if run else "idle" if wait is not None else None
        if kind is not None:
            kinds[kind] += [rate] * round((t1 - t0) * 100)  # weighted by duration
    return {
        "intervals": intervals,
        "steps_per_s": {
            kind: round(sum(r) / len(r), 1) if r else None for kind, r in kinds.items()
        },
    }


def chunk_times(raw: dict[str, Any] | None, started: float) -> list[dict[str, Any]]:
    """Per request: when it was sent and when each of its chunks arrived, in seconds from
    the start of the run (`vllm bench serve --save-detailed` data)."""
    if not raw:
        return []
    starts, ttfts, itls = raw.get("start_times"), raw.get("ttfts"), raw.get("itls")
    if not (isinstance(starts, list) and isinstance(ttfts, list) and isinstance(itls, list)):
        return []
    out = []
    for start, ttft, gaps in zip(starts, ttfts, itls, strict=False):
        if not start or not ttft:
            continue
        times = [start + ttft]
        for gap in gaps or ():
            times.append(times[-1] + gap)
        out.append(
            {
                "sent_s": round(start - started, 4),
                "chunks_s": [round(t - started, 4) for t in times],
            }
        )
    return out


def proxy_chunk_times(
    logs: dict[str, list[tuple[float, int]]] | None, started: float
) -> list[dict[str, Any]]:
    """Per request through the proxy: when each chunk of decode's answer reached the proxy
    (s from the start of the run) and its size in bytes (the last is the stream's end)."""
    return [
        {
            "request": request,
            "chunks_s": [round(at - started, 4) for at, _ in chunks],
            "bytes": [size for _, size in chunks],
        }
        for request, chunks in (logs or {}).items()
        if chunks
    ]


def burst_shares(raw: dict[str, Any] | None, at_proxy: list[dict[str, Any]]) -> dict[str, Any]:
    """The share of answers sent in one burst, at the client (`one_burst_share`) and at the
    proxy: there, an answer whose first chunk came less than ONE_BURST_MS before the chunk
    that brought 90 % of its bytes (so a closing usage or `[DONE]` chunk does not count).
    Equal shares put the bursts upstream of the proxy, in decode's server."""
    from kvpush.bench.results import ONE_BURST_MS, one_burst_share

    def burst(times: Sequence[float], sizes: Sequence[int]) -> bool:
        total, so_far = sum(sizes), 0
        for at, size in zip(times, sizes, strict=True):
            so_far += size
            if so_far >= 0.9 * total:
                return (at - times[0]) * 1e3 < ONE_BURST_MS
        return True

    bursts = [burst(c["chunks_s"], c["bytes"]) for c in at_proxy]
    proxy = sum(bursts) / len(bursts) if bursts else None
    return {"one_burst_client": one_burst_share(raw or {}), "one_burst_proxy": proxy}


def summary(cpu: dict[str, list[Any]], steps: dict[str, Any]) -> dict[str, Any]:
    """The few numbers to read first: CPU seconds per process of each server (by name), of
    the client and the proxy, and each server's engine steps per second by queue state."""
    out: dict[str, Any] = {
        role: {f"{p['pid']} {p['name']}": p["cpu_s"] for p in procs} for role, procs in cpu.items()
    }
    out["steps_per_s"] = {name: s["steps_per_s"] for name, s in steps.items()}
    return out


def describe(trace: dict[str, Any]) -> str:
    """One line for the sweep's progress output: CPU seconds of each server's busier
    processes, of the client and the proxy; decode's steps per second while requests wait."""
    parts = []
    for role, procs in trace["summary"].items():
        if not isinstance(procs, dict) or role == "steps_per_s":
            continue
        busy = [
            f"{name.split(' ', 1)[1]} {seconds:.1f}"
            for name, seconds in procs.items()
            if seconds >= 0.05
        ]
        parts.append(f"{role}: {', '.join(busy) or '0.0'}")
    line = "trace, CPU s: " + "; ".join(parts)
    for name, kinds in trace["summary"].get("steps_per_s", {}).items():
        if kinds.get("waiting") is not None:
            line += f"; {name} {kinds['waiting']:.0f} steps/s while requests wait"
    shares = [
        f"{where} {trace['summary'][f'one_burst_{where}']:.0%}"
        for where in ("client", "proxy")
        if trace["summary"].get(f"one_burst_{where}") is not None
    ]
    if shares:
        line += "; answers in one burst at the " + ", ".join(shares)
    return line


def write(path: Path, trace: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(trace, separators=(",", ":")) + "\n")
    tmp.replace(path)
