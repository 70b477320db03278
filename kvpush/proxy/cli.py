"""`kvpush proxy`: run the OpenAI-compatible P/D proxy in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Any

from kvpush.proxy.rewrite import MODES, parse_backend

EPILOG = """\
backends:
  --prefill and --decode take one or more URLs. In push mode decode must be told where each
  prefill's KV lives, so a prefill backend is written URL,engine=ID,kv=HOST:PORT[,tp=N]
  (the engine id and NIXL side-channel address the prefill server was started with).

examples:
  kvpush proxy --mode pull --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
  kvpush proxy --mode push \\
      --prefill http://127.0.0.1:8100,engine=prefill-0,kv=127.0.0.1:5600 \\
      --decode http://127.0.0.1:8200
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "proxy",
        help="run the OpenAI-compatible P/D proxy",
        description="OpenAI-compatible prefill/decode proxy: /v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics; streaming and not.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mode", choices=MODES, required=True, help="KV handoff mode")
    parser.add_argument("--prefill", nargs="+", required=True, metavar="BACKEND")
    parser.add_argument("--decode", nargs="+", required=True, metavar="BACKEND")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default %(default)s)")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds a request may take end to end before it fails with 504 (default %(default)s)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds to connect to a backend (default %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVPUSH_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $KVPUSH_API_KEY, else none)",
    )
    parser.add_argument(
        "--max-body-mb", type=float, default=8.0, help="largest request body accepted (MiB)"
    )
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> Any:
    from kvpush.proxy.server import ProxyConfig

    return ProxyConfig(
        mode=args.mode,
        prefill=[parse_backend(s) for s in args.prefill],
        decode=[parse_backend(s) for s in args.decode],
        request_timeout=args.request_timeout,
        connect_timeout=args.connect_timeout,
        api_key=args.api_key or None,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvpush proxy: {exc}")
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_serve(config, args.host, args.port))


async def _serve(config: Any, host: str, port: int) -> int:
    from kvpush.proxy.server import start_proxy

    try:
        runner = await start_proxy(config, host, port)
    except OSError as exc:
        print(f"kvpush proxy: cannot listen on {host}:{port}: {exc.strerror}; pick another --port")
        return 1
    print(f"kvpush proxy ({config.mode}) listening on http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    return 0
