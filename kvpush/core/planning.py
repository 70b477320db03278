"""Descriptor planning: which bytes of one side's KV memory land where on the other side.

A `KVLayout` describes the KV cache of one TP rank: several equally shaped regions (one per
layer, or one per layer and K/V), each an array of blocks; a block holds `block_size` tokens
of `num_heads` heads of `head_dim` elements, stored token-major ("NHD": token, head, dim) or
head-major ("HND": head, token, dim). `plan_transfer` turns "the first `num_tokens` tokens of
this request, in these blocks here, into those blocks there" into (src_addr, dst_addr,
length) descriptors, merged wherever both sides are contiguous, because every descriptor
costs time at post (fragmented KV turned 118 descriptors into 18,880 in vLLM).

All regions share one geometry, so the block walk runs once, in offsets from a region's
base, and its result is shifted per region; the cost follows the number of descriptors,
never the number of bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Order = Literal["NHD", "HND"]
ORDERS: tuple[Order, ...] = ("NHD", "HND")

Descriptor = tuple[int, int, int]
"""(src_addr, dst_addr, length) in bytes."""


class PlanError(ValueError):
    """A layout or request that cannot be mapped; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV memory of one TP rank.

    `block_stride` is the distance in bytes between consecutive blocks of a region; 0 means
    blocks are packed (stride = block_bytes). A larger stride describes caches that
    interleave K and V per block (e.g. FlashInfer's (num_blocks, 2, ...) tensors): K and V
    then become two regions whose bases differ by block_bytes.
    """

    region_bases: tuple[int, ...]
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    elem_size: int
    order: Order = "NHD"
    block_stride: int = 0

    def __post_init__(self) -> None:
        if not self.region_bases:
            raise PlanError("KV layout has no regions; register at least one KV cache tensor")
        for name in ("num_blocks", "block_size", "num_heads", "head_dim", "elem_size"):
            value = getattr(self, name)
            if value <= 0:
                raise PlanError(f"KV layout {name} must be positive, got {value}")
        if any(base < 0 for base in self.region_bases):
            raise PlanError("KV layout region base addresses must be non-negative")
        if self.order not in ORDERS:
            raise PlanError(f"KV layout order must be one of {ORDERS}, got {self.order!r}")
        if self.block_stride != 0 and self.block_stride < self.block_bytes:
            raise PlanError(
                f"KV layout block_stride {self.block_stride} is smaller than one block "
                f"({self.block_bytes} bytes); use 0 for packed blocks"
            )

    @property
    def num_regions(self) -> int:
        return len(self.region_bases)

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token: the unit every descriptor is made of."""
        return self.head_dim * self.elem_size

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.num_heads * self.head_bytes

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_bytes

    @property
    def region_bytes(self) -> int:
        """Bytes from a region's base to the end of its last block."""
        return (self.num_blocks - 1) * self.stride + self.block_bytes


@dataclass(frozen=True, slots=True)
class PlanSummary:
    regions: int
    descriptors: int
    total_bytes: int

    def __str__(self) -> str:
        per_region = self.descriptors // self.regions if self.regions else 0
        return (
            f"{self.descriptors} descriptors ({per_region} per region x {self.regions}), "
            f"{self.total_bytes} bytes"
        )


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Descriptors per region; each region's list is sorted by transfer order."""

    regions: tuple[tuple[Descriptor, ...], ...]

    @property
    def num_descriptors(self) -> int:
        return sum(len(descs) for descs in self.regions)

    @property
    def total_bytes(self) -> int:
        return sum(length for descs in self.regions for _, _, length in descs)

    def summary(self) -> PlanSummary:
        return PlanSummary(len(self.regions), self.num_descriptors, self.total_bytes)


def merge_runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ascending ids as (first_id, count): [4, 5, 6, 9] -> [(4, 3), (9, 1)]."""
    runs: list[tuple[int, int]] = []
    for block_id in ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            first, count = runs[-1]
            runs[-1] = (first, count + 1)
        else:
            runs.append((block_id, 1))
    return runs


def head_range(rank: int, tp_size: int, total_heads: int) -> tuple[int, int]:
    """The [first, end) global KV heads held by `rank` when heads are split evenly."""
    per_rank = total_heads // tp_size
    return rank * per_rank, (rank + 1) * per_rank


def peer_ranks(rank: int, tp_size: int, peer_tp_size: int) -> range:
    """Ranks of the other side whose heads overlap `rank`'s heads.

    On decode this is the set of producer ranks whose completions to wait for; on prefill,
    the decode ranks to write to.
    """
    first = rank * peer_tp_size // tp_size
    end = -(-(rank + 1) * peer_tp_size // tp_size)
    return range(first, end)


def check_mappable(
    a: KVLayout, b: KVLayout, a_tp: int, b_tp: int, a_name: str = "source", b_name: str = "dest"
) -> str | None:
    """Why KV laid out as `a` cannot be copied into `b` (None when it can)."""
    if a.num_regions != b.num_regions:
        return (
            f"{a_name} has {a.num_regions} KV regions, {b_name} {b.num_regions}: both sides "
            "must serve the same model and register KV per layer the same way"
        )
    if a.head_dim != b.head_dim:
        return (
            f"{a_name} head_dim {a.head_dim} != {b_name} head_dim {b.head_dim}: "
            "serve the same model on both sides"
        )
    if a.elem_size != b.elem_size:
        return (
            f"{a_name} stores {a.elem_size}-byte KV elements, {b_name} {b.elem_size}-byte: "
            "use the same KV cache dtype on both sides"
        )
    if a.order != b.order:
        return (
            f"{a_name} KV layout is {a.order}, {b_name} {b.order}: mixed layouts would move "
            "one head of one token per descriptor; use the same KV cache layout on both sides"
        )
    a_total, b_total = a.num_heads * a_tp, b.num_heads * b_tp
    if a_total != b_total:
        return (
            f"{a_name} holds {a.num_heads} KV heads x TP {a_tp} = {a_total}, {b_name} "
            f"{b.num_heads} x TP {b_tp} = {b_total}: serve the same model, and use TP sizes "
            "that divide its KV head count (replicated KV heads are not supported)"
        )
    return None


def plan_transfer(
    src: KVLayout,
    src_blocks: Sequence[int],
    dst: KVLayout,
    dst_blocks: Sequence[int],
    num_tokens: int,
    *,
    src_rank: int = 0,
    src_tp: int = 1,
    dst_rank: int = 0,
    dst_tp: int = 1,
) -> WritePlan:
    """Descriptors copying the first `num_tokens` tokens from `src_blocks` to `dst_blocks`.

    Only the heads held by both `src_rank` (of `src_tp`) and `dst_rank` (of `dst_tp`) move;
    `peer_ranks` tells which rank pairs share heads. Block ids beyond what `num_tokens`
    needs are ignored, and nothing outside the needed destination blocks is written.
    """
    problem = check_mappable(src, dst, src_tp, dst_tp)
    if problem:
        raise PlanError(problem)
    _check_rank("source", src_rank, src_tp)
    _check_rank("destination", dst_rank, dst_tp)
    if num_tokens < 0:
        raise PlanError(f"num_tokens must be non-negative, got {num_tokens}")
    src_used = _used_blocks("source", src, src_blocks, num_tokens)
    dst_used = _used_blocks("destination", dst, dst_blocks, num_tokens)

    total_heads = src.num_heads * src_tp
    src_first, src_end = head_range(src_rank, src_tp, total_heads)
    dst_first, dst_end = head_range(dst_rank, dst_tp, total_heads)
    first, end = max(src_first, dst_first), min(src_end, dst_end)
    if first >= end:
        raise PlanError(
            f"source rank {src_rank}/{src_tp} (heads {src_first}-{src_end - 1}) and "
            f"destination rank {dst_rank}/{dst_tp} (heads {dst_first}-{dst_end - 1}) share "
            "no KV heads; plan only for pairs from peer_ranks()"
        )
    pattern = _region_pattern(
        _Side(src, src_used, first - src_first),
        _Side(dst, dst_used, first - dst_first),
        end - first,
        num_tokens,
    )
    return WritePlan(
        tuple(
            tuple((s + src_base, d + dst_base, n) for s, d, n in pattern)
            for src_base, dst_base in zip(src.region_bases, dst.region_bases, strict=True)
        )
    )


def _check_rank(side: str, rank: int, tp_size: int) -> None:
    if tp_size <= 0 or not 0 <= rank < tp_size:
        raise PlanError(f"{side} TP rank {rank} is outside TP size {tp_size}")


def _used_blocks(
    side: str, layout: KVLayout, block_ids: Sequence[int], num_tokens: int
) -> Sequence[int]:
    needed = -(-num_tokens // layout.block_size)
    if len(block_ids) < needed:
        raise PlanError(
            f"{side} has {len(block_ids)} blocks for {num_tokens} tokens at block size "
            f"{layout.block_size}; {needed} are needed"
        )
    bad = [b for b in block_ids if not 0 <= b < layout.num_blocks]
    if bad:
        raise PlanError(
            f"{side} block ids {bad[:5]} are outside the {layout.num_blocks} registered blocks"
        )
    if len(set(block_ids)) != len(block_ids):
        raise PlanError(f"{side} block ids repeat: each block can hold only one request's KV")
    return block_ids[:needed]


@dataclass(frozen=True, slots=True)
class _Side:
    layout: KVLayout
    blocks: Sequence[int]
    head_offset: int  # first moved head, local to this rank


def _region_pattern(src: _Side, dst: _Side, heads: int, num_tokens: int) -> list[Descriptor]:
    """Merged descriptors for one region, as offsets from the regions' bases.

    Tokens are cut into pieces that stay inside one block on both sides. Inside a piece
    both sides store (token, head) vectors in the same order (heads outermost for HND,
    tokens outermost for NHD), contiguous along the inner index; each side is then either
    contiguous over the whole piece or once per outer index, so the piece splits into equal
    runs of the shorter of the two. Runs adjacent on both sides are merged, which is what
    joins consecutive whole blocks into one descriptor.
    """
    unit = src.layout.head_bytes
    head_major = src.layout.order == "HND"
    src_bs, dst_bs = src.layout.block_size, dst.layout.block_size
    out: list[Descriptor] = []
    run_src = run_dst = run_len = 0
    token = 0
    while token < num_tokens:
        src_index, src_off = divmod(token, src_bs)
        dst_index, dst_off = divmod(token, dst_bs)
        count = min(src_bs - src_off, dst_bs - dst_off, num_tokens - token)
        outer, inner = (heads, count) if head_major else (count, heads)
        s_base, s_outer = _piece(src, src.blocks[src_index], src_off, head_major)
        d_base, d_outer = _piece(dst, dst.blocks[dst_index], dst_off, head_major)
        whole_piece = outer == 1 or (s_outer == d_outer == inner * unit)
        length = (outer if whole_piece else 1) * inner * unit
        for o in range(1 if whole_piece else outer):
            s = s_base + o * s_outer
            d = d_base + o * d_outer
            if run_len and run_src + run_len == s and run_dst + run_len == d:
                run_len += length
            else:
                if run_len:
                    out.append((run_src, run_dst, run_len))
                run_src, run_dst, run_len = s, d, length
        token += count
    if run_len:
        out.append((run_src, run_dst, run_len))
    return out


def _piece(side: _Side, block_id: int, token_off: int, head_major: bool) -> tuple[int, int]:
    """Base offset and outer stride of a piece starting at `token_off` of a block."""
    layout = side.layout
    unit = layout.head_bytes
    start = block_id * layout.stride
    if head_major:
        head_stride = layout.block_size * unit
        return start + side.head_offset * head_stride + token_off * unit, head_stride
    token_stride = layout.num_heads * unit
    return start + token_off * token_stride + side.head_offset * unit, token_stride
