"""vLLM-built KV caches for tests: the views vLLM 0.32's model runner hands a connector.

`build` places the layers with vLLM's `get_kv_cache_config_from_groups` and makes the
per-layer views with `allocate_kv_cache`, for any `KVCacheLayout`, then lets kvpush read
them (`kvpush.vllm.layout`). Tests compare through vLLM's views, never kvpush's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvpush.core.planning import KVLayout
from kvpush.vllm.layout import KVCacheFacts, describe_kv_caches, kv_cache_facts

FP8 = torch.float8_e4m3fn


def attention(
    heads: int, head_size: int, block_size: int = 16, dtype: torch.dtype = torch.bfloat16
) -> FullAttentionSpec:
    quant = KVQuantMode.FP8_PER_TENSOR if dtype == FP8 else KVQuantMode.NONE
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=dtype,
        kv_quant_mode=quant,
    )


def mla(block_size: int = 16, dtype: torch.dtype = torch.bfloat16) -> MLAAttentionSpec:
    """DeepSeek-V2/V3: a 512-wide latent plus a 64-wide rotary key, one per token."""
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=576,
        dtype=dtype,
        max_tp_shards=1,
        cache_dtype_str="auto",
    )


@dataclass
class Cache:
    """One rank's KV cache as vLLM builds it, and kvpush's reading of it."""

    config: KVCacheConfig
    views: dict[str, torch.Tensor]
    facts: KVCacheFacts
    layout: KVLayout
    memory: tuple[tuple[int, int], ...]
    ratio: int  # kernel blocks per scheduler block
    layout_name: str

    @property
    def buffer(self) -> torch.Tensor:
        """The whole backing allocation as bytes."""
        storage = next(iter(self.views.values())).untyped_storage()
        return torch.empty(0, dtype=torch.uint8).set_(storage)

    def block_bytes(
        self, name: str, block: int, target: torch.Tensor | None = None
    ) -> torch.Tensor:
        """vLLM's view of scheduler block `block` of layer `name`, as bytes of `target`
        (default: the cache itself): [kernel blocks, heads, tokens, content bytes]."""
        view = self.views[name]
        elem = view.element_size()
        storage = self.buffer if target is None else target
        grouped = torch.as_strided(
            storage,
            size=(view.shape[0], view.shape[1], view.shape[2], view.shape[3] * elem),
            stride=(*(s * elem for s in view.stride()[:3]), 1),
            storage_offset=view.storage_offset() * elem,
        )
        return grouped[block * self.ratio : (block + 1) * self.ratio]

    def tokens(self, name: str, blocks: list[int], count: int, heads: slice) -> torch.Tensor:
        """The first `count` tokens held in `blocks`, as [tokens, heads, content bytes]."""
        parts = [self.block_bytes(name, b) for b in blocks]
        whole = torch.cat([p.permute(0, 2, 1, 3).flatten(0, 1) for p in parts])
        return whole[:count, heads].clone()

    def all_tokens(self, blocks: list[int], count: int) -> torch.Tensor:
        """`tokens` of every layer, stacked: [layers, tokens, heads, content bytes]."""
        return torch.stack(
            [self.tokens(name, blocks, count, slice(None)) for name in self.facts.layer_names]
        )


def build(
    spec: Any,
    layout: KVCacheLayout,
    kernel_block_size: int | None = None,
    tp_size: int = 1,
    model_kv_heads: int | None = None,
    cache_dtype: str = "auto",
    num_blocks: int = 6,
    layers: int = 3,
    packed: bool = False,
    window: int = 0,
    states: int = 0,
) -> Cache:
    """`window`: a hybrid model (vLLM's hybrid KV cache manager), its odd layers attending
    through a sliding window of that many tokens, each kind a KV cache group of its own.
    `states`: a hybrid model whose layers keep a state per request (Mamba, linear
    attention) but every `states`-th, which attends, as Qwen3-Next (`states` 4): a state
    group per attention layer's count of them, as vLLM groups them (prefix caching's
    "align" mode: blocks of the attention layers' tokens, each page one size)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    groups = [KVCacheGroupSpec(names, spec)]
    if states:
        full = names[states - 1 :: states]
        linear = [f"model.layers.{i}.linear_attn" for i in range(layers)
                  if i % states != states - 1]  # fmt: skip
        page = spec.page_size_bytes
        state = state_spec(spec.block_size, page)
        groups = [KVCacheGroupSpec(linear[g :: states - 1], state) for g in range(states - 1)]
        groups.append(KVCacheGroupSpec(full, spec))
    if window:
        windowed = SlidingWindowSpec(
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            dtype=spec.dtype,
            kv_quant_mode=spec.kv_quant_mode,
            sliding_window=window,
        )
        groups = [KVCacheGroupSpec(names[::2], spec), KVCacheGroupSpec(names[1::2], windowed)]
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=num_blocks,
            prefix_cache_retention_interval=None,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
    )
    config = get_kv_cache_config_from_groups(
        vllm_config,  # type: ignore[arg-type]
        groups,
        available_memory=1 << 40,
    )
    kernel = kernel_block_size or spec.block_size
    kernels = [kernel if isinstance(g.kv_cache_spec, FullAttentionSpec) or not states
               else spec.block_size for g in groups]  # fmt: skip
    views = allocate_kv_cache(config, torch.device("cpu"), layout, kernels)
    facts = kv_cache_facts(
        config,
        model="m",
        tp_size=tp_size,
        model_kv_heads=model_kv_heads or spec.num_kv_heads * tp_size,
        cache_dtype=cache_dtype,
    )
    described, memory = describe_kv_caches(facts, views, layout.name, packed)
    return Cache(config, views, facts, described, memory, spec.block_size // kernel, layout.name)


def state_spec(block_size: int, page: int) -> MambaSpec:
    """A gated-delta-net layer's state (conv then recurrent state) padded to `page`."""
    return MambaSpec(
        block_size=block_size,
        shapes=((3, 96), (2, 16, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=page,
        mamba_cache_mode="align",
    )


def state_bytes(cache: Cache, name: str, block: int, target: torch.Tensor | None = None) -> Any:
    """Block `block`'s state of state layer `name`, as the bytes of `target` (default: the
    cache itself) vLLM's view gives it."""
    view = cache.views[name]
    storage = cache.buffer if target is None else target
    elem = view.element_size()
    start = (view.storage_offset() + block * view.stride(0)) * elem
    return storage[start : start + view.shape[3] * elem]


def fill(cache: Cache, seed: int | None) -> None:
    """Random bytes (a seed), or zeros (None), over the whole allocation."""
    if seed is None:
        cache.buffer.zero_()
        return
    generator = torch.Generator().manual_seed(seed)
    cache.buffer.copy_(torch.randint(0, 256, cache.buffer.shape, dtype=torch.uint8,
                                     generator=generator))  # fmt: skip
