from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.core.planning import (
    ORDERS,
    KVLayout,
    Order,
    PlanError,
    WritePlan,
    check_mappable,
    head_range,
    merge_runs,
    peer_ranks,
    plan_transfer,
)

HB = 8  # bytes per head vector: head_dim 4 x 2-byte elements


def layout(
    heads: int = 4,
    block_size: int = 16,
    order: Order = "NHD",
    num_blocks: int = 64,
    regions: int = 2,
    base: int = 0x10000,
) -> KVLayout:
    block_bytes = block_size * heads * HB
    bases = tuple(base + r * num_blocks * block_bytes for r in range(regions))
    return KVLayout(bases, num_blocks, block_size, heads, 4, 2, order)


def per_region(plan: WritePlan) -> list[int]:
    return [len(descs) for descs in plan.regions]


def test_merge_runs() -> None:
    assert merge_runs([]) == []
    assert merge_runs([4, 5, 6, 9, 3, 4]) == [(4, 3), (9, 1), (3, 2)]


def test_consecutive_blocks_become_one_descriptor_per_region() -> None:
    src, dst = layout(), layout(base=0x900000)
    plan = plan_transfer(src, range(10, 20), dst, range(30, 40), 160)
    assert per_region(plan) == [1, 1]
    ((s, d, n),) = plan.regions[0]
    assert (s, d, n) == (
        src.region_bases[0] + 10 * src.block_bytes,
        dst.region_bases[0] + 30 * dst.block_bytes,
        10 * src.block_bytes,
    )
    assert plan.total_bytes == 2 * 160 * 4 * HB
    assert plan.summary().descriptors == 2


def test_scattered_blocks_merge_only_where_both_sides_are_consecutive() -> None:
    src, dst = layout(), layout()
    plan = plan_transfer(src, [3, 4, 5, 9, 10, 20], dst, [7, 8, 9, 1, 2, 0], 96)
    assert per_region(plan) == [3, 3]
    assert [n // src.block_bytes for _, _, n in plan.regions[0]] == [3, 2, 1]


def test_extra_blocks_beyond_num_tokens_are_ignored() -> None:
    plan = plan_transfer(layout(), [0, 1, 2, 3], layout(), [5, 6, 7, 60], 20)
    assert per_region(plan) == [1, 1]
    assert plan.total_bytes == 2 * 20 * 4 * HB


def test_partial_last_block_hnd_splits_per_head() -> None:
    # two whole blocks merge; the last, half-filled block is one run per head, and the
    # first head's run continues the whole blocks on both sides
    src, dst = layout(order="HND"), layout(order="HND")
    plan = plan_transfer(src, [0, 1, 2], dst, [4, 5, 6], 40)
    assert per_region(plan) == [4, 4]
    assert plan.total_bytes == 2 * 40 * 4 * HB


def test_partial_last_block_nhd_stays_contiguous() -> None:
    plan = plan_transfer(layout(), [0, 1, 2], layout(), [4, 5, 6], 40)
    assert per_region(plan) == [1, 1]


def test_different_block_sizes_consecutive_merge_fully() -> None:
    src, dst = layout(block_size=16), layout(block_size=32)
    plan = plan_transfer(src, range(8), dst, range(2, 6), 128)
    assert per_region(plan) == [1, 1]
    assert plan.total_bytes == 2 * 128 * 4 * HB


def test_different_block_sizes_scattered_map_per_token_run() -> None:
    src, dst = layout(block_size=16), layout(block_size=32)
    # dst block 9 gets src blocks 5 and 1 (not adjacent), dst block 3 gets src 2 and 3
    plan = plan_transfer(src, [5, 1, 2, 3], dst, [9, 3], 64)
    assert per_region(plan) == [3, 3]


@pytest.mark.parametrize("order", ORDERS)
def test_tp_1_to_2(order: Order) -> None:
    src, dst = layout(heads=4, order=order), layout(heads=2, order=order)
    for dst_rank in (0, 1):
        plan = plan_transfer(src, range(4), dst, range(4), 64, dst_rank=dst_rank, dst_tp=2)
        assert plan.total_bytes == 2 * 64 * 2 * HB
        # HND moves a head range per block; NHD one run per token
        assert per_region(plan) == ([4, 4] if order == "HND" else [64, 64])


@pytest.mark.parametrize("order", ORDERS)
def test_tp_2_to_1(order: Order) -> None:
    src, dst = layout(heads=2, order=order), layout(heads=4, order=order)
    for src_rank in (0, 1):
        plan = plan_transfer(src, range(4), dst, range(4), 50, src_rank=src_rank, src_tp=2)
        assert plan.total_bytes == 2 * 50 * 2 * HB
        # the last block holds 2 tokens: HND gives one run per head there
        assert per_region(plan) == ([5, 5] if order == "HND" else [50, 50])


def test_peer_ranks() -> None:
    assert list(peer_ranks(0, 1, 4)) == [0, 1, 2, 3]
    assert list(peer_ranks(3, 4, 1)) == [0]
    assert list(peer_ranks(1, 2, 8)) == [4, 5, 6, 7]
    assert list(peer_ranks(5, 8, 2)) == [1]
    assert head_range(1, 4, 8) == (2, 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"src_blocks": [0, 64]}, "outside the 64 registered blocks"),
        ({"dst_blocks": [0]}, "needed"),
        ({"dst_blocks": [3, 3]}, "repeat"),
        ({"num_tokens": -1}, "non-negative"),
        ({"src_rank": 1}, "outside TP size"),
        ({"dst": layout(heads=2)}, "KV heads"),
        ({"dst": layout(order="HND")}, "layout is NHD"),
        ({"dst": layout(regions=3)}, "KV regions"),
        (
            {
                "src": layout(heads=2),
                "src_tp": 2,
                "src_rank": 1,
                "dst": layout(heads=2),
                "dst_tp": 2,
            },
            "share no KV heads",
        ),
    ],
)
def test_invalid_plans_name_the_problem(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "src": layout(),
        "src_blocks": [0, 1],
        "dst": layout(),
        "dst_blocks": [0, 1],
        "num_tokens": 20,
    }
    args.update(kwargs)
    with pytest.raises(PlanError, match=message):
        plan_transfer(**args)  # type: ignore[arg-type]


def test_layout_validation() -> None:
    with pytest.raises(PlanError, match="no regions"):
        KVLayout((), 4, 16, 4, 4, 2)
    with pytest.raises(PlanError, match="block_stride"):
        KVLayout((0,), 4, 16, 4, 4, 2, "NHD", 100)
    assert check_mappable(layout(), layout(block_size=32, heads=2), 1, 2) is None


def test_planning_1000_blocks_8_regions_is_fast() -> None:
    src = layout(num_blocks=4096, regions=8)
    dst = layout(num_blocks=4096, regions=8, block_size=32, base=1 << 40)
    rng = np.random.default_rng(0)
    src_blocks = rng.permutation(4096)[:1000].tolist()
    dst_blocks = rng.permutation(4096)[:500].tolist()
    start = time.perf_counter()
    plan = plan_transfer(src, src_blocks, dst, dst_blocks, 16_000)
    elapsed = time.perf_counter() - start
    assert plan.num_descriptors == 8 * 1000
    assert elapsed < 0.5, f"planning took {elapsed * 1000:.1f} ms"


# -- simulated copies --------------------------------------------------------------------


def address(lay: KVLayout, region: int, block: int, token: int, head: int) -> int:
    inner = token * lay.num_heads + head if lay.order == "NHD" else head * lay.block_size + token
    return lay.region_bases[region] + block * lay.stride + inner * lay.head_bytes


@dataclass(frozen=True)
class Case:
    src: KVLayout
    src_blocks: list[int]
    dst: KVLayout
    dst_blocks: list[int]
    num_tokens: int
    src_tp: int
    dst_tp: int
    dst_rank: int


@st.composite
def transfer_cases(draw: st.DrawFn) -> Case:
    order = draw(st.sampled_from(ORDERS))
    total_heads = draw(st.sampled_from([1, 2, 4]))
    tps = [t for t in (1, 2, 4) if total_heads % t == 0]
    src_tp, dst_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    head_dim, elem_size = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2]))
    regions = draw(st.integers(1, 3))
    num_tokens = draw(st.integers(0, 24))

    def side(tp: int) -> tuple[KVLayout, list[int]]:
        block_size = draw(st.integers(1, 6))
        needed = -(-num_tokens // block_size)
        num_blocks = max(1, needed + draw(st.integers(0, 3)))
        heads = total_heads // tp
        block_bytes = block_size * heads * head_dim * elem_size
        stride = draw(st.sampled_from([0, block_bytes + draw(st.integers(1, 9))]))
        gap = draw(st.integers(0, 5))
        span = (num_blocks - 1) * (stride or block_bytes) + block_bytes
        bases = tuple(gap + r * (span + gap) for r in range(regions))
        lay = KVLayout(bases, num_blocks, block_size, heads, head_dim, elem_size, order, stride)
        ids = draw(st.permutations(range(num_blocks)))
        if draw(st.booleans()):
            ids = sorted(ids)
        return lay, list(ids[: draw(st.integers(needed, num_blocks))])

    src, src_blocks = side(src_tp)
    dst, dst_blocks = side(dst_tp)
    dst_rank = draw(st.integers(0, dst_tp - 1))
    return Case(src, src_blocks, dst, dst_blocks, num_tokens, src_tp, dst_tp, dst_rank)


def memory_size(lay: KVLayout) -> int:
    return lay.region_bases[-1] + lay.region_bytes + 7


@settings(max_examples=150, deadline=None)
@given(transfer_cases())
def test_simulated_copy_places_every_byte_and_nothing_else(case: Case) -> None:
    src, dst, src_blocks, dst_blocks = case.src, case.dst, case.src_blocks, case.dst_blocks
    num_tokens, src_tp, dst_tp, dst_rank = case.num_tokens, case.src_tp, case.dst_tp, case.dst_rank
    rng = np.random.default_rng(num_tokens)
    dst_mem = np.zeros(memory_size(dst), dtype=np.uint8)
    expected = dst_mem.copy()
    total_heads = dst.num_heads * dst_tp
    dst_first, _ = head_range(dst_rank, dst_tp, total_heads)
    hb = dst.head_bytes

    for src_rank in peer_ranks(dst_rank, dst_tp, src_tp):
        assert dst_rank in peer_ranks(src_rank, src_tp, dst_tp)
        # every byte non-zero, distinct per rank, so a stray or missing write shows
        src_mem = rng.integers(1, 256, memory_size(src), dtype=np.uint8)
        plan = plan_transfer(
            src, src_blocks, dst, dst_blocks, num_tokens,
            src_rank=src_rank, src_tp=src_tp, dst_rank=dst_rank, dst_tp=dst_tp,
        )  # fmt: skip
        src_first, src_end = head_range(src_rank, src_tp, total_heads)
        first, end = max(src_first, dst_first), min(src_end, dst_first + dst.num_heads)
        assert plan.total_bytes == src.num_regions * num_tokens * (end - first) * hb
        for descs in plan.regions:
            for s, d, n in descs:
                assert n > 0
                assert s >= 0 and s + n <= len(src_mem)
                assert d >= 0 and d + n <= len(dst_mem)
                dst_mem[d : d + n] = src_mem[s : s + n]
        for region in range(src.num_regions):
            for token in range(num_tokens):
                s_block = src_blocks[token // src.block_size]
                d_block = dst_blocks[token // dst.block_size]
                for head in range(first, end):
                    s = address(src, region, s_block, token % src.block_size, head - src_first)
                    d = address(dst, region, d_block, token % dst.block_size, head - dst_first)
                    expected[d : d + hb] = src_mem[s : s + hb]

    assert np.array_equal(dst_mem, expected)
