"""The simulator against this machine: `kvpush plan check` on a recorded `kvpush bench` sweep.

Fixtures in tests/data/plan/, as recorded (see docs/planning.md):
- sweep-pinned/: the pinned reference sweep, `kvpush bench sweep --setups
  kvpush-push,kvpush-pull,vllm-pull-nospin,vllm-pull,single --rates 1,2,4 --input-lens
  256,1024 --num-prompts 24 --iterations 3` (32 output tokens, --max-num-seqs 8), every
  server's whole process tree on its own core, each point with its own dataset seed
  (eabf6e2), the result files as written: 2026-12-01 01:35-02:29 at 8932cb7 (kvpush hands
  a step's specs over before the forward since 49247aa). 90 of 90 ok.
- profile.json: `kvpush plan measure` (command inside), pinned, 2026-11-30 19:20-19:27 on
  the same host as the sweep. Every parameter comes from probes without a handoff,
  kvpush's transfer metrics and the NIXL bandwidth measured once - none from these results.

On a second host (AVX-512, 2026-12-01), each server's processes on its own core, prefix
caching on:
- sweep-first-token/: the same command, kvpush's setups taking the first token from
  prefill (their default), 19:50-20:41 at bd814a6, 90 of 90 ok.
- sweep-decode-first/: `--setups kvpush-push,kvpush-pull,vllm-pull-nospin --first-token
  decode`, otherwise the same, 23:12-23:39 at e29182e, 54 of 54 ok.
- profile-avx512.json: `kvpush plan measure` there, 23:05-23:11 at e29182e, with the
  proxy's added latency from `kvpush proxy bench --streams 1` run just before it.

On that host again after 74de54e (vLLM's prefill on its own core, docs/benchmarks.md "What
vLLM moves"):
- sweep-reference/: the same command, 2026-12-02 05:52-06:45 at 74de54e, 89 of 90 ok;
- sweep-decode-first-reference/: in vLLM's order, 54 of 54 ok;
- profile-reference.json: `kvpush plan measure`, 2026-12-02 09:27-09:31 at 94c986a, the
  proxy's added latency measured just before it.
Within 25 % at 8 of 72 and 9 of 54 point-metrics, every prediction low; the sweep's TPOT
(each token through the proxy and the client, floating over both cores) is what the probes
miss most (docs/planning.md, "The reference sweeps, vLLM's prefill on its own core").
On a third host (2-core Intel Xeon, AVX-512), sweep-intel/: the same command, 2026-12-03
16:53-17:56 at 1ca3bf8, 90 of 90 ok (docs/benchmarks.md); profile-intel.json: `kvpush plan
measure` there, 2026-12-04 03:39-03:45 at 1d0cdf0, the proxy's added latency from `kvpush
proxy bench --streams 1` run just before it (0.38 ms pull, 1.77 ms push). Within 25 % at
24 of 72 point-metrics, every prediction low. sweep-intel-uvloop/: the same command there
again, 2026-12-04 06:29-07:17 at cb1e764 (the sweep's proxy on uvloop, as deployed), 90 of
90 ok; profile-intel-uvloop.json: `kvpush plan measure` there right after it, 07:18-07:24,
the same proxy hops. Within 25 % at 30 of 72 point-metrics, every prediction low.
On a fourth host (2-core AMD EPYC, no AVX-512), sweep-amd/: `--setups kvpush-push,
kvpush-pull,vllm-pull-nospin,single`, otherwise the same, 2026-12-04 12:54-13:29 at 6d56779,
72 of 72 ok; no profile was measured there, so no test reads it (docs/benchmarks.md).
sweep-amd-decode-first/: kvpush's two modes there with `--first-token decode`, 14:28-14:51
at 21588d4, 36 of 36 ok, after the host had slowed down (docs/benchmarks.md).
sweep-amd-vllm-order/: `--setups kvpush-push,kvpush-pull,vllm-pull-nospin,single
--first-token decode`, 16:02-16:43 at 1436f20, 72 of 72 ok, the host between the two.
sweep-amd-rotated/: the sweep-amd grid with four iterations, the setups' order rotated
(each runs first once), 19:16-20:01, 96 of 96 ok, the host at its fastest: at 67c829f but
for kvpush-push's iterations 2-4, whose servers imported a draft of the direct hand-off
(e883ae2) from the checkout being edited (their files count `kvpush:handoffs_total`).
sweep-amd-direct/: the same grid again at 1e62d05, 2026-12-05 00:21-01:06, 96 of 96 ok, each
file naming the code its servers ran (`code`). No test reads the AMD sweeps (no profile there).
On a fifth host (2-core Intel Xeon with AMX), sweep-intel-amx/: the sweep-amd grid with
four iterations, 2026-12-05 15:38-16:47 at 97e1b64, 96 of 96 ok; sweep-intel-amx-vllm-order/:
the same setups with `--first-token decode` and three iterations, 19:01-19:37 at b97dbc7,
72 of 72 ok; sweep-intel-amx-push-pull/: `--setups kvpush-push,kvpush-pull` alone in the
default order, three iterations, 20:39-20:57 at a1f2882, 36 of 36 ok;
sweep-intel-amx-push-pull-48/: the same two setups with 48 prompts a point and two
iterations, 2026-12-06 03:42-03:57 at 848c37c, 24 of 24 ok. No test reads those four.
sweep-intel-amx-reference/: issue 20's acceptance sweep, `--setups kvpush-push,kvpush-pull,
vllm-pull-nospin,vllm-pull,single --rates 1,2,4 --input-lens 256,1024 --iterations 3` (48
prompts), every server's prefix cache emptied before each run (e021566), 2026-12-06
05:32-06:30 at e021566, 90 of 90 ok; profile-intel-amx.json: `kvpush plan measure` there
right after it, 06:34-06:36, the proxy's added latency from `kvpush proxy bench --streams 1`
run just before it (0.09 ms pull, 0.90 ms push). Within 25 % at 47 of 72 point-metrics,
every prediction low.
On the sixth (2-core AMD EPYC with AVX-512, no AMX), sweep-amd-avx512-reference/: the same
acceptance sweep, 2026-12-07 03:44-04:47 at 84c6161 (66 runs at 3ffa38d's code, which only
names threads), 90 of 90 ok; profile-amd-avx512.json:
`kvpush plan measure` there right after it, 04:51-04:54, the proxy's added latency from
`kvpush proxy bench --streams 1` run just before it (0.82 ms pull, 1.17 ms push). Within
25 % at 56 of 72 point-metrics, every prediction low but vLLM pull's TPOT at three points.

On the first host the prediction is within 25 % at 22 of 72 point-metrics and low almost
everywhere; the parameters were not tuned toward it: this test pins the error actually
achieved at every point. kvpush is predicted between 40 % and 3 % low everywhere but
where prefill's one core saturates (1024 tokens, 4 req/s: TTFT -55 % pull, -52 % push);
vLLM's connectors are predicted 12-95 % low: their pull handoff latency
(vllm-pull-nospin's TTFT 121-4,817 ms) is kept by no probe. The profile was measured
before 49247aa, whose earlier hand-off is not in its parameters. The client and the proxy
share the two cores with the servers, which the model does not see. No answer came in one
burst.

On the second host, within 25 % at 24 of 72 point-metrics (first token from prefill) and
35 of 54 (from decode), all TTFTs low (-1 to -62 %): the prefill leg is predicted as the
probe's prefill, front end and the proxy's hop (14 ms at 256 tokens), measured 23-36 ms
through the proxy with the client beside it. The profile of the first host predicts this
one's kvpush TTFT 1.1-3.9x too high: profiles do not carry between machines.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpush.bench.results import load_results
from kvpush.plan.machine import CheckRow, check, load_profile

DATA = Path(__file__).resolve().parents[1] / "data" / "plan"

# (setup, input tokens, req/s): relative error (predicted - measured) / measured of the p50
# TTFT, TPOT and E2E latency, the measured p50 being the median over the ok iterations (at
# least one was ok at every point; None would mark a point with none).
Point = tuple[str, int, float]  # setup, input tokens, req/s
Errors = tuple[float | None, float | None, float | None]  # TTFT, TPOT, E2E

ACHIEVED: dict[Point, Errors] = {
    ("kvpush-pull", 256, 1): (-0.402, -0.278, -0.304),
    ("kvpush-pull", 256, 2): (-0.337, -0.296, -0.313),
    ("kvpush-pull", 256, 4): (-0.360, -0.284, -0.312),
    ("kvpush-pull", 1024, 1): (-0.216, -0.129, -0.203),
    ("kvpush-pull", 1024, 2): (-0.223, -0.213, -0.207),
    ("kvpush-pull", 1024, 4): (-0.552, -0.026, -0.390),
    ("kvpush-push", 256, 1): (-0.341, -0.184, -0.193),
    ("kvpush-push", 256, 2): (-0.330, -0.238, -0.273),
    ("kvpush-push", 256, 4): (-0.244, -0.119, -0.150),
    ("kvpush-push", 1024, 1): (-0.217, -0.096, -0.253),
    ("kvpush-push", 1024, 2): (-0.246, -0.183, -0.276),
    ("kvpush-push", 1024, 4): (-0.518, -0.085, -0.407),
    ("vllm-pull", 256, 1): (-0.154, -0.510, -0.428),
    ("vllm-pull", 256, 2): (-0.304, -0.481, -0.468),
    ("vllm-pull", 256, 4): (-0.291, -0.563, -0.495),
    ("vllm-pull", 1024, 1): (-0.198, -0.478, -0.290),
    ("vllm-pull", 1024, 2): (-0.119, -0.445, -0.237),
    ("vllm-pull", 1024, 4): (-0.260, -0.446, -0.288),
    ("vllm-pull-nospin", 256, 1): (-0.570, -0.718, -0.706),
    ("vllm-pull-nospin", 256, 2): (-0.660, -0.652, -0.663),
    ("vllm-pull-nospin", 256, 4): (-0.704, -0.647, -0.655),
    ("vllm-pull-nospin", 1024, 1): (-0.739, -0.697, -0.731),
    ("vllm-pull-nospin", 1024, 2): (-0.897, -0.662, -0.851),
    ("vllm-pull-nospin", 1024, 4): (-0.954, -0.642, -0.931),
}

# The points the item's 25 % holds at, per metric.
WITHIN_25: dict[str, set[Point]] = {
    "ttft": {
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("vllm-pull", 256, 1),
        ("vllm-pull", 1024, 1),
        ("vllm-pull", 1024, 2),
    },
    "tpot": {
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-pull", 1024, 4),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 2),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("kvpush-push", 1024, 4),
    },
    "e2el": {
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 4),
        ("vllm-pull", 1024, 2),
    },
}

# The share of answers that came in one burst: none anywhere once pinned (kvpush-push at
# 1024 tokens and 4 req/s was 0.875 before pinning).
ONE_BURST: dict[Point, float] = {
    ("kvpush-pull", 256, 1): 0.0,
    ("kvpush-push", 1024, 4): 0.0,
    ("vllm-pull-nospin", 1024, 1): 0.0,
}


# The same check on this project's second host (AVX-512; see the module doc), with the
# profile measured there: the reference sweep with kvpush's first token from prefill, and
# the one with it from decode (`kvpush bench sweep --first-token decode`).
FIRST_TOKEN_ACHIEVED: dict[Point, Errors] = {
    ("kvpush-pull", 256, 1): (-0.444, -0.172, -0.216),
    ("kvpush-pull", 256, 2): (-0.619, -0.372, -0.423),
    ("kvpush-pull", 256, 4): (-0.42, 0.056, -0.072),
    ("kvpush-pull", 1024, 1): (-0.093, -0.304, -0.291),
    ("kvpush-pull", 1024, 2): (-0.114, -0.272, -0.281),
    ("kvpush-pull", 1024, 4): (-0.273, -0.274, -0.263),
    ("kvpush-push", 256, 1): (-0.414, -0.358, -0.385),
    ("kvpush-push", 256, 2): (-0.5, -0.332, -0.359),
    ("kvpush-push", 256, 4): (-0.413, -0.387, -0.408),
    ("kvpush-push", 1024, 1): (-0.322, -0.297, -0.285),
    ("kvpush-push", 1024, 2): (-0.388, -0.31, -0.337),
    ("kvpush-push", 1024, 4): (-0.384, -0.442, -0.431),
    ("vllm-pull", 256, 1): (-0.353, 0.102, -0.02),
    ("vllm-pull", 256, 2): (-0.32, -0.042, -0.078),
    ("vllm-pull", 256, 4): (-0.293, -0.121, -0.184),
    ("vllm-pull", 1024, 1): (-0.451, -0.148, -0.189),
    ("vllm-pull", 1024, 2): (-0.418, -0.194, -0.241),
    ("vllm-pull", 1024, 4): (-0.471, -0.153, -0.25),
    ("vllm-pull-nospin", 256, 1): (-0.261, -0.164, -0.196),
    ("vllm-pull-nospin", 256, 2): (-0.323, -0.225, -0.245),
    ("vllm-pull-nospin", 256, 4): (-0.479, -0.332, -0.369),
    ("vllm-pull-nospin", 1024, 1): (-0.322, -0.227, -0.258),
    ("vllm-pull-nospin", 1024, 2): (-0.336, -0.23, -0.274),
    ("vllm-pull-nospin", 1024, 4): (-0.568, -0.207, -0.295),
}
FIRST_TOKEN_WITHIN_25: dict[str, set[Point]] = {
    "ttft": {
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
    },
    "tpot": {
        ("kvpush-pull", 256, 1),
        ("kvpush-pull", 256, 4),
        ("vllm-pull", 256, 1),
        ("vllm-pull", 256, 2),
        ("vllm-pull", 256, 4),
        ("vllm-pull", 1024, 1),
        ("vllm-pull", 1024, 2),
        ("vllm-pull", 1024, 4),
        ("vllm-pull-nospin", 256, 1),
        ("vllm-pull-nospin", 256, 2),
        ("vllm-pull-nospin", 1024, 1),
        ("vllm-pull-nospin", 1024, 2),
        ("vllm-pull-nospin", 1024, 4),
    },
    "e2el": {
        ("kvpush-pull", 256, 1),
        ("kvpush-pull", 256, 4),
        ("vllm-pull", 256, 1),
        ("vllm-pull", 256, 2),
        ("vllm-pull", 256, 4),
        ("vllm-pull", 1024, 1),
        ("vllm-pull", 1024, 2),
        ("vllm-pull-nospin", 256, 1),
        ("vllm-pull-nospin", 256, 2),
    },
}

DECODE_FIRST_ACHIEVED: dict[Point, Errors] = {
    ("kvpush-pull", 256, 1): (-0.406, -0.05, -0.139),
    ("kvpush-pull", 256, 2): (-0.4, -0.18, -0.255),
    ("kvpush-pull", 256, 4): (-0.384, 0.04, -0.04),
    ("kvpush-pull", 1024, 1): (-0.128, -0.191, -0.164),
    ("kvpush-pull", 1024, 2): (-0.009, -0.063, -0.046),
    ("kvpush-pull", 1024, 4): (-0.177, 0.002, -0.013),
    ("kvpush-push", 256, 1): (-0.438, -0.169, -0.226),
    ("kvpush-push", 256, 2): (-0.425, -0.272, -0.305),
    ("kvpush-push", 256, 4): (-0.362, -0.072, -0.1),
    ("kvpush-push", 1024, 1): (-0.289, -0.014, -0.075),
    ("kvpush-push", 1024, 2): (-0.355, -0.182, -0.213),
    ("kvpush-push", 1024, 4): (-0.464, -0.338, -0.362),
    ("vllm-pull-nospin", 256, 1): (-0.221, -0.004, -0.052),
    ("vllm-pull-nospin", 256, 2): (-0.236, 0.216, 0.131),
    ("vllm-pull-nospin", 256, 4): (-0.082, 0.313, 0.185),
    ("vllm-pull-nospin", 1024, 1): (-0.275, 0.167, 0.092),
    ("vllm-pull-nospin", 1024, 2): (-0.238, 0.163, 0.025),
    ("vllm-pull-nospin", 1024, 4): (-0.552, -0.31, -0.405),
}
DECODE_FIRST_WITHIN_25: dict[str, set[Point]] = {
    "ttft": {
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-pull", 1024, 4),
        ("vllm-pull-nospin", 256, 1),
        ("vllm-pull-nospin", 256, 2),
        ("vllm-pull-nospin", 256, 4),
        ("vllm-pull-nospin", 1024, 2),
    },
    "tpot": {
        ("kvpush-pull", 256, 1),
        ("kvpush-pull", 256, 2),
        ("kvpush-pull", 256, 4),
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-pull", 1024, 4),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("vllm-pull-nospin", 256, 1),
        ("vllm-pull-nospin", 256, 2),
        ("vllm-pull-nospin", 1024, 1),
        ("vllm-pull-nospin", 1024, 2),
    },
    "e2el": {
        ("kvpush-pull", 256, 1),
        ("kvpush-pull", 256, 4),
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-pull", 1024, 4),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("vllm-pull-nospin", 256, 1),
        ("vllm-pull-nospin", 256, 2),
        ("vllm-pull-nospin", 256, 4),
        ("vllm-pull-nospin", 1024, 1),
        ("vllm-pull-nospin", 1024, 2),
    },
}

# No answer came in one burst in either sweep.
AVX512_ONE_BURST: dict[Point, float] = {
    ("kvpush-push", 1024, 4): 0.0,
    ("kvpush-pull", 256, 1): 0.0,
}


# Both reference sweeps at 74de54e and after (vLLM's prefill on its own core), against
# profile-reference.json: kvpush's and vLLM's TTFTs predicted 13-72 % low everywhere.
REFERENCE_ACHIEVED: dict[Point, Errors] = {
    ("kvpush-pull", 256, 1): (-0.133, -0.311, -0.312),
    ("kvpush-pull", 256, 2): (-0.297, -0.280, -0.301),
    ("kvpush-pull", 256, 4): (-0.192, -0.387, -0.381),
    ("kvpush-pull", 1024, 1): (-0.438, -0.331, -0.362),
    ("kvpush-pull", 1024, 2): (-0.508, -0.289, -0.330),
    ("kvpush-pull", 1024, 4): (-0.435, -0.334, -0.337),
    ("kvpush-push", 256, 1): (-0.435, -0.197, -0.223),
    ("kvpush-push", 256, 2): (-0.554, -0.390, -0.412),
    ("kvpush-push", 256, 4): (-0.427, -0.061, -0.162),
    ("kvpush-push", 1024, 1): (-0.393, -0.161, -0.213),
    ("kvpush-push", 1024, 2): (-0.450, -0.318, -0.345),
    ("kvpush-push", 1024, 4): (-0.538, -0.348, -0.373),
    ("vllm-pull", 256, 1): (-0.547, -0.487, -0.499),
    ("vllm-pull", 256, 2): (-0.609, -0.509, -0.530),
    ("vllm-pull", 256, 4): (-0.597, -0.570, -0.563),
    ("vllm-pull", 1024, 1): (-0.592, -0.488, -0.519),
    ("vllm-pull", 1024, 2): (-0.577, -0.486, -0.507),
    ("vllm-pull", 1024, 4): (-0.620, -0.573, -0.569),
    ("vllm-pull-nospin", 256, 1): (-0.633, -0.612, -0.624),
    ("vllm-pull-nospin", 256, 2): (-0.679, -0.624, -0.627),
    ("vllm-pull-nospin", 256, 4): (-0.694, -0.636, -0.649),
    ("vllm-pull-nospin", 1024, 1): (-0.547, -0.671, -0.654),
    ("vllm-pull-nospin", 1024, 2): (-0.544, -0.642, -0.626),
    ("vllm-pull-nospin", 1024, 4): (-0.638, -0.676, -0.646),
}
REFERENCE_WITHIN_25: dict[str, set[Point]] = {
    "ttft": {
        ("kvpush-pull", 256, 1),
        ("kvpush-pull", 256, 4),
    },
    "tpot": {
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
    },
    "e2el": {
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
    },
}
REFERENCE_DECODE_FIRST_ACHIEVED: dict[Point, Errors] = {
    ("kvpush-pull", 256, 1): (-0.195, -0.261, -0.243),
    ("kvpush-pull", 256, 2): (-0.228, -0.360, -0.329),
    ("kvpush-pull", 256, 4): (-0.457, -0.465, -0.467),
    ("kvpush-pull", 1024, 1): (-0.461, -0.469, -0.470),
    ("kvpush-pull", 1024, 2): (-0.440, -0.338, -0.363),
    ("kvpush-pull", 1024, 4): (-0.507, -0.310, -0.360),
    ("kvpush-push", 256, 1): (-0.481, -0.373, -0.390),
    ("kvpush-push", 256, 2): (-0.429, -0.325, -0.332),
    ("kvpush-push", 256, 4): (-0.429, -0.054, -0.124),
    ("kvpush-push", 1024, 1): (-0.391, -0.163, -0.216),
    ("kvpush-push", 1024, 2): (-0.410, -0.096, -0.164),
    ("kvpush-push", 1024, 4): (-0.581, -0.470, -0.465),
    ("vllm-pull-nospin", 256, 1): (-0.668, -0.555, -0.568),
    ("vllm-pull-nospin", 256, 2): (-0.716, -0.596, -0.620),
    ("vllm-pull-nospin", 256, 4): (-0.669, -0.602, -0.615),
    ("vllm-pull-nospin", 1024, 1): (-0.519, -0.563, -0.552),
    ("vllm-pull-nospin", 1024, 2): (-0.571, -0.603, -0.592),
    ("vllm-pull-nospin", 1024, 4): (-0.632, -0.629, -0.612),
}
REFERENCE_DECODE_FIRST_WITHIN_25: dict[str, set[Point]] = {
    "ttft": {
        ("kvpush-pull", 256, 1),
        ("kvpush-pull", 256, 2),
    },
    "tpot": {
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
    },
    "e2el": {
        ("kvpush-pull", 256, 1),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
    },
}
REFERENCE_ONE_BURST: dict[Point, float] = {
    ("kvpush-push", 256, 1): 0.0,
    ("kvpush-push", 1024, 4): 0.0,
    ("vllm-pull-nospin", 1024, 2): 0.0,
}


# The Intel host's reference sweep (sweep-intel, 1ca3bf8) against profile-intel.json,
# measured there afterwards (the proxy's added latency from `kvpush proxy bench --streams 1`
# just before it): every point predicted low, TTFT 18-53 %.
INTEL_ACHIEVED: dict[Point, Errors] = {
    ("kvpush-pull", 256, 1): (-0.341, -0.413, -0.429),
    ("kvpush-pull", 256, 2): (-0.459, -0.435, -0.449),
    ("kvpush-pull", 256, 4): (-0.389, -0.429, -0.453),
    ("kvpush-pull", 1024, 1): (-0.346, -0.345, -0.353),
    ("kvpush-pull", 1024, 2): (-0.451, -0.391, -0.407),
    ("kvpush-pull", 1024, 4): (-0.516, -0.452, -0.461),
    ("kvpush-push", 256, 1): (-0.507, -0.274, -0.31),
    ("kvpush-push", 256, 2): (-0.492, -0.219, -0.256),
    ("kvpush-push", 256, 4): (-0.431, -0.271, -0.292),
    ("kvpush-push", 1024, 1): (-0.247, -0.201, -0.22),
    ("kvpush-push", 1024, 2): (-0.244, -0.091, -0.128),
    ("kvpush-push", 1024, 4): (-0.319, -0.015, -0.084),
    ("vllm-pull", 256, 1): (-0.341, -0.063, -0.096),
    ("vllm-pull", 256, 2): (-0.235, 0.106, -0.039),
    ("vllm-pull", 256, 4): (-0.339, -0.156, -0.199),
    ("vllm-pull", 1024, 1): (-0.247, -0.079, -0.142),
    ("vllm-pull", 1024, 2): (-0.176, -0.128, -0.153),
    ("vllm-pull", 1024, 4): (-0.252, -0.072, -0.141),
    ("vllm-pull-nospin", 256, 1): (-0.313, -0.435, -0.421),
    ("vllm-pull-nospin", 256, 2): (-0.521, -0.574, -0.559),
    ("vllm-pull-nospin", 256, 4): (-0.417, -0.462, -0.457),
    ("vllm-pull-nospin", 1024, 1): (-0.471, -0.487, -0.492),
    ("vllm-pull-nospin", 1024, 2): (-0.375, -0.405, -0.387),
    ("vllm-pull-nospin", 1024, 4): (-0.526, -0.484, -0.492),
}
INTEL_WITHIN_25: dict[str, set[Point]] = {
    "ttft": {
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("vllm-pull", 256, 2),
        ("vllm-pull", 1024, 1),
        ("vllm-pull", 1024, 2),
    },
    "tpot": {
        ("kvpush-push", 256, 2),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("kvpush-push", 1024, 4),
        ("vllm-pull", 256, 1),
        ("vllm-pull", 256, 2),
        ("vllm-pull", 256, 4),
        ("vllm-pull", 1024, 1),
        ("vllm-pull", 1024, 2),
        ("vllm-pull", 1024, 4),
    },
    "e2el": {
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("kvpush-push", 1024, 4),
        ("vllm-pull", 256, 1),
        ("vllm-pull", 256, 2),
        ("vllm-pull", 256, 4),
        ("vllm-pull", 1024, 1),
        ("vllm-pull", 1024, 2),
        ("vllm-pull", 1024, 4),
    },
}
INTEL_ONE_BURST: dict[Point, float] = {
    ("kvpush-push", 256, 1): 0.0,
    ("kvpush-push", 1024, 4): 0.0,
    ("vllm-pull-nospin", 1024, 4): 0.0,
}


# The same host's reference sweep again after cb1e764 (sweep-intel-uvloop: the benchmarks'
# proxy on uvloop, as `kvpush proxy` serves it), against profile-intel-uvloop.json measured
# there right after it: every point predicted low, TTFT 15-47 %.
INTEL_UVLOOP_ACHIEVED: dict[Point, Errors] = {
    ("kvpush-pull", 256, 1): (-0.343, -0.185, -0.203),
    ("kvpush-pull", 256, 2): (-0.46, -0.4, -0.425),
    ("kvpush-pull", 256, 4): (-0.469, -0.507, -0.506),
    ("kvpush-pull", 1024, 1): (-0.249, -0.224, -0.288),
    ("kvpush-pull", 1024, 2): (-0.277, -0.214, -0.224),
    ("kvpush-pull", 1024, 4): (-0.416, -0.377, -0.411),
    ("kvpush-push", 256, 1): (-0.308, -0.223, -0.234),
    ("kvpush-push", 256, 2): (-0.372, -0.242, -0.241),
    ("kvpush-push", 256, 4): (-0.288, -0.154, -0.176),
    ("kvpush-push", 1024, 1): (-0.169, -0.116, -0.123),
    ("kvpush-push", 1024, 2): (-0.268, -0.263, -0.279),
    ("kvpush-push", 1024, 4): (-0.268, -0.222, -0.279),
    ("vllm-pull", 256, 1): (-0.379, -0.251, -0.276),
    ("vllm-pull", 256, 2): (-0.298, -0.132, -0.173),
    ("vllm-pull", 256, 4): (-0.328, -0.298, -0.324),
    ("vllm-pull", 1024, 1): (-0.268, -0.267, -0.287),
    ("vllm-pull", 1024, 2): (-0.221, -0.164, -0.172),
    ("vllm-pull", 1024, 4): (-0.335, -0.115, -0.154),
    ("vllm-pull-nospin", 256, 1): (-0.304, -0.156, -0.187),
    ("vllm-pull-nospin", 256, 2): (-0.367, -0.344, -0.355),
    ("vllm-pull-nospin", 256, 4): (-0.412, -0.348, -0.369),
    ("vllm-pull-nospin", 1024, 1): (-0.153, -0.246, -0.214),
    ("vllm-pull-nospin", 1024, 2): (-0.25, -0.438, -0.406),
    ("vllm-pull-nospin", 1024, 4): (-0.24, -0.343, -0.311),
}
INTEL_UVLOOP_WITHIN_25: dict[str, set[Point]] = {
    "ttft": {
        ("kvpush-pull", 1024, 1),
        ("kvpush-push", 1024, 1),
        ("vllm-pull", 1024, 2),
        ("vllm-pull-nospin", 1024, 1),
        ("vllm-pull-nospin", 1024, 2),
        ("vllm-pull-nospin", 1024, 4),
    },
    "tpot": {
        ("kvpush-pull", 256, 1),
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 2),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 4),
        ("vllm-pull", 256, 2),
        ("vllm-pull", 1024, 2),
        ("vllm-pull", 1024, 4),
        ("vllm-pull-nospin", 256, 1),
        ("vllm-pull-nospin", 1024, 1),
    },
    "e2el": {
        ("kvpush-pull", 256, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 2),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("vllm-pull", 256, 2),
        ("vllm-pull", 1024, 2),
        ("vllm-pull", 1024, 4),
        ("vllm-pull-nospin", 256, 1),
        ("vllm-pull-nospin", 1024, 1),
    },
}
INTEL_UVLOOP_ONE_BURST: dict[Point, float] = {
    ("kvpush-push", 256, 1): 0.0,
    ("kvpush-push", 1024, 4): 0.0,
    ("vllm-pull-nospin", 1024, 4): 0.0,
}

# The acceptance sweep of issue 20 on the Intel host with AMX (sweep-intel-amx-reference: five
# setups, 48 prompts, three iterations, every server's prefix cache emptied before each run),
# against profile-intel-amx.json measured there right after it: every point predicted low,
# TTFT 22-51 %, TPOT and E2E within 25 % at 46 of 48.
AMX_ACHIEVED: dict[Point, Errors] = {
    ("kvpush-pull", 256, 1): (-0.509, -0.182, -0.216),
    ("kvpush-pull", 256, 2): (-0.44, -0.16, -0.187),
    ("kvpush-pull", 256, 4): (-0.388, -0.181, -0.208),
    ("kvpush-pull", 1024, 1): (-0.381, -0.184, -0.23),
    ("kvpush-pull", 1024, 2): (-0.408, -0.225, -0.26),
    ("kvpush-pull", 1024, 4): (-0.364, -0.249, -0.268),
    ("kvpush-push", 256, 1): (-0.468, -0.104, -0.155),
    ("kvpush-push", 256, 2): (-0.419, -0.151, -0.18),
    ("kvpush-push", 256, 4): (-0.374, -0.154, -0.184),
    ("kvpush-push", 1024, 1): (-0.337, -0.095, -0.138),
    ("kvpush-push", 1024, 2): (-0.314, -0.107, -0.144),
    ("kvpush-push", 1024, 4): (-0.276, -0.115, -0.149),
    ("vllm-pull", 256, 1): (-0.403, -0.013, -0.086),
    ("vllm-pull", 256, 2): (-0.469, -0.099, -0.17),
    ("vllm-pull", 256, 4): (-0.482, -0.086, -0.147),
    ("vllm-pull", 1024, 1): (-0.219, -0.057, -0.103),
    ("vllm-pull", 1024, 2): (-0.252, -0.014, -0.072),
    ("vllm-pull", 1024, 4): (-0.291, -0.03, -0.064),
    ("vllm-pull-nospin", 256, 1): (-0.488, -0.119, -0.191),
    ("vllm-pull-nospin", 256, 2): (-0.457, -0.053, -0.134),
    ("vllm-pull-nospin", 256, 4): (-0.473, -0.016, -0.109),
    ("vllm-pull-nospin", 1024, 1): (-0.304, -0.03, -0.095),
    ("vllm-pull-nospin", 1024, 2): (-0.274, -0.023, -0.076),
    ("vllm-pull-nospin", 1024, 4): (-0.308, -0.008, -0.104),
}
AMX_WITHIN_25: dict[str, set[Point]] = {
    "ttft": {
        ("vllm-pull", 1024, 1),
    },
    "tpot": {
        ("kvpush-pull", 256, 1),
        ("kvpush-pull", 256, 2),
        ("kvpush-pull", 256, 4),
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-pull", 1024, 4),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 2),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("kvpush-push", 1024, 4),
        ("vllm-pull", 256, 1),
        ("vllm-pull", 256, 2),
        ("vllm-pull", 256, 4),
        ("vllm-pull", 1024, 1),
        ("vllm-pull", 1024, 2),
        ("vllm-pull", 1024, 4),
        ("vllm-pull-nospin", 256, 1),
        ("vllm-pull-nospin", 256, 2),
        ("vllm-pull-nospin", 256, 4),
        ("vllm-pull-nospin", 1024, 1),
        ("vllm-pull-nospin", 1024, 2),
        ("vllm-pull-nospin", 1024, 4),
    },
    "e2el": {
        ("kvpush-pull", 256, 1),
        ("kvpush-pull", 256, 2),
        ("kvpush-pull", 256, 4),
        ("kvpush-pull", 1024, 1),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 2),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("kvpush-push", 1024, 4),
        ("vllm-pull", 256, 1),
        ("vllm-pull", 256, 2),
        ("vllm-pull", 256, 4),
        ("vllm-pull", 1024, 1),
        ("vllm-pull", 1024, 2),
        ("vllm-pull", 1024, 4),
        ("vllm-pull-nospin", 256, 1),
        ("vllm-pull-nospin", 256, 2),
        ("vllm-pull-nospin", 256, 4),
        ("vllm-pull-nospin", 1024, 1),
        ("vllm-pull-nospin", 1024, 2),
        ("vllm-pull-nospin", 1024, 4),
    },
}
AMX_ONE_BURST: dict[Point, float] = {
    ("kvpush-push", 256, 1): 0.0,
    ("kvpush-pull", 1024, 4): 0.0,
    ("vllm-pull", 1024, 4): 0.0,
}


# The same acceptance sweep on the AMD host with AVX-512 (sweep-amd-avx512-reference), against
# profile-amd-avx512.json measured there right after it: every point predicted low but
# vLLM pull's TPOT at three, TTFT by 16-43 %, 56 of 72 point-metrics within 25 %.
AMD_ACHIEVED: dict[Point, Errors] = {
    ("kvpush-pull", 256, 1): (-0.407, -0.171, -0.203),
    ("kvpush-pull", 256, 2): (-0.397, -0.14, -0.18),
    ("kvpush-pull", 256, 4): (-0.427, -0.137, -0.175),
    ("kvpush-pull", 1024, 1): (-0.181, -0.146, -0.148),
    ("kvpush-pull", 1024, 2): (-0.159, -0.106, -0.112),
    ("kvpush-pull", 1024, 4): (-0.202, -0.095, -0.132),
    ("kvpush-push", 256, 1): (-0.247, -0.263, -0.264),
    ("kvpush-push", 256, 2): (-0.243, -0.168, -0.17),
    ("kvpush-push", 256, 4): (-0.266, -0.2, -0.208),
    ("kvpush-push", 1024, 1): (-0.235, -0.31, -0.289),
    ("kvpush-push", 1024, 2): (-0.198, -0.22, -0.22),
    ("kvpush-push", 1024, 4): (-0.229, -0.187, -0.174),
    ("vllm-pull", 256, 1): (-0.37, -0.084, -0.117),
    ("vllm-pull", 256, 2): (-0.432, 0.028, -0.053),
    ("vllm-pull", 256, 4): (-0.276, 0.013, -0.037),
    ("vllm-pull", 1024, 1): (-0.221, 0.017, -0.058),
    ("vllm-pull", 1024, 2): (-0.233, -0.033, -0.073),
    ("vllm-pull", 1024, 4): (-0.219, -0.124, -0.172),
    ("vllm-pull-nospin", 256, 1): (-0.405, -0.174, -0.233),
    ("vllm-pull-nospin", 256, 2): (-0.406, -0.172, -0.231),
    ("vllm-pull-nospin", 256, 4): (-0.412, -0.193, -0.23),
    ("vllm-pull-nospin", 1024, 1): (-0.193, -0.217, -0.213),
    ("vllm-pull-nospin", 1024, 2): (-0.203, -0.274, -0.279),
    ("vllm-pull-nospin", 1024, 4): (-0.214, -0.071, -0.124),
}
AMD_WITHIN_25: dict[str, set[Point]] = {
    "ttft": {
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-pull", 1024, 4),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 2),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("kvpush-push", 1024, 4),
        ("vllm-pull", 1024, 1),
        ("vllm-pull", 1024, 2),
        ("vllm-pull", 1024, 4),
        ("vllm-pull-nospin", 1024, 1),
        ("vllm-pull-nospin", 1024, 2),
        ("vllm-pull-nospin", 1024, 4),
    },
    "tpot": {
        ("kvpush-pull", 256, 1),
        ("kvpush-pull", 256, 2),
        ("kvpush-pull", 256, 4),
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-pull", 1024, 4),
        ("kvpush-push", 256, 2),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 2),
        ("kvpush-push", 1024, 4),
        ("vllm-pull", 256, 1),
        ("vllm-pull", 256, 2),
        ("vllm-pull", 256, 4),
        ("vllm-pull", 1024, 1),
        ("vllm-pull", 1024, 2),
        ("vllm-pull", 1024, 4),
        ("vllm-pull-nospin", 256, 1),
        ("vllm-pull-nospin", 256, 2),
        ("vllm-pull-nospin", 256, 4),
        ("vllm-pull-nospin", 1024, 1),
        ("vllm-pull-nospin", 1024, 4),
    },
    "e2el": {
        ("kvpush-pull", 256, 1),
        ("kvpush-pull", 256, 2),
        ("kvpush-pull", 256, 4),
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-pull", 1024, 4),
        ("kvpush-push", 256, 2),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 2),
        ("kvpush-push", 1024, 4),
        ("vllm-pull", 256, 1),
        ("vllm-pull", 256, 2),
        ("vllm-pull", 256, 4),
        ("vllm-pull", 1024, 1),
        ("vllm-pull", 1024, 2),
        ("vllm-pull", 1024, 4),
        ("vllm-pull-nospin", 256, 1),
        ("vllm-pull-nospin", 256, 2),
        ("vllm-pull-nospin", 256, 4),
        ("vllm-pull-nospin", 1024, 1),
        ("vllm-pull-nospin", 1024, 4),
    },
}
AMD_ONE_BURST: dict[Point, float] = {
    ("kvpush-push", 256, 1): 0.0,
    ("kvpush-pull", 1024, 4): 0.0,
    ("vllm-pull", 1024, 4): 0.0,
}


@dataclass(frozen=True)
class Recorded:
    """A recorded sweep, the profile measured on its host, and what the check achieved."""

    profile: str
    achieved: dict[Point, Errors]
    within_25: dict[str, set[Point]]
    one_burst: dict[Point, float]


RECORDED: dict[str, Recorded] = {
    "sweep-pinned": Recorded("profile.json", ACHIEVED, WITHIN_25, ONE_BURST),
    "sweep-first-token": Recorded(
        "profile-avx512.json", FIRST_TOKEN_ACHIEVED, FIRST_TOKEN_WITHIN_25, AVX512_ONE_BURST
    ),
    "sweep-decode-first": Recorded(
        "profile-avx512.json", DECODE_FIRST_ACHIEVED, DECODE_FIRST_WITHIN_25, AVX512_ONE_BURST
    ),
    "sweep-reference": Recorded(
        "profile-reference.json", REFERENCE_ACHIEVED, REFERENCE_WITHIN_25, REFERENCE_ONE_BURST
    ),
    "sweep-decode-first-reference": Recorded(
        "profile-reference.json",
        REFERENCE_DECODE_FIRST_ACHIEVED,
        REFERENCE_DECODE_FIRST_WITHIN_25,
        REFERENCE_ONE_BURST,
    ),
    "sweep-intel": Recorded("profile-intel.json", INTEL_ACHIEVED, INTEL_WITHIN_25, INTEL_ONE_BURST),
    "sweep-intel-uvloop": Recorded(
        "profile-intel-uvloop.json",
        INTEL_UVLOOP_ACHIEVED,
        INTEL_UVLOOP_WITHIN_25,
        INTEL_UVLOOP_ONE_BURST,
    ),
    "sweep-intel-amx-reference": Recorded(
        "profile-intel-amx.json", AMX_ACHIEVED, AMX_WITHIN_25, AMX_ONE_BURST
    ),
    "sweep-amd-avx512-reference": Recorded(
        "profile-amd-avx512.json", AMD_ACHIEVED, AMD_WITHIN_25, AMD_ONE_BURST
    ),
}
CASES = [
    (sweep, point) for sweep, rec in sorted(RECORDED.items()) for point in sorted(rec.achieved)
]


@functools.cache
def rows(sweep: str) -> dict[Point, CheckRow]:
    profile = load_profile(DATA / RECORDED[sweep].profile)
    found = check(profile, load_results(DATA / sweep), seeds=10)
    return {(r.measured.setup, r.measured.input_len, r.measured.rate): r for r in found}


@pytest.mark.parametrize("sweep", sorted(RECORDED))
def test_every_recorded_point_is_predicted(sweep: str) -> None:
    assert set(rows(sweep)) == set(RECORDED[sweep].achieved)


@pytest.mark.parametrize(("sweep", "point"), CASES)
def test_error_achieved_is_pinned(sweep: str, point: Point) -> None:
    row = rows(sweep)[point]
    expected_errors = RECORDED[sweep].achieved[point]
    for metric, expected in zip(("ttft", "tpot", "e2el"), expected_errors, strict=True):
        error = row.error(metric)
        if expected is None:
            assert error is None
        else:
            assert error == pytest.approx(expected, abs=0.005, rel=0.001), metric


@pytest.mark.parametrize("sweep", sorted(RECORDED))
@pytest.mark.parametrize("metric", ["e2el", "tpot", "ttft"])
def test_where_the_prediction_is_within_25_percent(sweep: str, metric: str) -> None:
    within = {
        point
        for point, row in rows(sweep).items()
        if (error := row.error(metric)) is not None and abs(error) <= 0.25
    }
    assert within == RECORDED[sweep].within_25[metric]


@pytest.mark.parametrize(
    ("sweep", "point"),
    [(sweep, point) for sweep, rec in sorted(RECORDED.items()) for point in sorted(rec.one_burst)],
)
def test_the_share_of_answers_in_one_burst_is_reported(sweep: str, point: Point) -> None:
    expected = RECORDED[sweep].one_burst[point]
    assert rows(sweep)[point].measured.one_burst == pytest.approx(expected, abs=0.001)
