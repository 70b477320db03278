"""Which cores each server of a topology runs on, and confining its whole process tree there.

`VLLM_CPU_OMP_THREADS_BIND` binds only a server's model-worker threads; its API server,
engine core and their other threads would float over every core, and on a small machine
one server's busy processes then take the core the other server's model runs on.
Pinned (the default), every server's process is started with its cores as its CPU
affinity, which every process and thread it starts inherits (vLLM's CPU worker binds its
OpenMP threads within the same list). `--no-pin` keeps the old behaviour: only the worker's
threads are bound.

The proxy and the load generator get the cores no server has: pinned with more cores than
servers, one core (and what an even split leaves) is kept for them; with as many cores as
servers or fewer (a 2-core machine running a 1P1D pair) none is left, and they float over
all cores.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NO_PIN_HELP = (
    "do not confine each vLLM server to its cores: only its model worker's threads are "
    "bound there (VLLM_CPU_OMP_THREADS_BIND) and its API server and engine core float over "
    "every core, as before pinning (default: every process of a server runs on its own "
    "cores only, and the proxy and load generator on the cores left over, if any)"
)


@dataclass(frozen=True, slots=True)
class CorePlan:
    """Cores per server (in `build_specs`'s order) and for the proxy and load generator."""

    servers: tuple[tuple[int, ...], ...]
    rest: tuple[int, ...]  # what the proxy and load generator may use
    pinned: bool

    @property
    def server_cores(self) -> list[int]:
        """Every core some server has."""
        return sorted({core for share in self.servers for core in share})

    @property
    def rest_is_own(self) -> bool:
        """Whether the proxy and load generator have cores no server uses."""
        return self.pinned and bool(self.rest) and set(self.server_cores).isdisjoint(self.rest)


def plan_cores(
    n_prefill: int,
    n_decode: int,
    available: Sequence[int],
    pin: bool = True,
    single: bool = False,
) -> CorePlan:
    """Split `available` between the servers (prefill first) and the proxy and client.

    `single`: one server in place of the pair, given every core the pair's servers would
    have (so it is compared on the same cores)."""
    from kvpush.testbed.topology import assign_cores

    cores = sorted(available)
    n_servers = n_prefill + n_decode
    if pin and len(cores) > n_servers:
        shares = assign_cores(n_prefill, n_decode, cores[:-1])
    else:
        shares = assign_cores(n_prefill, n_decode, cores)
    used = sorted({core for share in shares for core in share})
    rest = [core for core in cores if core not in used] if pin else []
    if single:  # unpinned, as before pinning: every core
        shares = [used if pin else cores]
    return CorePlan(tuple(tuple(share) for share in shares), tuple(rest or cores), pin)


# How the testbed starts a server (or any process tree it signals as a whole): in a process
# group of its own, so that one signal reaches the whole tree, but in the caller's session.
# A session of its own (setsid) would also be a scheduling group of its own under Linux's
# autogroup (CONFIG_SCHED_AUTOGROUP, on by default), and the kernel then shares each core
# fairly between sessions before threads: where two servers share a core (TP 2 on a 2-core
# machine), the session whose load lies mostly on its other core gets a weight near zero
# on the shared one, and its TP rank there stood runnable and unrun for a minute at a time
# while the other server's worker polled vLLM's queue. In one session each thread gets its
# share.
OWN_GROUP: dict[str, Any] = {"process_group": 0}


def pin_preexec(cores: Sequence[int]) -> Callable[[], None]:
    """A Popen `preexec_fn` that gives the child (and so everything it starts) `cores`.

    Built before the fork: the child only makes the one system call."""
    return functools.partial(os.sched_setaffinity, 0, frozenset(cores))


@contextlib.contextmanager
def confined(cores: Sequence[int] | None) -> Iterator[None]:
    """Run the calling thread (and the threads it starts meanwhile) on `cores`, then give it
    back its affinity. None: leave it alone."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# -- reading it back from /proc -------------------------------------------------------------


def parse_cpu_list(text: str) -> frozenset[int]:
    """`"0-2,5"` (as /proc's Cpus_allowed_list writes it) -> {0, 1, 2, 5}."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return frozenset(cores)


def _status(path: Path) -> dict[str, str]:
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def descendants(root: int) -> list[int]:
    """`root` and every process below it, from /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the command name is in parentheses and may hold spaces: split after it
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        tree.append(pid)
        todo += sorted(children.get(pid, ()))
    return tree


def command_name(pid: int) -> str:
    """What a process calls itself: vLLM sets titles like `VLLM::EngineCore`."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [w.decode(errors="replace") for w in cmdline if w]
    if not words:
        return _status(Path(f"/proc/{pid}/status")).get("Name", "?")
    if len(words) == 1:  # a title set with setproctitle
        return words[0][:60]
    module = words[words.index("-m") + 1] if "-m" in words[:-1] else ""
    return (module or Path(words[0]).name)[:60]


@dataclass(frozen=True, slots=True)
class ThreadAffinity:
    pid: int
    tid: int
    process: str
    thread: str
    cores: frozenset[int]


def tree_affinity(root: int) -> list[ThreadAffinity]:
    """The CPU affinity of every thread of every process below `root`."""
    out = []
    for pid in descendants(root):
        name = command_name(pid)
        with contextlib.suppress(OSError):
            for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: int(p.name)):
                status = _status(task / "status")
                if "Cpus_allowed_list" in status:
                    cores = parse_cpu_list(status["Cpus_allowed_list"])
                    out.append(
                        ThreadAffinity(pid, int(task.name), name, status.get("Name", "?"), cores)
                    )
    return out


def check_confined(root: int, cores: Sequence[int]) -> tuple[list[ThreadAffinity], list[str]]:
    """Every thread below `root`, and one line for each that may run off `cores`."""
    allowed = frozenset(cores)
    threads = tree_affinity(root)
    problems = [
        f"pid {t.pid} ({t.process}) thread {t.tid} ({t.thread}) may run on "
        f"{sorted(t.cores)}, not only {sorted(allowed)}"
        for t in threads
        if not t.cores <= allowed
    ]
    return threads, problems


def summary(threads: Sequence[ThreadAffinity]) -> dict[str, Any]:
    """Per process of a server: its name, threads, and the cores its threads may use."""
    processes: dict[int, dict[str, Any]] = {}
    for t in threads:
        entry = processes.setdefault(t.pid, {"pid": t.pid, "name": t.process, "threads": 0})
        entry["threads"] += 1
        cores = set(entry.get("cores", ())) | t.cores
        entry["cores"] = sorted(cores)
    return {"processes": list(processes.values())}


# -- after start-up: what vLLM moved ----------------------------------------------------


def reconfine(root: int, cores: Sequence[int]) -> list[ThreadAffinity]:
    """Put every thread below `root` that may run off `cores` back on them; returns those
    (as they were). vLLM's NixlConnector, on the CPU backend, binds the thread that creates
    it, the model worker's own, to the last core of each NUMA node: on a machine that
    stands in for two hosts that is the other server's core, where separate hosts would
    have kept it on its own (the threads it starts later inherit the binding put back)."""
    allowed = frozenset(cores)
    moved = []
    for t in tree_affinity(root):
        if not t.cores <= allowed:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(t.tid, allowed)
                moved.append(t)
    return moved


def describe_moved(moved: Sequence[ThreadAffinity]) -> list[str]:
    """One line per process whose threads were moved: `VLLM::Worker 1234: 3 threads from 1`."""
    per: dict[tuple[int, str], list[ThreadAffinity]] = {}
    for t in moved:
        per.setdefault((t.pid, t.process), []).append(t)
    return [
        f"{name} {pid}: {len(ts)} thread{'s' * (len(ts) != 1)} from cores "
        + ",".join(str(c) for c in sorted(frozenset().union(*(t.cores for t in ts))))
        for (pid, name), ts in per.items()
    ]


# -- a model worker with a core of its own --------------------------------------------------

# vLLM's process titles: the model worker's process (multiprocess executor), else the engine
# core process whose main thread runs the worker (in-process executor)
WORKER_TITLES = ("VLLM::Worker", "VLLM::EngineCore")


def isolate_worker(root: int, worker: Sequence[int], aside: Sequence[int]) -> int:
    """Leave the model worker's thread of the server below `root` alone on `worker` and
    move every other thread of that server (API server, engine core, the KV connector's
    threads, those the worker started since) to `aside`. Returns how many threads moved.

    The worker's thread is the main thread of the process vLLM titles `VLLM::Worker`, or,
    with no such process (the in-process executor), of `VLLM::EngineCore`. ValueError if
    there is neither (not a vLLM server, or not up)."""
    threads = tree_affinity(root)
    workers: set[int] = set()
    for title in WORKER_TITLES:
        workers = {t.tid for t in threads if t.tid == t.pid and t.process.startswith(title)}
        if workers:
            break
    else:
        raise ValueError(
            f"no vLLM model worker (a process titled {' or '.join(WORKER_TITLES)}) below pid {root}"
        )
    moved = 0
    for t in threads:
        target = frozenset(worker if t.tid in workers else aside)
        if t.cores != target:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(t.tid, target)
                moved += 1
    return moved
