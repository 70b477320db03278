"""`kvpush model`: the command line of the tiny model builder (`kvpush/testbed/model.py`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvpush.args import at_least, cannot_write
from kvpush.testbed import model
from kvpush.testbed.model import ARCHS, DTYPE_BYTES, TinyModelSpec, build_tiny_model

EXAMPLES = """\
examples:
  kvpush model tiny models/tiny          # 2 layers, 512 KV bytes per token, in seconds
  kvpush model tiny models/m --layers 8 --heads 8 --kv-heads 8 --head-dim 64
  kvpush model tiny models/gqa8 --heads 16 --kv-heads 8 --head-dim 128
  kvpush model tiny models/mla --arch deepseek_v2   # multi-head latent attention
  kvpush model tiny models/swa --arch llama --layers 4 --sliding-window 32
                                         # sliding-window layers between full ones
  kvpush model tiny models/gdn --arch qwen3_next --layers 4   # states (linear attention)
  kvpush model tiny models/swo --arch llama --sliding-window 256 --every-layer-windowed
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "model",
        help="build models for local testing",
        description="Build models for local testing, offline.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kinds = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    tiny = kinds.add_parser(
        "tiny",
        help="a small random-weight model (Qwen2, Llama or DeepSeek-V2 style), offline",
        description=model.__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tiny.add_argument("dir", type=Path, help="output directory (created if missing)")
    defaults = TinyModelSpec()
    tiny.add_argument("--layers", type=at_least(1), default=defaults.layers)
    tiny.add_argument("--heads", type=at_least(1), default=defaults.heads, help="attention heads")
    tiny.add_argument("--kv-heads", type=at_least(1), default=defaults.kv_heads)
    tiny.add_argument("--head-dim", type=at_least(1), default=defaults.head_dim)
    tiny.add_argument("--intermediate-size", type=at_least(1), default=defaults.intermediate_size)
    tiny.add_argument("--vocab-size", type=at_least(300), default=defaults.vocab_size)
    tiny.add_argument("--dtype", default=defaults.dtype, choices=sorted(DTYPE_BYTES))
    tiny.add_argument(
        "--arch",
        default=defaults.arch,
        choices=ARCHS,
        help="qwen2 (grouped-query attention), llama (the same, and it can have "
        "sliding-window layers), deepseek_v2 (MLA) or qwen3_next (three linear-attention "
        "layers, keeping a state per request, to every full-attention one; bfloat16 on "
        "vLLM's CPU backend); default qwen2",
    )
    tiny.add_argument(
        "--sliding-window",
        type=at_least(0),
        default=defaults.sliding_window,
        metavar="TOKENS",
        help="--arch llama: every other layer, from the first, attends only this many "
        "tokens back, the others the whole context (default 0: every layer full)",
    )
    tiny.add_argument(
        "--every-layer-windowed",
        action="store_true",
        help="with --sliding-window: every layer attends through the window (as Mistral 7B "
        "v0.1), none the whole context",
    )
    tiny.add_argument("--seed", type=int, default=defaults.seed)
    tiny.set_defaults(func=_run_tiny)


def _run_tiny(args: argparse.Namespace) -> int:
    try:
        spec = TinyModelSpec(
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            intermediate_size=args.intermediate_size,
            vocab_size=args.vocab_size,
            dtype=args.dtype,
            seed=args.seed,
            arch=args.arch,
            sliding_window=args.sliding_window,
            every_layer_windowed=args.every_layer_windowed,
        )
    except ValueError as exc:
        print(f"kvpush model tiny: {exc}", file=sys.stderr)
        return 2
    try:
        summary = build_tiny_model(args.dir, spec)
    except OSError as exc:
        print(
            f"kvpush model tiny: {cannot_write(exc, args.dir)}; give a directory you can write",
            file=sys.stderr,
        )
        return 2
    print(
        f"built {summary['path']}: {spec.arch}, {spec.layers} layers, "
        + ("MLA latent 512+64" if spec.arch == "deepseek_v2" else
           f"{spec.kv_heads} KV heads x {spec.head_dim} dims")  # fmt: skip
        + (f", sliding window {spec.sliding_window} on "
           f"{'every' if spec.every_layer_windowed else 'every other'} layer"
           if spec.sliding_window else "")  # fmt: skip
        + f", {spec.dtype}, vocab {summary['vocab']}, "
        f"{spec.kv_bytes_per_token} KV bytes/token"
    )
    return 0
