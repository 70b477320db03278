"""Streamed completions at a fixed pace through a running proxy, one at a time.

Made to sit under a tracer, e.g. Linux's scheduler trace of prefill's core while each
request runs (docs/benchmarks.md, "What runs on prefill's core before push's first
token"):

    export KVPUSH_SECRET=$(openssl rand -hex 16)
    kvpush up --connector kvpush-push --model .kvpush/models/tiny &
    .venv/bin/python scripts/paced_requests.py -n 5             # warm
    perf sched record -C 0 -o push.data -- .venv/bin/python scripts/paced_requests.py -n 12
    perf sched timehist -i push.data --time T0,T1

Each line gives the request's TTFT and total time and `at`, its start on the monotonic
clock (which perf's timestamps follow on Linux), so a trace can be cut per request.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvpush.bench.compare import stream_completion  # noqa: E402

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()  # noqa: SIM905


async def paced(args: argparse.Namespace) -> None:
    import aiohttp

    rng = random.Random(args.seed)
    async with aiohttp.ClientSession() as session:
        for i in range(args.requests):
            body = {
                "model": args.model,
                "prompt": " ".join(rng.choice(WORDS) for _ in range(args.words)),
                "max_tokens": args.max_tokens,
                "stream": True,
                "ignore_eos": True,
            }
            started = time.monotonic()
            result = await stream_completion(session, args.url, body, i, timeout=60)
            total = time.monotonic() - started
            if result.ttft_s is None:
                print(f"request {i} failed: {result.error} at {started:.6f}")
            else:
                print(
                    f"request {i} ttft_ms {result.ttft_s * 1000:.1f} total_ms {total * 1000:.1f}"
                    f" tokens {result.tokens} at {started:.6f}"
                )
            await asyncio.sleep(max(0.0, 1 / args.rate - (time.monotonic() - started)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--requests", type=int, default=12)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the proxy")
    parser.add_argument("--model", default=".kvpush/models/tiny", help="served model name")
    parser.add_argument("--words", type=int, default=1000, help="prompt words")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    asyncio.run(paced(parser.parse_args()))


if __name__ == "__main__":
    main()
