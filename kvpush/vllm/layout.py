"""The one place that turns vLLM's KV cache into a `KVLayout`, from what vLLM says it built.

vLLM 0.32 allocates one backing buffer and views it as one 4D tensor per layer with the
logical shape [blocks, heads, tokens, content] (content: K and V of one head of one
token, or MLA's latent vector), in the physical order of the resolved `KVCacheLayout`
(LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC). The facts come from vLLM: the KV cache spec
of the transferable cache groups (block size, heads, content bytes, dtype, whether TP
ranks replicate it; a state layer's state bytes), the resolved layout, and the views'
strides; the views are checked against the layout, never interpreted by shape. What
kvpush cannot move exactly (cache groups of different shapes, per-token quantisation
scales, states kept other than in prefix caching's "align" mode, decode context
parallelism) is refused here, at start, with what is supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpush.core.planning import KVLayout, PlanError

SUPPORTED = (
    "kvpush moves the KV cache of decoder models whose layers keep full attention, MLA or a "
    "sliding window, with or without state (Mamba, linear attention) layers between them "
    "(every vLLM KV cache layout; KV cache dtype auto, bfloat16, float16, float32 or fp8 "
    "with per-tensor scales)"
)
_PLAIN_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
_FP8_ALIASES = {"fp8": "fp8_e4m3", "fp8_inc": "fp8_e4m3"}


class UnsupportedKVCache(ValueError):
    """A KV cache kvpush cannot move exactly; the message names the model and the fix."""


@dataclass(frozen=True, slots=True)
class KVCacheFacts:
    """What vLLM's KV cache config says about the cache kvpush transfers on one rank."""

    group_layers: tuple[tuple[str, ...], ...]  # each transferable group's layers, vLLM's order
    group_ids: tuple[int, ...]  # the transferable groups' indices in vLLM's KV cache config
    block_size: int  # tokens per scheduler block
    num_heads: int  # head slots per rank
    unit_bytes: int  # bytes of one head of one token
    total_heads: int  # distinct KV heads across the TP group
    kv_dtype: str  # what the two sides must agree on, e.g. "bfloat16" or "fp8_e4m3"
    mla: bool
    windowed: bool = False  # a group attends through a sliding window: vLLM drops its blocks
    # groups (positions in `group_layers`) that keep a state per request (Mamba, linear
    # attention): one state in one block, not a token's KV per cell
    state_groups: tuple[int, ...] = ()
    state_bytes: int = 0  # bytes of one layer's state, from the start of its block

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every transferable layer, group by group."""
        return tuple(name for names in self.group_layers for name in names)


def kv_cache_facts(
    kv_cache_config: Any,
    *,
    model: str,
    tp_size: int,
    model_kv_heads: int,
    cache_dtype: str,
    dcp_size: int = 1,
) -> KVCacheFacts:
    """The facts of the transferable KV cache groups; raises `UnsupportedKVCache`.

    Several groups (vLLM's hybrid KV cache manager: full-attention layers in one group,
    sliding-window layers in others) must be attention caches of one shape: their layers
    share vLLM's KV tensors, each group with block ids of its own.

    `model_kv_heads` is the model's total KV head count (vLLM's
    `ModelConfig.get_total_num_kv_heads`), used when heads are fewer than TP ranks.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVQuantMode,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    def refuse(what: str) -> UnsupportedKVCache:
        return UnsupportedKVCache(f"kvpush cannot transfer the KV cache of {model}: {what}. "
                                  f"{SUPPORTED}.")  # fmt: skip

    groups = [(i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups) if g.enable_kv_transfer]
    if not groups:
        raise refuse("it has no KV cache group to transfer")
    specs = []
    for _, group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            uniform = set(spec.kv_cache_specs.values())
            if len(uniform) != 1:
                raise refuse("its layers have different KV cache shapes")
            (spec,) = uniform
        specs.append(spec)
    states = [g for g, spec in enumerate(specs) if isinstance(spec, MambaSpec)]
    attention = [spec for spec in specs if not isinstance(spec, MambaSpec)]
    for spec in attention:
        if type(spec) not in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec):
            hybrid = " (in a hybrid model)" * (len(specs) > 1)
            raise refuse(f"its layers keep a {type(spec).__name__} cache{hybrid}")
        if spec.kv_quant_mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
            raise refuse(f"KV cache dtype {cache_dtype} keeps scales kvpush does not move")
        if spec.tokens_per_state != 1:
            raise refuse("its cache stores other than one state per token")
        if spec.num_head_slots is not None and spec.num_head_slots != spec.num_kv_heads:
            raise refuse("its cache packs several KV heads per slot")
    if states and not attention:
        raise refuse("every layer keeps a state (Mamba or linear attention) and none "
                     "attends; kvpush moves states alongside attention layers' KV")  # fmt: skip
    state_bytes = _state_bytes([specs[g] for g in states], refuse)
    shapes = {
        (s.block_size, s.num_heads, s.state_content_size_bytes, s.dtype, s.max_tp_shards)
        for s in attention
    }
    if len(shapes) != 1:
        raise refuse(
            "its KV cache groups differ in block size, heads or bytes per head: "
            f"{sorted(map(str, shapes))}"
        )
    spec = attention[0]
    if any(specs[g].block_size != spec.block_size for g in states):
        raise refuse(
            "its state (Mamba or linear attention) layers keep one block per request, as "
            "vLLM does with prefix caching off (mamba cache mode 'none'); kvpush moves "
            "states with prefix caching on, vLLM's default (mode 'align')"
        )
    if dcp_size > 1:
        raise refuse(f"decode context parallelism ({dcp_size}) shards tokens across ranks")
    if spec.max_tp_shards is not None:
        replicas = max(1, tp_size // spec.max_tp_shards)
    else:
        replicas = max(1, tp_size // max(1, model_kv_heads))
    total_heads = spec.num_heads * (tp_size // replicas)
    dtype = cache_dtype.lower()
    if dtype in _PLAIN_DTYPES:
        dtype = str(spec.dtype).removeprefix("torch.")
    return KVCacheFacts(
        group_layers=tuple(tuple(group.layer_names) for _, group in groups),
        group_ids=tuple(index for index, _ in groups),
        block_size=spec.block_size,
        num_heads=spec.num_heads,
        unit_bytes=spec.state_content_size_bytes,
        total_heads=total_heads,
        kv_dtype=_FP8_ALIASES.get(dtype, dtype),
        mla=isinstance(spec, MLAAttentionSpec),
        windowed=any(isinstance(s, SlidingWindowSpec) for s in specs),
        state_groups=tuple(states),
        state_bytes=state_bytes,
    )


def _state_bytes(specs: list[Any], refuse: Any) -> int:
    """The bytes of one layer's state (every state layer's the same), checked for what
    kvpush can move: one state per request, the same on every rank's share."""
    if not specs:
        return 0
    if len({s.state_content_size_bytes for s in specs}) != 1:
        raise refuse("its state layers keep states of different sizes")
    for s in specs:
        if s.num_speculative_blocks:
            raise refuse(
                "speculative decoding keeps extra state blocks per request in its state "
                "(Mamba or linear attention) layers, which kvpush does not move yet"
            )
        if s.tp_replicated:
            raise refuse("its state layers keep a state every TP rank replicates")
    return int(specs[0].state_content_size_bytes)


# Attention backends whose kernels pack the tokens of each head's block their own way,
# whatever the view's [tokens, content] says: vLLM's CPU attention views a layer as
# [blocks, heads, 2 * block tokens, head size] and stores the K half transposed (head size
# x tokens, on its "vec" kernels) ahead of the V half. kvpush moves such blocks whole.
PACKED_BLOCK_BACKENDS = ("CPU_ATTN",)


def describe_kv_caches(
    facts: KVCacheFacts, kv_caches: dict[str, Any], layout_name: str, packed: bool = False
) -> tuple[KVLayout, tuple[tuple[int, int], ...]]:
    """One region per KV tensor the transferable layers use, in vLLM's layer order, plus
    the memory to register with NIXL (the backing storage of the views). One group: a
    region per layer. Several (vLLM's hybrid KV cache manager): the i-th layers of the
    groups share a tensor, and a block id names its cells for whichever group holds it.

    `kv_caches` are the per-layer views vLLM hands `register_kv_caches`; `layout_name`
    is vLLM's resolved KV cache layout, which the views' strides must follow. With
    `packed` (the attention backend is one of PACKED_BLOCK_BACKENDS) a head's block is one
    opaque run of the view's size, and the layout says its blocks move only whole.
    """
    from vllm.v1.kv_cache_layout import KVCacheLayout

    missing = [name for name in facts.layer_names if name not in kv_caches]
    if missing:
        raise UnsupportedKVCache(
            f"vLLM registered no KV cache for layers {missing[:3]}; kvpush needs every "
            "layer of the transferable cache group"
        )
    order = KVCacheLayout[layout_name].layer_view_order
    bases: list[int] = []
    # each region's layer of each group ("": none there; a pipeline stage holds some)
    region_layers: dict[int, list[str]] = {}
    group_of = {name: g for g, names in enumerate(facts.group_layers) for name in names}
    memory: dict[int, int] = {}
    geometry: set[tuple[int, ...]] = set()
    for names in facts.group_layers:
        shared = {kv_caches[name].data_ptr() for name in names}
        if len(shared) != len(names):
            raise UnsupportedKVCache(
                f"layers of one KV cache group share KV memory ({', '.join(names[:4])}): each "
                "needs its own"
            )
    states = {name for g in facts.state_groups for name in facts.group_layers[g]}
    pages: set[tuple[int, int]] = set()  # state layers: (blocks, bytes from one to the next)
    for name in facts.layer_names:
        view = kv_caches[name]
        elem = view.element_size()
        if name in states:
            pages.add(_state_page(name, view, facts.state_bytes))
            if view.data_ptr() not in bases:
                bases.append(view.data_ptr())
            region_layers.setdefault(view.data_ptr(), [""] * len(facts.group_layers))
            region_layers[view.data_ptr()][group_of[name]] = name
            storage = view.untyped_storage()
            memory[storage.data_ptr()] = storage.nbytes()
            continue
        if view.dim() != 4:
            raise UnsupportedKVCache(
                f"the KV cache view of {name} has shape {tuple(view.shape)}; vLLM 0.32 "
                "builds [blocks, heads, tokens, content] views"
            )
        blocks, heads, tokens, content = view.shape
        strides = [s * elem for s in view.stride()]
        if strides[3] != elem or content * elem != facts.unit_bytes or heads != facts.num_heads:
            raise UnsupportedKVCache(
                f"the KV cache view of {name} (shape {tuple(view.shape)}, strides "
                f"{tuple(view.stride())}) does not hold {facts.num_heads} heads of "
                f"{facts.unit_bytes} contiguous bytes per token, as its KV cache spec says"
            )
        if facts.block_size % tokens or blocks % (facts.block_size // tokens):
            raise UnsupportedKVCache(
                f"the KV cache view of {name} has blocks of {tokens} tokens, which do not "
                f"divide vLLM's block size {facts.block_size}"
            )
        physical = sorted(
            (axis for axis in range(4) if view.shape[axis] > 1), key=lambda a: -strides[a]
        )
        expected = [axis for axis in order if view.shape[axis] > 1]
        if physical != expected:
            raise UnsupportedKVCache(
                f"the KV cache view of {name} has strides {tuple(view.stride())}, which do "
                f"not follow vLLM's resolved KV cache layout {layout_name}"
            )
        if packed and (facts.mla or strides[1] != tokens * strides[2]):
            raise UnsupportedKVCache(
                f"the KV cache view of {name} (shape {tuple(view.shape)}, strides "
                f"{tuple(view.stride())}) does not keep each head's block in one run, as "
                "vLLM's CPU attention packs it"
            )
        if view.data_ptr() not in bases:  # the groups' layers share their regions
            bases.append(view.data_ptr())
        region_layers.setdefault(view.data_ptr(), [""] * len(facts.group_layers))
        region_layers[view.data_ptr()][group_of[name]] = name
        geometry.add((blocks, tokens, *strides[:3]))
        storage = view.untyped_storage()
        memory[storage.data_ptr()] = storage.nbytes()
    if len(geometry) != 1:
        raise UnsupportedKVCache(
            f"the KV cache views of the layers differ in blocks or strides: {sorted(geometry)}"
        )
    ((blocks, tokens, block_stride, head_stride, token_stride),) = geometry
    sub_blocks = facts.block_size // tokens
    if pages and pages != {(blocks // sub_blocks, block_stride * sub_blocks)}:
        raise UnsupportedKVCache(
            f"the state layers keep their blocks as pages {sorted(p for _, p in pages)} bytes "
            f"apart, the attention layers {block_stride * sub_blocks} in vLLM's resolved KV "
            f"cache layout {layout_name}: kvpush moves states where every block is one page "
            "for every KV cache group (a layout that keeps a block's heads together, such "
            "as LBHNC, which kvpush asks vLLM for)"
        )
    try:
        layout = KVLayout(
            region_bases=tuple(bases),
            num_blocks=blocks,
            block_size=tokens,
            num_heads=facts.num_heads,
            unit_bytes=facts.unit_bytes,
            block_stride=block_stride,
            head_stride=head_stride,
            token_stride=token_stride,
            total_heads=facts.total_heads,
            sub_blocks=sub_blocks,
            whole_blocks=packed,
            groups=len(facts.group_layers),
            layers=tuple(tuple(region_layers[base]) for base in bases),
            state_groups=facts.state_groups,
            state_bytes=facts.state_bytes,
        )
    except PlanError as exc:
        raise UnsupportedKVCache(f"the KV cache views of vLLM make no valid layout: {exc}") from exc
    return layout, tuple(sorted(memory.items()))


def _state_page(name: str, view: Any, state_bytes: int) -> tuple[int, int]:
    """A state layer's view (vLLM 0.32: [blocks, 1, 1, state bytes] over the page of each
    block) as (blocks, bytes from one block to the next), checked against its spec."""
    elem = view.element_size()
    if view.dim() != 4 or tuple(view.shape[1:3]) != (1, 1) or view.shape[3] * elem != state_bytes:
        raise UnsupportedKVCache(
            f"the state cache view of {name} has shape {tuple(view.shape)}; kvpush expects "
            f"vLLM 0.32's [blocks, 1, 1, {state_bytes} bytes]"
        )
    return int(view.shape[0]), int(view.stride(0) * elem)
