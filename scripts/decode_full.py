"""Requests that wait for decode's blocks longer than prefill's lease (docs/failures.md,
"Decode's KV cache full"), against a running `kvpush up`:

    kvpush model tiny /tmp/m8 --kv-heads 8 --heads 16 --head-dim 128 --vocab-size 32000
    kvpush up --connector kvpush-push --model /tmp/m8 --eager --kv-cache-gib 4 \\
        --max-model-len 23936 --decode-args "--num-gpu-blocks-override 188" &
    .venv/bin/python scripts/decode_full.py --model /tmp/m8

One long answer (a ~20k-token prompt, 3,800 tokens out) fills decode's 188 blocks for
about 50 s on a 2-core CPU; `--late` shorter prompts sent `--after` seconds later find no
room and wait for it to end, past the default 30 s lease on their KV. Prints each
request's outcome and how many kvpush failures each server counted meanwhile.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvpush.testbed import scrape  # noqa: E402

WORDS = "water light river stone "  # 5 tokens a repetition with the tiny models' tokenizer


def ask(proxy: str, model: str, tag: str, repeats: int, max_tokens: int) -> str:
    body = {"model": model, "prompt": f"{tag} " + WORDS * repeats, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        proxy + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=600) as resp:
            usage = json.loads(resp.read())["usage"]
        outcome = f"ok, {usage['prompt_tokens']} prompt and {usage['completion_tokens']} out"
    except urllib.error.HTTPError as exc:
        outcome = f"HTTP {exc.code}: {exc.read().decode()[:300]}"
    return f"{tag}: {outcome} after {time.monotonic() - started:.1f} s"


def failures(url: str) -> float:
    return scrape.total(scrape.scrape(url), "kvpush:failures_total")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model kvpush up serves")
    parser.add_argument("--port", type=int, default=8000, help="kvpush up's proxy port")
    parser.add_argument("--fill", type=int, default=4000, help="repetitions in the long prompt")
    parser.add_argument("--fill-tokens", type=int, default=3800, help="the long answer's length")
    parser.add_argument("--late", type=int, default=4, help="requests sent after it")
    parser.add_argument("--late-repeats", type=int, default=800, help="their prompt repetitions")
    parser.add_argument("--after", type=float, default=6.0, help="seconds before they go")
    args = parser.parse_args()
    proxy = f"http://127.0.0.1:{args.port}"
    servers = {"prefill": f"http://127.0.0.1:{args.port + 100}",
               "decode": f"http://127.0.0.1:{args.port + 200}"}  # fmt: skip
    before = {name: failures(url) for name, url in servers.items()}
    with ThreadPoolExecutor(args.late + 1) as pool:
        fill = pool.submit(ask, proxy, args.model, "fill", args.fill, args.fill_tokens)
        time.sleep(args.after)
        late = [
            pool.submit(ask, proxy, args.model, f"late{i}", args.late_repeats, 8)
            for i in range(args.late)
        ]
        for future in [*late, fill]:
            print(future.result(), flush=True)
    for name, url in servers.items():
        print(f"{name}: kvpush failures +{failures(url) - before[name]:g}")


if __name__ == "__main__":
    main()
