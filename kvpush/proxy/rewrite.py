"""Pure request rewriting for the P/D proxy: no I/O, easy to unit-test.

Pull: the prefill leg runs the prompt with max_tokens=1 and returns `kv_transfer_params`
(prefill's coordinates and block ids); the decode leg carries those back to the engine.
Push: the decode instance is chosen up front; both legs are sent at once with the same
request id, and decode is told where prefill lives (engine id, side-channel host/port, TP).
A data-parallel prefill (`dp=N`) runs N engines behind one API server: the proxy picks the
engine, names it to decode, and pins prefill's leg to it (vLLM's `X-data-parallel-rank`).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvpush.core.protocol import ENGINE_PARAM, MISROUTED_PARAM, MODES

# Fields that only make sense for the client-facing leg and must not reach prefill.
_PREFILL_DROPPED = ("stream_options", "logprobs", "top_logprobs", "n", "best_of", "min_tokens")


class RequestError(ValueError):
    """The client's request cannot be served; the message says what to change."""


@dataclass(frozen=True, slots=True)
class Backend:
    """One vLLM server: its HTTP URL and, for prefill in push mode, its KV coordinates."""

    url: str
    engine_id: str = ""
    kv_host: str = ""
    kv_port: int = 0
    tp_size: int = 1
    # data-parallel engines behind its one API server: they share its load, and a push
    # prefill's legs are pinned to one of them
    dp_size: int = 1
    # pipeline stages of each engine: with TP, the engine's control ports (one per rank)
    pp_size: int = 1

    @property
    def has_kv_coordinates(self) -> bool:
        return bool(self.engine_id and self.kv_host and self.kv_port)

    def engine(self, dp_rank: int) -> tuple[str, int]:
        """The engine id and first control port of its data-parallel engine `dp_rank`:
        vLLM appends "_dp<rank>" to a data-parallel engine's id, and kvpush gives each
        engine's ranks (TP x pipeline stages) the control ports after the previous engine's."""
        if self.dp_size == 1:
            return self.engine_id, self.kv_port
        ranks = self.tp_size * self.pp_size
        return f"{self.engine_id}_dp{dp_rank}", self.kv_port + dp_rank * ranks


DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM runs the request on that engine


def parse_backend(spec: str) -> Backend:
    """Parse `URL[,engine=ID][,kv=HOST:PORT][,tp=N][,pp=N][,dp=N]` as given on the command
    line."""
    url, *options = [part.strip() for part in spec.split(",")]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"backend {spec!r}: expected a URL like http://127.0.0.1:8100")
    fields: dict[str, Any] = {"url": url.rstrip("/")}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"backend {spec!r}: option {option!r} is not KEY=VALUE")
        if key == "engine":
            fields["engine_id"] = value
        elif key == "kv":
            host, colon, port = value.rpartition(":")
            if not colon or not port.isdigit():
                raise ValueError(f"backend {spec!r}: kv={value!r} must be HOST:PORT")
            fields["kv_host"], fields["kv_port"] = host, int(port)
        elif key in ("tp", "pp", "dp"):
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"backend {spec!r}: {key}={value!r} must be a positive integer")
            fields[f"{key}_size"] = int(value)
        else:
            raise ValueError(
                f"backend {spec!r}: unknown option {key!r} (use engine, kv, tp, pp, dp)"
            )
    return Backend(**fields)


def format_backend(backend: Backend) -> str:
    """Inverse of `parse_backend`."""
    dp = f",dp={backend.dp_size}" if backend.dp_size > 1 else ""
    if not backend.has_kv_coordinates:
        return backend.url + dp
    pp = f",pp={backend.pp_size}" if backend.pp_size > 1 else ""
    return (
        f"{backend.url},engine={backend.engine_id},"
        f"kv={backend.kv_host}:{backend.kv_port},tp={backend.tp_size}{pp}{dp}"
    )


def usable_header(value: str, limit: int = 512) -> bool:
    """Whether a header value may be passed on as it is: printable ASCII, not too long."""
    return 0 < len(value) <= limit and value.isascii() and value.isprintable()


def answer_id(client_id: str | None) -> str:
    """The X-Request-Id a request is answered with: the client's own when usable (at most
    128 printable ASCII characters), else a new one."""
    if client_id and usable_header(client_id, limit=128):
        return client_id
    return uuid.uuid4().hex


def leg_id(answered: str, client_id: str | None) -> str:
    """The id both legs carry as X-Request-Id (and push's transfer id): the answered id,
    with a unique suffix when the client chose it, since two clients may send the same one
    and vLLM and the KV handoff need an id per request."""
    if answered == client_id:
        return f"{answered}-{uuid.uuid4().hex[:12]}"
    return answered


TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's trace context, for both legs, so a trace spans proxy and servers."""
    return {name: headers[name] for name in TRACE_HEADERS if usable_header(headers.get(name, ""))}


def validate_body(body: Any) -> dict[str, Any]:
    """Check the parts of a completion request that the proxy itself relies on."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if "kv_transfer_params" in body:
        raise RequestError("kv_transfer_params is set by the proxy; remove it from the request")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise RequestError(f"{key} must be a positive integer")
    extra = body.get("vllm_xargs")
    if isinstance(extra, dict) and any(str(key).startswith("kvpush_") for key in extra):
        raise RequestError("vllm_xargs keys starting with kvpush_ are the proxy's; remove them")
    if body.get("n", 1) != 1 or body.get("best_of", 1) not in (None, 1):
        raise RequestError("n and best_of must be 1 in P/D serving (one KV handoff per request)")
    return body


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A rough size of the prompt in tokens, for load accounting only (no tokenizer here).

    Text counts one token per 4 characters, a list of token ids one per id; chat messages
    count their text. Good enough to tell a 100-token prompt from a 10,000-token one.
    """
    total = 0
    stack: list[Any] = [body.get("messages", body.get("prompt", ""))]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += (len(item) + 3) // 4
        elif isinstance(item, int):
            total += 1
        elif isinstance(item, list):
            if item and type(item[0]) is int:
                # one prompt's token ids: counted by length, not id by id, which held
                # the proxy's event loop 2.4 ms for a 16k-token prompt (0.04 for 256)
                total += len(item)
            else:
                stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.get(key) for key in ("content", "text") if key in item)
    return max(total, 1)


def requested_output_tokens(body: dict[str, Any]) -> int:
    """The most tokens decode may generate for this request (vLLM's default 16 if unset)."""
    value = body.get("max_tokens") or body.get("max_completion_tokens")
    return value if isinstance(value, int) else 16


# The legs are shallow copies of the client's body: only top-level keys are set, and nested
# values are only ever serialised, never changed (copying them cost more than the rest).


def prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: same prompt and sampling, one token, no streaming."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] >= 1:
        out["min_tokens"] = 1  # no EOS as the first token, as decode would not sample it
    out["kv_transfer_params"] = kv_transfer_params
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The decode leg: the client's request as sent, plus where its KV comes from."""
    return {**body, "kv_transfer_params": kv_transfer_params}


def pull_prefill_params() -> dict[str, Any]:
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def push_prefill_params(transfer_id: str, engine_id: str = "") -> dict[str, Any]:
    params = pull_prefill_params()
    params["transfer_id"] = transfer_id
    if engine_id:
        params[ENGINE_PARAM] = engine_id  # checked by that engine
    return params


def push_decode_params(prefill: Backend, transfer_id: str, dp_rank: int = 0) -> dict[str, Any]:
    if not prefill.has_kv_coordinates:
        raise ValueError(
            f"prefill backend {prefill.url} has no KV coordinates; push mode needs "
            "--prefill URL,engine=ID,kv=HOST:PORT[,tp=N][,pp=N][,dp=N]"
        )
    engine_id, port = prefill.engine(dp_rank)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_host": prefill.kv_host,
        "remote_port": port,
        "remote_request_id": transfer_id,
        "remote_block_ids": [],
        "tp_size": prefill.tp_size,
        "pp_size": prefill.pp_size,
        "transfer_id": transfer_id,
    }


def misrouted(prefill_response: Any, sent: dict[str, Any]) -> str:
    """Why a push prefill's answer cannot pair with decode's registration: it ran on another
    engine than the one decode registered with (which freed its KV); "" when it did not."""
    params = None
    if isinstance(prefill_response, dict):
        params = prefill_response.get("kv_transfer_params")
    ran_on = params.get(MISROUTED_PARAM) if isinstance(params, dict) else None
    if not ran_on:
        return ""
    return (
        f"prefill engine {ran_on} ran the request meant for {sent.get(ENGINE_PARAM)}, whose "
        "KV decode was waiting for: the server's front end did not honour the proxy's "
        f"{DP_RANK_HEADER} header, or the backend's engine= or dp= do not match the server"
    )


def pull_decode_params(prefill_response: Any, prefill: Backend) -> dict[str, Any]:
    """Take the coordinates prefill returned; refuse a response that has none."""
    params = None
    if isinstance(prefill_response, dict):
        params = prefill_response.get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        raise ValueError(
            f"prefill backend {prefill.url} returned no kv_transfer_params; is it started "
            "with a KV connector in the producer role (--kv-transfer-config)?"
        )
    return params


_KVPUSH_INFO = re.compile(r"^kvpush:info\{([^}]*)\}\s+1(?:\.0)?\s*$", re.MULTILINE)
_MODE_LABEL = re.compile(r'\bmode="(' + "|".join(MODES) + ')"')


def kvpush_mode(metrics_text: str) -> str | None:
    """The kvpush mode a vLLM server reports on /metrics (`kvpush:info`), if any."""
    for labels in _KVPUSH_INFO.findall(metrics_text):
        match = _MODE_LABEL.search(labels)
        if match:
            return match.group(1)
    return None


_FIRST_TOKEN_LABEL = re.compile(r'\bfirst_token="([^"]*)"')


def decode_first_token(metrics_text: str) -> str | None:
    """How a kvpush decode says it starts its answers (`kvpush:info`'s first_token):
    "pinned" (from prefill's first token), "own" (it samples its own: speculative
    decoding), or None where it does not say (not kvpush, or a kvpush from before)."""
    for labels in _KVPUSH_INFO.findall(metrics_text):
        match = _FIRST_TOKEN_LABEL.search(labels)
        if match and match.group(1) in ("pinned", "own"):
            return match.group(1)
    return None


def mode_conflict(
    proxy_mode: str,
    prefill: Backend,
    prefill_mode: str | None,
    decode: Backend,
    decode_mode: str | None,
) -> str | None:
    """Why this prefill/decode pair cannot hand KV over, from the modes they report."""
    fix = "set the same kv_connector_extra_config.mode on prefill and decode, and that proxy --mode"
    if prefill_mode and decode_mode and prefill_mode != decode_mode:
        return (
            f"mode mismatch: prefill {prefill.url} runs kvpush in {prefill_mode} mode, "
            f"decode {decode.url} in {decode_mode} mode; {fix}"
        )
    pair_mode = prefill_mode or decode_mode
    if pair_mode and pair_mode != proxy_mode:
        return (
            f"mode mismatch: the proxy runs --mode {proxy_mode}, but prefill {prefill.url} / "
            f"decode {decode.url} run kvpush in {pair_mode} mode; {fix}"
        )
    return None


_FAILURES = re.compile(r"^kvpush:failures_total\{([^}]*)\}\s+(\S+)\s*$", re.MULTILINE)
_KIND_LABEL = re.compile(r'\bkind="([^"]*)"')


def kvpush_failures(metrics_text: str) -> dict[str, float]:
    """kvpush's failed-transfer counters on a server's /metrics, summed by kind."""
    counts: dict[str, float] = {}
    for labels, value in _FAILURES.findall(metrics_text):
        kind = _KIND_LABEL.search(labels)
        if kind:
            try:
                counts[kind.group(1)] = counts.get(kind.group(1), 0.0) + float(value)
            except ValueError:
                continue
    return counts


def failure_growth(before: dict[str, float] | None, after: dict[str, float]) -> str:
    """'kind +n, ...' for the counters that grew; with no earlier reading, those above 0."""
    grown = {k: v - (before or {}).get(k, 0.0) for k, v in after.items()}
    parts = [f"{k} +{v:g}" for k, v in sorted(grown.items()) if v > 0]
    return ", ".join(parts)
