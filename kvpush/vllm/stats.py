"""Connector statistics: what moved, how long it took, and what our hooks cost the engine.

Workers and the scheduler each collect a `KvpushStats` per interval; vLLM ships them to
the logger process, `aggregate`s them, prints `reduce()` and feeds `KvpushPromMetrics`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvpush.node.config import ROLES, KvpushConfig
from kvpush.node.results import SERIES, empty_data


@dataclass
class KvpushStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=empty_data)

    def reset(self) -> None:
        self.data = empty_data()

    def is_empty(self) -> bool:
        d = self.data
        return not (
            d["bytes"] or d["failures"] or d["rejected"] or d.get("handoffs") or d["hook_s"]
        )

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs = other.data
        for name in SERIES:
            self.data[name].extend(theirs.get(name, ()))
        for table in ("failures", "rejected", "handoffs", "hook_s", "hook_calls"):
            for key, value in theirs.get(table, {}).items():
                self.data[table][key] = self.data[table].get(key, 0) + value
        self.data["gauges"].update(theirs.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {"transfers": len(d["bytes"])}
        if d["bytes"]:
            n = len(d["bytes"])
            out["avg_MB"] = round(sum(d["bytes"]) / n / 1e6, 3)
            out["avg_descriptors"] = round(sum(d["descriptors"]) / n, 1)
            for series, key in (
                ("write_s", "avg_write_ms"),
                ("read_s", "avg_read_ms"),
                ("reg_to_write_s", "avg_reg_to_write_ms"),
                ("finish_to_handoff_s", "avg_finish_to_handoff_ms"),
                ("finish_to_write_s", "avg_finish_to_write_ms"),
            ):
                if d[series]:
                    out[key] = round(1e3 * sum(d[series]) / len(d[series]), 3)
        if d["wait_s"]:
            out["avg_decode_wait_ms"] = round(1e3 * sum(d["wait_s"]) / len(d["wait_s"]), 3)
        out["failures"] = sum(d["failures"].values())
        out["rejected_messages"] = sum(d["rejected"].values())
        main = sum(d["hook_s"].values())
        out["main_thread_ms"] = round(1e3 * main, 3)
        return out


def _buckets(lo: float, factor: float, n: int) -> list[float]:
    return [lo * factor**i for i in range(n)]


class KvpushPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        # vLLM passes its own (multiprocess-aware) metric classes; typed loosely there.
        hist: Any = self._histogram_cls
        counter: Any = self._counter_cls
        gauge: Any = self._gauge_cls

        def histogram(name: str, documentation: str, buckets: list[float]) -> dict[int, Any]:
            return per_engine(
                hist(name=name, documentation=documentation, buckets=buckets, labelnames=labelnames)
            )

        seconds = _buckets(1e-5, 3, 14)
        self.bytes = histogram(
            "kvpush:transfer_bytes", "Bytes per KV transfer", _buckets(4096, 4, 12)
        )
        self.descriptors = histogram(
            "kvpush:transfer_descriptors", "NIXL descriptors per transfer", _buckets(1, 4, 10)
        )
        self.write_s = histogram("kvpush:write_seconds", "Push: WRITE post to completion", seconds)
        self.read_s = histogram("kvpush:read_seconds", "Pull: READ post to completion", seconds)
        self.reg_to_write_s = histogram(
            "kvpush:registration_to_write_seconds",
            "Push: registration arrival to WRITE post (about 0 when it came after the prefill)",
            seconds,
        )
        self.finish_to_handoff_s = histogram(
            "kvpush:finish_to_handoff_seconds",
            "Push: vLLM finished the prefill to kvpush's worker thread got it (vLLM's step hop)",
            seconds,
        )
        self.finish_to_write_s = histogram(
            "kvpush:finish_to_write_seconds",
            "Push: vLLM finished the prefill to WRITE post (waits for the registration if later)",
            seconds,
        )
        self.wait_s = histogram(
            "kvpush:decode_wait_seconds", "Decode: blocks allocated to all KV arrived", seconds
        )
        self.failures = counter(
            name="kvpush:failures",
            documentation="Failed transfers by cause",
            labelnames=[*labelnames, "kind"],
        )
        self.rejected = counter(
            name="kvpush:rejected_messages",
            documentation="Control messages rejected (malformed, forged, oversized)",
            labelnames=[*labelnames, "kind"],
        )
        self.handoffs = counter(
            name="kvpush:handoffs",
            documentation="Push prefill: finished prefills by how they reached the writer first "
            "(direct: from the scheduler's process at once; next_step: in vLLM's metadata)",
            labelnames=[*labelnames, "path"],
        )
        self.hook_s = counter(
            name="kvpush:main_thread_seconds",
            documentation="Time our hooks spent on vLLM's scheduler/worker main thread",
            labelnames=[*labelnames, "hook"],
        )
        self.hook_calls = counter(
            name="kvpush:main_thread_calls",
            documentation="Calls of our hooks",
            labelnames=[*labelnames, "hook"],
        )
        self.gauges = gauge(
            name="kvpush:waiting",
            documentation="Registrations, prefills, leases, blocks and transfers waiting",
            labelnames=[*labelnames, "what"],
            multiprocess_mode="mostrecent",
        )
        # Lets a router tell, from /metrics, which kvpush mode and role a server runs -
        # from start-up on, before any request (the proxy names mode mismatches with it) -
        # and an operator whether its control messages are authenticated (auth "off": the
        # server runs with insecure: true). first_token, on decode: "pinned" where it
        # continues from prefill's first token (kvpush's logits processor), "own" where it
        # samples its own, as with speculative decoding, for which vLLM loads no custom
        # logits processor, or a model with state layers, whose prompt's last token decode
        # computes; the proxy then takes a stream's first token from decode.
        info = gauge(
            name="kvpush:info",
            documentation="kvpush connector identity (always 1): mode, role, auth on/off, "
            "and whether decode continues from prefill's first token",
            labelnames=[*labelnames, "mode", "role", "auth", "first_token"],
            multiprocess_mode="mostrecent",
        )
        transfer = self._kv_transfer_config
        if transfer is not None:
            extra = dict(transfer.kv_connector_extra_config or {})
            config = KvpushConfig.from_extra(extra, require_secret=False)
            role = ROLES.get(str(transfer.kv_role), str(transfer.kv_role))
            auth = "on" if config.secret else "off"
            first = "-"
            if transfer.kv_role == "kv_consumer":
                drafts = getattr(vllm_config, "speculative_config", None) is not None
                model = getattr(vllm_config, "model_config", None)
                states = model is not None and bool(getattr(model, "is_hybrid", False))
                first = "own" if drafts or states else "pinned"
            for labels in self.per_engine_labelvalues.values():
                info.labels(*labels, config.mode, role, auth, first).set(1)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        labels = self.per_engine_labelvalues[engine_idx]
        metric: Any
        for series, metric in (
            ("bytes", self.bytes),
            ("descriptors", self.descriptors),
            ("write_s", self.write_s),
            ("read_s", self.read_s),
            ("reg_to_write_s", self.reg_to_write_s),
            ("finish_to_handoff_s", self.finish_to_handoff_s),
            ("finish_to_write_s", self.finish_to_write_s),
            ("wait_s", self.wait_s),
        ):
            for value in d.get(series, ()):
                metric[engine_idx].observe(value)
        for table, metric in (
            ("failures", self.failures),
            ("rejected", self.rejected),
            ("handoffs", self.handoffs),
            ("hook_s", self.hook_s),
            ("hook_calls", self.hook_calls),
        ):
            for key, value in d.get(table, {}).items():
                metric.labels(*labels, key).inc(value)
        for key, value in d.get("gauges", {}).items():
            self.gauges.labels(*labels, key).set(value)
