"""`kvpush plan` and `kvpush plan simulate` end to end through the real argument parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpush.cli import main

ARTICLES_EXAMPLE = [
    "plan", "--layers", "64", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bfloat16",
    "--tp", "8", "--link-gbps", "50", "--rate", "8", "--input-len", "16000",
    "--output-len", "128", "--tpot-ms", "10.4,7.0", "--max-num-seqs", "8",
]  # fmt: skip


def test_plan_prints_the_articles_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(ARTICLES_EXAMPLE) == 0
    out = capsys.readouterr().out
    assert "256.0 KiB" in out
    assert "4.19 GB" in out
    assert "10.49 ms ideal" in out
    assert "10.65" in out and "7.17" in out
    assert "requests queue for a decode slot" in out


def test_plan_json_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARTICLES_EXAMPLE, "--tpot-ms", "pull=10.4,push=7.0", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["kv_bytes_per_token"] == 262144
    assert body["transfer_ms"] == pytest.approx(10.49, abs=0.01)
    slots = {mode["label"]: mode["slots_held"] for mode in body["modes"]}
    assert slots == pytest.approx({"pull": 10.65, "push": 7.17}, abs=0.01)


def test_plan_reads_a_model_through_vllm_and_flags_override_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    models = Path(__file__).parent.parent / "data" / "models"
    assert main(["plan", "--model", str(models / "deepseek-v3"), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["kv_bytes_per_token"] == 70_272
    assert body["inputs"]["shape"]["mla"] is True
    argv = ["plan", "--model", str(models / "qwen3-32b"), "--layers", "32", "--json"]
    assert main(argv) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["inputs"]["shape"] == {
        "layers": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "dtype": "bfloat16",
        "mla": False,
        "window": None,
        "window_layers": 0,
        "state_layers": 0,
        "state_bytes": 0,
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan"], "missing --layers, --kv-heads, --head-dim, --dtype; pass --model"),
        (["plan", "--preset", "articles", "--rate", "-2"], "--rate must be a positive"),
        (["plan", "--preset", "articles", "--dtype", "fp7"], "unknown dtype 'fp7'"),
        (["plan", "--preset", "articles", "--tpot-ms", "pull=fast"], "not a number"),
        (["plan", "--model", "/no/such/config.json"], "holds no config.json"),
        (["plan", "--model", "x", "--preset", "articles"], "pass only one of them"),
        (
            [
                "plan",
                "simulate",
                "--layers",
                "2",
                "--kv-heads",
                "1",
                "--head-dim",
                "8",
                "--dtype",
                "fp16",
            ],
            "pass --prefill-tok-s",
        ),  # fmt: skip
        (["plan", "simulate", "--preset", "articles", "--rates", "1,-4"], "--rates needs"),
        (["plan", "simulate", "--preset", "articles", "--modes", "pul"], "'pul' is unknown"),
        (["plan", "simulate", "--preset", "articles", "--output-len", "1"], "at least 2"),
    ],
)
def test_bad_input_exits_2_naming_the_fix(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpush plan: error:")
    assert message in err


def test_simulate_prints_a_table_per_mode(capsys: pytest.CaptureFixture[str]) -> None:
    argv = "plan simulate --preset articles --rates 1,8 --input-lens 1024 --num-prompts 40"
    assert main(argv.split()) == 0
    captured = capsys.readouterr()
    assert "[4/4] input 1024, 8 req/s, push" in captured.err
    lines = captured.out.splitlines()
    header = next(line for line in lines if line.startswith("input"))
    assert "TTFT mean" in header and "TPOT mean" in header
    assert sum(line.startswith("1024 ") for line in lines) == 4


def test_simulate_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "sim.png"
    argv = (
        "plan simulate --preset articles --rates 1,2 --input-lens 1024,4096 "
        f"--num-prompts 20 --seed 3 --json --plot {plot}"
    )
    assert main(argv.split()) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["params"]["seed"] == 3
    assert body["params"]["prefill"]["tokens_per_s"] == pytest.approx(50_709, rel=1e-3)
    assert len(body["results"]) == 8
    assert {result["mode"] for result in body["results"]} == {"pull", "push"}
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_flags_before_simulate_are_kept(capsys: pytest.CaptureFixture[str]) -> None:
    argv = "plan --preset articles --tp 4 simulate --rates 1 --input-lens 512 --num-prompts 5"
    assert main([*argv.split(), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"]["tp"] == 4


def test_simulate_with_measured_prefill_speed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = (
        "plan simulate --layers 64 --kv-heads 8 --head-dim 128 --dtype bf16 "
        "--prefill-tok-s 40000 --rates 2 --input-lens 2048 --num-prompts 20 --json"
    )
    assert main(argv.split()) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["params"]["prefill"] == {
        "tokens_per_s": 40000.0,
        "attn_tokens": None,
        "fixed_s": 0.0,
    }
    assert body["results"][0]["prefill_load"] == pytest.approx(2 * 2048 / 40000)
