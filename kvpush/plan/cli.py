"""`kvpush plan` (static capacity plan) and `kvpush plan simulate` (pull vs push simulation).

Defaults are the articles' setup (TP 8, 50 GB/s per GPU, `--max-num-seqs 8`, 128 output
tokens, 400 prompts, their measured TPOTs); the model shape always comes from `--model`,
the shape flags or `--preset articles` (Qwen3-32B). Input errors exit with code 2 and a
message that names the flag to fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from kvpush.args import UsageError, positive_list
from kvpush.core.protocol import MODES, Mode
from kvpush.plan import machine_cli
from kvpush.plan.model import (
    DTYPE_BYTES,
    KIB,
    DenseFlops,
    ModelShape,
    Plan,
    PlanInputs,
    PlannerError,
    PrefillSpeed,
    make_plan,
)
from kvpush.plan.model_config import read_model
from kvpush.plan.simulate import (
    FIRST_TOKENS,
    H200_BF16_DENSE_TFLOPS,
    H200_HBM_TBPS,
    MODE_ORDER,
    PR45211_PROMPT_TOKENS,
    PR45211_SUBMIT_MS,
    PREFILL_MFU,
    QWEN3_32B_FLOPS,
    QWEN3_32B_SHAPE,
    RunResult,
    SimParams,
    sweep,
)
from kvpush.report import format_table, pyplot, save_figure

PRESETS: dict[str, tuple[ModelShape, DenseFlops]] = {
    "articles": (QWEN3_32B_SHAPE, QWEN3_32B_FLOPS),
}

SIMULATE_EPILOG = """\
model: Poisson arrivals -> one prefill server (FCFS, FLOPs-derived speed) -> handoff ->
one decode step loop with --max-num-seqs slots.
  pull: after prefill, 2 proxy hops; decode allocates at its next step with a free slot;
        descriptor prep + READ submit run inline (--pull-submit-us-per-token x prompt
        tokens), delaying the request and stretching that step for every running
        sequence; then the transfer at TP x --link-gbps.
  push: decode allocates and registers while prefill runs; after prefill only the
        transfer remains; no work on decode's loop.
  decode step = --base-tpot-ms + n x --per-seq-ms + KV read (context x KV bytes per
        token / (TP x --hbm-tbps)) + inline submissions.
The defaults are the articles' setup on 8 x H200. At 8 QPS x 16k tokens the offered
prefill work exceeds the GPUs' peak FLOPs, so the simulator does not reproduce the
published TTFTs there; see kvpush/plan/simulate.py for what it includes and misses.

examples:
  kvpush plan simulate --preset articles --rates 1,2,4,8 --input-lens 1024,16384 --plot sim.png
  kvpush plan simulate --profile profile.json --setup kvpush-push --rates 1,2,4 --json"""

PLAN_DESCRIPTION = """\
Static capacity plan for the prefill -> decode KV handoff: KV bytes per token and request,
ideal transfer time, decode slots held (Little's law) per TPOT, headroom and the highest
sustainable rate. `kvpush plan simulate -h` for the pull vs push simulator."""
PLAN_EPILOG = """\
examples:
  kvpush plan --preset articles                   # the articles' 8 QPS, 16k-token point
  kvpush plan --model models/tiny/config.json --tp 1 --link-gbps 12 --rate 2 --input-len 2048
  kvpush plan --preset articles --tpot-ms pull=10.4,push=7.0 --json"""


def _tpot_list(text: str) -> tuple[tuple[str, float], ...]:
    items = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        label, _, value = item.rpartition("=")
        try:
            tpot = float(value)
        except ValueError:
            raise PlannerError(
                f"--tpot-ms item {item!r} is not a number; write e.g. pull=10.4,push=7.0"
            ) from None
        items.append((label.strip() or f"{tpot:g} ms", tpot))
    return tuple(items)


def _modes(text: str) -> tuple[Mode, ...]:
    names: dict[str, Mode] = {mode: mode for mode in MODES}
    try:
        return tuple(names[item.strip()] for item in text.split(","))
    except KeyError as exc:
        raise PlannerError(
            f"--modes item {exc.args[0]!r} is unknown; use pull, push or pull,push"
        ) from None


def resolve_model(args: argparse.Namespace) -> tuple[ModelShape, DenseFlops | None]:
    """Shape from --model or --preset, with any explicit shape flag taking precedence."""
    shape: ModelShape | None = None
    flops: DenseFlops | None = None
    if args.model is not None and args.preset is not None:
        raise PlannerError("--model and --preset both name a model; pass only one of them")
    if args.model is not None:
        found = read_model(args.model, args.dtype)
        shape, flops = found.shape, found.flops
    elif args.preset is not None:
        shape, flops = PRESETS[args.preset]
    flags = {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    flags = {name: value for name, value in flags.items() if value is not None}
    if args.dtype is not None:
        flags["dtype"] = args.dtype
    if shape is None:
        missing = [
            f"--{name.replace('_', '-')}"
            for name in ("layers", "kv_heads", "head_dim", "dtype")
            if name not in flags
        ]
        if missing:
            raise PlannerError(
                f"missing {', '.join(missing)}; pass --model CONFIG.json, all of "
                "--layers/--kv-heads/--head-dim/--dtype, or --preset articles"
            )
        return ModelShape(**flags), None
    shape = dataclasses.replace(shape, **flags)
    if flops is not None:
        flops = dataclasses.replace(
            flops, layers=shape.layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim
        )
    return shape, flops


def _add_common(parser: argparse.ArgumentParser, nested: bool = False) -> None:
    """Model, deployment and output flags. A nested parser (`plan simulate`) leaves unset
    flags out of its namespace, so a flag given before `simulate` is kept, not reset."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if nested else value

    model = parser.add_argument_group("model (one of --model, the shape flags, --preset)")
    model.add_argument(
        "--model",
        default=default(None),
        metavar="CONFIG",
        help="a model directory (or its config.json), read through vLLM: MLA, sliding "
        "windows and head sizes as vLLM allocates them; nothing is downloaded",
    )
    model.add_argument(
        "--preset", default=default(None), choices=sorted(PRESETS), help="articles: Qwen3-32B"
    )
    model.add_argument("--layers", default=default(None), type=int, help="num_hidden_layers")
    model.add_argument("--kv-heads", default=default(None), type=int, help="num_key_value_heads")
    model.add_argument("--head-dim", default=default(None), type=int, help="attention head size")
    model.add_argument(
        "--dtype",
        default=default(None),
        help=f"KV cache dtype, one of {', '.join(sorted(DTYPE_BYTES))} (vLLM's "
        "--kv-cache-dtype); default: the model's dtype",
    )
    deploy = parser.add_argument_group("deployment (defaults: the articles' setup)")
    deploy.add_argument(
        "--tp", type=int, default=default(8), help="tensor-parallel size (default: 8)"
    )
    deploy.add_argument(
        "--link-gbps",
        type=float,
        default=default(50.0),
        help="network GB/s (1e9 B/s) per GPU; 16 x 200 Gb/s EFA over 8 GPUs (default: 50)",
    )
    deploy.add_argument(
        "--max-num-seqs", type=int, default=default(8), help="decode's --max-num-seqs (default: 8)"
    )
    deploy.add_argument(
        "--output-len",
        type=int,
        default=default(128),
        help="output tokens per request (default: 128)",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON, not tables"
    )


def register(subparsers: Any) -> None:
    plan = subparsers.add_parser(
        "plan",
        help="capacity plan: KV bytes, ideal transfer, decode slots (and `plan simulate`)",
        description=PLAN_DESCRIPTION,
        epilog=PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(plan)
    work = plan.add_argument_group("workload (defaults: the articles' 8 QPS, 16k point)")
    work.add_argument("--rate", type=float, default=8.0, help="requests/s (default: 8)")
    work.add_argument(
        "--input-len", type=int, default=16384, help="prompt tokens per request (default: 16384)"
    )
    work.add_argument(
        "--tpot-ms",
        default="pull=10.4,push=7.0",
        help="TPOT per mode, LABEL=MS or MS, comma-separated (default: pull=10.4,push=7.0, "
        "the articles' TPOTs at 8 QPS, 16k)",
    )
    work.add_argument(
        "--target-util",
        type=float,
        default=0.8,
        help="slot utilisation to plan for; the articles advise under ~80%% (default: 0.8)",
    )
    plan.set_defaults(func=run_plan)
    nested = plan.add_subparsers(dest="plan_command", metavar="{simulate,measure,check}")
    sim = nested.add_parser(
        "simulate",
        help="discrete-event simulation of pull vs push TTFT/TPOT over a rate x length grid",
        description="Simulate TTFT and TPOT of pull and push handoff, 1 prefill + 1 decode.",
        epilog=SIMULATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(sim, nested=True)
    grid = sim.add_argument_group("grid")
    grid.add_argument("--rates", default="1,2,4,8", help="requests/s (default: 1,2,4,8)")
    grid.add_argument(
        "--input-lens", default="1024,16384", help="prompt tokens (default: 1024,16384)"
    )
    grid.add_argument("--modes", default="pull,push", help="default: pull,push")
    grid.add_argument(
        "--num-prompts", type=int, default=400, help="requests per run (default: 400)"
    )
    grid.add_argument("--seed", type=int, default=0, help="arrival RNG seed (default: 0)")
    grid.add_argument("--plot", metavar="FILE.png", help="draw TTFT and TPOT vs rate")
    measured = sim.add_argument_group(
        "measured parameters (instead of the flags below; see `kvpush plan measure`)"
    )
    measured.add_argument(
        "--profile", metavar="PROFILE.json", help="a machine profile from `kvpush plan measure`"
    )
    measured.add_argument(
        "--setup", help="the profile's connector setup to simulate, e.g. kvpush-push"
    )
    pre = sim.add_argument_group(
        "prefill (default: FLOPs of --model/--preset at --mfu of --gpu-tflops x TP)"
    )
    pre.add_argument("--prefill-tok-s", type=float, help="measured prefill tokens/s (matmuls)")
    pre.add_argument(
        "--prefill-attn-tokens",
        type=float,
        help="prompt length where attention FLOPs equal matmul FLOPs (default: from config; "
        "inf with --prefill-tok-s)",
    )
    pre.add_argument(
        "--gpu-tflops",
        type=float,
        default=H200_BF16_DENSE_TFLOPS,
        help=f"dense peak TFLOP/s per GPU (default: {H200_BF16_DENSE_TFLOPS:g}, H200 BF16)",
    )
    pre.add_argument(
        "--mfu",
        type=float,
        default=PREFILL_MFU,
        help=f"fraction of peak prefill sustains, an assumption (default: {PREFILL_MFU})",
    )
    pre.add_argument(
        "--prefill-fixed-ms",
        type=float,
        default=0.0,
        help="prefill time per prompt whatever its length (default: 0)",
    )
    pre.add_argument(
        "--prefill-concurrency",
        type=int,
        default=1,
        help="prompts prefilled at once, sharing throughput (default: 1, FCFS chunked)",
    )
    dec = sim.add_argument_group("handoff and decode (defaults: measured in the articles)")
    dec.add_argument(
        "--hop-ms", type=float, default=1.0, help="one proxy HTTP hop (default: 1.0, assumed)"
    )
    dec.add_argument(
        "--transfer-setup-ms",
        type=float,
        default=0.0,
        help="per transfer besides its bytes: posting, completion (default: 0)",
    )
    dec.add_argument(
        "--api-fixed-ms",
        type=float,
        default=0.0,
        help="a server's front end per response, on prefill's answer in pull and on the "
        "first token (default: 0, left out)",
    )
    dec.add_argument(
        "--api-us-per-token",
        type=float,
        default=0.0,
        help="a server's front end per prompt token before its engine sees the prompt "
        "(tokenisation; default: 0, left out)",
    )
    dec.add_argument(
        "--base-tpot-ms",
        type=float,
        default=5.6,
        help="decode step at batch 1, short context (default: 5.6, articles' low-load TPOT)",
    )
    dec.add_argument(
        "--per-seq-ms", type=float, default=0.0, help="extra step time per sequence (default: 0)"
    )
    dec.add_argument(
        "--per-context-token-us",
        type=float,
        default=0.0,
        help="extra step time per context token in the batch, beyond reading its KV "
        "(attention compute; default: 0)",
    )
    dec.add_argument(
        "--hbm-tbps",
        type=float,
        default=H200_HBM_TBPS,
        help=f"HBM TB/s per GPU for KV reads (default: {H200_HBM_TBPS}, H200)",
    )
    default_submit = PR45211_SUBMIT_MS * 1e3 / PR45211_PROMPT_TOKENS
    dec.add_argument(
        "--pull-submit-us-per-token",
        type=float,
        default=default_submit,
        help=f"pull's inline descriptor prep + READ submit (default: {default_submit:.2f}, "
        f"vLLM PR #45211: {PR45211_SUBMIT_MS} ms at {PR45211_PROMPT_TOKENS} tokens)",
    )
    dec.add_argument(
        "--first-token",
        choices=FIRST_TOKENS,
        default="decode",
        help="where a streamed answer's first token comes from: decode (default: vLLM's "
        "proxies and the articles, decode's first step) or prefill (kvpush's proxy: "
        "prefill's answer, the handoff then shows at the second token)",
    )
    sim.set_defaults(func=run_simulate)
    machine_cli.register(nested)


def _fail(exc: UsageError) -> int:
    print(f"kvpush plan: error: {exc}", file=sys.stderr)
    return 2


def _bytes(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.2f} MB"
    return f"{n / KIB:.1f} KiB"


def render_plan(plan: Plan) -> str:
    i = plan.inputs
    shape = i.shape
    per_layer = (
        f"an MLA latent of {shape.head_dim}"
        if shape.mla
        else f"{shape.kv_heads} KV heads x {shape.head_dim} dims"
    )
    window = (
        f"; {shape.window_layers} layers keep a {shape.window:,}-token window"
        if shape.window and shape.window_layers
        else ""
    )
    if shape.state_layers:
        window += (f"; {shape.state_layers} state layers keep {_bytes(shape.state_bytes)} "
                   "per request")  # fmt: skip
    lines = [
        f"model        {shape.layers} attention layers x {per_layer}, {shape.dtype} "
        f"({shape.dtype_bytes} B){window}"
        if shape.state_layers
        else f"model        {shape.layers} layers x {per_layer}, {shape.dtype} "
        f"({shape.dtype_bytes} B){window}",
        f"KV/token     {plan.kv_bytes_per_token / KIB:.1f} KiB ({plan.kv_bytes_per_token:,} B)",
        f"KV/request   {_bytes(plan.kv_bytes_per_request)} ({i.input_len:,} prompt tokens)",
        f"transfer     {plan.transfer_ms:.2f} ms ideal, over {i.tp} GPUs x {i.link_gbps:g} GB/s",
        f"link         {plan.link_utilisation:.1%} busy at {i.rate:g} req/s; "
        f"link-bound max {plan.link_max_rate:.1f} req/s at {i.target_util:.0%}",
        "",
        f"decode slots (Little's law: {i.rate:g} req/s x {i.output_len} tokens x TPOT; "
        f"--max-num-seqs {i.max_num_seqs})",
    ]
    headers = ["mode", "TPOT ms", "slots held", "utilisation", "headroom", "max req/s"]
    headers[-1] = f"max req/s @ {i.target_util:.0%}"
    rows = [
        [
            mode.label,
            f"{mode.tpot_ms:.2f}",
            f"{mode.slots_held:.2f}",
            f"{mode.utilisation:.0%}",
            f"{mode.headroom_slots:+.2f}",
            f"{mode.max_rate:.2f}",
        ]
        for mode in plan.modes
    ]
    lines.append(format_table(headers, rows))
    for mode in plan.modes:
        if mode.headroom_slots < 0:
            lines.append(
                f"{mode.label}: needs {mode.slots_held:.1f} of {i.max_num_seqs} slots on "
                "average; requests queue for a decode slot and TTFT grows"
            )
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    return value


def run_plan(args: argparse.Namespace) -> int:
    try:
        shape, _ = resolve_model(args)
        plan = make_plan(
            PlanInputs(
                shape=shape,
                tp=args.tp,
                link_gbps=args.link_gbps,
                rate=args.rate,
                input_len=args.input_len,
                output_len=args.output_len,
                tpot_ms=_tpot_list(args.tpot_ms),
                max_num_seqs=args.max_num_seqs,
                target_util=args.target_util,
            )
        )
    except UsageError as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps(_jsonable(dataclasses.asdict(plan)), indent=2))
    else:
        print(render_plan(plan))
    return 0


def sim_params(args: argparse.Namespace) -> SimParams:
    shape, flops = resolve_model(args)
    fixed_s = args.prefill_fixed_ms / 1e3
    if args.prefill_tok_s is not None:
        prefill = PrefillSpeed(args.prefill_tok_s, args.prefill_attn_tokens or math.inf, fixed_s)
    elif flops is not None:
        prefill = flops.prefill_speed(args.tp, args.gpu_tflops, args.mfu)
        attn = prefill.attn_tokens if args.prefill_attn_tokens is None else args.prefill_attn_tokens
        prefill = PrefillSpeed(prefill.tokens_per_s, attn, fixed_s)
    else:
        raise PlannerError(
            "cannot derive prefill speed from the shape flags alone (or from a mixture-of-"
            "experts config); pass --prefill-tok-s (measured prompt tokens/s), or --model "
            "with a dense config.json"
        )
    return SimParams(
        kv_bytes_per_token=shape.kv_bytes(args.input_len) // args.input_len,
        prefill=prefill,
        prefill_concurrency=args.prefill_concurrency,
        tp=shape.shards(args.tp),
        link_gbps=args.link_gbps,
        transfer_setup_ms=args.transfer_setup_ms,
        hbm_tbps=args.hbm_tbps,
        max_num_seqs=args.max_num_seqs,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        hop_ms=args.hop_ms,
        api_fixed_ms=args.api_fixed_ms,
        api_us_per_token=args.api_us_per_token,
        base_tpot_ms=args.base_tpot_ms,
        per_seq_ms=args.per_seq_ms,
        per_context_token_us=args.per_context_token_us,
        pull_submit_us_per_token=args.pull_submit_us_per_token,
        first_token=args.first_token,
        seed=args.seed,
    )


def render_results(params: SimParams, results: Sequence[RunResult]) -> str:
    lens = sorted({result.input_len for result in results})
    speed = params.prefill
    attention = (
        f"attention FLOPs equal those at {speed.attn_tokens:,.0f} tokens"
        if math.isfinite(speed.attn_tokens)
        else "no attention term"
    )
    fixed = f", {speed.fixed_s * 1e3:.2f} ms per prompt" if speed.fixed_s else ""
    lines = [
        f"prefill      {speed.tokens_per_s / 1e3:.1f}k tokens/s on matmuls, {attention}{fixed}"
    ]
    for n in lens:
        lines.append(
            f"{n:>6,} tok   prefill {speed.seconds(n) * 1e3:.1f} ms, "
            f"transfer {params.transfer_s(n) * 1e3:.1f} ms, "
            f"pull inline submit {params.submit_s(n) * 1e3:.1f} ms"
        )
    lines += [
        f"runs         {params.num_prompts} prompts, {params.output_len} output tokens, "
        f"--max-num-seqs {params.max_num_seqs}, seed {params.seed}",
        f"first token  from {params.first_token}"
        + (" (kvpush's proxy)" if params.first_token == "prefill" else " (vLLM's proxies)"),
        "",
    ]
    headers = [
        "input", "req/s", "mode", "prefill load",
        "TTFT mean", "p50", "p99", "2nd token p50", "TPOT mean", "p50", "p99",
    ]  # fmt: skip
    rows = [
        [
            f"{r.input_len}",
            f"{r.rate:g}",
            r.mode,
            f"{r.prefill_load:.2f}",
            *(f"{v:.1f}" for v in (r.ttft_ms.mean, r.ttft_ms.p50, r.ttft_ms.p99, r.tt2t_ms.p50)),
            *(f"{v:.2f}" for v in (r.tpot_ms.mean, r.tpot_ms.p50, r.tpot_ms.p99)),
        ]
        for r in results
    ]
    lines.append(format_table(headers, rows))
    lines.append("(times in ms)")
    overloaded = sorted({(r.input_len, r.rate) for r in results if r.prefill_load >= 1})
    if overloaded:
        points = ", ".join(f"{n} tokens at {rate:g} req/s" for n, rate in overloaded)
        lines.append(
            f"prefill load >= 1 ({points}): prefill cannot keep up, so TTFT there grows "
            "with --num-prompts and reflects the backlog, not the handoff"
        )
    return "\n".join(lines)


def plot_results(results: Sequence[RunResult], path: str) -> None:
    """TTFT (top) and TPOT (bottom) vs rate, as `kvpush bench plot` draws a sweep: p50
    solid, p99 dashed, one column per input length, one colour per mode."""
    plt = pyplot()
    lens = sorted({r.input_len for r in results})
    modes = [mode for mode in MODE_ORDER if any(r.mode == mode for r in results)]
    fig, axes = plt.subplots(2, len(lens), figsize=(4.5 * len(lens), 7), squeeze=False)
    colours = plt.get_cmap("tab10")
    for col, input_len in enumerate(lens):
        for index, mode in enumerate(modes):
            runs = sorted(
                (r for r in results if r.input_len == input_len and r.mode == mode),
                key=lambda r: r.rate,
            )
            rates = [r.rate for r in runs]
            for row, stats in enumerate(([r.ttft_ms for r in runs], [r.tpot_ms for r in runs])):
                ax = axes[row][col]
                ax.plot(rates, [s.p50 for s in stats], "-o", color=colours(index), label=mode)
                ax.plot(rates, [s.p99 for s in stats], "--", color=colours(index), alpha=0.5)
        ttfts = [r.ttft_ms.p99 for r in results if r.input_len == input_len]
        ttfts += [r.ttft_ms.p50 for r in results if r.input_len == input_len]
        if max(ttfts) > 50 * min(ttfts):
            axes[0][col].set_yscale("log")
        axes[0][col].set_title(f"input {input_len:,} tokens")
        axes[0][col].set_ylabel("TTFT (ms): p50 solid, p99 dashed")
        axes[1][col].set_ylabel("TPOT (ms): p50 solid, p99 dashed")
        for row in (0, 1):
            axes[row][col].set_xlabel("request rate (req/s)")
            axes[row][col].grid(True, alpha=0.3)
            axes[row][col].legend()
    save_figure(plt, fig, path)


def run_simulate(args: argparse.Namespace) -> int:
    try:
        if args.profile is not None:
            params, modes = machine_cli.profile_params(args)
        elif args.setup is not None:
            raise PlannerError("--setup names a setup of a --profile; pass --profile too")
        else:
            params, modes = sim_params(args), _modes(args.modes)
        rates = positive_list(float, "--rates", args.rates)
        lens = positive_list(int, "--input-lens", args.input_lens)

        def progress(index: int, total: int, what: str) -> None:
            print(f"[{index}/{total}] {what}", file=sys.stderr, flush=True)

        results = sweep(params, rates, lens, modes, progress=progress)
        if args.plot:
            plot_results(results, args.plot)
    except UsageError as exc:
        return _fail(exc)
    if args.json:
        body = {
            "params": dataclasses.asdict(params),
            "results": [dataclasses.asdict(result) for result in results],
        }
        print(json.dumps(_jsonable(body), indent=2))
    else:
        print(render_results(params, results))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0
