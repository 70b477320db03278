"""`kvpush bench turns`: two-turn chats, decode's prefix cache on and off, in one run.

A chat's second turn repeats the first turn and its answer, then asks something new. With
vLLM's prefix caching on (its default) decode already holds the first turn's blocks, so
kvpush moves only the rest; with it off, decode receives the whole prompt again. For each
setup this command starts the pair twice - decode (and prefill) with prefix caching on,
then off - and sends the same conversations through the proxy one at a time: turn 1, then
turn 2 with the answer of turn 1. For every turn it reads decode's
`vllm:prompt_tokens_by_source_total` before and after, so it reports per turn how many
prompt tokens came from decode's cache, by transfer, or were computed, and the client's
TTFT. vLLM's `bench serve` has shared-prefix datasets but no conversation that carries its
own answers forward, hence this small driver.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvpush.args import at_least, cannot_write, positive
from kvpush.bench.compare import (
    add_pair_options,
    bench_model,
    model_prompts,
    pair_settings,
    stream_completion,
)
from kvpush.report import format_table
from kvpush.testbed import scrape
from kvpush.testbed.topology import (
    PairSettings,
    StartupError,
    StartupProgress,
    Topology,
    check_setups,
)
from kvpush.testbed.topology_proxy import with_warm_proxy

SOURCES = ("local_cache_hit", "external_kv_transfer", "local_compute")
EPILOG = """\
examples:
  kvpush bench turns                                  # kvpush-push and kvpush-pull, 8 chats
  kvpush bench turns --setups kvpush-push --conversations 16 --turn1-len 1024
"""


@dataclass(frozen=True, slots=True)
class TurnSpec:
    setups: tuple[str, ...] = ("kvpush-push", "kvpush-pull")
    conversations: int = 8
    turn1_len: int = 512
    turn2_len: int = 64
    output_len: int = 32
    request_timeout: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_setups(list(self.setups))


@dataclass(slots=True)
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    ttft_ms: float
    sources: dict[str, float]


@dataclass(slots=True)
class Run:
    setup: str
    prefix_caching: bool
    status: str = "ok"
    reason: str = ""
    startup_s: float = 0.0
    turns: list[Turn] = field(default_factory=list)

    def of(self, turn: int) -> list[Turn]:
        return [t for t in self.turns if t.turn == turn]


def decode_sources(url: str) -> dict[str, float]:
    samples = scrape.scrape(url)
    name = "vllm:prompt_tokens_by_source_total"
    return {source: scrape.total(samples, name, source=source) for source in SOURCES}


def chat_body(model: str, messages: list[dict[str, str]], spec: TurnSpec) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": spec.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def converse(
    spec: TurnSpec, topology: Topology, url: str, prompts: list[str], run: Run
) -> None:
    """Every conversation, one request at a time, so each counter delta is one turn's."""
    import aiohttp

    model = str(topology.config.model)
    decode = next(s.url for s in topology.specs if s.role == "decode")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        for index in range(spec.conversations):
            first, follow_up = prompts[2 * index], prompts[2 * index + 1]
            messages = [{"role": "user", "content": f"chat {index}: {first}"}]
            for turn in (1, 2):
                before = await asyncio.to_thread(decode_sources, decode)
                result = await stream_completion(
                    session, url, chat_body(model, messages, spec), index,
                    spec.request_timeout, path="/v1/chat/completions",
                )  # fmt: skip
                if not result.ok or result.ttft_s is None:
                    run.status, run.reason = "failed", f"chat {index} turn {turn}: {result.error}"
                    return
                after = await asyncio.to_thread(decode_sources, decode)
                moved = {k: after[k] - before[k] for k in SOURCES}
                run.turns.append(
                    Turn(index, turn, result.prompt_tokens, 1000 * result.ttft_s, moved)
                )
                messages += [
                    {"role": "assistant", "content": result.text},
                    {"role": "user", "content": follow_up},
                ]


def run_pair(
    spec: TurnSpec, pair: PairSettings, setup: str, caching: bool, prompts: list[str]
) -> Run:
    run = Run(setup, caching)
    label = "turns-" + ("cache-on" if caching else "cache-off")
    topology = Topology(replace(pair, prefix_caching=caching).topology(setup, label))
    print(f"\n== {setup}, prefix caching {'on' if caching else 'off'}", flush=True)
    try:
        topology.start()
        run.startup_s = topology.wait_healthy(pair.startup_timeout, StartupProgress("  "))
        asyncio.run(
            with_warm_proxy(
                topology,
                pair.port,
                lambda url: converse(spec, topology, url, prompts, run),
                request_timeout=spec.request_timeout + 10,
            )
        )
    except StartupError as exc:
        run.status, run.reason = "failed", str(exc).splitlines()[0]
    finally:
        topology.stop()
    print(f"  {run.status} {run.reason}".rstrip(), flush=True)
    return run


def summary_rows(runs: list[Run]) -> list[list[str]]:
    rows = []
    for run in runs:
        if run.status != "ok":
            rows.append([run.setup, "on" if run.prefix_caching else "off", run.status,
                         "", "", "", "", run.reason[:60]])  # fmt: skip
            continue
        second = run.of(2)
        prompt = sum(t.prompt_tokens for t in second)
        moved = {k: sum(t.sources[k] for t in second) for k in SOURCES}
        sent = moved["external_kv_transfer"]
        rows.append(
            [
                run.setup,
                "on" if run.prefix_caching else "off",
                "ok",
                f"{statistics.median(t.ttft_ms for t in run.of(1)):.1f}",
                f"{statistics.median(t.ttft_ms for t in second):.1f}",
                f"{prompt}",
                f"{sent:.0f} ({100 * sent / prompt:.0f}%)" if prompt else f"{sent:.0f}",
                f"{moved['local_cache_hit']:.0f} / {moved['local_compute']:.0f}",
            ]
        )
    return rows


HEADER = [
    "setup", "decode prefix cache", "result", "turn 1 TTFT p50 ms", "turn 2 TTFT p50 ms",
    "turn 2 prompt tokens", "transferred", "cached / computed",
]  # fmt: skip


# -- command line --------------------------------------------------------------------------


def register(tools: Any) -> None:
    parser = tools.add_parser(
        "turns",
        help="two-turn chats with decode's prefix cache on and off: tokens moved, TTFT",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = TurnSpec()
    parser.add_argument(
        "--setups", default=",".join(defaults.setups), help="comma-separated (default %(default)s)"
    )
    parser.add_argument("--conversations", type=at_least(1), default=defaults.conversations)
    parser.add_argument(
        "--turn1-len", type=at_least(1), default=defaults.turn1_len,
        help="tokens of the first message (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--turn2-len", type=at_least(1), default=defaults.turn2_len,
        help="tokens of the follow-up message (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--output-len", type=at_least(1), default=defaults.output_len)
    parser.add_argument("--request-timeout", type=positive(), default=defaults.request_timeout)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    add_pair_options(parser)
    parser.add_argument("--out", type=Path, default=None, help="also write every turn to this JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        given = {f.name: getattr(args, f.name) for f in fields(TurnSpec) if f.name != "setups"}
        setups = tuple(s.strip() for s in args.setups.split(",") if s.strip())
        spec = TurnSpec(setups=setups, **given)
    except ValueError as exc:
        print(f"{args.prog}: {exc}", file=sys.stderr)
        return 2
    try:
        model = bench_model(args)
    except ValueError as exc:
        print(f"{args.prog}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"{args.prog}: {cannot_write(exc, Path(exc.filename or args.workdir))}", file=sys.stderr
        )
        return 2
    firsts = model_prompts(model, spec.conversations, spec.turn1_len, spec.seed)
    follow_ups = model_prompts(model, spec.conversations, spec.turn2_len, spec.seed + 1)
    prompts = [p for pair in zip(firsts, follow_ups, strict=True) for p in pair]
    pair = pair_settings(model, args)
    started = time.monotonic()
    runs = [
        run_pair(spec, pair, setup, caching, prompts)
        for setup in spec.setups
        for caching in (True, False)
    ]
    print(f"\nkvpush bench turns: {spec.conversations} two-turn chats per row, "
          f"{time.monotonic() - started:.0f} s\n")  # fmt: skip
    print(format_table(HEADER, summary_rows(runs)))
    if args.out is not None:
        try:
            args.out.write_text(
                json.dumps({"spec": asdict(spec), "runs": [asdict(r) for r in runs]}, indent=1)
            )
        except OSError as exc:
            print(f"{args.prog}: {cannot_write(exc, args.out)}", file=sys.stderr)
            return 2
    return 0 if all(r.status == "ok" for r in runs) else 1
