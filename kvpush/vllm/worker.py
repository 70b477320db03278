"""Worker side: owns the KV memory, the NIXL agent and the background threads.

The engine-loop hooks (`start_load_kv`, `get_finished`) only put specs on a queue and swap
result sets: O(1) per request. Everything slow - handshakes, descriptor planning, posting
and polling transfers, control messages - runs on the threads below:

  control-server  (per worker) blocks in select(); decodes control messages, answers
                  handshakes and lease questions, queues the rest
  push-writer     (prefill, push) rendezvous of registrations with finished prefills; WRITEs
  pull-leases     (prefill, pull) holds finished prefills' blocks until decode read them
  push-receiver   (decode, push)  sends registrations, counts WriteDone per producer rank
  pull-reader     (decode, pull)  READs from each producer rank, confirms, renews leases
  handshakes      (per thread above) a small pool: first contact with a peer never delays
                  transfers to peers already known

Progress model: NIXL's own progress thread is off (it spins a core); transfers are
initiator-driven (UCX with error handling "none"), so the initiator polls only while a
transfer it posted is in flight, and completions travel as frames on the control channel.
Idle, nothing spins.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvpush.core.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Hello,
    LeaseRenew,
    Message,
    ReadDone,
    Registration,
    WriteDone,
    check_compatible,
)
from kvpush.dataplane.control import ControlServer
from kvpush.dataplane.transport import NixlTransport
from kvpush.vllm.config import KvpushConfig
from kvpush.vllm.layout import KVCacheFacts, describe_kv_caches
from kvpush.vllm.metadata import KvpushMetadata
from kvpush.vllm.pull import LeaseKeeper
from kvpush.vllm.push import PushWriter
from kvpush.vllm.receiver import Receiver
from kvpush.vllm.stats import HookTimer
from kvpush.vllm.threads import Results

log = logging.getLogger("kvpush.worker")


@dataclass(frozen=True, slots=True)
class Identity:
    engine_id: str
    role: str  # "prefill" or "decode"
    model: str
    tp_rank: int
    tp_size: int


class WorkerSide:
    def __init__(self, config: KvpushConfig, identity: Identity) -> None:
        self.config = config
        self.identity = identity
        self.timer = HookTimer("worker")
        self.results = Results()
        self.transport: NixlTransport | None = None
        self.server: ControlServer | None = None
        # Prefill: the writer (push) or the lease keeper (pull); decode: the receiver.
        self.writer: PushWriter | None = None
        self.keeper: LeaseKeeper | None = None
        self.receiver: Receiver | None = None
        self.hello: Hello | None = None
        self._rejected_reported: dict[str, int] = {}

    @property
    def port(self) -> int:
        return self.config.port + self.identity.tp_rank

    def register_kv_caches(
        self, kv_caches: dict[str, Any], facts: KVCacheFacts, layout_name: str
    ) -> None:
        ident = self.identity
        layout, memory = describe_kv_caches(facts, kv_caches, layout_name)
        name = f"{ident.engine_id}-tp{ident.tp_rank}-{uuid.uuid4().hex[:8]}"
        self.transport = NixlTransport(name, self.config.backend)
        # GPU KV (kv_buffer_device "cuda") is registered as VRAM so NIXL moves it with
        # GPUDirect where the backend supports it; CPU KV as DRAM.
        first = kv_caches[facts.layer_names[0]]
        on_gpu = first.device.type == "cuda"
        self.transport.register_regions(
            list(memory), mem="VRAM" if on_gpu else "DRAM", device=first.device.index or 0
        )
        self.hello = Hello(
            version=PROTOCOL_VERSION,
            engine_id=ident.engine_id,
            role=ident.role,  # type: ignore[arg-type]
            mode=self.config.mode,  # type: ignore[arg-type]
            model=ident.model,
            kv_dtype=facts.kv_dtype,
            tp_rank=ident.tp_rank,
            tp_size=ident.tp_size,
            layout=layout,
            agent_name=name,
            agent_metadata=self.transport.metadata(),
            memory=memory,
        )
        part: PushWriter | LeaseKeeper | Receiver
        if ident.role == "decode":
            part = self.receiver = Receiver(self)
        elif self.config.mode == "pull":
            part = self.keeper = LeaseKeeper(self)
        else:
            part = self.writer = PushWriter(self)
        part.start()
        self.server = ControlServer(
            self.config.host, self.port, self._on_message, secret=self.config.secret
        )
        self.server.start()
        log.info(
            "kvpush %s worker %d/%d: %d layers x %d blocks of %d tokens, %d of %d KV heads "
            "(%s, %s layout), control on %s:%d",
            ident.role,
            ident.tp_rank,
            ident.tp_size,
            layout.num_regions,
            layout.scheduler_blocks,
            layout.block_tokens,
            layout.num_heads,
            layout.total_heads,
            facts.kv_dtype,
            layout_name,
            self.config.host,
            self.port,
        )
        if self.config.secret is None:
            log.warning(
                "kvpush control messages on %s:%d are not authenticated: anyone who can reach "
                "the port can send them; set the same secret in KVPUSH_SECRET (or the variable "
                "kv_connector_extra_config.secret_env names) on every prefill and decode",
                self.config.host,
                self.port,
            )
        if self.config.faults:
            log.warning(
                "kvpush test hooks enabled (KVPUSH_FAULTS): %s; never in production",
                ", ".join(sorted(self.config.faults.enabled)),
            )

    @property
    def _parts(self) -> list[PushWriter | LeaseKeeper | Receiver]:
        return [p for p in (self.writer, self.keeper, self.receiver) if p is not None]

    def _on_message(self, msg: Message, peer: Any) -> Message | None:
        """Runs on the control-server thread: answer handshakes and lease questions, hand
        the rest over.

        The handshake reply is our own Hello even when the peer is incompatible, so the
        peer's own check names the mismatch too (e.g. both modes) and fails its requests.
        A Registration reaching a pull-mode prefill is refused by its lease keeper.
        """
        if isinstance(msg, Hello):
            assert self.hello is not None
            problem = check_compatible(self.hello, msg)
            if problem:
                log.error("refusing handshake from %s: %s", msg.engine_id, problem)
                self.results.count("failures", "incompatible_peer")
            return self.hello
        if self.keeper is not None and isinstance(msg, ReadDone | LeaseRenew):
            return self.keeper.answer(msg)
        if isinstance(msg, Registration) and self.config.faults.fires(
            "drop_registration", msg.transfer_id
        ):
            return None
        if self.writer is not None and isinstance(msg, Registration | Cancel):
            self.writer.inbox.put((msg, time.monotonic()))
        elif self.keeper is not None and isinstance(msg, Registration):
            self.keeper.inbox.put((msg, time.monotonic()))
        elif self.receiver is not None and isinstance(msg, WriteDone | Cancel):
            self.receiver.inbox.put((msg, time.monotonic()))
        else:
            self.results.count("rejected", f"unexpected_{type(msg).__name__}")
        return None

    def start_load_kv(self, meta: KvpushMetadata) -> None:
        with self.timer("start_load_kv"):
            now = time.monotonic()
            if self.receiver is not None:
                for spec in meta.recv:
                    self.receiver.inbox.put((spec, now))
            producer = self.writer or self.keeper
            if producer is not None:
                for send in meta.send:
                    producer.inbox.put((send, now))
            # A pull-mode prefill that ended early granted no lease: nothing to undo.
            target = self.writer or self.receiver
            if target is not None:
                for abort in meta.aborted:
                    target.inbox.put((abort, now))

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self.timer("get_finished"):
            return self.results.take()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.results.take_load_errors()

    def stats_data(self) -> dict[str, Any]:
        data = self.results.take_data()
        self.timer.drain(data)
        if self.server is not None:
            # The server keeps running totals; stats carry what is new since last time.
            for kind, total in self.server.rejected.items():
                new = total - self._rejected_reported.get(kind, 0)
                if new:
                    data["rejected"][kind] = data["rejected"].get(kind, 0) + new
                    self._rejected_reported[kind] = total
        for part in self._parts:
            data["gauges"].update(part.gauges())
        return data

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        for part in self._parts:
            part.stop()
        if self.transport is not None:
            self.transport.close()
