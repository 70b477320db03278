"""Describe vLLM's KV cache tensors as a `KVLayout` the planner understands."""

from __future__ import annotations

from typing import Any

from kvpush.core.planning import KVLayout


def describe_kv_caches(
    kv_caches: dict[str, Any], block_size: int, num_heads: int, head_dim: int
) -> tuple[KVLayout, tuple[tuple[int, int], ...]]:
    """One region per layer and K/V plane, in layer order, plus the memory to register.

    Understands the two shapes vLLM's attention backends allocate:
    (num_blocks, 2, block_size, heads * head_dim) on CPU - K and V planes inside each
    block - and (2, num_blocks, block_size, heads, head_dim) or its head-major variant
    (2, num_blocks, heads, block_size, head_dim) on GPUs.
    """
    bases: list[int] = []
    memory: dict[int, int] = {}
    geometry: set[tuple[int, int, str]] = set()
    for name, tensor in kv_caches.items():
        shape, elem = tuple(tensor.shape), tensor.element_size()
        if len(shape) >= 3 and shape[1] == 2 and shape[0] != 2:
            num_blocks, stride = shape[0], tensor.stride(0) * elem
            planes = [tensor.data_ptr(), tensor.data_ptr() + tensor.stride(1) * elem]
            order = "NHD"
        elif shape[0] == 2 and len(shape) == 5:
            num_blocks, stride = shape[1], tensor.stride(1) * elem
            planes = [tensor[0].data_ptr(), tensor[1].data_ptr()]
            order = "HND" if shape[2] == num_heads and shape[3] == block_size else "NHD"
        else:
            raise ValueError(
                f"kvpush does not understand the KV cache of {name}: shape {shape}; "
                "expected (blocks, 2, block_size, heads*dim) or (2, blocks, ...)"
            )
        bases += planes
        geometry.add((num_blocks, stride, order))
        storage = tensor.untyped_storage()
        memory[storage.data_ptr()] = storage.nbytes()
    if len(geometry) != 1:
        raise ValueError(f"KV cache tensors differ in block count/stride/order: {geometry}")
    ((num_blocks, stride, order),) = geometry
    elem = next(iter(kv_caches.values())).element_size()
    layout = KVLayout(
        region_bases=tuple(bases),
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=num_heads,
        head_dim=head_dim,
        elem_size=elem,
        order=order,  # type: ignore[arg-type]
        block_stride=stride,
    )
    return layout, tuple(sorted(memory.items()))


def block_pieces(layout: KVLayout) -> list[tuple[int, int]]:
    """Every (region, block) as one (address, length) piece, region-major."""
    return [
        (base + block * layout.stride, layout.block_bytes)
        for base in layout.region_bases
        for block in range(layout.num_blocks)
    ]
