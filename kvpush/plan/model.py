"""Closed-form capacity formulas for the prefill -> decode KV handoff.

Everything here is arithmetic on a model's shape and a deployment's numbers; no I/O except
`read_hf_config`, no randomness, no time. The formulas are the ones the articles use:

- KV bytes per token = layers x 2 (K and V) x KV heads x head dim x dtype bytes.
- ideal transfer time = request KV bytes / (TP x per-GPU link bandwidth): every TP rank
  sends its own shard over its own link at the same time. Link speeds are decimal GB/s.
- decode slots held (Little's law) = request rate x output tokens x TPOT; a request holds
  one of `--max-num-seqs` slots for as long as it generates.
- the highest rate a TPOT sustains under a utilisation target is the inverse of that.

It also estimates prefill speed of a dense transformer from FLOPs (used by the simulator):
a prefill of n tokens costs n x (2 x matmul params + 2 x layers x attention width x n)
FLOPs, the second term being causal attention (QK^T and AV over n/2 keys on average).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 1e9
KIB = 1024

DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}


class PlanError(ValueError):
    """Invalid planner input; the message names the flag or file to fix."""


def check_positive(name: str, value: float, fix: str) -> None:
    if not value > 0 or not math.isfinite(value):
        raise PlanError(f"{name} must be a positive number (got {value!r}); {fix}")


def check_non_negative(name: str, value: float, fix: str) -> None:
    if not value >= 0 or not math.isfinite(value):
        raise PlanError(f"{name} must be a finite number >= 0 (got {value!r}); {fix}")


def check_positive_int(name: str, value: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{name} must be a positive integer (got {value!r}); {fix}")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a KV dtype name as HF configs and vLLM spell it."""
    try:
        return DTYPE_BYTES[dtype.lower().removeprefix("torch.")]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise PlanError(f"unknown dtype {dtype!r}; pass --dtype as one of: {known}") from None


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The part of a model's shape that sizes its KV cache."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        check_positive_int("--layers", self.layers, "pass the model's num_hidden_layers")
        check_positive_int("--kv-heads", self.kv_heads, "pass num_key_value_heads")
        check_positive_int("--head-dim", self.head_dim, "pass the attention head size")
        dtype_bytes(self.dtype)

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class DenseFlops:
    """The part of a dense transformer's shape that sets its prefill FLOPs."""

    layers: int
    hidden_size: int
    intermediate_size: int
    attn_heads: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("layers", "hidden_size", "intermediate_size", "attn_heads", "kv_heads"):
            check_positive_int(name, getattr(self, name), "check the model config")
        check_positive_int("head_dim", self.head_dim, "check the model config")

    @property
    def attn_width(self) -> int:
        return self.attn_heads * self.head_dim

    @property
    def matmul_params(self) -> int:
        """Weights every prompt token multiplies: Q, K, V, O and a gated (3-matrix) MLP."""
        attn = 2 * self.hidden_size * self.attn_width
        attn += 2 * self.hidden_size * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.layers * (attn + mlp)

    def prefill_speed(self, tp: int, gpu_tflops: float, mfu: float) -> PrefillSpeed:
        """Prefill speed on `tp` GPUs of `gpu_tflops` dense peak each, run at `mfu` of peak."""
        check_positive_int("--tp", tp, "pass the tensor-parallel size")
        check_positive("--gpu-tflops", gpu_tflops, "pass the dense peak TFLOP/s per GPU")
        check_positive("--mfu", mfu, "pass the fraction of peak prefill sustains")
        if mfu > 1:
            raise PlanError(f"--mfu must be at most 1 (got {mfu}); it is a fraction of peak")
        flops = tp * gpu_tflops * 1e12 * mfu
        return PrefillSpeed(
            tokens_per_s=flops / (2 * self.matmul_params),
            attn_tokens=self.matmul_params / (self.layers * self.attn_width),
        )


@dataclass(frozen=True, slots=True)
class PrefillSpeed:
    """Prefill time of n tokens = fixed_s + n / tokens_per_s x (1 + n / attn_tokens).

    `tokens_per_s` is the rate on matmuls alone; `attn_tokens` is the prompt length at which
    causal attention costs as many FLOPs per token as the matmuls (inf: ignore attention);
    `fixed_s` is what a prompt costs whatever its length (an engine step's own overhead,
    which a small model on a CPU core makes visible; 0 in a FLOPs estimate).
    """

    tokens_per_s: float
    attn_tokens: float = math.inf
    fixed_s: float = 0.0

    def __post_init__(self) -> None:
        check_positive("--prefill-tok-s", self.tokens_per_s, "pass prefill tokens/s")
        if not self.attn_tokens > 0:
            raise PlanError(f"--prefill-attn-tokens must be > 0 (got {self.attn_tokens!r})")
        check_non_negative("--prefill-fixed-ms", self.fixed_s, "pass ms per prompt")

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + tokens / self.tokens_per_s * (1 + tokens / self.attn_tokens)


@dataclass(frozen=True, slots=True)
class HfModel:
    """What `read_hf_config` found: the KV shape, and FLOPs when the model is dense."""

    shape: ModelShape
    flops: DenseFlops | None


def read_hf_config(path: str | Path, dtype: str | None = None) -> HfModel:
    """Read a Hugging Face config.json (or a directory holding one).

    `dtype` overrides the config's torch_dtype (or dtype); a multimodal config's
    `text_config` is used when the top level has no layer count. Mixture-of-experts
    configs yield no `flops`, since their active parameters are not the dense count.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    fix = "pass --model as a Hugging Face config.json (or its folder), or give the shape flags"
    try:
        raw = json.loads(file.read_text())
    except OSError as exc:
        raise PlanError(f"cannot read model config {str(file)!r}: {exc.strerror}; {fix}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise PlanError(f"{str(file)!r} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{str(file)!r} is not a JSON object; {fix}")
    cfg: dict[str, Any] = raw
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}

    def field(name: str) -> int:
        value = cfg.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PlanError(f"{str(file)!r} has no positive integer {name!r}; {fix}")
        return value

    layers = field("num_hidden_layers")
    attn_heads = field("num_attention_heads")
    kv_heads = field("num_key_value_heads") if "num_key_value_heads" in cfg else attn_heads
    if cfg.get("head_dim") is not None:
        head_dim = field("head_dim")
    else:
        head_dim = field("hidden_size") // attn_heads
    model_dtype = dtype or cfg.get("torch_dtype") or cfg.get("dtype")
    if not isinstance(model_dtype, str):
        raise PlanError(f"{str(file)!r} names no torch_dtype; pass --dtype (e.g. bfloat16)")
    shape = ModelShape(layers, kv_heads, head_dim, model_dtype)
    moe = any(key in cfg for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    flops = None
    if not moe and "hidden_size" in cfg and "intermediate_size" in cfg:
        flops = DenseFlops(
            layers=layers,
            hidden_size=field("hidden_size"),
            intermediate_size=field("intermediate_size"),
            attn_heads=attn_heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
        )
    return HfModel(shape, flops)


def transfer_seconds(nbytes: float, tp: int, link_gbps: float) -> float:
    """Ideal time to move `nbytes` split evenly over `tp` links of `link_gbps` GB/s each."""
    return nbytes / (tp * link_gbps * GB)


def slots_held(rate: float, output_len: int, tpot_s: float) -> float:
    """Little's law: mean decode slots occupied = arrival rate x time each holds one."""
    return rate * output_len * tpot_s


def max_rate(slots: float, output_len: int, tpot_s: float) -> float:
    """The request rate at which `slots` slots are held on average."""
    return slots / (output_len * tpot_s)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """A deployment and workload to size; `tpot_ms` is (label, TPOT ms) per mode."""

    shape: ModelShape
    tp: int
    link_gbps: float
    rate: float
    input_len: int
    output_len: int
    tpot_ms: tuple[tuple[str, float], ...]
    max_num_seqs: int
    target_util: float

    def __post_init__(self) -> None:
        check_positive_int("--tp", self.tp, "pass the tensor-parallel size")
        check_positive("--link-gbps", self.link_gbps, "pass GB/s per GPU (articles: 50)")
        check_positive("--rate", self.rate, "pass the request rate in req/s")
        check_positive_int("--input-len", self.input_len, "pass prompt tokens per request")
        check_positive_int("--output-len", self.output_len, "pass output tokens per request")
        check_positive_int("--max-num-seqs", self.max_num_seqs, "pass decode's --max-num-seqs")
        if not self.tpot_ms:
            raise PlanError("--tpot-ms is empty; pass one TPOT per mode, e.g. pull=10.4,push=7.0")
        for label, tpot in self.tpot_ms:
            check_positive(f"--tpot-ms {label}", tpot, "pass TPOT in milliseconds")
        if not 0 < self.target_util <= 1:
            raise PlanError(
                f"--target-util must be in (0, 1] (got {self.target_util}); e.g. 0.8 for 80 %"
            )


@dataclass(frozen=True, slots=True)
class ModeCapacity:
    label: str
    tpot_ms: float
    slots_held: float
    utilisation: float
    headroom_slots: float
    max_rate: float


@dataclass(frozen=True, slots=True)
class Plan:
    inputs: PlanInputs
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    transfer_ms: float
    link_utilisation: float
    link_max_rate: float
    modes: tuple[ModeCapacity, ...]


def make_plan(inputs: PlanInputs) -> Plan:
    per_token = inputs.shape.kv_bytes_per_token
    per_request = per_token * inputs.input_len
    transfer_s = transfer_seconds(per_request, inputs.tp, inputs.link_gbps)
    modes = []
    for label, tpot in inputs.tpot_ms:
        held = slots_held(inputs.rate, inputs.output_len, tpot / 1e3)
        modes.append(
            ModeCapacity(
                label=label,
                tpot_ms=tpot,
                slots_held=held,
                utilisation=held / inputs.max_num_seqs,
                headroom_slots=inputs.max_num_seqs - held,
                max_rate=max_rate(
                    inputs.target_util * inputs.max_num_seqs, inputs.output_len, tpot / 1e3
                ),
            )
        )
    return Plan(
        inputs=inputs,
        kv_bytes_per_token=per_token,
        kv_bytes_per_request=per_request,
        transfer_ms=transfer_s * 1e3,
        link_utilisation=inputs.rate * transfer_s,
        link_max_rate=inputs.target_util / transfer_s,
        modes=tuple(modes),
    )
