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
import json
import random
import time
import urllib.request

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def one(url: str, model: str, words: int, max_tokens: int, rng: random.Random) -> str:
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.monotonic()
    first = None
    chunks = 0
    with urllib.request.urlopen(request, timeout=60) as answer:
        for line in answer:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                chunks += 1
                if first is None:
                    first = time.monotonic() - started
    total = time.monotonic() - started
    ttft = "none" if first is None else f"{first * 1000:.1f}"
    return f"ttft_ms {ttft} total_ms {total * 1000:.1f} chunks {chunks} at {started:.6f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--requests", type=int, default=12)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the proxy")
    parser.add_argument("--model", default=".kvpush/models/tiny", help="served model name")
    parser.add_argument("--words", type=int, default=1000, help="prompt words")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    for i in range(args.requests):
        started = time.monotonic()
        print(f"request {i} " + one(args.url, args.model, args.words, args.max_tokens, rng))
        time.sleep(max(0.0, 1 / args.rate - (time.monotonic() - started)))


if __name__ == "__main__":
    main()
