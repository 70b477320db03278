"""Prepared block pieces: the fast path's descriptor lists over a `KVLayout`.

When both sides cut blocks alike (`kvpush.node.peers.same_shape`), each side prepares
every piece of every block once per peer, and a transfer names pieces by index.
"""

from __future__ import annotations

from kvpush.core.planning import KVLayout


def block_pieces(layout: KVLayout) -> list[tuple[int, int]]:
    """Every contiguous piece of every kernel block, region-major then block-major: what
    the prepared fast path indexes (`piece_indices`)."""
    chunks = layout.block_chunks()
    return [
        (base + block * layout.block_stride + offset, length)
        for base in layout.region_bases
        for block in range(layout.num_blocks)
        for offset, length in chunks
    ]


def piece_indices(layout: KVLayout, block_ids: list[int]) -> list[int]:
    """Indices into `block_pieces(layout)` of scheduler blocks `block_ids`, every region."""
    chunks = len(layout.block_chunks())
    sub = layout.sub_blocks
    per_region = layout.num_blocks * chunks
    return [
        region * per_region + (b * sub + j) * chunks + c
        for region in range(layout.num_regions)
        for b in block_ids
        for j in range(sub)
        for c in range(chunks)
    ]
