"""Prepared block pieces: the fast path's descriptor lists over a `KVLayout`.

When both sides cut blocks alike (`kvpush.node.peers.same_shape`), each side prepares
every piece of every block once per peer, and a transfer names pieces by index.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpush.core.planning import KVLayout
from kvpush.dataplane.transport import Indices, Pieces

# NIXL names prepared descriptors by int32 index
MAX_PIECES = 2**31 - 1


def block_pieces(layout: KVLayout) -> Pieces:
    """Every contiguous piece of every kernel block, region-major then block-major: what
    the prepared fast path indexes (`piece_indices`). One (address, length) row each.

    Built with numpy: a GPU's cache holds tens of thousands of blocks in each of 64
    regions, millions of pieces, which Python tuples took seconds to list (and as long
    again to hand NIXL) on the handshake thread, holding the GIL."""
    chunks = np.array(layout.block_chunks(), dtype=np.int64)  # [piece, (offset, length)]
    bases = np.array(layout.region_bases, dtype=np.int64)
    blocks = np.arange(layout.num_blocks, dtype=np.int64) * layout.block_stride
    starts = bases[:, None, None] + blocks[None, :, None] + chunks[None, None, :, 0]
    pieces = np.empty((starts.size, 2), dtype=np.uint64)
    pieces[:, 0] = starts.reshape(-1)
    pieces[:, 1] = np.broadcast_to(chunks[:, 1], starts.shape).reshape(-1)
    return pieces


def piece_indices(layout: KVLayout, block_ids: Sequence[int]) -> Indices:
    """Indices into `block_pieces(layout)` of scheduler blocks `block_ids`, every region,
    region-major, then block, sub-block and piece: int32, as NIXL takes them.

    Built with numpy: a long prompt on a real model names regions x blocks pieces (64 x
    1,024 for 16k tokens of a 32-layer model with K and V apart), which a Python loop
    took ~70 ms to list on the thread that posts the transfer, holding the GIL."""
    per_block, within_block, regions = _index_parts(layout)
    blocks = np.asarray(block_ids, dtype=np.int64) * per_block
    within = (blocks[:, None] + within_block).reshape(-1)  # block, then sub-block and piece
    indices: np.ndarray[Any, np.dtype[np.int32]] = (regions + within).reshape(-1).astype(np.int32)
    return indices


@functools.lru_cache(maxsize=64)
def _index_parts(layout: KVLayout) -> tuple[int, Any, Any]:
    """What `piece_indices` needs of `layout`, worked out once: pieces per scheduler block,
    each piece's offset within its block's run, each region's first index (a column)."""
    chunks = len(layout.block_chunks())
    per_region = layout.num_blocks * chunks
    if layout.num_regions * per_region > MAX_PIECES:
        raise ValueError(
            f"{layout.num_regions} regions x {per_region} pieces exceed the "
            f"{MAX_PIECES} NIXL can index"
        )
    per_block = layout.sub_blocks * chunks
    within_block = np.arange(per_block, dtype=np.int64)
    regions = np.arange(layout.num_regions, dtype=np.int64)[:, None] * per_region
    return per_block, within_block, regions
