"""The planner's closed-form formulas, checked against the articles' arithmetic."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvpush.plan.model import (
    DenseFlops,
    ModelShape,
    PlanInputs,
    PlannerError,
    PrefillSpeed,
    make_plan,
    max_rate,
    slots_held,
    transfer_seconds,
)
from kvpush.plan.model_config import read_model

QWEN3_32B = ModelShape(layers=64, kv_heads=8, head_dim=128, dtype="bfloat16")


def articles_inputs(**overrides: object) -> PlanInputs:
    values: dict[str, object] = {
        "shape": QWEN3_32B,
        "tp": 8,
        "link_gbps": 50.0,
        "rate": 8.0,
        "input_len": 16000,
        "output_len": 128,
        "tpot_ms": (("pull", 10.4), ("push", 7.0)),
        "max_num_seqs": 8,
        "target_util": 0.8,
    }
    values.update(overrides)
    return PlanInputs(**values)  # type: ignore[arg-type]


def test_kv_bytes_per_token_is_256_kib_for_qwen3_32b() -> None:
    assert QWEN3_32B.kv_bytes_per_token == 256 * 1024
    assert ModelShape(64, 8, 128, "float8_e4m3fn").kv_bytes_per_token == 128 * 1024
    assert ModelShape(64, 8, 128, "torch.float32").kv_bytes_per_token == 512 * 1024


def test_articles_point_transfer_and_slots() -> None:
    plan = make_plan(articles_inputs())
    assert plan.kv_bytes_per_request == 16000 * 262144
    assert plan.kv_bytes_per_request / 1e9 == pytest.approx(4.19, abs=0.01)
    assert plan.transfer_ms == pytest.approx(10.49, abs=0.01)
    pull, push = plan.modes
    assert (pull.label, push.label) == ("pull", "push")
    assert pull.slots_held == pytest.approx(10.65, abs=0.01)
    assert push.slots_held == pytest.approx(7.17, abs=0.01)
    assert pull.headroom_slots < 0 < push.headroom_slots
    assert pull.utilisation == pytest.approx(10.6496 / 8)


def test_max_rate_inverts_littles_law() -> None:
    plan = make_plan(articles_inputs(target_util=1.0))
    for mode in plan.modes:
        assert slots_held(mode.max_rate, 128, mode.tpot_ms / 1e3) == pytest.approx(8.0)
    assert plan.modes[0].max_rate == pytest.approx(8 / (128 * 0.0104))
    assert max_rate(0.8 * 8, 128, 0.007) == pytest.approx(7.14, abs=0.01)
    assert plan.link_utilisation == pytest.approx(8 * transfer_seconds(16000 * 262144, 8, 50))


def test_transfer_uses_decimal_gigabytes_per_gpu() -> None:
    assert transfer_seconds(400e9, tp=8, link_gbps=50) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"rate": -1.0}, "--rate"),
        ({"rate": math.nan}, "--rate"),
        ({"tp": 0}, "--tp"),
        ({"link_gbps": 0.0}, "--link-gbps"),
        ({"input_len": -5}, "--input-len"),
        ({"output_len": 0}, "--output-len"),
        ({"max_num_seqs": 0}, "--max-num-seqs"),
        ({"tpot_ms": ()}, "--tpot-ms"),
        ({"tpot_ms": (("pull", -1.0),)}, "--tpot-ms pull"),
        ({"target_util": 1.5}, "--target-util"),
    ],
)
def test_plan_inputs_reject_bad_values_naming_the_flag(
    overrides: dict[str, object], flag: str
) -> None:
    with pytest.raises(PlannerError, match=f"^{flag}"):
        articles_inputs(**overrides)


def test_shape_rejects_unknown_dtype_and_non_positive_sizes() -> None:
    with pytest.raises(PlannerError, match="unknown dtype 'bf17'; pass --dtype as one of"):
        ModelShape(64, 8, 128, "bf17")
    with pytest.raises(PlannerError, match="--kv-heads must be a positive integer"):
        ModelShape(64, 0, 128, "bf16")
    with pytest.raises(PlannerError, match="--layers"):
        ModelShape(True, 8, 128, "bf16")


def test_qwen3_32b_prefill_speed_from_flops() -> None:
    flops = DenseFlops(
        layers=64, hidden_size=5120, intermediate_size=25600, attn_heads=64, kv_heads=8,
        head_dim=128,
    )  # fmt: skip
    assert flops.matmul_params == pytest.approx(31.21e9, rel=1e-3)
    speed = flops.prefill_speed(tp=8, gpu_tflops=989, mfu=0.4)
    assert speed.tokens_per_s == pytest.approx(50_709, rel=1e-3)
    assert speed.attn_tokens == pytest.approx(59_520)
    assert speed.seconds(16384) == pytest.approx(0.412, abs=0.001)
    with pytest.raises(PlannerError, match="--mfu must be at most 1"):
        flops.prefill_speed(tp=8, gpu_tflops=989, mfu=1.5)


def test_prefill_speed_without_attention_term_is_linear() -> None:
    speed = PrefillSpeed(10_000.0)
    assert speed.seconds(20_000) == pytest.approx(2.0)
    with pytest.raises(PlannerError, match="--prefill-tok-s"):
        PrefillSpeed(0.0)


MODELS = Path(__file__).parent.parent / "data" / "models"


def test_deepseek_v3_is_sized_as_mla_by_vllm() -> None:
    """DeepSeek-V3's published config: one 512+64 latent per layer and token, 61 layers;
    reading its 128 heads as K and V heads would say ~25x more."""
    found = read_model(MODELS / "deepseek-v3")
    assert found.shape.mla and found.shape.kv_bytes_per_token == 61 * 576 * 2 == 70_272
    assert found.flops is None  # mixture of experts: no dense FLOPs
    assert found.shape.shards(8) == 1, "every TP rank holds the whole latent"
    assert read_model(MODELS / "deepseek-v3", kv_dtype="fp8").shape.kv_bytes_per_token == 35_136


def test_a_dense_config_gives_shape_and_flops() -> None:
    found = read_model(MODELS / "qwen3-32b" / "config.json")
    assert found.shape == QWEN3_32B
    assert found.flops is not None and found.flops.attn_width == 8192
    assert found.shape.shards(16) == 8


def test_sliding_window_layers_hold_only_their_window() -> None:
    shape = read_model(MODELS / "mistral-7b-v0.1").shape
    assert (shape.window, shape.window_layers) == (4096, 32)
    per_token = 32 * 2 * 8 * 128 * 2
    assert shape.kv_bytes(1000) == 1000 * per_token
    assert shape.kv_bytes(16_000) == 4096 * per_token


def test_a_model_with_state_layers_counts_its_attention_layers_and_each_requests_states(
    tmp_path: Path,
) -> None:
    """A Qwen3-Next pattern (three gated-delta-net layers to one attending): KV per token
    comes from the attention layer alone, and each request adds its states, as vLLM's model
    class sizes them (per layer: a conv state of 3 x 1,024 in bfloat16 and a recurrent one
    of 4 heads x 128 x 128, float32 on vLLM's CPU backend)."""
    from kvpush.testbed.model import TinyModelSpec, ensure_tiny_model

    spec = TinyModelSpec(arch="qwen3_next", layers=4, heads=4, kv_heads=2, head_dim=64)
    shape = read_model(ensure_tiny_model(tmp_path / "gdn", spec)).shape
    per_state = 3 * 1024 * 2 + 4 * 128 * 128 * 4
    assert (shape.layers, shape.state_layers, shape.state_bytes) == (1, 3, 3 * per_state)
    assert shape.kv_bytes_per_token == 2 * 2 * 64 * 2  # the attention layer's K and V
    assert shape.kv_bytes(1000) == 1000 * 512 + 3 * per_state


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "holds no config.json"),
        ("{not json", "vLLM cannot read"),
    ],
)
def test_model_errors_say_what_to_fix(tmp_path: Path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(PlannerError, match=message):
        read_model(tmp_path)
