"""Oracle: every KV cache layout vLLM 0.32 can build, read by kvpush, planned and copied.

The caches are built with vLLM's own helpers, as its model runner builds them
(`get_kv_cache_config_from_groups` places the layers, `allocate_kv_cache` makes the
per-layer views), for every `KVCacheLayout`, several KV-head counts, head sizes, block
sizes, dtypes, kernel-block splits and MLA. kvpush describes them
(`kvpush.vllm.layout`), and the checks go through vLLM's views, never kvpush's own
arithmetic: the bytes kvpush moves for a block are exactly that block's bytes in every
layer (no gap, no overlap, nothing outside), and copies planned between two caches (other
layouts, block sizes, TP splits) make the destination's views equal the source's for the
request's tokens and leave every other byte alone. No GPU needed: the GPU layouts are the
same views over a CPU buffer.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvpush.core.planning import (
    PlanError,
    blocks_needed,
    group_ranges,
    head_range,
    plan_transfer,
    sources,
)
from kvpush.node.layout import block_pieces, piece_indices
from kvpush.node.peers import same_shape
from kvpush.vllm.layout import UnsupportedKVCache, describe_kv_caches, kv_cache_facts
from tests.vllm_caches import FP8, Cache, attention, build, fill, mla, state_bytes, state_spec

LAYOUTS = list(KVCacheLayout)
NUM_BLOCKS = 6
LAYERS = 3


def addresses(pieces: list[tuple[int, int]], base: int, size: int) -> np.ndarray[Any, Any]:
    """A mask of the buffer's bytes the (address, length) pieces cover; each byte once."""
    mask = np.zeros(size, dtype=np.int32)
    for address, length in pieces:
        assert base <= address and address + length <= base + size, "piece outside the buffer"
        mask[address - base : address - base + length] += 1
    return mask


def vllm_mask(cache: Cache, blocks: list[int]) -> np.ndarray[Any, Any]:
    """The bytes vLLM's views give to `blocks` in every transferable layer."""
    marks = torch.zeros_like(cache.buffer)
    for name in cache.facts.layer_names:
        for block in blocks:
            cache.block_bytes(name, block, marks).fill_(1)
    return marks.numpy().astype(np.int32)


SPECS = [
    pytest.param(attention(1, 128), id="mqa-h1-d128"),
    pytest.param(attention(2, 64), id="h2-d64"),
    pytest.param(attention(4, 128, block_size=32), id="h4-d128-b32"),
    pytest.param(attention(8, 128), id="h8-d128"),
    pytest.param(attention(8, 64, block_size=128), id="h8-d64-b128"),
    pytest.param(attention(16, 256, block_size=16, dtype=torch.float16), id="h16-d256-fp16"),
    pytest.param(attention(8, 128, block_size=64, dtype=torch.float32), id="h8-d128-b64-fp32"),
    pytest.param(attention(8, 128, dtype=FP8), id="h8-d128-fp8"),
    pytest.param(mla(), id="mla"),
    pytest.param(mla(block_size=64, dtype=FP8), id="mla-b64-fp8"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("spec", SPECS)
def test_every_block_is_exactly_its_bytes_in_every_layer(spec: Any, layout: KVCacheLayout) -> None:
    cache = build(spec, layout, cache_dtype="fp8" if spec.dtype == FP8 else "auto")
    lay, buf = cache.layout, cache.buffer
    base, size = buf.data_ptr(), buf.numel()
    assert cache.memory == ((base, size),)
    assert lay.num_regions == LAYERS and lay.scheduler_blocks == NUM_BLOCKS
    assert lay.unit_bytes == spec.state_content_size_bytes
    pieces = block_pieces(lay)
    for blocks in ([0], [NUM_BLOCKS - 1], [1, 2, 4]):
        expected = vllm_mask(cache, blocks)
        # the prepared fast path: the pieces of these blocks, every layer
        fast = [pieces[i] for i in piece_indices(lay, blocks)]
        assert np.array_equal(addresses(fast, base, size), expected)
        # the planner: all tokens of these blocks into the same blocks of a twin cache
        plan = plan_transfer(lay, blocks, lay, blocks, len(blocks) * lay.block_tokens)
        planned = [(s, n) for s, _, n in plan.descriptors()]
        assert np.array_equal(addresses(planned, base, size), expected)
    if layout.is_block_contiguous and layout.is_layer_compact:
        assert len(plan.descriptors()) == LAYERS * 2  # blocks 1-2, block 4, per layer


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC])
def test_scheduler_blocks_split_into_kernel_blocks(layout: KVCacheLayout) -> None:
    cache = build(attention(4, 64, block_size=64), layout, kernel_block_size=16)
    assert (cache.layout.sub_blocks, cache.layout.block_size) == (4, 16)
    base, size = cache.buffer.data_ptr(), cache.buffer.numel()
    plan = plan_transfer(cache.layout, [3, 1], cache.layout, [3, 1], 128)
    planned = [(s, n) for s, _, n in plan.descriptors()]
    assert np.array_equal(addresses(planned, base, size), vllm_mask(cache, [3, 1]))
    # the prepared fast path names each scheduler block's kernel blocks, every layer
    pieces = block_pieces(cache.layout)
    assert isinstance(pieces, np.ndarray) and pieces.dtype == np.uint64 and pieces.shape[1] == 2
    indices = piece_indices(cache.layout, [3, 1])
    assert isinstance(indices, np.ndarray) and indices.dtype == np.int32  # as NIXL takes them
    fast = [pieces[i] for i in indices]
    assert np.array_equal(addresses(fast, base, size), vllm_mask(cache, [3, 1]))
    assert len(piece_indices(cache.layout, [])) == 0


def copy(descriptors: np.ndarray) -> None:
    for s, d, n in descriptors.tolist():
        ctypes.memmove(d, s, n)


@dataclass(frozen=True)
class Pair:
    spec: Any
    src_layout: KVCacheLayout
    dst_layout: KVCacheLayout
    dst_block_size: int


# Copies between caches vLLM builds differently: other layouts with the same interior
# order, other block sizes, layers inside or outside blocks.
PAIRS = [
    Pair(attention(8, 128), KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, 16),
    Pair(attention(8, 128), KVCacheLayout.LBHNC, KVCacheLayout.BLHNC, 32),
    Pair(attention(4, 64, block_size=32), KVCacheLayout.LBNHC, KVCacheLayout.BLNHC, 16),
    Pair(attention(4, 64), KVCacheLayout.LHBNC, KVCacheLayout.BHLNC, 64),
    Pair(attention(2, 128), KVCacheLayout.BHLNC, KVCacheLayout.LBHNC, 16),
    Pair(attention(1, 128), KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, 32),
    Pair(mla(), KVCacheLayout.LBHNC, KVCacheLayout.BLNHC, 64),
]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p.src_layout.name}-{p.dst_layout.name}"
                         f"-b{p.dst_block_size}-h{p.spec.num_kv_heads}")  # fmt: skip
@pytest.mark.parametrize("first_token", [0, 64])
def test_copies_between_caches_match_through_vllms_views(pair: Pair, first_token: int) -> None:
    src = build(pair.spec, pair.src_layout)
    dst_spec = pair.spec.copy_with_new_block_size(pair.dst_block_size)
    dst = build(dst_spec, pair.dst_layout)
    fill(src, 1)
    fill(dst, 2)
    before = dst.buffer.clone()
    num_tokens = 70
    src_ids, dst_ids = [4, 0, 5, 1, 2], [3, 5, 0, 1, 4]
    src_from = first_token // src.layout.block_tokens
    dst_from = first_token // dst.layout.block_tokens
    plan = plan_transfer(
        src.layout, src_ids[src_from:], dst.layout, dst_ids[dst_from:], num_tokens,
        first_token=first_token,
    )  # fmt: skip
    copy(plan.descriptors())
    heads = slice(None)
    for name in src.facts.layer_names:
        got = dst.tokens(name, dst_ids, num_tokens, heads)
        want = src.tokens(name, src_ids, num_tokens, heads)
        assert torch.equal(got[first_token:], want[first_token:]), name
    written = [(d, n) for _, d, n in plan.descriptors()]
    touched = addresses(written, dst.buffer.data_ptr(), dst.buffer.numel()) > 0
    unchanged = (dst.buffer == before).numpy()
    assert unchanged[~touched].all(), "a byte outside the request's cells changed"


@pytest.mark.parametrize(
    ("spec", "src_tp", "dst_tp", "kv_heads"),
    [
        pytest.param(attention(8, 64), 1, 2, 8, id="8-heads-tp1-to-tp2"),
        pytest.param(attention(4, 64), 2, 1, 8, id="8-heads-tp2-to-tp1"),
        pytest.param(attention(2, 64), 4, 2, 8, id="8-heads-tp4-to-tp2"),
        pytest.param(attention(1, 64), 4, 1, 2, id="2-heads-replicated-tp4-to-tp1"),
        pytest.param(mla(), 2, 4, 1, id="mla-tp2-to-tp4"),
    ],
)
def test_tensor_parallel_ranks_get_their_heads_from_the_right_producers(
    spec: Any, src_tp: int, dst_tp: int, kv_heads: int
) -> None:
    """Consumer rank r's cache equals the single-rank truth for r's heads, assembled
    from the producer ranks `sources` names."""
    full_heads = 1 if isinstance(spec, MLAAttentionSpec) else kv_heads
    truth = build(attention(full_heads, spec.head_size) if full_heads > 1 else spec,
                  KVCacheLayout.LBHNC)  # fmt: skip
    fill(truth, 7)

    def rank_spec(tp: int) -> Any:
        if isinstance(spec, MLAAttentionSpec):
            return spec
        return attention(max(1, kv_heads // tp), spec.head_size)

    producers = []
    for rank in range(src_tp):
        cache = build(rank_spec(src_tp), KVCacheLayout.LBHNC, tp_size=src_tp,
                      model_kv_heads=kv_heads)  # fmt: skip
        first, end = head_range(rank, src_tp, cache.layout.total_heads)
        for name in truth.facts.layer_names:
            for block in range(NUM_BLOCKS):
                cache.block_bytes(name, block).copy_(truth.block_bytes(name, block)[:, first:end])
        producers.append(cache)
    num_tokens = 40
    blocks = [2, 0, 3]
    for rank in range(dst_tp):
        dst = build(rank_spec(dst_tp), KVCacheLayout.LBHNC, tp_size=dst_tp,
                    model_kv_heads=kv_heads)  # fmt: skip
        fill(dst, 9)
        for src_rank in sources(rank, dst_tp, src_tp, dst.layout.total_heads):
            plan = plan_transfer(
                producers[src_rank].layout, blocks, dst.layout, [5, 1, 4], num_tokens,
                src_rank=src_rank, src_tp=src_tp, dst_rank=rank, dst_tp=dst_tp,
            )  # fmt: skip
            copy(plan.descriptors())
        first, end = head_range(rank, dst_tp, dst.layout.total_heads)
        for name in truth.facts.layer_names:
            got = dst.tokens(name, [5, 1, 4], num_tokens, slice(None))
            want = truth.tokens(name, blocks, num_tokens, slice(first, end))
            assert torch.equal(got, want), (name, rank)


def copy_groups(
    src: Cache, dst: Cache, ranges: list[Any], num_tokens: int, path: str
) -> None:
    """Each KV cache group's copy (`group_ranges`), planned, or as the prepared path moves
    it: the blocks' pieces, paired by index."""
    for group, (start, s, d) in enumerate(ranges):
        if path == "planned":
            copy(plan_transfer(src.layout, s, dst.layout, d, num_tokens, first_token=start,
                               group=group).descriptors())  # fmt: skip
            continue
        n = blocks_needed(src.layout, start, num_tokens)
        pieces_src, pieces_dst = block_pieces(src.layout), block_pieces(dst.layout)
        for i, j in zip(piece_indices(src.layout, s[:n]), piece_indices(dst.layout, d[:n]),
                        strict=True):  # fmt: skip
            assert pieces_src[i][1] == pieces_dst[j][1]
            ctypes.memmove(int(pieces_dst[j][0]), int(pieces_src[i][0]), int(pieces_src[i][1]))


# A hybrid model's request of 70 tokens, blocks of 16: prefill's block lists per KV cache
# group (full attention on even layers, a 32-token window on odd ones, which keeps tokens
# from 39 on: vLLM's null block 0 stands for the two blocks below them).
HYBRID_TOKENS = 70
PREFILL_FULL, PREFILL_WINDOW = [2, 3, 5, 7, 8], [0, 0, 1, 4, 6]


def hybrid(layout: KVCacheLayout, kernel: int | None = None) -> Cache:
    return build(attention(2, 64), layout, kernel_block_size=kernel, layers=4, window=32,
                 num_blocks=12)  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("path", ["prepared", "planned"])
@pytest.mark.parametrize(
    ("first_token", "decode_full", "decode_window"),
    [
        pytest.param(0, [7, 8, 9, 10, 11], [0, 0, 1, 2, 3], id="whole-prompt"),
        pytest.param(32, [9, 10, 11], [1, 2, 3], id="decode-prefix-hit"),
    ],
)
def test_hybrid_groups_move_their_own_blocks_and_nothing_else(
    layout: KVCacheLayout, path: str, first_token: int, decode_full: list[int],
    decode_window: list[int],
) -> None:  # fmt: skip
    """vLLM's hybrid KV cache manager: the groups' layers share the KV tensors, each group
    with its own block ids. Every group's tokens land in the destination's blocks of that
    group, through vLLM's views of the group's own layers, and no other byte changes."""
    src, dst = hybrid(layout), hybrid(layout)
    assert (src.layout.groups, src.layout.num_regions) == (2, 2)
    fill(src, 7)
    fill(dst, 9)
    before = dst.buffer.clone()
    first_block = first_token // 16
    ranges = group_ranges(
        src.layout,
        [b for ids in (PREFILL_FULL, PREFILL_WINDOW) for b in ids[first_block:]],
        dst.layout,
        decode_full + decode_window,
        first_token,
        HYBRID_TOKENS,
    )
    assert [start for start, _, _ in ranges] == [first_token, 32]  # the window: its blocks
    copy_groups(src, dst, ranges, HYBRID_TOKENS, path)
    touched = torch.zeros_like(dst.buffer)
    groups = src.facts.group_layers
    for names, (start, s, d) in zip(groups, ranges, strict=True):
        count = HYBRID_TOKENS - start // 16 * 16
        for name in names:
            got = dst.tokens(name, list(d), count, slice(None))
            assert torch.equal(got, src.tokens(name, list(s), count, slice(None))), name
            for block in d:
                dst.block_bytes(name, block, touched).fill_(1)
    untouched = touched == 0
    assert torch.equal(dst.buffer[untouched], before[untouched])


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1), (2, 4)])
def test_hybrid_groups_across_tp_splits(src_tp: int, dst_tp: int) -> None:
    """4 KV heads: each destination rank assembles its heads of every group's tokens from
    the producer ranks `sources` names, one plan per group and rank pair."""
    heads = 4

    def rank_cache(tp: int) -> Cache:
        return build(attention(heads // tp, 64), KVCacheLayout.LBHNC, layers=4, window=32,
                     num_blocks=12, tp_size=tp, model_kv_heads=heads)  # fmt: skip

    truth = build(attention(heads, 64), KVCacheLayout.LBHNC, layers=4, window=32,
                  num_blocks=12)  # fmt: skip
    fill(truth, 7)
    producers = []
    for rank in range(src_tp):
        cache = rank_cache(src_tp)
        first, end = head_range(rank, src_tp, heads)
        for name in truth.facts.layer_names:
            for block in range(12):
                cache.block_bytes(name, block).copy_(truth.block_bytes(name, block)[:, first:end])
        producers.append(cache)
    src_blocks = PREFILL_FULL + PREFILL_WINDOW
    dst_blocks = [7, 8, 9, 10, 11, 0, 0, 1, 2, 3]
    for rank in range(dst_tp):
        dst = rank_cache(dst_tp)
        fill(dst, 9)
        for src_rank in sources(rank, dst_tp, src_tp, heads):
            src = producers[src_rank].layout
            for start, s, d in group_ranges(src, src_blocks, dst.layout, dst_blocks, 0,
                                            HYBRID_TOKENS):  # fmt: skip
                copy(plan_transfer(src, s, dst.layout, d, HYBRID_TOKENS, first_token=start,
                                   src_rank=src_rank, src_tp=src_tp, dst_rank=rank,
                                   dst_tp=dst_tp).descriptors())  # fmt: skip
        first, end = head_range(rank, dst_tp, heads)
        lists = ((PREFILL_FULL, dst_blocks[:5], 0), (PREFILL_WINDOW[2:], dst_blocks[7:], 32))
        for names, (s, d, start) in zip(truth.facts.group_layers, lists, strict=True):
            for name in names:
                got = dst.tokens(name, list(d), HYBRID_TOKENS - start, slice(None))
                want = truth.tokens(name, list(s), HYBRID_TOKENS - start, slice(first, end))
                assert torch.equal(got, want), (name, rank)


def test_hybrid_groups_refuse_a_source_that_no_longer_holds_the_window() -> None:
    src = hybrid(KVCacheLayout.LBHNC)
    with pytest.raises(PlanError, match="no longer holds tokens"):
        group_ranges(src.layout, [2, 3, 5, 7, 8, 0, 0, 0, 4, 6], src.layout,
                     [7, 8, 9, 10, 11, 0, 0, 1, 2, 3], 0, HYBRID_TOKENS)  # fmt: skip
    with pytest.raises(PlanError, match="same number for each"):
        group_ranges(src.layout, [2, 3, 5, 7, 8, 0, 0, 1, 4], src.layout,
                     [7, 8, 9, 10, 11, 0, 0, 1, 2, 3], 0, HYBRID_TOKENS)  # fmt: skip
    with pytest.raises(PlanError, match="null block between real ones"):
        group_ranges(src.layout, [2, 3, 5, 7, 8, 0, 0, 1, 4, 6], src.layout,
                     [7, 8, 9, 10, 11, 0, 0, 1, 0, 3], 0, HYBRID_TOKENS)  # fmt: skip


def test_a_hybrid_and_a_plain_layout_do_not_pair() -> None:
    plain = build(attention(2, 64), KVCacheLayout.LBHNC, layers=2, num_blocks=12)
    with pytest.raises(PlanError, match="hybrid KV cache manager on both sides"):
        plan_transfer(hybrid(KVCacheLayout.LBHNC).layout, [1], plain.layout, [1], 16)


# A request of 70 tokens on a model whose layers keep states but every fourth (Qwen3-Next),
# blocks of 16: the attention group's blocks per position, and each state group's, where
# vLLM keeps the state after token 70 in the block of its last token (position 4) and has
# nulled the rest, an older state left at position 3 in one group on prefill.
STATE_TOKENS = 70
# layouts that keep a block's heads apart: no block is one page, which states need
APART = (KVCacheLayout.LHBNC,)
PREFILL_STATES = ([2, 3, 5, 7, 8], [0, 0, 0, 0, 1], [0, 0, 0, 9, 4], [0, 0, 0, 0, 6])
DECODE_STATES = ([7, 8, 9, 10, 11], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 3])


def states_cache(layout: KVCacheLayout, kernel: int | None = None) -> Cache:
    return build(attention(2, 64), layout, kernel_block_size=kernel, layers=8, states=4,
                 num_blocks=12)  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("path", ["prepared", "planned"])
def test_state_groups_move_the_state_of_the_last_token_and_attention_its_tokens(
    layout: KVCacheLayout, path: str
) -> None:
    """Each state group's state after the request's last token lands in the block decode
    keeps for that token's position, in every layer of the group, through vLLM's views of
    them; the attention layers' tokens land as ever; nothing else of decode's cache changes
    (the prepared path moves whole pages of the request's blocks, the planned one the
    state's bytes alone)."""
    if layout in APART:
        with pytest.raises(UnsupportedKVCache, match=f"layout {layout.name}: kvpush moves states"):
            states_cache(layout)
        return
    src, dst = states_cache(layout), states_cache(layout)
    assert (src.layout.groups, src.layout.state_groups) == (4, (0, 1, 2))
    if path == "prepared" and not same_shape(src.layout, dst.layout):
        pytest.skip(f"{layout.name}: the prepared path is not taken (regions of some groups)")
    fill(src, 7)
    fill(dst, 9)
    before = dst.buffer.clone()
    # vLLM's group order: the three state groups, then the attention one
    prefill = [*PREFILL_STATES[1:], PREFILL_STATES[0]]
    decode = [*DECODE_STATES[1:], DECODE_STATES[0]]
    ranges = group_ranges(src.layout, [b for ids in prefill for b in ids], dst.layout,
                          [b for ids in decode for b in ids], 0, STATE_TOKENS)  # fmt: skip
    assert [(start, list(s), list(d)) for start, s, d in ranges[:3]] == [
        (69, [1], [1]), (69, [4], [2]), (69, [6], [3])
    ]
    copy_groups(src, dst, ranges, STATE_TOKENS, path)
    touched = torch.zeros_like(dst.buffer)
    groups = src.facts.group_layers
    for names, (_, s, d) in zip(groups[:3], ranges[:3], strict=True):
        for name in names:
            assert torch.equal(state_bytes(dst, name, d[0]), state_bytes(src, name, s[0])), name
            state_bytes(dst, name, d[0], touched).fill_(1)
    for name in groups[3]:
        got = dst.tokens(name, DECODE_STATES[0], STATE_TOKENS, slice(None))
        assert torch.equal(got, src.tokens(name, PREFILL_STATES[0], STATE_TOKENS, slice(None)))
        for block in DECODE_STATES[0]:
            dst.block_bytes(name, block, touched).fill_(1)
    if path == "prepared":  # whole pages of the state blocks, in every region
        for block in (1, 2, 3):
            for name in groups[3]:
                dst.block_bytes(name, block, touched).fill_(1)
    untouched = touched == 0
    assert torch.equal(dst.buffer[untouched], before[untouched])


def test_a_state_is_taken_from_the_block_of_the_last_token_or_refused() -> None:
    """80 tokens move (5 blocks of 16) and decode computes token 81 in a sixth block: the
    state goes to the block of the last token moved, which decode reads first, not to its
    last block. A source without a block there has no state to give."""
    lay = states_cache(KVCacheLayout.LBHNC).layout
    prefill = [[0, 0, 0, 0, 1], [0, 0, 0, 9, 4], [0, 0, 0, 0, 6], [2, 3, 5, 7, 8]]
    decode = [[0, 0, 0, 0, 1, 5], [0, 0, 0, 0, 2, 6], [0, 0, 0, 0, 3, 10], [7, 8, 9, 11, 4, 0]]
    flat = [b for ids in decode for b in ids]
    ranges = group_ranges(lay, [b for ids in prefill for b in ids], lay, flat, 0, 80)
    assert [(list(s), list(d)) for _, s, d in ranges[:3]] == [([1], [1]), ([4], [2]), ([6], [3])]
    prefill[1][4] = 0
    with pytest.raises(PlanError, match="holds no block for the state"):
        group_ranges(lay, [b for ids in prefill for b in ids], lay, flat, 0, 80)


def test_states_move_only_between_equal_tp_sizes_and_equal_states() -> None:
    def rank_cache(tp: int) -> Cache:
        return build(attention(2 // tp, 64), KVCacheLayout.LBHNC, layers=8, states=4,
                     num_blocks=12, tp_size=tp, model_kv_heads=2)  # fmt: skip

    one, two = rank_cache(1), rank_cache(2)
    with pytest.raises(PlanError, match="same --tensor-parallel-size"):
        plan_transfer(one.layout, [1], two.layout, [1], STATE_TOKENS, src_tp=1, dst_tp=2,
                      group=0)  # fmt: skip
    plain = build(attention(2, 64), KVCacheLayout.LBHNC, layers=2, num_blocks=12)
    with pytest.raises(PlanError, match="Mamba cache settings"):
        plan_transfer(one.layout, [1], plain.layout, [1], 16)


def test_kv_dtypes_are_named_for_the_handshake() -> None:
    assert build(attention(2, 64), KVCacheLayout.LBHNC).facts.kv_dtype == "bfloat16"
    fp8 = build(attention(2, 64, dtype=FP8), KVCacheLayout.LBHNC, cache_dtype="fp8")
    assert fp8.facts.kv_dtype == "fp8_e4m3"
    assert build(mla(), KVCacheLayout.LBHNC, tp_size=4).facts.total_heads == 1


def refused(groups: list[KVCacheGroupSpec], **kwargs: Any) -> str:
    config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=groups)
    args: dict[str, Any] = {"model": "org/model", "tp_size": 1, "model_kv_heads": 2,
                            "cache_dtype": "auto"} | kwargs  # fmt: skip
    with pytest.raises(UnsupportedKVCache) as failure:
        kv_cache_facts(config, **args)
    message = str(failure.value)
    assert "org/model" in message and "full attention, MLA or a sliding window" in message
    assert "state (Mamba, linear attention) layers" in message
    return message


def test_what_kvpush_cannot_move_exactly_is_refused_at_start() -> None:
    full = KVCacheGroupSpec(["a"], attention(2, 64))
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128
    )
    hybrid_ok = KVCacheConfig(num_blocks=4, kv_cache_tensors=[],
                              kv_cache_groups=[full, KVCacheGroupSpec(["b"], window)])  # fmt: skip
    facts = kv_cache_facts(hybrid_ok, model="org/model", tp_size=1, model_kv_heads=2,
                           cache_dtype="auto")  # fmt: skip
    assert (facts.group_layers, facts.group_ids) == ((("a",), ("b",)), (0, 1))
    wider = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16, sliding_window=128
    )
    assert "differ in block size, heads" in refused([full, KVCacheGroupSpec(["b"], wider)])
    page = attention(2, 64).page_size_bytes
    states = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["m"], state_spec(16, page)), full])  # fmt: skip
    facts = kv_cache_facts(states, model="org/model", tp_size=1, model_kv_heads=2,
                           cache_dtype="auto")  # fmt: skip
    assert (facts.state_groups, facts.state_bytes, facts.num_heads) == ((0,), 2624, 2)
    one_per_request = state_spec(4096, page)  # prefix caching off: vLLM's mode "none"
    assert "prefix caching on" in refused([full, KVCacheGroupSpec(["m"], one_per_request)])
    drafts = dataclasses.replace(state_spec(16, page), num_speculative_blocks=2)
    assert "speculative decoding" in refused([full, KVCacheGroupSpec(["m"], drafts)])
    shared = dataclasses.replace(state_spec(16, page), tp_replicated=True)
    assert "replicates" in refused([full, KVCacheGroupSpec(["m"], shared)])
    assert "none attends" in refused([KVCacheGroupSpec(["m"], state_spec(16, page))])
    only_windows = KVCacheConfig(num_blocks=4, kv_cache_tensors=[],
                                 kv_cache_groups=[KVCacheGroupSpec(["b"], window)])  # fmt: skip
    facts = kv_cache_facts(only_windows, model="org/model", tp_size=1, model_kv_heads=2,
                           cache_dtype="auto")  # fmt: skip
    assert facts.windowed and facts.group_ids == (0,)  # every layer windowed: moved too
    per_token = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.int8,
        kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
    )  # fmt: skip
    assert "int8_per_token_head" in refused(
        [KVCacheGroupSpec(["a"], per_token)], cache_dtype="int8_per_token_head"
    )
    assert "context parallelism" in refused([full], dcp_size=2)


def test_views_that_do_not_follow_the_resolved_layout_are_refused() -> None:
    cache = build(attention(4, 64), KVCacheLayout.LBHNC)
    with pytest.raises(UnsupportedKVCache, match="do not follow vLLM's resolved KV cache layout"):
        describe_kv_caches(cache.facts, cache.views, "LBNHC")
    views = dict(cache.views)
    views.pop(cache.facts.layer_names[1])
    with pytest.raises(UnsupportedKVCache, match="no KV cache for layers"):
        describe_kv_caches(cache.facts, views, "LBHNC")


def test_every_layout_is_covered() -> None:
    assert {layout.name for layout in LAYOUTS} == {
        "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"
    }  # fmt: skip
    assert len(list(itertools.product(LAYOUTS, SPECS))) == 60


def cpu_attention_write(
    cache: Cache, blocks: list[int], keys: torch.Tensor, values: torch.Tensor, first_token: int
) -> None:
    """Tokens [first_token, len) of `keys`/`values` ([layers, tokens, heads, head size])
    stored by vLLM's CPU attention kernel itself, as its forward pass stores them."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    for index, name in enumerate(cache.facts.layer_names):
        view = cache.views[name]
        blocks_n, heads, size, _ = view.shape
        key_cache, value_cache = view.view(blocks_n, heads, size * 2, -1).chunk(2, dim=2)
        isa = _get_attn_isa(view.dtype, size, keys.shape[-1], "auto")
        tokens = torch.arange(first_token, keys.shape[1])
        slots = torch.tensor([blocks[t // size] * size + t % size for t in tokens.tolist()])
        ops.cpu_attn_reshape_and_cache(
            keys[index, first_token:].contiguous(),
            values[index, first_token:].contiguous(),
            key_cache,
            value_cache,
            slots,
            isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )


@pytest.mark.parametrize(
    ("block_size", "kv_heads", "head_size", "dtype"),
    [
        pytest.param(32, 4, 64, torch.bfloat16, id="b32-h4-d64-bf16"),
        pytest.param(64, 2, 128, torch.float32, id="b64-h2-d128-fp32"),
        pytest.param(32, 4, 80, torch.bfloat16, id="b32-h4-d80-bf16-vec16"),
    ],
)
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 1), (1, 2), (2, 1)])
@pytest.mark.parametrize("first_token", [0, 64])
def test_cpu_attention_blocks_move_whole_and_land_as_its_kernel_stores_them(
    block_size: int, kv_heads: int, head_size: int, dtype: torch.dtype,
    src_tp: int, dst_tp: int, first_token: int,
) -> None:  # fmt: skip
    """vLLM's CPU attention packs each head's block its own way (K transposed on its "vec"
    kernels). Prefill's cache is written by that kernel; what kvpush copies into decode's
    cache (other block ids, other TP, a prefix-cache hit on decode, a partial last block)
    must be byte for byte what the kernel stores there for the same tokens and heads."""
    layers, num_tokens = 2, 2 * 64 + 9

    def cache(tp: int) -> Cache:
        spec = attention(kv_heads // tp, head_size, block_size=block_size, dtype=dtype)
        return build(spec, KVCacheLayout.LBHNC, tp_size=tp, model_kv_heads=kv_heads,
                     num_blocks=12, layers=layers, packed=True)  # fmt: skip

    generator = torch.Generator().manual_seed(block_size + head_size)
    keys = torch.randn(layers, num_tokens, kv_heads, head_size, generator=generator).to(dtype)
    values = torch.randn(layers, num_tokens, kv_heads, head_size, generator=generator).to(dtype)
    src_ids, dst_ids = [7, 2, 9, 0, 5, 11], [3, 10, 1, 6, 8, 4]
    per_src, per_dst = kv_heads // src_tp, kv_heads // dst_tp
    producers = []
    for rank in range(src_tp):
        heads = slice(rank * per_src, (rank + 1) * per_src)
        producer = cache(src_tp)
        fill(producer, None)
        cpu_attention_write(producer, src_ids, keys[:, :, heads], values[:, :, heads], 0)
        assert producer.layout.whole_blocks
        producers.append(producer)
    start = first_token // block_size
    for rank in range(dst_tp):
        heads = slice(rank * per_dst, (rank + 1) * per_dst)
        truth, dst = cache(dst_tp), cache(dst_tp)
        fill(truth, None)
        fill(dst, None)
        cpu_attention_write(truth, dst_ids, keys[:, :, heads], values[:, :, heads], first_token)
        for src_rank in sources(rank, dst_tp, src_tp, kv_heads):
            plan = plan_transfer(
                producers[src_rank].layout, src_ids[start:], dst.layout, dst_ids[start:],
                num_tokens, first_token=first_token,
                src_rank=src_rank, src_tp=src_tp, dst_rank=rank, dst_tp=dst_tp,
            )  # fmt: skip
            copy(plan.descriptors())
        assert torch.equal(dst.buffer, truth.buffer), f"decode rank {rank} differs"


def test_cpu_attention_kernel_oracle_catches_moving_tokens_of_a_packed_block() -> None:
    """The oracle above can fail: describing the same caches as plain token rows (what
    kvpush once did) moves a partial last block wrong."""
    src, dst, truth = (build(attention(2, 64, block_size=32), KVCacheLayout.LBHNC)
                       for _ in range(3))  # fmt: skip
    for cache in (src, dst, truth):
        fill(cache, None)
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(3, 40, 2, 64, generator=generator).to(torch.bfloat16)
    values = torch.randn(3, 40, 2, 64, generator=generator).to(torch.bfloat16)
    cpu_attention_write(src, [1, 4], keys, values, 0)
    cpu_attention_write(truth, [2, 0], keys, values, 0)
    assert not src.layout.whole_blocks
    copy(plan_transfer(src.layout, [1, 4], dst.layout, [2, 0], 40).descriptors())
    assert not torch.equal(dst.buffer, truth.buffer)


def test_cpu_attention_blocks_of_other_sizes_are_refused_with_the_fix() -> None:
    small = build(attention(2, 64, block_size=32), KVCacheLayout.LBHNC, packed=True)
    large = build(attention(2, 64, block_size=64), KVCacheLayout.LBHNC, packed=True)
    plain = build(attention(2, 64, block_size=32), KVCacheLayout.LBHNC)
    for src, dst, fix in (
        (small, large, "serve both sides with the same --block-size"),
        (small, plain, "run both sides on the same attention backend"),
        (plain, small, "run both sides on the same attention backend"),
    ):
        with pytest.raises(PlanError, match=fix):
            plan_transfer(src.layout, [0, 1], dst.layout, [0, 1], 40)
