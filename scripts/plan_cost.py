"""What planning one transfer costs when the two sides cut blocks differently.

Where prefill and decode lay out KV alike, kvpush names prepared pieces by index
(`kvpush.node.layout`). Where they do not (a different TP size, block size or kernel
block), each transfer is planned descriptor by descriptor (`kvpush.core.planning.
plan_transfer`) on the thread that posts it: prefill's writer in push, decode's reader in
pull, in the model worker's process. This script times that planning, and the split
into the two piece lists the transport takes, at a real model's shape.

    .venv/bin/python scripts/plan_cost.py                      # Llama-3-8B-like, 16k tokens
    .venv/bin/python scripts/plan_cost.py --layers 80 --kv-heads 8 --tokens 32768
    .venv/bin/python scripts/plan_cost.py --order NHD --src-tp 2 --dst-tp 1

Regions are one per layer for K and one for V (as vLLM's FlashAttention layouts register
them); `--order HND` is heads outside tokens inside a block (the layout kvpush asks
vLLM for), `NHD` tokens outside heads. Block ids are a random scattering of the cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvpush.core.planning import KVLayout, heads_per_rank, plan_transfer  # noqa: E402


def layout(args: argparse.Namespace, tp: int, base: int) -> KVLayout:
    """One TP rank's KV cache: K and V regions per layer, blocks dense in each."""
    heads = heads_per_rank(args.kv_heads, tp)
    unit = args.head_dim * args.dtype_bytes
    token, head = (unit, unit * args.block_size) if args.order == "HND" else (unit * heads, unit)
    block = unit * heads * args.block_size
    region = block * args.num_blocks
    regions = tuple(base + r * region for r in range(2 * args.layers))
    return KVLayout(
        regions, args.num_blocks, args.block_size, heads, unit, block, head, token, args.kv_heads
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32, help="model layers (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="model KV heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head size (default 128)")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="KV bytes per value (2)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    parser.add_argument("--num-blocks", type=int, default=8192, help="blocks per region")
    parser.add_argument("--tokens", type=int, default=16384, help="prompt tokens (16384)")
    parser.add_argument("--order", choices=("HND", "NHD"), default="HND")
    parser.add_argument("--src-tp", type=int, default=1, help="prefill's TP size (1)")
    parser.add_argument("--dst-tp", type=int, default=2, help="decode's TP size (2)")
    parser.add_argument("-n", "--repeat", type=int, default=5, help="timed runs (median)")
    args = parser.parse_args(argv)
    needed = -(-args.tokens // args.block_size)
    if needed > args.num_blocks:
        parser.error(f"{args.tokens} tokens need {needed} blocks; raise --num-blocks")
    src, dst = layout(args, args.src_tp, 1 << 32), layout(args, args.dst_tp, 1 << 40)
    rng = np.random.default_rng(0)
    src_blocks = rng.permutation(args.num_blocks)[:needed].tolist()
    dst_blocks = rng.permutation(args.num_blocks)[:needed].tolist()
    times, count, nbytes = [], 0, 0
    for _ in range(args.repeat):
        start = time.perf_counter()
        plan = plan_transfer(
            src, src_blocks, dst, dst_blocks, args.tokens, src_tp=args.src_tp, dst_tp=args.dst_tp
        )
        pieces = plan.descriptors().astype(np.uint64)
        local, remote = pieces[:, [0, 2]], pieces[:, [1, 2]]
        times.append(time.perf_counter() - start)
        count, nbytes = len(local), int(remote[:, 1].sum())
    print(
        f"{args.order} TP {args.src_tp} -> {args.dst_tp}, {args.tokens} tokens, "
        f"{2 * args.layers} regions: {count} descriptors, {nbytes / 2**20:.1f} MiB "
        f"from one prefill rank to one decode rank, plan and split "
        f"{statistics.median(times) * 1e3:.1f} ms (median of {args.repeat})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
