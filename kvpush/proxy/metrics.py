"""The proxy's Prometheus metrics (its /metrics) and the one-line status `kvpush up` prints.

Counters and histograms of requests, failed legs, ejections, retries and latencies, plus
per-backend gauges read from the pools whenever /metrics is scraped.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpush.proxy.balance import Pool

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _FleetCollector(Collector):
    """Per-backend gauges, read from the pools when /metrics is scraped."""

    def __init__(self, pools: dict[str, Pool]) -> None:
        self.pools = pools

    def collect(self) -> Iterable[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(
                f"kvpush_proxy_backend_{name}", doc, labels=["role", "backend"]
            )

        in_flight = gauge("in_flight", "Legs in flight per backend")
        tokens = gauge(
            "in_flight_tokens",
            "Tokens of the legs in flight (prefill: prompt; decode: prompt + max output), "
            "estimated at 4 characters a token",
        )
        healthy = gauge("healthy", "1 while the backend gets new requests, 0 while ejected")
        speed = gauge(
            "seconds_per_unit",
            "The proxy's estimate of the backend's speed: prefill seconds per prompt token, "
            "decode seconds to the first byte",
        )
        waiting = gauge("reported_waiting", "vllm:num_requests_waiting at the last scrape")
        running = gauge("reported_running", "vllm:num_requests_running at the last scrape")
        kv_usage = gauge("reported_kv_usage", "vllm:kv_cache_usage_perc at the last scrape")
        for role, pool in self.pools.items():
            for s in pool:
                labels = [role, s.url]
                in_flight.add_metric(labels, s.in_flight)
                tokens.add_metric(labels, s.tokens)
                healthy.add_metric(labels, 1.0 if s.healthy else 0.0)
                if s.estimate is not None:
                    speed.add_metric(labels, s.estimate)
                if s.reported is not None:
                    waiting.add_metric(labels, s.reported.waiting)
                    running.add_metric(labels, s.reported.running)
                    if s.reported.kv_usage is not None:
                        kv_usage.add_metric(labels, s.reported.kv_usage)
        return [in_flight, tokens, healthy, speed, waiting, running, kv_usage]


class Metrics:
    def __init__(self, pools: dict[str, Pool]) -> None:
        self.pools = pools
        self.registry = CollectorRegistry()
        self.registry.register(_FleetCollector(pools))
        self.requests = Counter(
            "kvpush_proxy_requests",
            "Client requests by outcome",
            ["mode", "outcome"],
            registry=self.registry,
        )
        self.errors = Counter(
            "kvpush_proxy_backend_errors",
            "Failed legs per backend",
            ["role", "backend", "kind"],
            registry=self.registry,
        )
        self.ejections = Counter(
            "kvpush_proxy_backend_ejections",
            "Times a backend was taken out of the choice (failed health checks, refused "
            "connections)",
            ["role", "backend"],
            registry=self.registry,
        )
        self.retries = Counter(
            "kvpush_proxy_retries",
            "Legs sent again to another backend, by why that was safe (unsent, lost)",
            ["role", "cause"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvpush_proxy_ttft_seconds",
            "Time from client request to the client's first byte (labelled with the backend "
            "that sent it: prefill when its first token led the stream)",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prefill = Histogram(
            "kvpush_proxy_prefill_seconds",
            "Duration of the prefill leg (prefill-side TTFT)",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.handoff = Histogram(
            "kvpush_proxy_handoff_seconds",
            "Decode's first byte at the proxy minus the prefill leg's duration, per decode "
            "backend: the KV handoff plus waiting at decode",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

        self.first_token = Counter(
            "kvpush_proxy_first_token",
            "Streamed requests whose first token could come from prefill, by where it came "
            "from (prefill, decode) and mismatch: decode did not reproduce prefill's token",
            ["source"],
            registry=self.registry,
        )

    def first_token_counts(self) -> dict[str, int]:
        """`first_token`'s counts so far, by source (prefill, decode, mismatch)."""
        counts: dict[str, int] = {}
        for metric in self.first_token.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["source"]] = int(sample.value)
        return counts

    def exposition(self) -> bytes:
        """What /metrics answers, in Prometheus' text format."""
        return generate_latest(self.registry)

    def status_line(self) -> str:
        """One human-readable line: request outcomes, legs in flight, ejected backends."""
        outcomes: dict[str, int] = {}
        for metric in self.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    key = sample.labels["outcome"]
                    outcomes[key] = outcomes.get(key, 0) + int(sample.value)
        done = ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items())) or "no requests yet"
        busy = ", ".join(
            f"{role} {sum(s.in_flight for s in pool)}" for role, pool in self.pools.items()
        )
        line = f"requests: {done} | in flight: {busy}"
        ejected = [s.url for pool in self.pools.values() for s in pool if not s.healthy]
        return f"{line} | ejected: {', '.join(ejected)}" if ejected else line
