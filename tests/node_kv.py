"""KV memory for node tests, without vLLM: numpy arrays in vLLM's LBHNC layout.

`kvpush.node` runs on any memory a `KVLayout` describes; these tests give it a plain
buffer (layers outermost, then blocks, heads, tokens, and each head's K and V bytes), as
vLLM's CPU backend lays out its cache, and read tokens back by index, not by kvpush's
arithmetic.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass

import numpy as np

from kvpush.core.planning import KVLayout


@dataclass
class KVMemory:
    array: np.ndarray  # uint8 [layers, blocks, heads, tokens, unit bytes]
    layout: KVLayout

    @classmethod
    def make(
        cls,
        layers: int,
        blocks: int,
        heads: int,
        block_size: int,
        unit: int,
        total_heads: int,
        seed: int | None,
    ) -> KVMemory:
        """Random bytes from `seed`, or zeros (None)."""
        shape = (layers, blocks, heads, block_size, unit)
        if seed is None:
            array = np.zeros(shape, dtype=np.uint8)
        else:
            array = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
        base = array.ctypes.data
        layout = KVLayout(
            region_bases=tuple(base + layer * array.strides[0] for layer in range(layers)),
            num_blocks=blocks,
            block_size=block_size,
            num_heads=heads,
            unit_bytes=unit,
            block_stride=array.strides[1],
            head_stride=array.strides[2],
            token_stride=array.strides[3],
            total_heads=total_heads,
        )
        return cls(array, layout)

    @property
    def memory(self) -> tuple[tuple[int, int], ...]:
        return ((self.array.ctypes.data, self.array.nbytes),)

    def tokens(self, blocks: tuple[int, ...] | list[int], n: int) -> np.ndarray:
        """The first `n` tokens held in `blocks`, every layer: [layer, token, head, unit]."""
        picked = self.array[:, list(blocks)]  # [layer, block, head, token, unit]
        layers, count, heads, size, unit = picked.shape
        per_token = picked.transpose(0, 1, 3, 2, 4).reshape(layers, count * size, heads, unit)
        return per_token[:, :n].copy()


def free_port(span: int = 2) -> int:
    """A port with `span` free ports from it, below the kernel's ephemeral range (32768+), so
    no outgoing connection of this process takes it before the control server binds it."""
    while True:
        port = random.randrange(20_000, 30_000)
        try:
            for offset in range(span):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port
