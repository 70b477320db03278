"""Discrete-event simulation of one prefill and one decode instance, pull vs push handoff.

What is simulated (one request's path):

1. Arrivals are Poisson at `rate` (the `vllm bench serve --request-rate` default); the
   first request arrives at t=0. Every HTTP hop through the proxy costs `hop_ms`.
2. Prefill is one server working through prompts at `PrefillSpeed` (matmul tokens/s plus a
   causal-attention term), shared by at most `prefill_concurrency` prompts at a time, the
   rest waiting first come first served. The default of 1 is vLLM's chunked prefill: the
   oldest prompt takes the whole token budget while its remainder exceeds it.
3. Handoff.
   - pull: prefill's response goes back to the proxy and on to decode (2 hops). Decode's
     scheduler sees the request at its next step, and allocates destination blocks only
     while fewer than `max_num_seqs` requests run (vLLM stops admitting at that limit).
     The worker then prepares descriptors and submits the READ inline, before that step's
     forward pass: `pull_submit_us_per_token` x prompt tokens, which delays this request
     and stretches the step for every running sequence. The READ then moves the KV at
     link speed.
   - push: the proxy sends the request to decode when it sends it to prefill (1 hop).
     Decode allocates and registers at its next step (same slot rule as pull); whichever
     of registration and prefill completion comes second starts the WRITE on a prefill
     background thread; only the transfer itself is left after prefill, and decode's loop
     does no transfer work.
   Transfers share one link (TP x `link_gbps`) first come first served.
4. Decode is a step loop. A request whose KV has landed joins the running batch at the next
   step if a slot is free (its first token comes at the end of that step). A step of n
   running sequences takes `base_tpot_ms` + n x `per_seq_ms` + the time to read their KV
   (context tokens x KV bytes per token / (TP x `hbm_tbps`)), plus any inline submissions.
   TTFT = first token - arrival; TPOT = (last token - first token) / (output_len - 1), as
   `vllm bench serve` computes them; the time to the second token is the end of decode's
   second step for the request, where the handoff shows whichever leg sent the first.
   Where the first token comes from (`first_token`): "decode", vLLM's proxies, the end of
   decode's first step for the request; "prefill", kvpush's proxy, prefill's answer (its
   first token) on its way through prefill's front end, decode's first step then only
   reproducing that token.
5. Front ends (0 in the articles' setup, which states none; measured on a CPU machine by
   `kvpush plan measure`): each server reads a prompt for `api_us_per_token` per token
   before its engine sees it, and each answer leaves through its front end in
   `api_fixed_ms` - prefill's answer on the way to decode in pull, decode's first token on
   the way to the client in both modes. In push decode's front end works while prefill
   runs; in pull it comes after. `per_context_token_us` adds step time per context token
   beyond reading its KV (attention on a CPU), `PrefillSpeed.fixed_s` a cost per prompt,
   and `transfer_setup_ms` a cost per transfer besides moving its bytes.

Defaults are the articles' setup (Qwen3-32B, 1P1D, 2 x 8 x H200, TP 8, 50 GB/s per GPU,
`--max-num-seqs 8`, 128 output tokens, 400 prompts) and each engine cost is derived there:

- `base_tpot_ms` 5.6: the articles' low-load, short-prompt TPOT (5.6-5.8 ms).
- `per_seq_ms` 0: at batch <= 8 a decode step reads the weights once whatever the batch;
  what a sequence adds is its KV read, modelled separately.
- `hbm_tbps` 4.8: H200 HBM3e bandwidth (datasheet), for the KV read per step.
- `pull_submit_us_per_token` 7.18: vLLM PR #45211 measured 14.7 ms of inline READ
  submission per request at 2,048 prompt tokens. The work is per descriptor, and pull
  posts one descriptor per block per layer for K and V, so it scales with prompt tokens:
  14.7 ms / 2,048 tokens (117.6 ms at 16,384 tokens).
- `hop_ms` 1.0: an assumption (one proxy HTTP hop inside one availability zone); the
  articles give no figure.
- prefill speed: FLOPs, not a measurement. Qwen3-32B multiplies 31.2 G weights per token
  (64 layers; Q/O 5120x8192, K/V 5120x1024, MLP 3 x 5120x25600) and its causal attention
  adds 2 x 64 x 8192 x n FLOPs per token; 8 x H200 give 8 x 989 TFLOP/s dense BF16 and
  prefill is assumed to sustain 40 % of that (`PREFILL_MFU`, a typical model-FLOPs
  utilisation for TP8 prefill with all-reduces). That is 50.7 k tokens/s on matmuls,
  20.5 ms for a 1,024-token prompt and 412 ms for 16,384 tokens.

Checked against the articles (tests/unit/test_plan_simulate.py, seed 0, 400 prompts):

- 1 QPS, 1k input: TPOT pull 5.65 / push 5.61 ms, inside the published 5.6-5.8 ms. TTFT
  pull 41.1 / push 29.4 ms: 12 ms apart (two more proxy hops, 7.4 ms of inline submission,
  one more decode step boundary). Published: "nearly identical". Small on the articles'
  1.7 s scale, but 40 % relative, more than the 25 % aimed for: the simulator leaves out
  the fixed per-request time both modes share (tokenisation, API server, proxy
  streaming), which would shrink the ratio without changing the gap.
- 8 QPS, 16k input: NOT reproduced. Published TTFT pull ~1,744 / push ~540 ms; simulated
  54.7 s / 54.6 s (31x and 101x), TPOT 7.74 / 5.81 ms against ~10.4 / ~7. Offered prefill
  work is 8 x 16,384 tokens x 79.6 GFLOP/token = 10.4 PFLOP/s, above the 7.9 PFLOP/s
  dense BF16 peak of 8 x H200, so no FLOPs-honest prefill keeps up (`prefill_load` 3.3 at
  40 %, 1.3 even at 100 % of peak): TTFT is the prefill backlog, which grows through the
  run for both modes, and decode sees only the ~2.4 req/s prefill delivers, hence the low
  TPOTs. The model is missing whatever kept the published run below prefill capacity
  (a client concurrency cap, shorter effective prompts, prefix-cache hits on prefill,
  where caching was left on); the articles state none of them, so none is assumed.
- Where prefill keeps up the handoff effects show: with prefill made fast
  (`--prefill-tok-s 1e9`) 8 QPS, 16k gives pull 20.8 s vs push 81 ms mean TTFT, since
  117.6 ms of inline submission per request at 8 QPS leaves pull's decode loop almost no
  time for tokens; at 4 QPS pull TPOT is 10.6 ms vs push 6.0 ms.
- Cross-check, not a test: PR #45211's pull mean TTFT at 2,048 tokens, 8 QPS is
  215.88 ms; simulated 152-512 ms over seeds 0-4 (the decode slots run at ~75 % there,
  so 400 Poisson arrivals leave the mean at the mercy of bursts).

Not modelled: tokenisation and API-server time, the proxy's own queueing, registration
and completion-notification latency, NIXL handshakes and their head-of-line blocking,
KV-cache capacity (decode never runs out of blocks), preemption, decode-side prefill
(decode runs none), prefill writer-thread contention, and variance in step or transfer
times.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from kvpush.core.protocol import MODES, Mode
from kvpush.plan.model import (
    GB,
    DenseFlops,
    ModelShape,
    PlannerError,
    PrefillSpeed,
    check_non_negative,
    check_positive,
    check_positive_int,
    transfer_seconds,
)
from kvpush.proxy.first_token import SOURCES

# The modes in the order the planner reports them: alphabetical, which puts pull, the
# baseline, first.
MODE_ORDER: tuple[Mode, ...] = tuple(sorted(MODES))

QWEN3_32B_SHAPE = ModelShape(layers=64, kv_heads=8, head_dim=128, dtype="bfloat16")
QWEN3_32B_FLOPS = DenseFlops(
    layers=64, hidden_size=5120, intermediate_size=25600, attn_heads=64, kv_heads=8, head_dim=128
)
H200_BF16_DENSE_TFLOPS = 989.0
H200_HBM_TBPS = 4.8
PREFILL_MFU = 0.4
PR45211_SUBMIT_MS = 14.7
PR45211_PROMPT_TOKENS = 2048

# Where a streamed answer's first token comes from, as `kvpush proxy --first-token` takes
# it: decode's first step (vLLM's proxies, the articles) or prefill's answer (kvpush's).
FIRST_TOKENS = tuple(sorted(SOURCES))

PUBLISHED_TTFT_MS = {("pull", 8.0, 16384): 1744.0, ("push", 8.0, 16384): 540.0}
"""The articles' mean TTFT at 8 QPS, 16k input (read off their chart, hence '~')."""


@dataclass(frozen=True, slots=True)
class SimParams:
    """Everything one simulated run needs besides mode, rate and prompt length.

    Field defaults are the articles' setup; see the module docstring for where each comes
    from. Times are in the unit their name ends with.
    """

    kv_bytes_per_token: int
    prefill: PrefillSpeed
    prefill_concurrency: int = 1
    tp: int = 8
    link_gbps: float = 50.0
    transfer_setup_ms: float = 0.0
    hbm_tbps: float = H200_HBM_TBPS
    max_num_seqs: int = 8
    output_len: int = 128
    num_prompts: int = 400
    hop_ms: float = 1.0
    api_fixed_ms: float = 0.0
    api_us_per_token: float = 0.0
    base_tpot_ms: float = 5.6
    per_seq_ms: float = 0.0
    per_context_token_us: float = 0.0
    pull_submit_us_per_token: float = PR45211_SUBMIT_MS * 1e3 / PR45211_PROMPT_TOKENS
    first_token: str = "decode"
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive_int("--kv-bytes-per-token", self.kv_bytes_per_token, "check the shape")
        check_positive_int(
            "--prefill-concurrency", self.prefill_concurrency, "1 is FCFS chunked prefill"
        )
        check_positive_int("--tp", self.tp, "pass the tensor-parallel size")
        check_positive_int("--max-num-seqs", self.max_num_seqs, "pass decode's --max-num-seqs")
        check_positive_int("--num-prompts", self.num_prompts, "pass how many requests to send")
        if isinstance(self.output_len, bool) or not isinstance(self.output_len, int):
            raise PlannerError(f"--output-len must be an integer (got {self.output_len!r})")
        if self.output_len < 2:
            raise PlannerError(
                f"--output-len must be at least 2 (got {self.output_len}); TPOT needs 2 tokens"
            )
        check_positive("--link-gbps", self.link_gbps, "pass GB/s per GPU (articles: 50)")
        check_positive("--hbm-tbps", self.hbm_tbps, "pass HBM TB/s per GPU (H200: 4.8)")
        check_non_negative("--hop-ms", self.hop_ms, "pass one proxy hop in ms")
        check_non_negative(
            "--transfer-setup-ms", self.transfer_setup_ms, "pass ms per transfer besides bytes"
        )
        check_non_negative("--api-fixed-ms", self.api_fixed_ms, "pass ms per server response")
        check_non_negative("--api-us-per-token", self.api_us_per_token, "pass us per token")
        check_non_negative(
            "--per-context-token-us", self.per_context_token_us, "pass us per context token"
        )
        check_non_negative("--base-tpot-ms", self.base_tpot_ms, "pass a measured TPOT")
        check_non_negative("--per-seq-ms", self.per_seq_ms, "pass ms per running sequence")
        check_non_negative(
            "--pull-submit-us-per-token", self.pull_submit_us_per_token, "pass us per token"
        )
        if self.base_tpot_ms + self.per_seq_ms <= 0:
            raise PlannerError(
                "--base-tpot-ms and --per-seq-ms are both 0; a decode step takes time"
            )
        if self.first_token not in FIRST_TOKENS:
            raise PlannerError(
                f"--first-token must be one of {', '.join(FIRST_TOKENS)} (got {self.first_token!r})"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise PlannerError(f"--seed must be a non-negative integer (got {self.seed!r})")

    def transfer_s(self, tokens: int) -> float:
        moved = transfer_seconds(tokens * self.kv_bytes_per_token, self.tp, self.link_gbps)
        return self.transfer_setup_ms * 1e-3 + moved

    def submit_s(self, tokens: int) -> float:
        return tokens * self.pull_submit_us_per_token * 1e-6

    def api_in_s(self, tokens: int) -> float:
        """A server's front end, before its engine sees a prompt of `tokens` tokens."""
        return tokens * self.api_us_per_token * 1e-6

    def step_s(self, batch: int, context_tokens: int) -> float:
        kv_read = context_tokens * self.kv_bytes_per_token / (self.tp * self.hbm_tbps * 1e3 * GB)
        attention = context_tokens * self.per_context_token_us * 1e-6
        return (self.base_tpot_ms + self.per_seq_ms * batch) * 1e-3 + kv_read + attention


def articles_params(**overrides: object) -> SimParams:
    """The articles' setup with Qwen3-32B's shape and FLOPs-derived prefill speed."""
    values: dict[str, object] = {
        "kv_bytes_per_token": QWEN3_32B_SHAPE.kv_bytes_per_token,
        "prefill": QWEN3_32B_FLOPS.prefill_speed(8, H200_BF16_DENSE_TFLOPS, PREFILL_MFU),
    }
    values.update(overrides)
    return SimParams(**values)  # type: ignore[arg-type]


@dataclass(slots=True)
class _Request:
    arrival: float
    tokens: int
    prefill_done: float = math.inf
    registered: float = math.inf
    allocated: bool = False
    kv_landed: float = math.inf
    generated: int = 0
    first_token: float = math.nan  # decode's first step for it ends
    second_token: float = math.nan
    finished: float = math.nan

    def shown_first(self, first_token: str) -> float:
        """When the client's first token left its server's engine."""
        return self.prefill_done if first_token == "prefill" else self.first_token


@dataclass(frozen=True, slots=True)
class Stats:
    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> Stats:
        data = np.asarray(values_ms, dtype=float)
        return cls(float(data.mean()), *(float(v) for v in np.percentile(data, [50, 99])))


@dataclass(frozen=True, slots=True)
class RunResult:
    mode: Mode
    rate: float
    input_len: int
    ttft_ms: Stats
    tpot_ms: Stats
    tt2t_ms: Stats
    """Arrival to the second token: decode's second step for the request."""
    e2el_ms: Stats
    """Arrival to last token, which chunks coalesced in a busy stream do not move."""
    prefill_load: float
    """Offered prefill work per second of time (> 1: prefill cannot keep up)."""


class _Sim:
    """One run: an event heap, a processor-sharing prefill server and a decode step loop."""

    def __init__(self, params: SimParams, mode: Mode, rate: float, input_len: int) -> None:
        self.p = params
        self.mode = mode
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.counter = 0
        rng = np.random.default_rng(params.seed)
        gaps = rng.exponential(1.0 / rate, params.num_prompts - 1)
        arrivals = np.concatenate(([0.0], np.cumsum(gaps)))
        self.requests = [_Request(float(t), input_len) for t in arrivals]
        self.prefill_waiting: deque[_Request] = deque()
        self.prefill_active: dict[int, tuple[_Request, float]] = {}
        self.prefill_clock = 0.0
        self.prefill_version = 0
        self.link_free = 0.0
        self.decode_queue: list[_Request] = []
        self.running: list[_Request] = []
        self.stepping = False
        self.hop = params.hop_ms * 1e-3

    def at(self, time: float, action: Callable[[float], None]) -> None:
        self.counter += 1
        heapq.heappush(self.events, (time, self.counter, action))

    def run(self) -> list[_Request]:
        for req in self.requests:
            self.at(req.arrival, partial(self.arrive, req))
        while self.events:
            now, _, action = heapq.heappop(self.events)
            action(now)
        return self.requests

    def arrive(self, req: _Request, now: float) -> None:
        seen = now + self.hop + self.p.api_in_s(req.tokens)
        self.at(seen, partial(self.prefill_enqueue, req))
        if self.mode == "push":
            self.at(seen, partial(self.decode_sees, req))

    # prefill: processor sharing among at most `prefill_concurrency` prompts
    def prefill_advance(self, now: float) -> None:
        if self.prefill_active:
            share = (now - self.prefill_clock) / len(self.prefill_active)
            for key, (req, left) in self.prefill_active.items():
                self.prefill_active[key] = (req, left - share)
        self.prefill_clock = now

    def prefill_enqueue(self, req: _Request, now: float) -> None:
        self.prefill_advance(now)
        self.prefill_waiting.append(req)
        self.prefill_fill(now)

    def prefill_fill(self, now: float) -> None:
        while self.prefill_waiting and len(self.prefill_active) < self.p.prefill_concurrency:
            req = self.prefill_waiting.popleft()
            self.prefill_active[id(req)] = (req, self.p.prefill.seconds(req.tokens))
        self.prefill_version += 1
        if self.prefill_active:
            version = self.prefill_version
            left = min(left for _, left in self.prefill_active.values())
            done = now + max(left, 0.0) * len(self.prefill_active)
            self.at(done, partial(self.prefill_tick, version))

    def prefill_tick(self, version: int, now: float) -> None:
        if version != self.prefill_version:
            return
        self.prefill_advance(now)
        finished = [req for req, left in self.prefill_active.values() if left <= 1e-12]
        for req in finished:
            del self.prefill_active[id(req)]
            self.prefill_finished(req, now)
        self.prefill_fill(now)

    def prefill_finished(self, req: _Request, now: float) -> None:
        req.prefill_done = now
        if self.mode == "pull":
            # prefill's answer goes out through its front end, then via the proxy to
            # decode's front end
            answered = now + self.p.api_fixed_ms * 1e-3 + 2 * self.hop
            self.at(answered + self.p.api_in_s(req.tokens), partial(self.decode_sees, req))
        elif req.registered <= now:
            self.start_transfer(req, now)

    def start_transfer(self, req: _Request, ready: float) -> None:
        start = max(ready, self.link_free)
        self.link_free = start + self.p.transfer_s(req.tokens)
        self.at(self.link_free, partial(self.kv_lands, req))

    def kv_lands(self, req: _Request, now: float) -> None:
        req.kv_landed = now
        self.decode_step(now)

    # decode: one engine loop; the scheduler runs at the start of every step
    def decode_sees(self, req: _Request, now: float) -> None:
        self.decode_queue.append(req)
        self.decode_step(now)

    def decode_step(self, now: float) -> None:
        if self.stepping:
            return
        stall = 0.0
        kept: list[_Request] = []
        for index, req in enumerate(self.decode_queue):
            if len(self.running) >= self.p.max_num_seqs:
                kept.extend(self.decode_queue[index:])
                break
            if req.kv_landed <= now:
                self.running.append(req)
                continue
            kept.append(req)
            if req.allocated:
                continue
            req.allocated = True
            if self.mode == "pull":
                stall += self.p.submit_s(req.tokens)
                self.start_transfer(req, now + stall)
            else:
                req.registered = now
                if req.prefill_done <= now:
                    self.start_transfer(req, now)
        self.decode_queue = kept
        duration = stall
        if self.running:
            context = sum(req.tokens + req.generated for req in self.running)
            duration += self.p.step_s(len(self.running), context)
        if duration > 0:
            self.stepping = True
            self.at(now + duration, self.decode_step_end)

    def decode_step_end(self, now: float) -> None:
        self.stepping = False
        still: list[_Request] = []
        for req in self.running:
            req.generated += 1
            if req.generated == 1:
                req.first_token = now
            elif req.generated == 2:
                req.second_token = now
            if req.generated == self.p.output_len:
                req.finished = now
            else:
                still.append(req)
        self.running = still
        self.decode_step(now)


def simulate(params: SimParams, mode: Mode, rate: float, input_len: int) -> RunResult:
    """Run `params.num_prompts` requests of `input_len` prompt tokens at `rate` req/s."""
    if mode not in MODE_ORDER:
        raise PlannerError(f"unknown mode {mode!r}; use one of {', '.join(MODE_ORDER)}")
    check_positive("--rates", rate, "pass request rates in req/s")
    check_positive_int("--input-lens", input_len, "pass prompt lengths in tokens")
    requests = _Sim(params, mode, rate, input_len).run()
    # every token still passes its server's front end on its way to the client
    out = params.api_fixed_ms
    shown = [req.shown_first(params.first_token) for req in requests]
    ttft = [(first - req.arrival) * 1e3 + out for req, first in zip(requests, shown, strict=True)]
    tt2t = [(req.second_token - req.arrival) * 1e3 + out for req in requests]
    tpot = [
        (req.finished - first) * 1e3 / (params.output_len - 1)
        for req, first in zip(requests, shown, strict=True)
    ]
    e2el = [(req.finished - req.arrival) * 1e3 + params.api_fixed_ms for req in requests]
    return RunResult(
        mode=mode,
        rate=rate,
        input_len=input_len,
        ttft_ms=Stats.of(ttft),
        tpot_ms=Stats.of(tpot),
        tt2t_ms=Stats.of(tt2t),
        e2el_ms=Stats.of(e2el),
        prefill_load=rate * params.prefill.seconds(input_len),
    )


def sweep(
    params: SimParams,
    rates: Iterable[float],
    input_lens: Iterable[int],
    modes: Iterable[Mode] = MODE_ORDER,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[RunResult]:
    """Every (input length, rate, mode) of the grid, in that nesting order."""
    grid = [(n, r, m) for n in input_lens for r in rates for m in modes]
    results = []
    for index, (input_len, rate, mode) in enumerate(grid, start=1):
        if progress is not None:
            progress(index, len(grid), f"input {input_len}, {rate:g} req/s, {mode}")
        results.append(simulate(params, mode, rate, input_len))
    return results
