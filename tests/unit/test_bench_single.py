"""The `single` setup: one plain vLLM server on the pair's cores, the load straight to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush.bench import compare, plot, sweep
from kvpush.bench.compare import LoadSpec
from kvpush.bench.results import Aggregate, Point
from kvpush.cli import build_parser, main
from kvpush.plan.measure import MeasureSpec
from kvpush.plan.model import PlannerError
from kvpush.proxy.stub import StubBackend, StubBehaviour, serve_stub
from kvpush.testbed.topology import SINGLE, PairSettings, Topology, check_setups, first_token_of
from tests.node_kv import free_port


def pair(tmp_path: Path, port: int = 9000) -> PairSettings:
    (tmp_path / "config.json").write_text("{}")
    return PairSettings(tmp_path, workdir=tmp_path / "w", port=port)


def test_single_is_one_plain_server_on_the_cores_of_the_pair(tmp_path: Path) -> None:
    config = pair(tmp_path).topology(SINGLE, "sweep", timed_hooks=True)
    assert config.setup is None and not config.timed_hooks  # no connector to time
    assert config.workdir == tmp_path / "w" / "sweep" / SINGLE
    topology = Topology(config, cores=[0, 1, 2])
    (server,) = topology.specs
    assert (server.name, server.role, server.port) == ("single-0", "single", 9300)
    assert server.cores == [0, 1]
    assert "--kv-transfer-config" not in server.argv
    assert server.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert topology.client_cores == [2]
    paired = Topology(pair(tmp_path).topology("kvpush-push", "sweep"), cores=[0, 1, 2])
    assert sorted(c for s in paired.specs for c in s.cores) == server.cores


def test_single_is_a_benchmark_setup_but_not_a_plan_one(tmp_path: Path) -> None:
    check_setups(["kvpush-push", SINGLE])
    args = build_parser().parse_args(["bench", "sweep"])
    assert args.setups.split(",")[-1] == SINGLE
    assert SINGLE in build_parser().parse_args(["bench", "compare"]).setups.split(",")
    assert SINGLE not in build_parser().parse_args(["bench", "hooks"]).setups.split(",")
    assert SINGLE in build_parser().parse_args(["demo"]).setups.split(",")
    with pytest.raises(PlannerError, match="no handoff to measure"):
        MeasureSpec(pair(tmp_path), [SINGLE, "kvpush-push"], [256], tmp_path / "p.json")


def test_a_sweep_sends_the_single_setups_load_straight_to_its_server(tmp_path: Path) -> None:
    topology = Topology(pair(tmp_path).topology(SINGLE, "sweep"), cores=[0, 1])
    with sweep.front(topology, 9000, 30.0) as target:
        assert isinstance(target, sweep.Direct) and target.url == "http://127.0.0.1:9300"
    assert sweep.server_urls(topology) == {"single": "http://127.0.0.1:9300"}
    paired = Topology(pair(tmp_path).topology("kvpush-pull", "sweep"), cores=[0, 1])
    assert isinstance(sweep.front(paired, 9000, 30.0), sweep.ProxyThread)
    assert sweep.server_urls(paired) == {
        "decode": "http://127.0.0.1:9200",
        "prefill": "http://127.0.0.1:9100",
    }


async def test_compare_streams_the_single_setups_requests_to_its_server(tmp_path: Path) -> None:
    stub = StubBackend("single", StubBehaviour(tokens=("a", "b", "c")))
    runner, url = await serve_stub(stub)
    try:
        port = int(url.rsplit(":", 1)[1])
        topology = Topology(pair(tmp_path, port=port - 300).topology(SINGLE, "compare"), [0, 1])
        assert topology.specs[0].url == url
        load = LoadSpec(requests=3, concurrency=2, output_len=3, request_timeout=10.0)
        report = await compare._drive(topology, SINGLE, 1, load, ["p0", "p1", "p2"])
    finally:
        await runner.cleanup()
    assert report.status == "ok" and len(report.results) == 3
    assert set(report.texts.values()) == {"abc"}
    bodies = [body for _, body in stub.received if body.get("prompt") != "warm up"]
    assert len(bodies) == 3 and all("kv_transfer_params" not in b for b in bodies)
    assert all(b["stream"] for b in bodies)  # the client's own requests, unchanged


def test_the_table_keeps_ratios_to_vllm_and_adds_a_column_against_single() -> None:
    def row(setup: str, ttft: float, tpot: float) -> Aggregate:
        return Aggregate(setup, 256, 4.0, 1, 1, ["ok"], [], ttft, 2 * ttft, tpot, 2 * tpot, 4.0)

    rows = [row("kvpush-push", 30.0, 4.0), row("vllm-pull", 60.0, 8.0), row(SINGLE, 20.0, 5.0)]
    text = plot.table(rows)
    header = text.splitlines()[0].split()
    assert header[-4:] == ["TTFT/vLLM", "TPOT/vLLM", "TTFT/single", "TPOT/single"]
    cells = {line.split()[2]: line.split() for line in text.splitlines()[1:4]}
    assert cells["kvpush-push"][-4:] == ["0.50x", "0.50x", "1.50x", "0.80x"]
    assert cells[SINGLE][-4:] == ["0.33x", "0.62x", "1.00x", "1.00x"]  # a row of its own
    assert "X/single" in text and "above 1.00x disaggregating costs" in text
    assert plot.line_style(SINGLE) == "-."
    fig = plot.figure(rows)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert SINGLE in labels


def test_kvpush_can_be_measured_with_its_first_token_from_decode(tmp_path: Path) -> None:
    """`--first-token decode` runs kvpush's setups in vLLM's order (the articles'); prefill
    is refused for a setup whose decode cannot reproduce prefill's token, before anything
    starts; each result file records where the first token came from."""
    assert first_token_of("kvpush-push") == first_token_of("kvpush-pull") == "prefill"
    assert first_token_of("kvpush-push", "decode") == "decode"
    assert first_token_of("vllm-pull") == first_token_of("vllm-pull", "decode") == "decode"
    assert first_token_of(SINGLE, "decode") is None  # no proxy
    with pytest.raises(ValueError, match="vllm-pull's decode cannot reproduce"):
        first_token_of("vllm-pull", "prefill")
    settings = pair(tmp_path)
    with pytest.raises(ValueError, match="--first-token prefill: setup vllm-pull-nospin"):
        sweep.SweepSpec(
            ["kvpush-push", "vllm-pull-nospin"], [1.0], [256], 8, 4, 1, tmp_path, settings,
            first_token="prefill",
        )  # fmt: skip
    spec = sweep.SweepSpec(
        ["kvpush-push", "vllm-pull", SINGLE], [1.0], [256], 8, 4, 1, tmp_path, settings,
        first_token="decode",
    )  # fmt: skip
    heads = {}
    for setup in spec.setups:
        topology = Topology(settings.topology(setup, "sweep"), cores=[0, 1])
        heads[setup] = sweep.record_head(spec, Point(1, setup, 256, 1.0, 8), topology)
    assert {s: h["first_token"] for s, h in heads.items()} == {
        "kvpush-push": "decode",
        "vllm-pull": "decode",
        SINGLE: None,
    }
    default = sweep.SweepSpec(["kvpush-push"], [1.0], [256], 8, 4, 1, tmp_path, settings)
    topology = Topology(settings.topology("kvpush-push", "sweep"), cores=[0, 1])
    point = Point(1, "kvpush-push", 256, 1.0, 8)
    assert sweep.record_head(default, point, topology)["first_token"] == "prefill"
    # the proxy the sweep starts takes it from where it was told
    for asked, used in ((None, "prefill"), ("decode", "decode")):
        with sweep.front(topology, free_port(), 30.0, asked) as proxy:
            assert isinstance(proxy, sweep.ProxyThread)
            assert proxy._proxy().config.first_token == used


def test_first_token_from_prefill_for_vllms_connector_is_refused_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")
    out = tmp_path / "out"
    argv = ["bench", "sweep", "--setups", "kvpush-push,vllm-pull", "--first-token", "prefill"]
    assert main([*argv, "--model", str(tmp_path), "--out", str(out), "--no-plot"]) == 2
    assert "setup vllm-pull's decode cannot reproduce prefill's token" in capsys.readouterr().err
    assert not list(out.glob("*.json"))  # nothing ran
    up = ["up", "--connector", "vllm-pull", "--first-token", "prefill", "--model", str(tmp_path)]
    assert main([*up, "--workdir", str(tmp_path / "w")]) == 2
    assert "Leave --first-token out" in capsys.readouterr().err
    assert build_parser().parse_args(["bench", "sweep"]).first_token is None
