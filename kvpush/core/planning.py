"""Descriptor planning: which bytes of one side's KV memory land where on the other side.

A `KVLayout` describes the KV cache of one TP rank as vLLM laid it out: one region per
layer, each an array of blocks; a block holds `block_size` tokens of `num_heads` head
slots, and one head of one token is a `unit_bytes`-long run (K and V together for normal
attention, the latent vector for MLA). Where block, head and token sit is given by three
byte strides, so every layout vLLM can build (heads or tokens outermost inside a block,
layers inside blocks, heads outside blocks, padded pages) is the same description with
other numbers; nothing here guesses from tensor shapes.

`plan_transfer` turns "tokens [first_token, num_tokens) of this request, in these blocks
here, into those blocks there" into (src_addr, dst_addr, length) descriptors, merged
wherever both sides are contiguous, because every descriptor costs time at post
(fragmented KV turned 118 descriptors into 18,880 in vLLM). All regions share one
geometry, so the block walk runs once, in offsets from a region's base, and its result is
shifted per region; the cost follows the number of descriptors, never the number of bytes.

Tensor parallelism: a model's `total_heads` distinct KV heads are split evenly over the TP
ranks, or, with fewer heads than ranks (and always for MLA, whose one latent "head" every
rank holds), each rank holds one head that `tp / total_heads` consecutive ranks share, as
vLLM does. `sources` says which producer rank sends which heads to a consumer rank: each
head comes from exactly one producer, replicas taking turns across consumers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    Rows = np.ndarray[Any, np.dtype[np.int64]]
    """Descriptors as an [N, 3] int64 array of (src_addr, dst_addr, length) rows."""

Descriptor = tuple[int, int, int]
"""(src_addr, dst_addr, length) in bytes."""


class PlanError(ValueError):
    """A layout or request that cannot be mapped; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV memory of one TP rank.

    Head `h` of token `t` of block `b` in region `r` starts at
    `region_bases[r] + b * block_stride + h * head_stride + t * token_stride` and is
    `unit_bytes` long. Blocks are the attention kernel's; one block id of vLLM's scheduler
    covers `sub_blocks` consecutive ones (vLLM splits a scheduler block into kernel blocks
    when the backend needs smaller ones).

    `whole_blocks`: the attention kernel packs each head's block its own way, so the
    cells above locate a head's block but not the tokens inside it (vLLM's CPU attention
    stores a block's K transposed, head size x tokens, then its V). Such blocks only move
    whole, between sides with the same block size.

    `groups`: vLLM's KV cache groups (its hybrid KV cache manager: full-attention layers in
    one group, sliding-window layers in others). The groups' layers share the regions, each
    group's block ids its own, so a block id names the same cells in every region whichever
    group holds it. A request's block list is then one list per group, concatenated, every
    group's of the same length (`group_lists`); block 0, vLLM's null block, stands for a
    block a sliding-window group no longer keeps.

    `state_groups`: the groups whose layers keep one state per request (Mamba, linear
    attention) instead of a KV cell per token. A block of theirs holds a state of
    `state_bytes` from the block's first byte (a scheduler block, `sub_blocks` kernel
    blocks, is one page for every group), and a request's state after its last token is
    in the block of that token's position: what moves is that block's state, in each
    region holding the group's layer, whatever the other tokens.
    """

    region_bases: tuple[int, ...]
    num_blocks: int
    block_size: int
    num_heads: int
    unit_bytes: int
    block_stride: int
    head_stride: int
    token_stride: int
    total_heads: int
    sub_blocks: int = 1
    whole_blocks: bool = False
    groups: int = 1
    layers: tuple[tuple[str, ...], ...] = ()
    state_groups: tuple[int, ...] = ()
    state_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.region_bases:
            raise PlanError("KV layout has no regions; register at least one KV cache tensor")
        if self.state_groups:
            self._check_states()
        if self.layers:
            self._check_layers()
        for name in (
            "num_blocks",
            "block_size",
            "num_heads",
            "unit_bytes",
            "block_stride",
            "head_stride",
            "token_stride",
            "total_heads",
            "sub_blocks",
            "groups",
        ):
            value = getattr(self, name)
            if value <= 0:
                raise PlanError(f"KV layout {name} must be positive, got {value}")
        if any(base < 0 for base in self.region_bases):
            raise PlanError("KV layout region base addresses must be non-negative")
        if self.num_blocks % self.sub_blocks:
            raise PlanError(
                f"KV layout has {self.num_blocks} kernel blocks, not a multiple of "
                f"{self.sub_blocks} per scheduler block"
            )
        problem = _overlap(self)
        if problem:
            raise PlanError(f"KV layout cells overlap: {problem}")

    def _check_states(self) -> None:
        page = self.block_stride * self.sub_blocks
        if not all(0 <= g < self.groups for g in self.state_groups) or len(
            set(self.state_groups)
        ) != len(self.state_groups):
            raise PlanError(
                f"KV layout names state groups {self.state_groups} among {self.groups} groups"
            )
        if len(self.state_groups) == self.groups:
            raise PlanError("KV layout keeps states alone; kvpush needs an attention group")
        if not 0 < self.state_bytes <= page:
            raise PlanError(
                f"KV layout keeps states of {self.state_bytes} bytes in blocks of {page}"
            )

    def _check_layers(self) -> None:
        if len(self.layers) != len(self.region_bases):
            raise PlanError(
                f"KV layout names the layers of {len(self.layers)} regions, but has "
                f"{len(self.region_bases)}"
            )
        if any(len(names) != self.groups or not any(names) for names in self.layers):
            raise PlanError(
                f"KV layout names a region's layers other than one per KV cache group "
                f"({self.groups}), at least one of them a layer"
            )
        named = [name for names in self.layers for name in names if name]
        if len(set(named)) != len(named):
            raise PlanError("KV layout names one layer in two regions")

    @property
    def num_regions(self) -> int:
        return len(self.region_bases)

    @property
    def block_tokens(self) -> int:
        """Tokens of one scheduler block (the unit block ids count in)."""
        return self.block_size * self.sub_blocks

    @property
    def scheduler_blocks(self) -> int:
        """How many block ids the scheduler hands out: valid ids are 0..this-1."""
        return self.num_blocks // self.sub_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of KV one kernel block of one region holds (padding excluded)."""
        return self.block_size * self.num_heads * self.unit_bytes

    @property
    def region_bytes(self) -> int:
        """Bytes from a region's base to the end of its last cell."""
        last = (
            (self.num_blocks - 1) * self.block_stride
            + (self.num_heads - 1) * self.head_stride
            + (self.block_size - 1) * self.token_stride
        )
        return last + self.unit_bytes

    @property
    def head_major(self) -> bool:
        """Inside a block, heads are outermost (HND) rather than tokens (NHD)."""
        return self.head_stride > self.token_stride

    def block_chunks(self) -> tuple[tuple[int, int], ...]:
        """The contiguous (offset, length) runs one block's cells make, in address order.

        One run when a block is dense (vLLM's block-contiguous layouts), one per head when
        heads sit outside blocks, one per cell in the worst case. Worked out once per
        layout: every transfer asks, on the thread that posts it.
        """
        return _block_chunks(self)

    def _chunks(self) -> tuple[tuple[int, int], ...]:
        dims = sorted(
            ((s, n) for s, n in ((self.token_stride, self.block_size),
                                 (self.head_stride, self.num_heads)) if n > 1),
        )  # fmt: skip
        unit = self.unit_bytes
        if not dims:
            return ((0, unit),)
        if dims[0][0] != unit:
            cells = [
                h * self.head_stride + t * self.token_stride
                for h in range(self.num_heads)
                for t in range(self.block_size)
            ]
            return tuple((c, unit) for c in sorted(cells))
        inner = dims[0][1] * unit
        if len(dims) == 1:
            return ((0, inner),)
        outer_stride, outer_count = dims[1]
        if outer_stride == inner:
            return ((0, inner * outer_count),)
        return tuple((i * outer_stride, inner) for i in range(outer_count))


@functools.lru_cache(maxsize=64)
def _block_chunks(layout: KVLayout) -> tuple[tuple[int, int], ...]:
    return layout._chunks()


def _overlap(layout: KVLayout) -> str | None:
    """Why two cells of `layout` would share bytes (None when none do)."""
    dims = sorted(
        (stride, count, name)
        for stride, count, name in (
            (layout.token_stride, layout.block_size, "token"),
            (layout.head_stride, layout.num_heads, "head"),
            (layout.block_stride, layout.num_blocks, "block"),
        )
        if count > 1
    )
    extent = layout.unit_bytes
    for stride, count, name in dims:
        if stride < extent:
            return f"{name} stride {stride} is below the {extent} bytes the inner dimensions span"
        extent = stride * count
    return None


def align(a: KVLayout, b: KVLayout, a_name: str = "source", b_name: str = "dest") -> tuple[
    KVLayout, KVLayout
]:
    """`a` and `b` cut to the regions of the layers both hold, in the same order, so
    region i of one pairs with region i of the other.

    A pipeline-parallel side holds some of the model's layers on each stage: the side
    that holds every layer of the other is cut to the regions that hold them, each named
    for the layers the other holds there (a region twice where the other side keeps two
    of its groups' layers apart, once for each). Unnamed regions
    pair by index. Raises `PlanError` when neither side holds every layer of the other.
    """
    if a.layers and a.layers == b.layers:
        return a, b
    if not a.layers or not b.layers:
        if a.num_regions == b.num_regions:
            return a, b
        raise PlanError(
            f"{a_name} has {a.num_regions} KV layers, {b_name} {b.num_regions}: both sides "
            "must serve the same model"
        )
    into_b, missing = _places(a, b)
    if into_b is not None:
        return a, _regions(b, tuple(into_b), a.layers)
    into_a, other = _places(b, a)
    if into_a is not None:
        return _regions(a, tuple(into_a), b.layers), b
    raise PlanError(
        f"{a_name} holds KV layer {missing} where {b_name} does not, and {b_name} layer "
        f"{other} where {a_name} does not: both sides must serve the same model, and at "
        "most one of them split over pipeline stages"
    )


def _places(part: KVLayout, whole: KVLayout) -> tuple[list[int] | None, str]:
    """For each region of `part`, the region of `whole` that holds the same layers for
    every group `part` names there; None (and the first layer without one) if any lacks."""
    at = {name: i for i, names in enumerate(whole.layers) for name in names if name}
    places = []
    for names in part.layers:
        first = next(name for name in names if name)
        i = at.get(first)
        if i is None or any(n and n != w for n, w in zip(names, whole.layers[i], strict=True)):
            return None, first
        places.append(i)
    return places, ""


def partial(layout: KVLayout) -> bool:
    """Some region holds fewer layers than the model's KV cache groups (a pipeline stage
    of a model with several groups)."""
    return any(not all(names) for names in layout.layers)


def group_regions(src: KVLayout, dst: KVLayout, group: int) -> list[int] | None:
    """The regions (of aligned `src` and `dst`) through which KV cache group `group`'s
    blocks move: where both hold that group's layer. None: every region (neither side
    names a region with fewer layers than the model's groups)."""
    if not (partial(src) or partial(dst)):
        return None
    pairs = zip(src.layers, dst.layers, strict=True)
    return [i for i, (s, d) in enumerate(pairs) if s[group] and d[group]]


@functools.lru_cache(maxsize=256)
def _regions(
    layout: KVLayout, keep: tuple[int, ...], layers: tuple[tuple[str, ...], ...]
) -> KVLayout:
    """`layout` with regions `keep` alone, in that order, holding `layers`."""
    return dataclasses.replace(
        layout, region_bases=tuple(layout.region_bases[i] for i in keep), layers=layers
    )


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


@dataclass(frozen=True, slots=True, eq=False)
class WritePlan:
    """One region's descriptors as offsets from the regions' bases (`pattern`, [P, 3]
    int64 rows sorted by source), shifted to every region pair: all regions share one
    geometry, so a plan holds P rows however many regions the model has."""

    pattern: Rows
    src_bases: tuple[int, ...]
    dst_bases: tuple[int, ...]

    @property
    def regions(self) -> tuple[tuple[Descriptor, ...], ...]:
        """Descriptors per region, as Python tuples (for reading; `descriptors()` for use)."""
        rows = self.pattern.tolist()
        return tuple(
            tuple((s + sb, d + db, n) for s, d, n in rows)
            for sb, db in zip(self.src_bases, self.dst_bases, strict=True)
        )

    @property
    def num_descriptors(self) -> int:
        return len(self.pattern) * len(self.src_bases)

    @property
    def total_bytes(self) -> int:
        return int(self.pattern[:, 2].sum()) * len(self.src_bases)

    def summary(self) -> PlanSummary:
        return PlanSummary(len(self.src_bases), self.num_descriptors, self.total_bytes)

    def descriptors(self) -> Rows:
        """Every descriptor, [N, 3] int64 rows in source order, joined across regions where
        both sides continue each other (layouts that put all layers of a block together
        move a block as one run)."""
        import numpy as np

        order = np.argsort(np.array(self.src_bases, dtype=np.int64), kind="stable")
        rows = np.empty((len(order), len(self.pattern), 3), dtype=np.int64)
        rows[:] = self.pattern
        rows[:, :, 0] += np.array(self.src_bases, dtype=np.int64)[order, None]
        rows[:, :, 1] += np.array(self.dst_bases, dtype=np.int64)[order, None]
        return coalesce(rows.reshape(-1, 3))


def coalesce(descriptors: Sequence[Descriptor] | Rows) -> Rows:
    """`descriptors` in source order, adjacent ones (on both sides) joined; [N, 3] int64.

    Vectorized: a long prompt on a model with K and V apart makes hundreds of thousands of
    descriptors when the sides cut blocks differently (TP 1 to TP 2 in token-major
    layouts: one per token, head range and layer), which a Python loop took a second to
    sort and join on the thread that posts the transfer, holding the GIL."""
    import numpy as np

    rows: Rows = np.asarray(descriptors, dtype=np.int64).reshape(-1, 3)
    if len(rows) < 2:
        return rows.copy()
    starts = rows[:, 0]
    if not bool(np.all(starts[1:] > starts[:-1])):  # cells never overlap: starts differ
        rows = rows[np.argsort(starts, kind="stable")]
    ends = rows[:-1, :2] + rows[:-1, 2:3]
    breaks = np.flatnonzero((rows[1:, 0] != ends[:, 0]) | (rows[1:, 1] != ends[:, 1])) + 1
    first = np.concatenate(([0], breaks))
    out: Rows = rows[first]
    out[:, 2] = np.add.reduceat(rows[:, 2], first)
    return out


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


def tp_problem(total_heads: int, tp_size: int) -> str | None:
    """Why `total_heads` KV heads cannot be split over `tp_size` ranks (None if they can)."""
    if total_heads >= tp_size and total_heads % tp_size:
        return f"{total_heads} KV heads do not split evenly over TP {tp_size}"
    if total_heads < tp_size and tp_size % total_heads:
        return f"TP {tp_size} is not a multiple of the model's {total_heads} KV heads"
    return None


def heads_per_rank(total_heads: int, tp_size: int) -> int:
    return max(1, total_heads // tp_size)


def head_range(rank: int, tp_size: int, total_heads: int) -> tuple[int, int]:
    """The [first, end) global KV heads held by `rank` (replicated heads: shared ranks)."""
    if total_heads >= tp_size:
        per_rank = total_heads // tp_size
        return rank * per_rank, (rank + 1) * per_rank
    head = rank // (tp_size // total_heads)
    return head, head + 1


def sources(
    rank: int, tp_size: int, src_tp: int, total_heads: int
) -> dict[int, tuple[int, int]]:
    """Producer ranks (of `src_tp`) that send consumer `rank` (of `tp_size`) its heads, and
    the [first, end) global heads each sends.

    Every head comes from exactly one producer; where producers replicate a head, consumer
    ranks take turns, so replicas share the work.
    """
    first, end = head_range(rank, tp_size, total_heads)
    chosen: dict[int, tuple[int, int]] = {}
    for head in range(first, end):
        if total_heads >= src_tp:
            src = head // (total_heads // src_tp)
        else:
            replicas = src_tp // total_heads
            src = head * replicas + rank % replicas
        lo, _ = chosen.get(src, (head, head))
        chosen[src] = (lo, head + 1)
    return chosen


def destinations(src_rank: int, src_tp: int, tp_size: int, total_heads: int) -> list[int]:
    """Consumer ranks (of `tp_size`) that `src_rank` sends heads to (`sources` inverted)."""
    return [r for r in range(tp_size) if src_rank in sources(r, tp_size, src_tp, total_heads)]


def unread(src_tp: int, tp_size: int, total_heads: int) -> list[int]:
    """Producer ranks (of `src_tp`) that send no consumer rank (of `tp_size`) anything: their
    heads are replicas another producer sends. Nobody reads their KV, so it can go at once."""
    used: set[int] = set()
    for rank in range(tp_size):
        used.update(sources(rank, tp_size, src_tp, total_heads))
    return [r for r in range(src_tp) if r not in used]


def check_mappable(
    a: KVLayout, b: KVLayout, a_tp: int, b_tp: int, a_name: str = "source", b_name: str = "dest"
) -> str | None:
    """Why KV laid out as `a` cannot be copied into `b` (None when it can)."""
    if (a.state_groups or b.state_groups) and a_tp != b_tp:  # each rank's state differs
        return state_tp_problem(a_tp, b_tp)
    if a.state_groups != b.state_groups or a.state_bytes != b.state_bytes:
        return (
            f"{a_name} keeps states of {a.state_bytes} bytes in KV cache groups "
            f"{list(a.state_groups)}, {b_name} of {b.state_bytes} in {list(b.state_groups)}: "
            "serve the same model with the same Mamba cache settings on both sides"
        )
    if a.groups != b.groups:
        return (
            f"{a_name} keeps {a.groups} KV cache groups, {b_name} {b.groups}: run vLLM's "
            "hybrid KV cache manager on both sides or on neither (the same "
            "--disable-hybrid-kv-cache-manager setting)"
        )
    try:
        a, b = align(a, b, a_name, b_name)
    except PlanError as exc:
        return str(exc)
    if a.unit_bytes != b.unit_bytes:
        return (
            f"{a_name} stores {a.unit_bytes} bytes per head and token, {b_name} "
            f"{b.unit_bytes}: serve the same model with the same KV cache dtype on both sides"
        )
    if a.total_heads != b.total_heads:
        return (
            f"{a_name} holds a model with {a.total_heads} KV heads, {b_name} "
            f"{b.total_heads}: serve the same model on both sides"
        )
    for name, layout, tp in ((a_name, a, a_tp), (b_name, b, b_tp)):
        problem = tp_problem(layout.total_heads, tp)
        if problem:
            return f"{name}: {problem}"
        if layout.num_heads != heads_per_rank(layout.total_heads, tp):
            return (
                f"{name} holds {layout.num_heads} KV heads per rank, but {layout.total_heads} "
                f"heads over TP {tp} give {heads_per_rank(layout.total_heads, tp)}"
            )
    if a.whole_blocks != b.whole_blocks:
        packed, plain = (a_name, b_name) if a.whole_blocks else (b_name, a_name)
        return (
            f"{packed}'s attention backend packs the tokens of each KV block its own way "
            f"(vLLM's CPU attention) and {plain}'s does not: run both sides on the same "
            "attention backend"
        )
    if a.whole_blocks and a.block_size != b.block_size:
        return (
            f"{a_name} has KV blocks of {a.block_size} tokens, {b_name} of {b.block_size}, "
            "and vLLM's CPU attention packs the tokens of each block its own way, so its "
            "blocks only move whole: serve both sides with the same --block-size"
        )
    if _interior(a) is not None and _interior(b) is not None and a.head_major != b.head_major:
        order = {True: "head-major (HND)", False: "token-major (NHD)"}
        return (
            f"{a_name} lays out blocks {order[a.head_major]}, {b_name} "
            f"{order[b.head_major]}: every head of every token would be its own descriptor; "
            "use the same KV cache layout on both sides (vLLM's VLLM_KV_CACHE_LAYOUT)"
        )
    return None


def _interior(layout: KVLayout) -> bool | None:
    """Whether heads are outermost inside a block; None when a block has one head or one
    token, where both orders are the same."""
    return layout.head_major if layout.num_heads > 1 and layout.block_size > 1 else None


def plan_transfer(
    src: KVLayout,
    src_blocks: Sequence[int],
    dst: KVLayout,
    dst_blocks: Sequence[int],
    num_tokens: int,
    *,
    first_token: int = 0,
    src_rank: int = 0,
    src_tp: int = 1,
    dst_rank: int = 0,
    dst_tp: int = 1,
    group: int | None = None,
) -> WritePlan:
    """Descriptors copying tokens [first_token, num_tokens) from `src_blocks` to
    `dst_blocks`.

    Each side's block list begins with the scheduler block that holds `first_token` on
    that side (a decode with a prefix-cache hit lists only its uncached tail). Only the
    heads `sources` assigns to this rank pair move. Block ids beyond what the tokens need
    are ignored, and nothing outside the needed destination cells is written (with
    `whole_blocks` layouts: outside the blocks that hold the tokens, each moved whole).
    The blocks are KV cache group `group`'s (needed where a pipeline stage holds some of
    its regions for fewer groups: only the regions where both sides hold the group's
    layer move).
    """
    problem = check_mappable(src, dst, src_tp, dst_tp)
    if problem:
        raise PlanError(problem)
    src, dst = align(src, dst)
    if group is None and src.groups > 1 and (partial(src) or partial(dst)):
        raise PlanError("a pipeline stage keeps some regions for fewer KV cache groups: "
                        "plan each group's blocks apart")  # fmt: skip
    keep = group_regions(src, dst, group or 0)
    _check_rank("source", src_rank, src_tp)
    _check_rank("destination", dst_rank, dst_tp)
    if not 0 <= first_token <= num_tokens:
        raise PlanError(
            f"tokens [{first_token}, {num_tokens}) are no range: first_token must be "
            "between 0 and num_tokens"
        )
    heads = sources(dst_rank, dst_tp, src_tp, src.total_heads)
    if src_rank not in heads:
        raise PlanError(
            f"source rank {src_rank}/{src_tp} sends no KV heads to destination rank "
            f"{dst_rank}/{dst_tp}; plan only for pairs from sources()"
        )
    first, end = heads[src_rank]
    if group is not None and group in src.state_groups:
        return _state_plan(src, src_blocks, dst, dst_blocks, keep)
    if src.whole_blocks and first_token < num_tokens:  # check_mappable: both, same size
        size = src.block_size
        first_token, num_tokens = first_token // size * size, -(-num_tokens // size) * size
    pattern = _region_pattern(
        _Side.of(src, "source", src_blocks, src_rank, src_tp, first, first_token, num_tokens),
        _Side.of(dst, "destination", dst_blocks, dst_rank, dst_tp, first, first_token, num_tokens),
        end - first,
        first_token,
        num_tokens,
    )
    if keep is None:
        return WritePlan(pattern, src.region_bases, dst.region_bases)
    return WritePlan(
        pattern,
        tuple(src.region_bases[i] for i in keep),
        tuple(dst.region_bases[i] for i in keep),
    )


def _state_plan(
    src: KVLayout,
    src_blocks: Sequence[int],
    dst: KVLayout,
    dst_blocks: Sequence[int],
    keep: list[int] | None,
) -> WritePlan:
    """The state of one request (the first block of each list, `group_ranges` cut them
    to it) in every region holding the group's layer: one run from the block's start
    (`check_mappable` refused sides of different TP sizes already)."""
    import numpy as np

    for side, layout, blocks in (("source", src, src_blocks), ("destination", dst, dst_blocks)):
        if not len(blocks):
            raise PlanError(f"the {side} names no block for a state layer group's state")
        check_block_ids(side, layout, blocks[:1])
    page_s, page_d = src.block_stride * src.sub_blocks, dst.block_stride * dst.sub_blocks
    pattern = np.array(
        [[src_blocks[0] * page_s, dst_blocks[0] * page_d, src.state_bytes]], dtype=np.int64
    )
    if keep is None:
        keep = list(range(src.num_regions))
    return WritePlan(
        pattern,
        tuple(src.region_bases[i] for i in keep),
        tuple(dst.region_bases[i] for i in keep),
    )


def state_tp_problem(src_tp: int, dst_tp: int) -> str:
    return (
        f"the model keeps states (Mamba or linear attention layers), which TP {src_tp} "
        f"and TP {dst_tp} split differently: serve both sides with the same "
        "--tensor-parallel-size"
    )


def _check_rank(side: str, rank: int, tp_size: int) -> None:
    if tp_size <= 0 or not 0 <= rank < tp_size:
        raise PlanError(f"{side} TP rank {rank} is outside TP size {tp_size}")


def check_block_ids(side: str, layout: KVLayout, block_ids: Sequence[int]) -> None:
    """Block ids a transfer names must be distinct scheduler blocks of `layout`."""
    limit = layout.scheduler_blocks
    if len(block_ids) and not (min(block_ids) >= 0 and max(block_ids) < limit):
        bad = [b for b in block_ids if not 0 <= b < limit]
        raise PlanError(
            f"{side} block ids {bad[:5]} are outside the {layout.scheduler_blocks} "
            "registered blocks"
        )
    if len(set(block_ids)) != len(block_ids):
        raise PlanError(f"{side} block ids repeat: each block can hold only one request's KV")


NULL_BLOCK = 0  # vLLM's null block: a sliding-window group's block below the window


def group_lists(side: str, layout: KVLayout, block_ids: Sequence[int]) -> list[Sequence[int]]:
    """A request's block list split into its KV cache groups' lists (`KVLayout.groups`)."""
    count = layout.groups
    if count == 1:
        return [block_ids]
    per, rest = divmod(len(block_ids), count)
    if rest:
        raise PlanError(
            f"{side} names {len(block_ids)} block ids, not the same number for each of its "
            f"{count} KV cache groups"
        )
    return [block_ids[g * per : (g + 1) * per] for g in range(count)]


def blocks_from(layout: KVLayout, block_ids: Sequence[int], first_token: int) -> Sequence[int]:
    """A request's block list (from token 0) cut to begin with the block of `first_token`,
    in each KV cache group."""
    first = first_token // layout.block_tokens
    if layout.groups == 1:
        return block_ids[first:]
    return [b for ids in group_lists("the request", layout, block_ids) for b in ids[first:]]


def leading_nulls(side: str, block_ids: Sequence[int]) -> int:
    """How many of `block_ids` are vLLM's null block before the first real one (a
    sliding-window group's blocks below the window); a null after a real block is refused."""
    count = 0
    while count < len(block_ids) and block_ids[count] == NULL_BLOCK:
        count += 1
    if NULL_BLOCK in block_ids[count:]:
        raise PlanError(f"{side} has vLLM's null block between real ones: {list(block_ids)[:8]}")
    return count


def group_ranges(
    src: KVLayout,
    src_blocks: Sequence[int],
    dst: KVLayout,
    dst_blocks: Sequence[int],
    first_token: int,
    num_tokens: int,
) -> list[tuple[int, Sequence[int], Sequence[int]]]:
    """One copy per KV cache group: where it starts, and both sides' lists cut to start there.

    Each side's list holds its groups' lists one after the other (`group_lists`), each
    beginning with the block that holds `first_token` on that side. A sliding-window group
    has vLLM's null block below its window: its copy starts at the destination's first
    real block, and the source must hold every token from there on.
    """
    if src.groups != dst.groups:
        raise PlanError(f"the source keeps {src.groups} KV cache groups, the destination "
                        f"{dst.groups}")  # fmt: skip
    s_first, d_first = first_token // src.block_tokens, first_token // dst.block_tokens
    s_needed = blocks_needed(src, first_token, num_tokens)
    d_needed = blocks_needed(dst, first_token, num_tokens)
    ranges: list[tuple[int, Sequence[int], Sequence[int]]] = []
    for group, (s, d) in enumerate(zip(
        group_lists("the source", src, src_blocks),
        group_lists("the destination", dst, dst_blocks),
        strict=True,
    )):  # fmt: skip
        if group in src.state_groups:
            last = num_tokens - 1
            s_at, d_at = last // src.block_tokens - s_first, last // dst.block_tokens - d_first
            s_state = _state_block("the source", s, s_at)
            ranges.append((last, s_state, _state_block("the destination", d, d_at)))
            continue
        real = (d_first + leading_nulls("the destination", d[:d_needed])) * dst.block_tokens
        start = min(max(first_token, real), num_tokens)
        held = (s_first + leading_nulls("the source", s[:s_needed])) * src.block_tokens
        if held > start:
            raise PlanError(
                f"the source no longer holds tokens [{start}, {held}) of a sliding-window "
                "KV cache group that the destination needs"
            )
        cut_s, cut_d = start // src.block_tokens - s_first, start // dst.block_tokens - d_first
        ranges.append((start, s[cut_s:], d[cut_d:]))
    return ranges


def _state_block(side: str, block_ids: Sequence[int], index: int) -> Sequence[int]:
    """A state group's list cut to the block that holds the request's state after its
    last token: vLLM keeps a request's running state in the block of its last computed
    token (prefix caching's "align" mode), the blocks before it null or older states."""
    if not 0 <= index < len(block_ids) or block_ids[index] == NULL_BLOCK:
        raise PlanError(
            f"{side} holds no block for the state of a state (Mamba) layer group at its "
            f"last token (block {index} of {list(block_ids)[:8]})"
        )
    return block_ids[index : index + 1]


def blocks_needed(layout: KVLayout, first_token: int, num_tokens: int) -> int:
    """Scheduler blocks holding tokens [first_token, num_tokens), counted from the one
    that holds `first_token`."""
    if num_tokens <= first_token:
        return 0
    return -(-num_tokens // layout.block_tokens) - first_token // layout.block_tokens


@dataclass(frozen=True, slots=True)
class _Side:
    layout: KVLayout
    blocks: Any  # kernel block ids (int64 array), the first holding kernel block `first_block`
    first_block: int
    head_offset: int  # first moved head, local to this rank

    @classmethod
    def of(
        cls,
        layout: KVLayout,
        side: str,
        block_ids: Sequence[int],
        rank: int,
        tp: int,
        first_head: int,
        first_token: int,
        num_tokens: int,
    ) -> _Side:
        import numpy as np

        needed = blocks_needed(layout, first_token, num_tokens)
        if len(block_ids) < needed:
            raise PlanError(
                f"{side} has {len(block_ids)} blocks for tokens [{first_token}, {num_tokens}) "
                f"at {layout.block_tokens} tokens per block; {needed} are needed"
            )
        check_block_ids(side, layout, block_ids)
        sub = layout.sub_blocks
        used = np.asarray(block_ids[:needed], dtype=np.int64)
        kernel = (used[:, None] * sub + np.arange(sub)).reshape(-1)
        first_block = first_token // layout.block_tokens * sub
        rank_first, _ = head_range(rank, tp, layout.total_heads)
        return cls(layout, kernel, first_block, first_head - rank_first)

    def cells(self, tokens: Any) -> Any:
        """Offset of the first moved head of each of `tokens` (an int64 array)."""
        layout = self.layout
        index, offset = tokens // layout.block_size, tokens % layout.block_size
        return (
            self.blocks[index - self.first_block] * layout.block_stride
            + self.head_offset * layout.head_stride
            + offset * layout.token_stride
        )


def _region_pattern(
    src: _Side, dst: _Side, heads: int, first_token: int, num_tokens: int
) -> Rows:
    """Merged descriptors for one region, as offsets from the regions' bases: [P, 3] int64
    rows in source order.

    Each token's moved heads are listed along the dimension that is contiguous on both
    sides: a run of tokens per head and piece (a piece stays inside one block on both
    sides) when tokens are innermost, a run of heads per token when heads are, else one
    cell per head and token. Rows adjacent on both sides then merge, which is what joins
    consecutive tokens, heads and whole blocks into one descriptor.
    """
    import numpy as np

    s_lay, d_lay = src.layout, dst.layout
    unit = s_lay.unit_bytes
    tokens = np.arange(first_token, num_tokens, dtype=np.int64)
    if tokens.size == 0:
        return np.empty((0, 3), dtype=np.int64)
    head = np.arange(heads, dtype=np.int64)
    if s_lay.token_stride == unit and d_lay.token_stride == unit:  # per head and piece
        cut = (tokens % s_lay.block_size == 0) | (tokens % d_lay.block_size == 0)
        cut[0] = True
        first = np.flatnonzero(cut)
        count = np.diff(np.append(first, tokens.size))
        at = tokens[first]
        s = src.cells(at)[:, None] + head * s_lay.head_stride
        d = dst.cells(at)[:, None] + head * d_lay.head_stride
        n = np.broadcast_to((count * unit)[:, None], s.shape)
    elif heads == 1 or (s_lay.head_stride == unit and d_lay.head_stride == unit):  # per token
        s, d = src.cells(tokens), dst.cells(tokens)
        n = np.full(s.shape, heads * unit, dtype=np.int64)
    else:  # per head and token
        s = src.cells(tokens)[:, None] + head * s_lay.head_stride
        d = dst.cells(tokens)[:, None] + head * d_lay.head_stride
        n = np.full(s.shape, unit, dtype=np.int64)
    rows = np.stack((s.reshape(-1), d.reshape(-1), n.reshape(-1)), axis=1)
    return coalesce(rows)
