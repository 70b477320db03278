"""`kvpush up`: a whole local P/D deployment in the foreground, stopped by Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from kvpush.args import allow_dash_value, at_least, json_object, port_number, positive
from kvpush.proxy.first_token import SOURCES as FIRST_TOKEN_SOURCES
from kvpush.testbed.hosts import Hosts, HostsError
from kvpush.testbed.pinning import NO_PIN_HELP, check_confined, confined
from kvpush.testbed.topology import (
    LOAD_FAILURE_POLICIES,
    NULL,
    SETUPS,
    Parallel,
    StartupError,
    StartupProgress,
    Topology,
    TopologyConfig,
    first_token_of,
    format_cores,
    stages_only_compiled,
)
from kvpush.testbed.topology_proxy import cannot_listen, local_url, start_topology_proxy, warm_up

EPILOG = """\
setups:
  vllm-pull    vLLM's NixlConnector (decode READs prefill's KV after prefill)
  vllm-push    vLLM's NixlPushConnector (decode registers first, prefill WRITEs)
  kvpush-push  kvpush's connector in push mode
  kvpush-pull  kvpush's connector in pull mode
  vllm-pull-nospin, vllm-push-nospin
               vLLM's connectors with NIXL's progress thread kept from spinning
               (kvpush.bench.nospin): the same code, one core less busy

ports: the proxy listens on --port; prefill i on PORT+100+i, decode j on PORT+200+j;
side channels (control ports) from KV_PORT on, one per worker (TP rank of each DP
engine) of each server in turn; logs go to WORKDIR/logs/.

hosts: with --hosts N (root), the servers run in N network namespaces joined by a bridge,
each with its own address in 198.18.0.0/15 (prefill and decode on different ones), the
KV moving over the link by UCX over TCP; the proxy stays here on 127.0.0.1:PORT.

cores: prefill servers share the first half of this process's cores, decode servers the
second (each its own share where there are enough); every process of a server (API server,
engine core, workers) runs on its share only. With more cores than servers, one is kept
for the proxy. --no-pin binds only the model workers' threads, as before.

examples:
  kvpush model tiny models/tiny && kvpush up --connector vllm-push --model models/tiny
  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "models/tiny", "prompt": "Hello", "max_tokens": 16}'
  kvpush up --connector kvpush-pull --model models/tiny --prefill 1 --decode 2 \\
       --vllm-args "--enable-prefix-caching --max-num-batched-tokens 512"
  kvpush up --connector vllm-pull --model models/tiny --vllm-args --enable-prefix-caching
  kvpush up --connector kvpush-push --model models/tiny --prefill-tp 2 --decode-tp 1
  kvpush up --connector kvpush-pull --model models/tiny --decode-dp 2 \
       --prefill-block-size 32 --decode-block-size 64
  sudo kvpush up --connector kvpush-push --model models/tiny --hosts 2
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "up",
        help="start a local P/D deployment (prefill + decode vLLM servers + proxy)",
        description="Start N prefill and M decode vLLM servers and the kvpush proxy on "
        "127.0.0.1 (the servers on namespace hosts with --hosts), wait until all are "
        "healthy, and keep them running until Ctrl-C.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--connector", choices=[s for s in SETUPS if s != NULL], required=True)
    parser.add_argument("--model", type=Path, required=True, help="model directory")
    parser.add_argument(
        "--prefill", type=at_least(1), default=1, help="prefill servers (default 1)"
    )
    parser.add_argument("--decode", type=at_least(1), default=1, help="decode servers (default 1)")
    parser.add_argument(
        "--port", type=port_number(), default=8000, help="proxy port (default 8000)"
    )
    parser.add_argument(
        "--kv-port", type=port_number(), default=5600, help="first NIXL side-channel port"
    )
    parser.add_argument("--kv-cache-gib", type=positive(), default=1.0, help="KV cache per server")
    parser.add_argument("--max-num-seqs", type=at_least(1), default=8)
    parser.add_argument("--max-model-len", type=at_least(1), default=None)
    parser.add_argument(
        "--eager", action="store_true",
        help="--enforce-eager: start faster, run slower (a pipeline-parallel server on vLLM's "
        "CPU backend stays compiled: it runs no other way)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="start every server with --no-enable-prefix-caching (default: vLLM's default, on)",
    )
    parser.add_argument(
        "--vllm-args",
        default="",
        metavar="ARGS",
        help="extra arguments for every vLLM server, as one string: --vllm-args "
        '"--enable-prefix-caching --max-num-batched-tokens 512"; a single flag needs no '
        "quotes (--vllm-args --enable-prefix-caching)",
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-args",
            default="",
            metavar="ARGS",
            help=f"extra arguments for {role} servers only, after --vllm-args, e.g. "
            + ('"--max-num-batched-tokens 256"' if role == "prefill"
               else '"--num-gpu-blocks-override 64"'),  # fmt: skip
        )
    allow_dash_value(parser, "--vllm-args", "--prefill-args", "--decode-args")
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-tp",
            type=at_least(1),
            default=1,
            metavar="N",
            help=f"tensor-parallel size of each {role} server (default 1)",
        )
        parser.add_argument(
            f"--{role}-dp",
            type=at_least(1),
            default=1,
            metavar="N",
            help=f"data-parallel size of each {role} server (default 1)"
            + ("; in push mode the proxy picks the engine" if role == "prefill" else ""),
        )
    parser.add_argument(
        "--prefill-pp",
        type=at_least(1),
        default=1,
        metavar="N",
        help="pipeline stages of each prefill server (default 1): each stage moves its own "
        "layers' KV; decode runs one stage",
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-block-size",
            type=at_least(1),
            default=None,
            metavar="TOKENS",
            help=f"KV block size of {role} servers (default: the attention backend's; "
            "vLLM's CPU backend takes multiples of 32)",
        )
    parser.add_argument(
        "--hosts",
        type=at_least(1),
        default=None,
        metavar="N",
        help="run the servers on N hosts: network namespaces on a bridge (needs root); "
        "prefill and decode on different ones from N=2, the proxy here (default: all on "
        "127.0.0.1)",
    )
    parser.add_argument(
        "--kv-extra-config",
        type=json_object,
        default={},
        metavar="JSON",
        help="settings added to every server's kv_connector_extra_config, as one JSON object, "
        "e.g. '{\"lease_s\": 60, \"transfer_timeout_s\": 10}' (kvpush's "
        "settings: the README's table); checked before any server starts",
    )
    parser.add_argument(
        "--kv-load-failure-policy",
        choices=LOAD_FAILURE_POLICIES,
        default="",
        help="what decode does with a request whose KV transfer failed (vLLM's "
        "kv_load_failure_policy): fail it (vLLM's default) or recompute its prompt itself, "
        "a slower answer instead of an error; kvpush still counts the failure",
    )
    parser.add_argument(
        "--workdir", type=Path, default=Path(".kvpush"),
        help="the servers' logs (WORKDIR/logs) and vLLM's cache (WORKDIR/vllm-cache, unless "
        "VLLM_CACHE_ROOT is set) (default: .kvpush)",
    )  # fmt: skip
    parser.add_argument("--startup-timeout", type=positive(), default=600.0)
    parser.add_argument("--request-timeout", type=positive(), default=300.0)
    parser.add_argument("--no-pin", dest="pin", action="store_false", help=NO_PIN_HELP)
    parser.add_argument(
        "--first-token",
        choices=FIRST_TOKEN_SOURCES,
        default=None,
        help="where the proxy takes a streamed answer's first token from (kvpush proxy "
        "--first-token; default: prefill with kvpush's connector, decode with vLLM's)",
    )
    parser.add_argument(
        "--warmup",
        type=at_least(0),
        default=1,
        help="requests sent through the proxy before 'ready' is printed (default 1; 0: none)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = TopologyConfig(
            model=args.model,
            setup=args.connector,
            n_prefill=args.prefill,
            n_decode=args.decode,
            port=args.port,
            kv_port=args.kv_port,
            kv_cache_gib=args.kv_cache_gib,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            eager=args.eager,
            prefix_caching=args.prefix_caching,
            kv_extra_config=args.kv_extra_config,
            kv_load_failure_policy=args.kv_load_failure_policy,
            extra_vllm_args=vllm_args(args.vllm_args),
            role_vllm_args={
                role: vllm_args(getattr(args, f"{role}_args"), f"--{role}-args")
                for role in ("prefill", "decode")
            },
            parallel={
                role: Parallel(
                    getattr(args, f"{role}_tp"),
                    getattr(args, f"{role}_dp"),
                    getattr(args, f"{role}_block_size"),
                    args.prefill_pp if role == "prefill" else 1,
                )
                for role in ("prefill", "decode")
            },
            workdir=args.workdir,
            pin=args.pin,
        )
        first_token_of(args.connector, args.first_token)  # before anything starts
    except ValueError as exc:
        print(f"kvpush up: {exc}", file=sys.stderr)
        return 2
    hosts = Hosts(args.hosts) if args.hosts else None
    try:
        if hosts is not None:
            hosts.create()
    except HostsError as exc:
        print(f"kvpush up: --hosts: {exc}", file=sys.stderr)
        return 1
    try:
        return _run(Topology(config, hosts=list(hosts or ())), args)
    finally:
        if hosts is not None:
            hosts.close()


def _run(topology: Topology, args: argparse.Namespace) -> int:
    stop_requested = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stop_requested
        stop_requested = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        _print_plan(topology)
        topology.start()
        took = topology.wait_healthy(args.startup_timeout, StartupProgress("", every=5.0))
        note = topology.moved_back_note()
        print(f"\nall {len(topology.specs)} servers healthy after {took:.0f} s{note}", flush=True)
        if topology.config.pin:
            print(confinement(topology), flush=True)
        with confined(topology.client_cores):
            from kvpush.proxy.server import run_proxy_loop

            return run_proxy_loop(_serve(topology, args))
    except StartupError as exc:
        print(f"\nkvpush up: {exc}\nstopping everything that was started.", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError) as exc:
        # CancelledError: SIGTERM while serving (`_stop_on_sigterm`)
        signalled = stop_requested or isinstance(exc, asyncio.CancelledError)
        print("\nstopping (signal)" if signalled else "\nstopping (Ctrl-C)", flush=True)
        return 0
    finally:
        # the stop is bounded (each server's grace, then SIGKILL): a second SIGTERM must
        # not cut it short and leave servers behind
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        topology.stop()
        print("all servers stopped", flush=True)


def vllm_args(text: str, flag: str = "--vllm-args") -> list[str]:
    """`flag`'s value split as a shell would split it; ValueError says what is wrong."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"{flag} {text!r}: {exc} (quote it as one string)") from None


def _print_plan(topology: Topology) -> None:
    config = topology.config
    pinning = topology.pinning()
    print(f"kvpush up: {config.setup}, model {config.model}", flush=True)
    for spec in topology.specs:
        ports = spec.kv_ports
        kv = f"{ports[0]}" if len(ports) == 1 else f"{ports[0]}-{ports[-1]}"
        print(
            f"  {spec.name:<10} {spec.url:<24} engine {spec.engine_id:<10} "
            f"kv {spec.address}:{kv:<11} cores {spec.env['VLLM_CPU_OMP_THREADS_BIND']:<5} "
            f"{spec.parallel.describe():<10} "
            + (f"netns {spec.netns} " if spec.netns else "")
            + f"log {spec.log_path}",
            flush=True,
        )
        if config.eager and stages_only_compiled(spec.parallel):
            print(f"  {spec.name}: compiled, not eager: vLLM's CPU backend runs a second "
                  "pipeline stage only compiled (its start takes longer)", flush=True)  # fmt: skip
    where = ", ".join(f"{n} on {s['cores']}" for n, s in pinning["servers"].items())
    how = "every process of each server" if config.pin else "model worker threads only (--no-pin)"
    print(f"  cores: {where} ({how}); proxy: {pinning['proxy_and_client']}", flush=True)


def confinement(topology: Topology) -> str:
    """One line per server: how many of its processes and threads run only on its cores,
    read back from /proc; or which do not."""
    lines = []
    for spec in topology.specs:
        proc = topology.procs.get(spec.name)
        if proc is None:
            continue
        threads, problems = check_confined(proc.pid, spec.cores)
        processes = len({t.pid for t in threads})
        lines.append(
            f"  {spec.name}: {processes} processes, {len(threads)} threads, all on cores "
            f"{format_cores(spec.cores)}"
            if not problems
            else f"  {spec.name}: NOT confined: " + "; ".join(problems[:3])
        )
    return "pinning read back from /proc:\n" + "\n".join(lines)


def _stop_on_sigterm() -> None:
    """From here on SIGTERM cancels the serving task, as Ctrl-C does under asyncio.run: the
    proxy closes, then `_run` stops the servers. The handler `_run` sets for start-up
    raises KeyboardInterrupt wherever the main thread happens to be, which inside the event
    loop can be the middle of asyncio's or aiohttp's own code. (Once, in a full test run, a
    `kvpush up` stopped that way signalled its servers only 60 s after its SIGTERM; the
    cause was not found, but nothing here interrupts the loop from outside any more.)"""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    cancelled = False

    def stop() -> None:
        nonlocal cancelled
        if not cancelled:  # a second SIGTERM must not cut the proxy's close short
            cancelled = True
            task.cancel()

    loop.add_signal_handler(signal.SIGTERM, stop)


async def _serve(topology: Topology, args: argparse.Namespace) -> int:
    from kvpush.proxy.server import PROXY_KEY

    _stop_on_sigterm()
    try:
        settings: dict[str, Any] = {"request_timeout": args.request_timeout}
        if args.first_token:
            settings["first_token"] = args.first_token
        runner = await start_topology_proxy(topology, args.port, **settings)
    except OSError as exc:
        raise cannot_listen(args.port, exc) from None
    proxy = runner.app[PROXY_KEY]
    mode = proxy.config.mode
    url = local_url(args.port)
    for i in range(args.warmup):
        error = await warm_up(url, str(topology.config.model))
        print(f"  warm-up {i + 1}/{args.warmup}: {error or 'ok'}", flush=True)
    source = proxy.config.first_token
    if source == "prefill" and not proxy.backends.prefill_may_give_first_token():
        source = ("decode (its decode samples its own: speculative decoding, or a model "
                  "with state layers)")
    print(f"  a streamed answer's first token comes from {source}", flush=True)
    print(f"proxy ({mode}) ready: {url}", flush=True)
    print(
        f"  try: curl -s {url}/v1/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{topology.config.model}", "prompt": "Hello", "max_tokens": 16}}\'',
        flush=True,
    )
    print("Ctrl-C stops everything.", flush=True)
    last = ""
    last_print = time.monotonic()
    try:
        while True:
            await asyncio.sleep(1.0)
            topology.check_alive()
            line = proxy.status_line()
            if line != last or time.monotonic() - last_print > 60:
                print(f"  [{time.strftime('%H:%M:%S')}] {line}", flush=True)
                last, last_print = line, time.monotonic()
    except StartupError as exc:
        print(f"kvpush up: a server died: {exc}", file=sys.stderr)
        return 1
    finally:
        await runner.cleanup()
