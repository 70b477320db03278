from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.core.planning import (
    KVLayout,
    PlanError,
    WritePlan,
    align,
    check_mappable,
    coalesce,
    destinations,
    head_range,
    merge_runs,
    plan_transfer,
    sources,
    unread,
)

UNIT = 8  # bytes of one head of one token

# Physical order of [layer, block, head, token] from outermost, as vLLM's KV cache layouts
# name them (content is always innermost).
ORDERS = {
    "LBHNC": "LBHN",
    "LBNHC": "LBNH",
    "LHBNC": "LHBN",
    "BLHNC": "BLHN",
    "BLNHC": "BLNH",
    "BHLNC": "BHLN",
}


def layout(
    heads: int = 4,
    block_size: int = 16,
    order: str = "LBNHC",
    num_blocks: int = 64,
    regions: int = 2,
    base: int = 0x10000,
    total_heads: int | None = None,
    sub_blocks: int = 1,
    unit: int = UNIT,
) -> KVLayout:
    """A packed layout in one of vLLM's orders, strides computed innermost first."""
    counts = {"L": regions, "B": num_blocks, "H": heads, "N": block_size}
    strides: dict[str, int] = {}
    stride = unit
    for dim in reversed(ORDERS[order]):
        strides[dim] = stride
        stride *= counts[dim]
    return KVLayout(
        tuple(base + r * strides["L"] for r in range(regions)),
        num_blocks,
        block_size,
        heads,
        unit,
        strides["B"],
        strides["H"],
        strides["N"],
        total_heads if total_heads is not None else heads,
        sub_blocks,
    )


def per_region(plan: WritePlan) -> list[int]:
    return [len(descs) for descs in plan.regions]


def test_merge_runs() -> None:
    assert merge_runs([]) == []
    assert merge_runs([4, 5, 6, 9, 3, 4]) == [(4, 3), (9, 1), (3, 2)]


def listed(rows: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(row) for row in rows.tolist()]


def test_coalesce_joins_runs_adjacent_on_both_sides_only() -> None:
    assert listed(coalesce([(20, 120, 4), (0, 100, 10), (10, 110, 10)])) == [(0, 100, 24)]
    assert listed(coalesce([(0, 100, 10), (10, 200, 10)])) == [(0, 100, 10), (10, 200, 10)]
    assert listed(coalesce([(5, 9, 1)])) == [(5, 9, 1)]
    assert coalesce([]).shape == (0, 3)


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_consecutive_blocks_become_one_descriptor_per_region(order: str) -> None:
    src, dst = layout(order=order), layout(order=order, base=0x900000)
    plan = plan_transfer(src, range(10, 20), dst, range(30, 40), 160)
    assert plan.total_bytes == 2 * 160 * 4 * UNIT
    if order.startswith("L"):
        assert per_region(plan) == [1, 1]
        ((s, d, n),) = plan.regions[0]
        assert (s, d, n) == (
            src.region_bases[0] + 10 * src.block_stride,
            dst.region_bases[0] + 30 * dst.block_stride,
            10 * src.block_bytes,
        )
    else:  # layers inside blocks: one run per block per layer, joined across layers
        assert per_region(plan) == [10, 10]
        assert listed(plan.descriptors()) == [
            (
                src.region_bases[0] + 10 * src.block_stride,
                dst.region_bases[0] + 30 * dst.block_stride,
                10 * 2 * src.block_bytes,
            )
        ]


def test_heads_outside_blocks_move_one_run_per_head() -> None:
    src, dst = layout(order="LHBNC"), layout(order="LHBNC", base=0x900000)
    plan = plan_transfer(src, range(10, 20), dst, range(30, 40), 160)
    assert per_region(plan) == [4, 4]
    assert plan.total_bytes == 2 * 160 * 4 * UNIT


def test_scattered_blocks_merge_only_where_both_sides_are_consecutive() -> None:
    src, dst = layout(), layout()
    plan = plan_transfer(src, [3, 4, 5, 9, 10, 20], dst, [7, 8, 9, 1, 2, 0], 96)
    assert per_region(plan) == [3, 3]
    assert [n // src.block_bytes for _, _, n in plan.regions[0]] == [3, 2, 1]


def test_extra_blocks_beyond_num_tokens_are_ignored() -> None:
    plan = plan_transfer(layout(), [0, 1, 2, 3], layout(), [5, 6, 7, 60], 20)
    assert per_region(plan) == [1, 1]
    assert plan.total_bytes == 2 * 20 * 4 * UNIT


def test_partial_last_block_head_major_splits_per_head() -> None:
    # two whole blocks merge; the last, half-filled block is one run per head, and the
    # first head's run continues the whole blocks on both sides
    src, dst = layout(order="LBHNC"), layout(order="LBHNC")
    plan = plan_transfer(src, [0, 1, 2], dst, [4, 5, 6], 40)
    assert per_region(plan) == [4, 4]
    assert plan.total_bytes == 2 * 40 * 4 * UNIT


def test_partial_last_block_token_major_stays_contiguous() -> None:
    plan = plan_transfer(layout(), [0, 1, 2], layout(), [4, 5, 6], 40)
    assert per_region(plan) == [1, 1]


def test_a_tail_from_first_token_lists_blocks_from_the_one_holding_it() -> None:
    # decode cached tokens 0..31 (two blocks); prefill has blocks of 32, so token 32 sits
    # in its second block
    src, dst = layout(block_size=32), layout(block_size=16, base=0x900000)
    plan = plan_transfer(src, [3, 7], dst, [11, 12, 13], 70, first_token=32)
    assert plan.total_bytes == 2 * (70 - 32) * 4 * UNIT
    first = plan.regions[0][0]
    assert first[0] == src.region_bases[0] + 3 * src.block_stride
    assert first[1] == dst.region_bases[0] + 11 * dst.block_stride
    with pytest.raises(PlanError, match="no range"):
        plan_transfer(src, [3, 7], dst, [11, 12, 13], 70, first_token=71)


def test_scheduler_blocks_of_several_kernel_blocks() -> None:
    # the scheduler's block 2 is kernel blocks 4 and 5 on the source
    src = layout(block_size=16, sub_blocks=2)
    dst = layout(block_size=32, base=0x900000)
    plan = plan_transfer(src, [2], dst, [9], 32)
    assert plan.regions[0] == (
        (src.region_bases[0] + 4 * src.block_stride, dst.region_bases[0] + 9 * dst.block_stride,
         32 * 4 * UNIT),
    )  # fmt: skip
    with pytest.raises(PlanError, match="outside the 32 registered"):
        plan_transfer(src, [32], dst, [9], 32)


def test_different_block_sizes_consecutive_merge_fully() -> None:
    src, dst = layout(block_size=16), layout(block_size=32)
    plan = plan_transfer(src, range(8), dst, range(2, 6), 128)
    assert per_region(plan) == [1, 1]
    assert plan.total_bytes == 2 * 128 * 4 * UNIT


def test_different_block_sizes_scattered_map_per_token_run() -> None:
    src, dst = layout(block_size=16), layout(block_size=32)
    # dst block 9 gets src blocks 5 and 1 (not adjacent), dst block 3 gets src 2 and 3
    plan = plan_transfer(src, [5, 1, 2, 3], dst, [9, 3], 64)
    assert per_region(plan) == [3, 3]


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
def test_tp_1_to_2(order: str) -> None:
    src, dst = layout(heads=4, order=order), layout(heads=2, order=order, total_heads=4)
    for dst_rank in (0, 1):
        plan = plan_transfer(src, range(4), dst, range(4), 64, dst_rank=dst_rank, dst_tp=2)
        assert plan.total_bytes == 2 * 64 * 2 * UNIT
        # head-major moves a head range per block; token-major one run per token
        assert per_region(plan) == ([4, 4] if order == "LBHNC" else [64, 64])


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
def test_tp_2_to_1(order: str) -> None:
    src, dst = layout(heads=2, order=order, total_heads=4), layout(heads=4, order=order)
    for src_rank in (0, 1):
        plan = plan_transfer(src, range(4), dst, range(4), 50, src_rank=src_rank, src_tp=2)
        assert plan.total_bytes == 2 * 50 * 2 * UNIT
        # the last block holds 2 tokens: head-major gives one run per head there
        assert per_region(plan) == ([5, 5] if order == "LBHNC" else [50, 50])


def test_sources_split_heads_and_share_replicas() -> None:
    assert head_range(1, 4, 8) == (2, 4)
    assert sources(0, 1, 4, 8) == {0: (0, 2), 1: (2, 4), 2: (4, 6), 3: (6, 8)}
    assert sources(3, 4, 1, 8) == {0: (6, 8)}
    assert sources(1, 2, 8, 8) == {4: (4, 5), 5: (5, 6), 6: (6, 7), 7: (7, 8)}
    # 2 KV heads over TP 4: ranks 0,1 hold head 0 and ranks 2,3 head 1
    assert head_range(1, 4, 2) == (0, 1) and head_range(2, 4, 2) == (1, 2)
    assert sources(0, 1, 4, 2) == {0: (0, 1), 2: (1, 2)}
    # MLA: one latent every rank holds; consumer ranks take turns among the replicas
    assert [sources(r, 4, 2, 1) for r in range(4)] == [{0: (0, 1)}, {1: (0, 1)}] * 2
    assert destinations(1, 2, 4, 1) == [1, 3]
    assert destinations(0, 1, 2, 4) == [0, 1]


def test_unread_names_the_replicas_no_consumer_reads() -> None:
    assert unread(2, 1, 1) == [1]  # MQA or MLA, prefill TP 2 -> decode TP 1
    assert unread(4, 2, 1) == [2, 3]
    assert unread(4, 1, 2) == [1, 3]  # ranks 0,1 hold head 0, ranks 2,3 head 1
    assert unread(2, 1, 4) == [] and unread(1, 2, 4) == [] and unread(2, 4, 1) == []
    for src_tp, tp, total in [(2, 1, 1), (4, 2, 1), (4, 1, 2), (8, 2, 4), (2, 2, 8)]:
        read = {p for r in range(tp) for p in sources(r, tp, src_tp, total)}
        assert read.isdisjoint(unread(src_tp, tp, total))
        assert read | set(unread(src_tp, tp, total)) == set(range(src_tp))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"src_blocks": [0, 64]}, "outside the 64 registered blocks"),
        ({"src_blocks": [-1, 0]}, "outside the 64 registered blocks"),
        ({"dst_blocks": [0]}, "needed"),
        ({"dst_blocks": [3, 3]}, "repeat"),
        ({"num_tokens": -1}, "no range"),
        ({"src_rank": 1}, "outside TP size"),
        ({"dst": layout(heads=2)}, "KV heads"),
        ({"dst": layout(order="LBHNC")}, "token-major"),
        ({"dst": layout(regions=3)}, "KV layers"),
        ({"dst": layout(unit=16)}, "bytes per head"),
        ({"dst": layout(heads=3, total_heads=3)}, "with 4 KV heads, dest 3"),
        ({"src_tp": 3}, "do not split evenly"),
        (
            {
                "src": layout(heads=2, total_heads=4),
                "src_tp": 2,
                "src_rank": 1,
                "dst": layout(heads=2, total_heads=4),
                "dst_tp": 2,
            },
            "sends no KV heads",
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
        KVLayout((), 4, 16, 4, 8, 512, 128, 8, 4)
    with pytest.raises(PlanError, match="overlap"):
        KVLayout((0,), 4, 16, 4, 8, 100, 128, 8, 4)  # blocks closer than a block's cells
    with pytest.raises(PlanError, match="multiple"):
        layout(num_blocks=63, sub_blocks=2)
    assert check_mappable(layout(), layout(block_size=32, heads=2, total_heads=4), 1, 2) is None


def named(lay: KVLayout, *layers: str | tuple[str, ...]) -> KVLayout:
    """`lay` with its regions holding `layers`: a name, or a tuple of each KV cache
    group's layer in the region ("": that group has none there)."""
    names = tuple((n,) if isinstance(n, str) else n for n in layers)
    return dataclasses.replace(lay, layers=names, groups=len(names[0]))


def test_a_pipeline_stage_moves_its_layers_into_the_same_layers_regions() -> None:
    """A prefill stage holding layers 2 and 3 of 4 writes decode's regions of layers 2 and
    3, and nothing of layers 0 and 1, whichever side is source."""
    full = named(layout(regions=4, base=0x100000), "m.0.attn", "m.1.attn", "m.2.attn", "m.3.attn")
    stage = named(layout(regions=2), "m.2.attn", "m.3.attn")
    region = full.region_bases[1] - full.region_bases[0]
    for src, dst, far in ((stage, full, "dst"), (full, stage, "src")):
        plan = plan_transfer(src, [3, 1], dst, [5, 6], 20)
        assert plan.total_bytes == 2 * 20 * 4 * UNIT  # two layers' worth, every head
        rows = plan.descriptors()
        column = rows[:, 1] if far == "dst" else rows[:, 0]
        lo, hi = full.region_bases[2], full.region_bases[3] + region
        assert ((column >= lo) & (column < hi)).all(), "only layers 2 and 3 of the full side"
    a, b = align(stage, full)
    assert a == stage and b.layers == stage.layers and b.region_bases == full.region_bases[2:]


def test_a_stage_of_a_hybrid_model_moves_each_groups_blocks_through_its_layers_regions() -> None:
    """vLLM's hybrid KV cache manager shares a region between the i-th layers of its
    groups; a pipeline stage may hold one group's layer of a region without the other's.
    Each group's blocks then move only through the regions where the stage holds that
    group's layer, into the whole model's region of that layer."""
    full = named(layout(regions=2, base=0x100000), ("full.0", "swa.1"), ("full.2", "swa.3"))
    # stage 1 of 2: layers 2 (full attention) and 3 (windowed), each alone in a region
    stage = named(layout(regions=2), ("full.2", ""), ("", "swa.3"))
    a, b = align(stage, full)
    assert b.region_bases == (full.region_bases[1], full.region_bases[1])
    region = full.region_bases[1] - full.region_bases[0]
    for group, src_region in ((0, 0), (1, 1)):
        plan = plan_transfer(stage, [3, 1], full, [5, 6], 20, group=group)
        assert plan.src_bases == (stage.region_bases[src_region],)
        assert plan.dst_bases == (full.region_bases[1],)
        assert plan.total_bytes == 20 * 4 * UNIT
        dst = plan.descriptors()[:, 1]
        assert ((dst >= full.region_bases[1]) & (dst < full.region_bases[1] + region)).all()
    with pytest.raises(PlanError, match="plan each group's blocks apart"):
        plan_transfer(stage, [3, 1, 4, 2], full, [5, 6, 7, 8], 20)


def test_layers_pair_by_name_not_by_place() -> None:
    """Regions pair by the layers they hold, in the smaller side's order; a region shared
    by several groups' layers pairs only with one holding the same layer for each group."""
    full = named(layout(regions=3), ("a", "b"), ("c", "d"), ("e", "f"))
    stage = named(layout(regions=2, base=0x900000), ("e", "f"), ("a", "b"))
    _, cut = align(stage, full)
    assert cut.region_bases == (full.region_bases[2], full.region_bases[0])
    for other, why in (
        (named(layout(regions=2), ("e", "x"), ("a", "b")), "does not"),
        (named(layout(regions=2), ("a", "b"), ("z", "")), "does not"),
        (dataclasses.replace(layout(regions=2), groups=2), "KV layers"),  # unnamed: by count
    ):
        problem = check_mappable(other, full, 1, 1)
        assert problem is not None and why in problem, problem
    assert check_mappable(named(layout(regions=2), "a", "b"), layout(regions=2), 1, 1) is None
    with pytest.raises(PlanError, match="names the layers of 1 regions"):
        named(layout(regions=2), "a")
    with pytest.raises(PlanError, match="one layer in two regions"):
        named(layout(regions=2), "a", "a")
    with pytest.raises(PlanError, match="one per KV cache group"):
        named(layout(regions=2), ("a", ""), ("", ""))


def test_block_chunks_follow_the_layout() -> None:
    assert layout(order="LBHNC").block_chunks() == ((0, 16 * 4 * UNIT),)
    assert layout(order="BLNHC").block_chunks() == ((0, 16 * 4 * UNIT),)
    heads_outside = layout(order="LHBNC", num_blocks=8)
    assert heads_outside.block_chunks() == tuple((h * 8 * 16 * UNIT, 16 * UNIT) for h in range(4))


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
    """Where (kernel) `block`'s `token` of local head `head` starts."""
    return (
        lay.region_bases[region]
        + block * lay.block_stride
        + head * lay.head_stride
        + token * lay.token_stride
    )


@dataclass(frozen=True)
class Case:
    src: KVLayout
    src_blocks: list[int]
    dst: KVLayout
    dst_blocks: list[int]
    first_token: int
    num_tokens: int
    src_tp: int
    dst_tp: int
    dst_rank: int


@st.composite
def transfer_cases(draw: st.DrawFn) -> Case:
    total_heads = draw(st.sampled_from([1, 2, 4]))
    tps = [t for t in (1, 2, 4) if total_heads % t == 0 or t % total_heads == 0]
    src_tp, dst_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    unit = draw(st.integers(1, 6))
    regions = draw(st.integers(1, 3))
    num_tokens = draw(st.integers(0, 24))
    order = draw(st.sampled_from(sorted(ORDERS)))

    def side(tp: int, first_token: int) -> tuple[KVLayout, list[int]]:
        block_size = draw(st.integers(1, 6))
        sub = draw(st.sampled_from([1, 1, 2]))
        block_tokens = block_size * sub
        needed = -(-num_tokens // block_tokens) - first_token // block_tokens
        num_blocks = max(1, needed + draw(st.integers(0, 3)))
        heads = max(1, total_heads // tp)
        lay = layout(
            heads, block_size, order, num_blocks * sub, regions,
            draw(st.integers(0, 5)), total_heads, sub, unit,
        )  # fmt: skip
        ids = draw(st.permutations(range(num_blocks)))
        if draw(st.booleans()):
            ids = sorted(ids)
        return lay, list(ids[: draw(st.integers(max(needed, 0), num_blocks))])

    first_token = draw(st.integers(0, num_tokens))
    src, src_blocks = side(src_tp, first_token)
    dst, dst_blocks = side(dst_tp, first_token)
    dst_rank = draw(st.integers(0, dst_tp - 1))
    return Case(
        src, src_blocks, dst, dst_blocks, first_token, num_tokens, src_tp, dst_tp, dst_rank
    )


def memory_size(lay: KVLayout) -> int:
    return max(lay.region_bases) + lay.region_bytes + 7


def kernel_cell(lay: KVLayout, blocks: list[int], first_token: int, token: int) -> tuple[int, int]:
    """(kernel block, token offset) of `token` in a list starting at `first_token`'s block."""
    index = token // lay.block_tokens - first_token // lay.block_tokens
    sub, offset = divmod(token % lay.block_tokens, lay.block_size)
    return blocks[index] * lay.sub_blocks + sub, offset


def fewest_runs(cells: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Cells in source order, each joined to the run before it where both sides continue
    it: the fewest descriptors that copy them (a plain loop, the planner's reference)."""
    runs: list[tuple[int, int, int]] = []
    for s, d, n in sorted(cells):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((s, d, n))
    return runs


@settings(max_examples=200, deadline=None)
@given(transfer_cases())
def test_simulated_copy_places_every_byte_and_nothing_else(case: Case) -> None:
    """Every producer rank's plan for one consumer rank, applied to random memory: each
    of the consumer's heads of each token lands exactly once, nothing else changes."""
    src, dst, src_blocks, dst_blocks = case.src, case.dst, case.src_blocks, case.dst_blocks
    first_token, num_tokens = case.first_token, case.num_tokens
    src_tp, dst_tp, dst_rank = case.src_tp, case.dst_tp, case.dst_rank
    rng = np.random.default_rng(num_tokens)
    dst_mem = np.zeros(memory_size(dst), dtype=np.uint8)
    expected = dst_mem.copy()
    total = dst.total_heads
    dst_first, dst_end = head_range(dst_rank, dst_tp, total)
    unit = dst.unit_bytes
    moved: list[int] = []

    for src_rank, (first, end) in sources(dst_rank, dst_tp, src_tp, total).items():
        assert dst_rank in destinations(src_rank, src_tp, dst_tp, total)
        moved += range(first, end)
        # every byte non-zero, distinct per rank, so a stray or missing write shows
        src_mem = rng.integers(1, 256, memory_size(src), dtype=np.uint8)
        plan = plan_transfer(
            src, src_blocks, dst, dst_blocks, num_tokens, first_token=first_token,
            src_rank=src_rank, src_tp=src_tp, dst_rank=dst_rank, dst_tp=dst_tp,
        )  # fmt: skip
        src_first, _ = head_range(src_rank, src_tp, total)
        cells = src.num_regions * (num_tokens - first_token) * (end - first)
        assert plan.total_bytes == cells * unit
        for s, d, n in plan.descriptors():
            assert n > 0
            assert s >= 0 and s + n <= len(src_mem)
            assert d >= 0 and d + n <= len(dst_mem)
            dst_mem[d : d + n] = src_mem[s : s + n]
        cells = []
        for region in range(src.num_regions):
            for token in range(first_token, num_tokens):
                s_block, s_off = kernel_cell(src, src_blocks, first_token, token)
                d_block, d_off = kernel_cell(dst, dst_blocks, first_token, token)
                for head in range(first, end):
                    s = address(src, region, s_block, s_off, head - src_first)
                    d = address(dst, region, d_block, d_off, head - dst_first)
                    expected[d : d + unit] = src_mem[s : s + unit]
                    cells.append((s, d, unit))
        assert listed(plan.descriptors()) == fewest_runs(cells), "every adjacent pair joined"

    assert sorted(moved) == list(range(dst_first, dst_end)), "every head from one producer"
    assert np.array_equal(dst_mem, expected)
