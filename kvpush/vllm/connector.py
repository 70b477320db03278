"""`KvpushConnector`: the class vLLM loads (kv_connector_module_path "kvpush.vllm").

A thin facade: vLLM builds it once in the scheduler process (role SCHEDULER) and once per
worker (role WORKER); each instance forwards to `SchedulerSide` or `WorkerSide`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpush.node.config import ROLES, KvpushConfig
from kvpush.node.context import Identity
from kvpush.node.worker import WorkerSide, in_process
from kvpush.vllm.layout import (
    PACKED_BLOCK_BACKENDS,
    UnsupportedKVCache,
    describe_kv_caches,
    kv_cache_facts,
)
from kvpush.vllm.metadata import KvpushMetadata
from kvpush.vllm.scheduler import SchedulerSide
from kvpush.vllm.stats import KvpushPromMetrics, KvpushStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpush.connector")

# How often the hooks' own timings go out with the stats. vLLM asks for stats at every
# engine step (~1000 a second while decode waits for KV), and each one it gets is shipped
# to the API server's process; transfers and failures still go out at the step they are
# recorded.
STATS_EVERY_S = 1.0


def log_like_vllm() -> None:
    """kvpush's log records go where vLLM's go - its handler, format and level - so an
    operator sees "released KV of ..." next to vLLM's own lines, with the process that
    logged it. An operator's own configuration of the "kvpush" logger is left alone."""
    ours, theirs = logging.getLogger("kvpush"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


def refuse_sleep_mode(model_config: Any) -> None:
    """kvpush registers vLLM's KV cache with NIXL once, for the server's life; sleep mode
    releases that memory and maps new memory at wake-up, under a registration that then
    points at memory no longer the cache's. Refused at start, with the way out."""
    if getattr(model_config, "enable_sleep_mode", False):
        raise ValueError(
            "kvpush cannot serve with --enable-sleep-mode: sleep releases the KV cache that "
            "kvpush registered with NIXL at start, and transfers would use a registration "
            "that no longer matches the memory; start the server without --enable-sleep-mode"
        )


def refuse_split_requests(parallel: Any, is_producer: bool) -> None:
    """kvpush moves a request's KV between whole layers of one rank's cache and another's,
    split by heads (tensor parallelism) and, on prefill, by layers (pipeline parallelism:
    each stage writes or is read for its own layers). Prefill context parallelism gives
    each rank some of the prompt's tokens, and a pipeline-parallel decode would need every
    stage's arrivals counted apart: both refused at start, naming what works."""
    checks = [
        ("--prefill-context-parallel-size",
         getattr(parallel, "prefill_context_parallel_size", 1),
         "each rank holds only its share of a prompt's tokens", "with --tensor-parallel-size"),
    ]  # fmt: skip
    if not is_producer:
        checks.append(
            ("--pipeline-parallel-size", getattr(parallel, "pipeline_parallel_size", 1),
             "kvpush splits a decode's KV by heads only", "on decode with "
             "--tensor-parallel-size (prefill may run pipeline stages)"),
        )  # fmt: skip
    for flag, size, what, instead in checks:
        if int(size or 1) > 1:
            raise ValueError(
                f"kvpush cannot serve with {flag} {size}: {what}, and kvpush moves each "
                f"rank's KV of a request whole; split the model {instead}, or serve more "
                "replicas behind the proxy"
            )


# get_transfer_results' answer in a step where nothing finished. vLLM only reads it (and
# pickles it to the scheduler); frozen sets make a change anywhere fail loudly instead of
# carrying into the next step.
NOTHING_FINISHED = KVConnectorTransferResults(
    finished_sending=frozenset(),  # type: ignore[arg-type]
    finished_recving=frozenset(),  # type: ignore[arg-type]
    failed_recving=frozenset(),  # type: ignore[arg-type]
)


NO_LOAD_ERRORS: frozenset[int] = frozenset()


class KvpushConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.P2P
    _stats_due = 0.0  # monotonic time after which the hook timings go out again

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_like_vllm()
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.config = KvpushConfig.from_extra(dict(transfer.kv_connector_extra_config or {}))
        if transfer.kv_role not in ROLES:
            raise ValueError(
                f"kvpush needs kv_role 'kv_producer' (prefill) or 'kv_consumer' (decode), "
                f"got {transfer.kv_role!r}"
            )
        engine_id = str(transfer.engine_id)
        model = vllm_config.model_config
        refuse_sleep_mode(model)
        parallel = vllm_config.parallel_config
        refuse_split_requests(parallel, transfer.kv_role == "kv_producer")
        pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
        # Refuse a KV cache kvpush cannot move exactly in both roles, so the scheduler
        # process fails at start with the reason, not a worker at its first transfer.
        self.facts = kv_cache_facts(
            kv_cache_config,
            model=str(model.model),
            tp_size=parallel.tensor_parallel_size,
            model_kv_heads=model.get_total_num_kv_heads(),
            cache_dtype=str(vllm_config.cache_config.cache_dtype),
            dcp_size=parallel.decode_context_parallel_size,
        )
        # vLLM gives each data-parallel engine its own engine id (it appends "_dp<rank>");
        # its ranks' control ports follow the previous engine's. (vLLM runs each DP engine
        # of a dense model as DP size 1: its index tells.) A data-parallel push prefill
        # relies on the proxy to choose the engine decode registers with and to pin
        # prefill's request to it (X-data-parallel-rank; `SchedulerSide._not_ours`).
        dp_index = int(getattr(parallel, "data_parallel_index", 0) or 0)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # vLLM builds the scheduler after its executor set up the KV cache, so a node
            # in this process (the in-process executor, one rank) has started by now
            node = in_process(engine_id)
            if node is not None:
                log.info("kvpush: the engine's worker runs in this process; specs go to it at once")
            self.scheduler = SchedulerSide(
                self.config,
                engine_id,
                is_producer=transfer.kv_role == "kv_producer",
                tp_size=parallel.tensor_parallel_size,
                dp_index=dp_index,
                local=node.queue if node is not None else None,
                pp_size=pp_size,
                group_ids=self.facts.group_ids,
                block_size=self.facts.block_size,
                windowed=self.facts.windowed,
                states=bool(self.facts.state_groups),
            )
        else:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
            )

            self.worker = WorkerSide(
                self.config,
                Identity(
                    engine_id=engine_id,
                    role=ROLES[transfer.kv_role],
                    model=str(model.model),
                    tp_rank=get_tensor_model_parallel_rank(),
                    tp_size=parallel.tensor_parallel_size,
                    dp_index=dp_index,
                    pp_rank=get_pp_group().rank_in_group if pp_size > 1 else 0,
                    pp_size=pp_size,
                ),
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Heads outermost inside each layer's blocks (LBHNC): a block is one contiguous
        run, and a TP rank's share of heads is one run per block too. MLA has one latent
        per token, where any layout moves as well."""
        model = vllm_config.model_config
        if model is None or model.use_mla:
            return None
        return "LBHNC"

    # -- scheduler side -------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvpushMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call with every KV cache group's blocks (kvpush declares `SupportsHMA`,
        so vLLM keeps its hybrid KV cache manager on for models with sliding-window
        layers, and keeps only their window's KV)."""
        assert self.scheduler is not None
        flat = self.scheduler.flat_block_ids(request, block_ids)
        return self.scheduler.request_finished(request, flat)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every group kvpush moves is written by the transfer: vLLM must not zero them."""
        return self.facts.group_ids

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        sending, recving = connector_output.finished_sending, connector_output.finished_recving
        if sending or recving:  # most steps report nothing: two attribute reads
            assert self.scheduler is not None
            self.scheduler.update_connector_output(sending or (), recving or ())

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    # -- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        name = self._vllm_config.cache_config.get_resolved_kv_cache_layout().name
        layout, memory = describe_kv_caches(self.facts, kv_caches, name, self._packed_blocks())
        first = kv_caches[self.facts.layer_names[0]]
        on_gpu = first.device.type == "cuda"
        self.worker.start(
            layout,
            memory,
            self.facts.kv_dtype,
            mem="VRAM" if on_gpu else "DRAM",
            device=first.device.index or 0,
        )

    def _packed_blocks(self) -> bool:
        """Whether the attention backend of the transferred layers packs each head's block
        its own way (vLLM's CPU attention), as vLLM reports it."""
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        facts = self.facts
        states = {name for g in facts.state_groups for name in facts.group_layers[g]}
        attention = [name for name in facts.layer_names if name not in states]
        backends = get_current_attn_backends(self._vllm_config, attention)
        names = {backend.get_name() for backend in backends}
        if len(names) > 1 and names & set(PACKED_BLOCK_BACKENDS):
            raise UnsupportedKVCache(
                f"the transferred layers use several attention backends ({sorted(names)}); "
                "kvpush needs one block layout for all of them"
            )
        return not self.facts.mla and bool(names & set(PACKED_BLOCK_BACKENDS))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Takes this step's metadata and hands its specs to the node's threads at once,
        before vLLM runs the step's forward. vLLM calls `start_load_kv` only after the
        forward (its loads are asynchronous), and a spec waiting there would wait a whole
        forward: a prefill that finished last step would start its push only when the
        next prefill's forward is done (tens to hundreds of ms under load)."""
        # What the base class does, without its call: this runs every engine step, and
        # between two steps the forward has evicted most of our code and data from the
        # caches, so each call and object touched costs microseconds here. A step with
        # nothing to hand over (most steps) stops after three attribute reads.
        self._connector_metadata = connector_metadata
        meta: KvpushMetadata = connector_metadata  # type: ignore[assignment]
        if meta.recv or meta.send or meta.aborted:
            assert self.worker is not None
            self.worker.hand_off(meta.recv, meta.send, meta.aborted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing left to do: `bind_connector_metadata` handed this step's specs over."""
        return None

    def has_connector_metadata(self) -> bool:
        """Always False: vLLM asks this before it calls `wait_for_layer_load` and
        `save_kv_layer` around every attention layer of every forward, and kvpush moves
        whole requests, never a layer at a time. Saying no spares the engine two calls per
        layer per step (64 on a 32-layer model); nothing else in vLLM asks it."""
        return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`'s sets as they are (the base class copies them, every step);
        in a step where nothing finished (most steps), one shared empty answer."""
        assert self.worker is not None
        results = self.worker.results
        if not (results.sending or results.recving):
            return NOTHING_FINISHED
        sending, recving = self.worker.get_finished()
        return KVConnectorTransferResults(
            finished_sending=sending,
            finished_recving=recving,
            failed_recving=results.take_failed(),  # by request id: several KV cache groups
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks decode will not receive; in a step with none (nearly all), one shared
        empty answer, which vLLM only reads."""
        assert self.worker is not None
        if not self.worker.results.load_errors:
            return NO_LOAD_ERRORS  # type: ignore[return-value]
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What is new since the last stats: at once when a transfer or failure was
        recorded, else the hook timings at most every `STATS_EVERY_S` (None between).
        All of it goes with a transfer: vLLM asks only while it steps, and an idle
        server would keep what it holds back out of /metrics until its next request."""
        now = time.monotonic()
        news = self.worker is not None and self.worker.has_news()
        if now < self._stats_due and not news:
            return None
        self._stats_due = now + STATS_EVERY_S
        if self.worker is not None:
            stats = KvpushStats(self.worker.stats_data())
        else:
            assert self.scheduler is not None
            stats = KvpushStats()
            self.scheduler.timer.drain(stats.data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KvpushStats(data=data) if data else KvpushStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvpushPromMetrics:
        return KvpushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
