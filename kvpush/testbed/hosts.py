"""Hosts on one machine: Linux network namespaces joined by a bridge (needs root).

`Hosts(n)` creates n namespaces, each with loopback up and one veth pair whose inner end
(`eth0`, in the namespace) has an address of one /24 of 198.18.0.0/15 (the range set aside
for benchmarking networks, RFC 2544) and whose outer end is a port of a bridge in the
root namespace. The bridge has the .1 address of that /24, so processes in the root
namespace (a proxy, a test) reach every host; the hosts reach each other and the root
namespace's bridge address only: no namespace has a default route, the root namespace
forwards nothing to them, so nothing is routed outside.

    with Hosts(2) as hosts:                       # kvpush-<pid>-h0, kvpush-<pid>-h1
        a, b = hosts
        subprocess.run(a.command(["ip", "-br", "addr"]))   # ip netns exec ... ip -br addr
        hosts.cut(b); hosts.restore(b)           # pull b's cable and plug it back in

Names carry a token made of the creating process id and a count (namespaces
`kvpush-<token>-h<i>`, bridge `kvpb<token>`, outer veth ends `kvpv<token>h<i>`), so a run
removes what an earlier run left behind when that run's process is gone, and never
touches a live run's. Leaving (or `close`) ends the
processes still inside the namespaces, deletes the namespaces (which deletes their veth
pairs) and the bridge; it runs even when the body raised.

Processes in the namespaces share the machine's IPC and PID namespaces, so UCX would move
bytes between them through shared memory (its `posix`, `sysv`, `cma` transports) instead
of over the link, as it never could between two machines: `UCX_ENV` keeps UCX to TCP on
the namespace's `eth0`, which is what two machines without RDMA use.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpush.testbed.ipc import process_alive

NETWORK = ipaddress.ip_network("198.18.0.0/15")
PREFIX = "kvpush-"
DEVICE = "eth0"  # the inner veth end, in every namespace
# UCX as between two machines without RDMA: TCP over eth0 (no shared memory, no loopback).
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": DEVICE}
_LOCK = Path("/run/lock/kvpush-hosts.lock")
_NAME = re.compile(rf"^{PREFIX}([0-9a-z]+)-h\d+$")
# Our links: the bridge kvpb<run> and the veth ends kvpv<run>h<i>, kvpi<run>h<i>. A run id
# may itself hold "h" and digits ("eh25"), so a bridge's name is all run id, and a veth's
# host suffix is the last "h<digits>" (the greedy run id leaves exactly that).
_BRIDGE = re.compile(r"^kvpb([0-9a-z]+)$")
_VETH = re.compile(r"^kvp[vi]([0-9a-z]+)h\d+$")
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_made = 0  # Hosts created by this process so far


class HostsError(RuntimeError):
    """Namespaces could not be created here (not root, no `ip`, no permission)."""


@dataclass(frozen=True, slots=True)
class Host:
    """One network namespace: its name, its address on the bridge, its outer veth end."""

    index: int
    netns: str
    address: str
    outer: str  # the veth end on the bridge, in the root namespace

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host (`ip netns exec NETNS ...`); the environment and the
        process id carry over, the network is the namespace's."""
        return ["ip", "netns", "exec", self.netns, *argv]


def unavailable() -> str:
    """Why namespaces cannot be created here ("" when they can)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{PREFIX}{_base36(os.getpid())}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return ""


class Hosts:
    """`n` hosts as network namespaces on one bridge; a context manager (see the module)."""

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 50:
            raise ValueError(f"hosts: 1 to 50 namespaces, not {n}")
        self.n = n
        global _made
        _made += 1
        # the pid in base 36 and one count digit: interface names stay within 15 bytes
        self.run_id = _base36(os.getpid()) + _DIGITS[_made % 36]
        self.bridge = f"kvpb{self.run_id}"
        self.hosts: list[Host] = []
        self.gateway = ""  # the bridge's address in the root namespace
        self.subnet: ipaddress.IPv4Network | None = None

    def __enter__(self) -> Hosts:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def create(self) -> None:
        problem = unavailable()
        if problem:
            raise HostsError(problem)
        _LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two runs never pick the same /24
            remove_stale()
            try:
                self._create()
            except BaseException:
                self.close()
                raise

    def _create(self) -> None:
        self.subnet = subnet = _free_subnet()
        addresses = list(subnet.hosts())
        self.gateway = str(addresses[0])
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/{subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            host = Host(i, f"{PREFIX}{self.run_id}-h{i}", str(addresses[i + 1]),
                        f"kvpv{self.run_id}h{i}")  # fmt: skip
            self.hosts.append(host)
            _ip("netns", "add", host.netns)
            inner = f"kvpi{self.run_id}h{i}"
            _ip("link", "add", host.outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", host.netns)
            _ip("link", "set", host.outer, "master", self.bridge)
            _ip("link", "set", host.outer, "up")
            inside = ["ip", "-n", host.netns]
            _run([*inside, "link", "set", inner, "name", DEVICE])
            _run([*inside, "addr", "add", f"{host.address}/{subnet.prefixlen}", "dev", DEVICE])
            _run([*inside, "link", "set", DEVICE, "up"])
            _run([*inside, "link", "set", "lo", "up"])

    def close(self) -> None:
        """End what runs in the namespaces, delete them and the bridge (idempotent)."""
        for host in self.hosts:
            _end_processes(host.netns)
            _ip("netns", "del", host.netns, check=False)
        self.hosts = []
        _ip("link", "del", self.bridge, check=False)

    def cut(self, host: Host) -> None:
        """Pull `host`'s cable: its outer veth end goes down, the namespace keeps its
        address and routes (as a machine whose switch port died), packets are dropped."""
        _ip("link", "set", host.outer, "down")

    def restore(self, host: Host) -> None:
        _ip("link", "set", host.outer, "up")

    def link_bytes(self, host: Host) -> int:
        """Bytes through `host`'s link so far, both directions (read at the outer end)."""
        stats = Path("/sys/class/net") / host.outer / "statistics"
        return sum(int((stats / f"{d}_bytes").read_text()) for d in ("rx", "tx"))


def remove_stale() -> list[str]:
    """Delete namespaces and bridges of earlier runs whose process is gone; their names."""
    removed = []
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        match = _NAME.match(name)
        if match and not process_alive(_owner(match.group(1))):
            _end_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for link in Path("/sys/class/net").iterdir():
        token = link_run(link.name)
        if token is not None and not process_alive(_owner(token)):
            _ip("link", "del", link.name, check=False)
            removed.append(link.name)
    return removed


def link_run(name: str) -> str | None:
    """The run id in the name of one of our links (bridge or veth end); None for others."""
    match = _BRIDGE.match(name) or _VETH.match(name)
    return match.group(1) if match else None


def _free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of NETWORK that no address or route of the root namespace is in."""
    shown = _ip("-4", "-o", "addr", "show").stdout
    shown += _ip("-4", "route", "show", "table", "all").stdout
    quad = r"\d+\.\d+\.\d+\.\d+"
    used = [ipaddress.ip_network(m, strict=False) for m in re.findall(rf"({quad}/\d+)", shown)]
    used += [ipaddress.ip_network(m) for m in re.findall(rf"(?:^|\s)({quad})(?=\s)", shown)]
    for subnet in NETWORK.subnets(new_prefix=24):
        assert isinstance(subnet, ipaddress.IPv4Network)
        if not any(subnet.overlaps(u) for u in used if u.prefixlen > 0):
            return subnet
    raise HostsError(f"no free /24 left in {NETWORK}")


def _end_processes(netns: str) -> None:
    """SIGTERM, then SIGKILL, the processes inside `netns` (only ours run there)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        pids = _pids(netns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = _pids(netns)
        if not pids:
            return


def _pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _base36(number: int) -> str:
    digits = ""
    while True:
        number, digit = divmod(number, 36)
        digits = _DIGITS[digit] + digits
        if not number:
            return digits


def _owner(token: str) -> int:
    """The process id in a run token (its last character is the count)."""
    return int(token[:-1], 36) if len(token) > 1 else 0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check=check)


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise HostsError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
    return done
