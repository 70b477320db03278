"""Closed-form capacity formulas for the prefill -> decode KV handoff.

Everything here is arithmetic on a model's shape and a deployment's numbers; no I/O, no
randomness, no time (`kvpush.plan.model_config` reads a model's shape through vLLM). The
formulas are the ones the articles use:

- KV bytes per token = layers x 2 (K and V) x KV heads x head dim x dtype bytes; for MLA
  (DeepSeek-V2/V3, Kimi) one latent vector per layer, layers x latent width x dtype bytes;
  sliding-window layers hold at most their window's tokens.
- ideal transfer time = request KV bytes / (shards x per-GPU link bandwidth): every TP rank
  sends its own shard over its own link at the same time; MLA's latent (and KV heads fewer
  than ranks) is replicated, so fewer shards than ranks. Link speeds are decimal GB/s.
- decode slots held (Little's law) = request rate x output tokens x TPOT; a request holds
  one of `--max-num-seqs` slots for as long as it generates.
- the highest rate a TPOT sustains under a utilisation target is the inverse of that.

It also estimates prefill speed of a dense transformer from FLOPs (used by the simulator):
a prefill of n tokens costs n x (2 x matmul params + 2 x layers x attention width x n)
FLOPs, the second term being causal attention (QK^T and AV over n/2 keys on average).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpush.args import UsageError

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
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}


class PlannerError(UsageError):
    """Invalid planner input; the message names the flag or file to fix."""


def check_positive(name: str, value: float, fix: str) -> None:
    if not value > 0 or not math.isfinite(value):
        raise PlannerError(f"{name} must be a positive number (got {value!r}); {fix}")


def check_non_negative(name: str, value: float, fix: str) -> None:
    if not value >= 0 or not math.isfinite(value):
        raise PlannerError(f"{name} must be a finite number >= 0 (got {value!r}); {fix}")


def check_positive_int(name: str, value: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlannerError(f"{name} must be a positive integer (got {value!r}); {fix}")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a KV dtype name as HF configs and vLLM spell it."""
    try:
        return DTYPE_BYTES[dtype.lower().removeprefix("torch.")]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise PlannerError(f"unknown dtype {dtype!r}; pass --dtype as one of: {known}") from None


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The part of a model's shape that sizes its KV cache.

    `mla`: one latent vector of `head_dim` per layer and token (`kv_heads` is 1), not a K
    and a V per head. `window_layers` of the `layers` keep only the last `window` tokens.
    `layers` counts attention layers: a hybrid model's state layers (Mamba, linear
    attention) keep `state_bytes` per request between them, whatever its length.
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    mla: bool = False
    window: int | None = None
    window_layers: int = 0
    state_layers: int = 0
    state_bytes: int = 0

    def __post_init__(self) -> None:
        check_positive_int("--layers", self.layers, "pass the model's num_hidden_layers")
        check_positive_int("--kv-heads", self.kv_heads, "pass num_key_value_heads")
        check_positive_int("--head-dim", self.head_dim, "pass the attention head size")
        dtype_bytes(self.dtype)
        if self.window is not None:
            check_positive_int("sliding window", self.window, "check the model config")
        if not 0 <= self.window_layers <= self.layers:
            raise PlannerError(
                f"{self.window_layers} sliding-window layers of {self.layers}; check the config"
            )

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def layer_bytes_per_token(self) -> int:
        planes = 1 if self.mla else 2
        return planes * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token adds while the prompt fits every window."""
        return self.layers * self.layer_bytes_per_token

    def shards(self, tp: int) -> int:
        """How many TP ranks hold distinct KV (the rest replicate it): an MLA latent is
        whole on every rank, and fewer KV heads than ranks are shared by several."""
        return 1 if self.mla else min(tp, self.kv_heads)

    def kv_bytes(self, tokens: int) -> int:
        """KV bytes of a `tokens`-long prompt: sliding-window layers hold their window,
        state layers their states."""
        full = (self.layers - self.window_layers) * tokens
        windowed = self.window_layers * min(tokens, self.window or tokens)
        return (full + windowed) * self.layer_bytes_per_token + self.state_bytes


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
            raise PlannerError(f"--mfu must be at most 1 (got {mfu}); it is a fraction of peak")
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
            raise PlannerError(f"--prefill-attn-tokens must be > 0 (got {self.attn_tokens!r})")
        check_non_negative("--prefill-fixed-ms", self.fixed_s, "pass ms per prompt")

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + tokens / self.tokens_per_s * (1 + tokens / self.attn_tokens)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """A model's KV shape, and FLOPs when the model is dense (see `model_config`)."""

    shape: ModelShape
    flops: DenseFlops | None


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
            raise PlannerError(
                "--tpot-ms is empty; pass one TPOT per mode, e.g. pull=10.4,push=7.0"
            )
        for label, tpot in self.tpot_ms:
            check_positive(f"--tpot-ms {label}", tpot, "pass TPOT in milliseconds")
        if not 0 < self.target_util <= 1:
            raise PlannerError(
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
    per_request = inputs.shape.kv_bytes(inputs.input_len)
    # every rank moves its own KV over its own link: a shard of it, or all of a replica
    transfer_s = transfer_seconds(per_request, inputs.shape.shards(inputs.tp), inputs.link_gbps)
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
