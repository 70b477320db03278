"""`kvpush proxy`: run the OpenAI-compatible P/D proxy in the foreground (`kvpush proxy bench`:
measure what it adds)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from kvpush.args import at_least, non_negative, port_number, positive
from kvpush.core.protocol import MODES
from kvpush.proxy import bench, first_token
from kvpush.proxy.balance import POLICIES, check_policy
from kvpush.proxy.rewrite import parse_backend

EPILOG = """\
backends:
  --prefill and --decode take one or more backends; any number of each. In push mode decode
  must be told where each prefill's KV lives, so a prefill backend is written
  URL,engine=ID,kv=HOST:PORT[,tp=N][,pp=N][,dp=N] (the engine id and kvpush control address
  the prefill server was started with, its TP size, its pipeline stages, and its
  data-parallel size: the proxy picks one of its DP engines per request and pins prefill's
  leg to it). Any backend may
  say dp=N (URL,dp=N): its queue counts as shared by its engines. Instead of the flags,
  --config FILE lists them in a JSON or TOML file, re-read whenever it changes:
      prefill = ["http://10.0.0.1:8100,engine=prefill-0,kv=10.0.0.1:5600,tp=8"]
      decode = ["http://10.0.0.2:8200", "http://10.0.0.3:8200"]

choice (--policy for both roles, or --prefill-policy / --decode-policy):
  least_loaded (default) sends each leg where it should finish first: the work the proxy has
  in flight there (prefill: prompt tokens; decode: requests), plus what the backend reports
  waiting when --scrape-interval reads its /metrics, times how fast it has been lately.
  Push chooses decode when the request arrives; pull chooses it after prefill answered.
  round_robin takes healthy backends in turn (to compare against). The names are spelled
  as vLLM's and SGLang's routers spell them; least-loaded and round-robin work too.

health:
  every --health-interval seconds each backend gets GET /health; after --eject-after failures
  in a row (or at once when it refuses a connection) it gets no new requests and the legs
  running on it fail at once; after --return-after passing checks it is back. A leg that
  never reached its backend (connection refused), or a pull prefill whose backend vanished
  before answering, is sent to another backend, up to --retries times. In push mode the pair
  is resent only if a leg never reached its backend, with a new transfer id.

conventions:
  errors are JSON as vLLM shapes them, {"error": {"message", "type", "code"}}, on every
  path (an unknown route is a 404 listing the routes). Every answer carries X-Request-Id:
  the client's own if it sent one, else a new one; both legs carry it (with a unique suffix
  when the client chose it) and the client's traceparent/tracestate. vLLM servers started
  with --api-key need --backend-api-key (or $KVPUSH_BACKEND_API_KEY) here.

readiness and shutdown:
  GET /ready answers 200 while the proxy takes requests, and 503 while a role has no healthy
  backend or once SIGTERM (or Ctrl-C) started a drain: point a load balancer's readiness
  check at it. A drain serves what still arrives and ends when no request is in flight (at
  most --request-timeout); a second signal ends it at once.

admin API (with --admin-token, header 'Authorization: Bearer TOKEN'):
  GET /admin/backends                  pools, health, load and estimates
  POST /admin/backends    {"role": "decode", "backend": "http://10.0.0.4:8200"}
  DELETE /admin/backends  {"role": "decode", "url": "http://10.0.0.4:8200"}
  A removed backend finishes the requests it has. Changing the --config file does the same.

examples:
  kvpush proxy --mode pull --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
  kvpush proxy --mode push \\
      --prefill http://127.0.0.1:8100,engine=prefill-0,kv=127.0.0.1:5600 \\
      --decode http://127.0.0.1:8200 http://127.0.0.1:8201
  kvpush proxy --mode pull --config fleet.toml --admin-token "$TOKEN" --scrape-interval 1
  KVPUSH_BACKEND_API_KEY=$VLLM_KEY kvpush proxy --mode pull --prefill-policy round_robin \
      --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 --port 0 --access-log
  kvpush proxy bench              # the proxy's own added latency, against stub backends
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "proxy",
        help="run the OpenAI-compatible P/D proxy (or `proxy bench`: measure its overhead)",
        description="OpenAI-compatible prefill/decode proxy: /v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /ready, /metrics, /admin/backends; streaming "
        "and not; any number of backends, load-aware, health-checked.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mode", choices=MODES, help="KV handoff mode (required)")
    parser.add_argument(
        "--prefill", nargs="+", default=[], metavar="BACKEND", help="prefill servers (see below)"
    )
    parser.add_argument(
        "--decode", nargs="+", default=[], metavar="BACKEND", help="decode servers (see below)"
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="JSON or TOML file listing the backends (instead of --prefill/--decode); "
        "re-read when it changes",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument(
        "--port",
        type=port_number(allow_zero=True),
        default=8000,
        help="port to bind, 1-65535, or 0 for any free one (default %(default)s)",
    )
    policy_names = "{" + ",".join(POLICIES) + "}"
    parser.add_argument(
        "--policy",
        type=policy,
        metavar=policy_names,
        default="least_loaded",
        help="how to choose among backends, for both roles (default %(default)s)",
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-policy",
            type=policy,
            metavar=policy_names,
            help=f"how to choose among {role} backends (default: --policy)",
        )
    parser.add_argument(
        "--retries",
        metavar="N",
        type=at_least(0),
        default=1,
        help="times a leg may be resent elsewhere where that is safe (default %(default)s)",
    )
    parser.add_argument(
        "--health-interval",
        metavar="S",
        type=positive(),
        default=2.0,
        help="seconds between health checks of each backend (default %(default)s)",
    )
    parser.add_argument(
        "--health-timeout",
        metavar="S",
        type=positive(),
        default=5.0,
        help="seconds a health check (or /metrics read) may take (default %(default)s)",
    )
    parser.add_argument(
        "--eject-after",
        metavar="N",
        type=at_least(1),
        default=3,
        help="failed health checks in a row that eject a backend (default %(default)s)",
    )
    parser.add_argument(
        "--return-after",
        metavar="N",
        type=at_least(1),
        default=2,
        help="passing health checks that bring it back (default %(default)s)",
    )
    parser.add_argument(
        "--scrape-interval",
        metavar="S",
        type=non_negative(),
        default=0.0,
        help="read each backend's /metrics (vLLM's waiting queue, KV usage) this often, in "
        "seconds, for the choice (default 0: off; the proxy's own counts only)",
    )
    add_secret(
        parser,
        "--admin-token",
        "enable /admin/backends for 'Authorization: Bearer TOKEN'",
        "KVPUSH_ADMIN_TOKEN",
        "the admin API is off",
    )
    parser.add_argument(
        "--request-timeout",
        metavar="S",
        type=positive(),
        default=300.0,
        help="seconds a request may take end to end before it fails with 504 (default %(default)s)",
    )
    parser.add_argument(
        "--connect-timeout",
        metavar="S",
        type=positive(),
        default=5.0,
        help="seconds to connect to a backend (default %(default)s)",
    )
    add_secret(
        parser,
        "--api-key",
        "require 'Authorization: Bearer KEY' on /v1/*",
        "KVPUSH_API_KEY",
        "none",
    )
    add_secret(
        parser,
        "--backend-api-key",
        "send 'Authorization: Bearer KEY' to every backend (legs, health checks, /metrics): "
        "the --api-key its vLLM servers were started with",
        "KVPUSH_BACKEND_API_KEY",
        "none",
    )
    parser.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per request: client, request line, status, bytes, seconds, X-Request-Id",
    )
    parser.add_argument(
        "--first-token",
        choices=first_token.SOURCES,
        default="prefill",
        help="where a streamed answer's first token comes from. prefill (default): sent the "
        "moment prefill answers, decode then made to continue from that very token (kvpush's "
        "logits processor, loaded by vLLM wherever kvpush is installed); decode: wait for "
        "the handoff and decode's first step, as vLLM's own proxies do. A decode with "
        "speculative decoding (no logits processor there) says so on /metrics and gets "
        "decode's first token either way; use decode with decode servers without kvpush",
    )
    parser.add_argument(
        "--max-body-mb",
        metavar="MIB",
        type=positive(),
        default=8.0,
        help="largest request body accepted, in MiB (default %(default)s)",
    )
    parser.set_defaults(func=run)
    bench.register(parser.add_subparsers(dest="proxy_command", metavar="{bench}"))


def add_secret(parser: argparse.ArgumentParser, flag: str, what: str, env: str, unset: str) -> None:
    """A secret flag whose default is an environment variable, so that the secret need not
    be on the command line, where any user's `ps` shows it."""
    metavar = flag.rpartition("-")[2].upper()
    parser.add_argument(
        flag,
        metavar=metavar,
        default=os.environ.get(env),
        help=f"{what} (default: ${env}, else {unset})",
    )


def policy(name: str) -> str:
    """An argparse type: a balancing policy's name (an alias is accepted)."""
    try:
        return check_policy(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def config_from_args(args: argparse.Namespace) -> Any:
    from kvpush.proxy.config import ProxyConfig
    from kvpush.proxy.fleet import read_fleet

    if not args.mode:
        raise ValueError("--mode push or --mode pull is required")
    if args.config and (args.prefill or args.decode):
        raise ValueError(
            "give the backends either with --prefill/--decode or in --config, not both"
        )
    if args.config:
        fleet = read_fleet(args.config)
        prefill, decode = list(fleet.prefill), list(fleet.decode)
    else:
        prefill = [parse_backend(s) for s in args.prefill]
        decode = [parse_backend(s) for s in args.decode]
    return ProxyConfig(
        mode=args.mode,
        prefill=prefill,
        decode=decode,
        request_timeout=args.request_timeout,
        connect_timeout=args.connect_timeout,
        api_key=args.api_key or None,
        backend_api_key=args.backend_api_key or None,
        access_log=args.access_log,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        retries=args.retries,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        eject_after=args.eject_after,
        return_after=args.return_after,
        scrape_interval=args.scrape_interval,
        admin_token=args.admin_token or None,
        fleet_file=args.config,
        first_token=args.first_token,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvpush proxy: {exc} (see kvpush proxy -h)", file=sys.stderr)
        return 2
    from kvpush.proxy.server import run_proxy_loop

    return run_proxy_loop(_serve(config, args.host, args.port))


def describe(config: Any) -> str:
    """'(pull, least_loaded): 1 prefill, 2 decode backends', policies per role if they differ."""
    prefill, decode = config.policies["prefill"], config.policies["decode"]
    choice = prefill if prefill == decode else f"prefill {prefill}, decode {decode}"
    return (
        f"({config.mode}, {choice}): {len(config.prefill)} prefill, "
        f"{len(config.decode)} decode backends,"
    )


def listening_url(runner: Any) -> str:
    """Where the proxy really listens (with --port 0, the port the system chose)."""
    host, bound = runner.addresses[0][:2]
    return f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"


async def _serve(config: Any, host: str, port: int) -> int:
    from kvpush.proxy.server import PROXY_KEY, start_proxy

    try:
        runner = await start_proxy(config, host, port)
    except OSError as exc:
        print(
            f"kvpush proxy: cannot listen on {host}:{port}: {exc.strerror}; "
            "pick another --port or --host",
            file=sys.stderr,
        )
        return 2
    print(f"kvpush proxy {describe(config)} listening on {listening_url(runner)}", flush=True)
    stop, stop_now = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        # The first SIGTERM or Ctrl-C drains; a second one stops at once.
        (stop_now if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    await runner.app[PROXY_KEY].drain(config.request_timeout, stop_now)
    await runner.cleanup()
    return 0
