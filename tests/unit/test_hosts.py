"""Hosts as network namespaces (`kvpush.testbed.hosts`) and the testbed's servers on them.

Placing servers on hosts needs nothing; the namespaces themselves need root and `ip`
(skipped with the reason elsewhere) and take about a second.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpush.testbed import hosts as netns
from kvpush.testbed.topology import Parallel, TopologyConfig, assign_hosts, build_specs


def fake_hosts(n: int) -> list[netns.Host]:
    return [netns.Host(i, f"kvpush-x-h{i}", f"198.18.7.{i + 2}", f"kvpvxh{i}") for i in range(n)]


@pytest.mark.parametrize(
    ("n_prefill", "n_decode", "n_hosts", "placed"),
    [
        (1, 1, 2, [0, 1]),
        (1, 1, 1, [0, 0]),
        (2, 2, 2, [0, 0, 1, 1]),
        (1, 3, 2, [0, 1, 1, 1]),
        (3, 1, 2, [0, 0, 0, 1]),
        (2, 2, 3, [0, 0, 1, 2]),
        (1, 2, 5, [0, 1, 2]),
    ],
)
def test_prefill_and_decode_share_no_host_while_there_are_two(
    n_prefill: int, n_decode: int, n_hosts: int, placed: list[int]
) -> None:
    got = assign_hosts(n_prefill, n_decode, fake_hosts(n_hosts))
    assert [h.index for h in got] == placed


def test_servers_on_hosts_run_inside_and_advertise_their_hosts_address(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    config = TopologyConfig(
        model=tmp_path,
        setup="kvpush-push",
        n_prefill=1,
        n_decode=1,
        port=9000,
        kv_port=7000,
        parallel={"prefill": Parallel(tp=2)},
        workdir=tmp_path / "w",
    )
    prefill, decode = build_specs(config, cores=[0, 1], hosts=fake_hosts(2))
    for spec, host in ((prefill, "198.18.7.2"), (decode, "198.18.7.3")):
        assert spec.argv[:4] == ["ip", "netns", "exec", spec.netns]
        assert spec.argv[spec.argv.index("--host") + 1] == host
        assert spec.url == f"http://{host}:{spec.port}"
        assert spec.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == host
        assert (spec.env["UCX_TLS"], spec.env["UCX_NET_DEVICES"]) == ("tcp", "eth0")
        assert spec.env["KVPUSH_SECRET"] == config.secret
        transfer = json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
        assert "127.0.0.1" not in json.dumps(transfer)
    assert (prefill.netns, decode.netns) == ("kvpush-x-h0", "kvpush-x-h1")
    assert list(prefill.kv_ports) == [7000, 7001] and list(decode.kv_ports) == [7002]
    backend = prefill.backend()
    assert (backend.kv_host, backend.kv_port, backend.tp_size) == ("198.18.7.2", 7000, 2)
    # without hosts, all stays on loopback in this namespace
    alone = build_specs(config, cores=[0, 1])
    assert all(s.netns == "" and s.argv[0] != "ip" for s in alone)
    assert {s.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] for s in alone} == {"127.0.0.1"}
    assert not any("UCX_TLS" in s.env for s in alone)


@pytest.fixture
def root() -> None:
    problem = netns.unavailable()
    if problem:
        pytest.skip(f"hosts as network namespaces cannot be created here: {problem}")


def run_in(host: netns.Host, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(host.command(argv), capture_output=True, text=True, timeout=20)


CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except OSError as exc:
    print(exc.strerror or type(exc).__name__)
"""


def connect(host: netns.Host, address: str, port: int, timeout: float = 2.0) -> str:
    """From inside `host`, a TCP connection to address:port: "connected" or why not."""
    done = run_in(host, sys.executable, "-c", CONNECT, address, str(port), str(timeout))
    return done.stdout.strip()


@pytest.mark.usefixtures("root")
def test_hosts_reach_each_other_over_the_bridge_and_nothing_else() -> None:
    with netns.Hosts(2) as hosts:
        a, b = hosts
        assert netns.NETWORK.overlaps(ipaddress.ip_network(f"{a.address}/32"))
        listener = subprocess.Popen(
            b.command([sys.executable, "-c", LISTEN, b.address]), stdout=subprocess.PIPE, text=True
        )
        try:
            assert listener.stdout is not None
            port = int(listener.stdout.readline())
            assert connect(a, b.address, port) == "connected"
            routes = run_in(a, "ip", "-4", "route", "show").stdout
            assert "default" not in routes and len(routes.strip().splitlines()) == 1, routes
            # nothing outside the bridge: no route to anywhere else
            assert connect(a, "192.0.2.1", 80) == "Network is unreachable"
            # a cut link drops packets, a restored one carries them again
            hosts.cut(b)
            assert connect(a, b.address, port, timeout=1.0) != "connected"
            hosts.restore(b)
            assert connect(a, b.address, port, timeout=5.0) == "connected"
        finally:
            listener.kill()
            listener.wait()
        names = [h.netns for h in hosts]
        bridge = hosts.bridge
    assert not set(names) & set(netns_list())
    assert not Path(f"/sys/class/net/{bridge}").exists()


LISTEN = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
while True:
    server.accept()[0].close()
"""


@pytest.mark.usefixtures("root")
def test_leaving_on_an_error_removes_everything_and_kills_what_ran_inside() -> None:
    with pytest.raises(RuntimeError, match="the test failed"), netns.Hosts(1) as hosts:
        sleeper = subprocess.Popen(hosts[0].command(["sleep", "60"]))
        name, bridge = hosts[0].netns, hosts.bridge
        deadline = time.monotonic() + 10
        while sleeper.pid not in netns._pids(name):  # `ip netns exec` entered it
            assert time.monotonic() < deadline, "the process never ran inside the host"
            time.sleep(0.05)
        raise RuntimeError("the test failed")
    try:
        assert sleeper.wait(timeout=10) != 0  # ended by the clean-up
    finally:
        sleeper.kill()
    assert name not in netns_list()
    assert not Path(f"/sys/class/net/{bridge}").exists()


@pytest.mark.usefixtures("root")
def test_what_a_dead_run_left_is_removed_and_a_live_runs_is_kept() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}{netns._base36(dead.pid)}0-h0"  # a run token of a gone process
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with netns.Hosts(1) as live:  # creating removes what dead runs left
            listed = netns_list()
            assert stale not in listed
            assert netns.remove_stale() == []  # and nothing of a live run
            assert live[0].netns in netns_list()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def netns_list() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def test_a_runs_links_are_read_back_to_its_run_whatever_its_id_holds() -> None:
    """A run id is the creator's pid in base 36 and a count: pid 18758 is "eh2", its sixth
    run "eh25". Its bridge kvpbeh25 once read as run "e" of host "h25", whose owner (pid
    0) is never alive, so a live run's bridge was deleted as stale (CI, 2026-12-02)."""
    for pid in (18758, 1, 35, 36, 4_194_303):
        for count in "05hz":
            run = netns._base36(pid) + count
            names = (f"kvpb{run}", f"kvpv{run}h0", f"kvpi{run}h12")
            assert [netns.link_run(n) for n in names] == [run] * 3
            assert netns._owner(run) == pid
    assert netns.link_run("kvpbeh25") == "eh25"
    for other in ("eth0", "kvpx12", "kvpb", "kvpv12", "docker0", "kvpbEH2"):
        assert netns.link_run(other) is None
