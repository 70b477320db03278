"""A model's KV shape as vLLM sees it: `kvpush plan --model DIR` asks vLLM, not the JSON.

vLLM knows what a config means for the KV cache: which models use MLA (one 576-wide latent
per layer and token for DeepSeek-V3, not 128 heads x 2 x 56), their head size, how many
layers slide over a window, and the KV cache dtype. Reading that from vLLM's
`ModelConfig` (no weights, no tokenizer, nothing downloaded) keeps the planner's numbers
the ones the servers will allocate.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvpush.plan.model import DenseFlops, ModelFacts, ModelShape, PlannerError

_FIX = "pass --model as a local model directory holding config.json, or give the shape flags"
# vLLM's --kv-cache-dtype names with their byte size (auto: the model's dtype)
KV_CACHE_DTYPES = {"fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "bfloat16": "bfloat16",
                   "float16": "float16", "float32": "float32"}  # fmt: skip


def read_model(path: str | Path, kv_dtype: str | None = None) -> ModelFacts:
    """The KV shape (and dense FLOPs) of the model in `path` (a directory or its
    config.json), through vLLM's ModelConfig; `kv_dtype` overrides the KV cache dtype."""
    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    if not (folder / "config.json").is_file():
        raise PlannerError(f"{str(path)!r} holds no config.json; {_FIX}")
    try:
        from vllm.config import ModelConfig
    except ImportError:
        raise PlannerError(
            "reading a model's KV size needs vLLM (pip install vllm); or give "
            "--layers/--kv-heads/--head-dim/--dtype"
        ) from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory; never the hub
    try:
        config = ModelConfig(model=str(folder), skip_tokenizer_init=True)
    except Exception as exc:  # vLLM raises many kinds for a config it cannot read
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PlannerError(f"vLLM cannot read {str(folder)!r}: {first}; {_FIX}") from None
    return facts_of(config, kv_dtype)


def facts_of(config: Any, kv_dtype: str | None = None) -> ModelFacts:
    """`ModelFacts` from a vLLM `ModelConfig`."""
    dtype = kv_dtype or str(config.dtype).removeprefix("torch.")
    layers = config.get_total_num_hidden_layers()
    head_size = config.get_head_size()
    mla = bool(config.use_mla)
    window = config.get_sliding_window()
    text = config.hf_text_config
    window_layers = 0
    if window:
        types = getattr(text, "layer_types", None)
        window_layers = (
            sum(1 for t in types if "sliding" in str(t)) if isinstance(types, list) else layers
        )
    attention, state_layers, state_bytes = layers, 0, 0
    if getattr(config, "is_hybrid", False):
        attention, state_layers, state_bytes = _states(config, layers)
    shape = ModelShape(
        layers=attention,
        kv_heads=1 if mla else config.get_total_num_kv_heads(),
        head_dim=head_size,
        dtype=dtype,
        mla=mla,
        window=window or None,
        window_layers=window_layers,
        state_layers=state_layers,
        state_bytes=state_bytes,
    )
    flops = None
    intermediate = getattr(text, "intermediate_size", None)
    if not mla and config.get_num_experts() == 0 and isinstance(intermediate, int):
        flops = DenseFlops(
            layers=layers,
            hidden_size=config.get_hidden_size(),
            intermediate_size=intermediate,
            attn_heads=config.model_arch_config.total_num_attention_heads,
            kv_heads=config.get_total_num_kv_heads(),
            head_dim=head_size,
        )
    return ModelFacts(shape, flops)


def _states(config: Any, layers: int) -> tuple[int, int, int]:
    """A hybrid model's attention layers, state layers and one request's state bytes (all
    its state layers, TP 1), as vLLM's model class sizes them."""
    import math

    from vllm.config import ParallelConfig, VllmConfig
    from vllm.model_executor.models import ModelRegistry

    attention = config.get_num_layers_by_block_type(ParallelConfig(), "attention")
    try:
        model_class: Any  # a hybrid model's class sizes its states (vLLM's IsHybrid)
        model_class, _ = ModelRegistry.resolve_model_cls(config.architectures, model_config=config)
        vllm_config = VllmConfig(model_config=config)
        shapes = model_class.get_mamba_state_shape_from_config(vllm_config)
        dtypes = model_class.get_mamba_state_dtype_from_config(vllm_config)
    except Exception as exc:  # vLLM's own errors for a config it cannot size
        raise PlannerError(f"vLLM could not size the state layers of {config.model}: {exc}; "
                           f"{_FIX}") from None  # fmt: skip
    pairs = zip(shapes, dtypes, strict=True)
    per_layer = sum(math.prod(shape) * dtype.itemsize for shape, dtype in pairs)
    return attention, layers - attention, (layers - attention) * per_layer
