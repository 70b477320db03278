"""Scheduler side: decides what each worker must move; never does I/O itself.

Every hook here runs on vLLM's scheduler thread, so each one only reads the request,
records a spec and returns. The specs reach the workers in the next step's metadata,
where background threads do the talking. Both modes take the same decisions: decode
records the blocks it allocated for remote KV, prefill keeps a finished prefill's blocks
until its worker says they moved; in pull mode prefill also answers with the coordinates
decode reads from. A decode request that waits for blocks past the step it arrived in
(decode's KV cache is full, or its queue long) is handed to the workers too (`HoldSpec`),
so that prefill keeps its KV for as long as it waits.

Where vLLM runs the worker in this very process and thread (its in-process executor:
one rank, the default at TP 1 on a GPU), the hooks hand each spec to the node at once
(`local`), not in the next step's metadata.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvpush.core.protocol import (
    ENGINE_PARAM,
    FIRST_TOKEN_OF_ARG,
    FIRST_TOKEN_PARAM,
    MISROUTED_PARAM,
    NO_TOKEN,
    grant,
)
from kvpush.node.config import KvpushConfig
from kvpush.node.direct import DirectSender
from kvpush.node.results import HookTimer
from kvpush.node.specs import AbortSpec, HoldSpec, RecvSpec, SendSpec
from kvpush.vllm.metadata import EMPTY_METADATA, KvpushMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

_DONE_MARK = "_kvpush_registered"
_TRUNCATED_MARK = "_kvpush_without_last_token"

log = logging.getLogger("kvpush.scheduler")

# A node's untimed hand-off (`WorkerSide.queue`): recv, send and aborted specs.
HandOff = Callable[
    [Sequence[RecvSpec | HoldSpec], Sequence[SendSpec], Sequence[AbortSpec]], None
]


class SchedulerSide:
    def __init__(
        self,
        config: KvpushConfig,
        engine_id: str,
        is_producer: bool,
        tp_size: int = 1,
        dp_index: int = 0,
        local: HandOff | None = None,
        pp_size: int = 1,
        group_ids: tuple[int, ...] = (0,),
        block_size: int = 16,
        windowed: bool = False,
        states: bool = False,
    ) -> None:
        self.config = config
        # vLLM's KV cache groups kvpush moves (several with its hybrid KV cache manager),
        # and their blocks' tokens: a request's block list is theirs, concatenated
        self.group_ids = group_ids
        self.block_size = block_size
        # a group attends through a sliding window: vLLM's null block stands in its lists
        self.windowed = windowed
        # Some layers keep a state per request (Mamba, linear attention), which cannot
        # take a token twice: prefill computes the prompt less its last token, and decode
        # computes that token itself from the state prefill reached (its first output
        # token is its own; vLLM recomputes a prompt's last token however much arrives).
        self.states = states
        # the node's hand-off when it runs in this process (vLLM's in-process executor)
        self.local = local
        self.engine_id = engine_id
        self.is_producer = is_producer
        self.tp_size = tp_size
        self.pp_size = pp_size
        # this engine's first control port (its ranks' follow, TP rank by TP rank, stage
        # after stage): DP engines take turns
        self.port = config.port + dp_index * tp_size * pp_size
        self.timer = HookTimer("scheduler")
        # the hooks of every step keep their spans
        self._meta_span = self.timer("build_connector_meta")
        self._output_span = self.timer("update_connector_output")
        self._recv: list[RecvSpec | HoldSpec] = []
        self._send: list[SendSpec] = []
        self._aborted: list[AbortSpec] = []
        # Prefill: requests whose blocks we hold until the worker says the write is done.
        self._sending: dict[str, float] = {}
        # Decode: requests from prefill that arrived this step and have no blocks yet; those
        # still without at the step's end are held (`HoldSpec`).
        self._arrived: dict[str, Request] = {}
        # Decode: requests waiting for their KV, with the generation of their registration.
        self._receiving: dict[str, str] = {}
        self._generations: dict[str, int] = {}
        # Decode, test hook hold_decode: when a held request was first seen.
        self._held: dict[str, float] = {}
        # Push prefill with its workers in other processes: each finished prefill goes to
        # them at once too, not only with the next step's metadata (`kvpush.node.direct`)
        self.direct: DirectSender | None = None
        if local is None and is_producer and config.mode == "push":
            ports = [self.port + rank for rank in range(tp_size * pp_size)]
            self.direct = DirectSender.open(engine_id, config.host, ports)

    def on_new_request(self, request: Request) -> None:
        """Decode: a request whose KV comes from prefill arrived (vLLM's add_request).
        Prefill, for a model with state layers: the prompt loses its last token."""
        if self.is_producer:
            if self.states:
                _without_last_token(request)
            return
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and params.get("remote_host"):
            self._arrived[request.request_id] = request  # most get blocks in this step

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        with self.timer("get_num_new_matched_tokens"):
            params = request.kv_transfer_params
            if not params or not params.get("do_remote_prefill") or params.get(_DONE_MARK):
                return 0, False
            if self._hold(request, str(params.get("transfer_id") or request.request_id)):
                return None, False  # vLLM: not known yet, ask again next step
            count = self._remote_tokens(request) - num_computed_tokens
            local = num_computed_tokens > 0 and count <= self.config.local_tail_tokens
            if count <= 0 or local:
                if count > 0 and _first_token_from_write(request):
                    # Decode must reproduce the first token prefill sampled, which comes
                    # with prefill's WriteDone: take the few tokens left from prefill too.
                    return count, True
                # A prefix-cache hit that leaves a short tail (vLLM caches whole blocks
                # below the prompt's last token): decode computes it, as one server would,
                # and update_state_after_alloc lets prefill free its KV. A longer tail, up
                # to a block of 128 tokens on vLLM's CPU backend, comes from prefill.
                return 0, False
            return count, True

    def _remote_tokens(self, request: Request) -> int:
        """The prompt tokens whose KV prefill computes for decode: all of them, or with
        state layers all but the last (`_without_last_token`; a one-token prompt: none,
        decode computes it)."""
        tokens = len(request.prompt_token_ids or ())
        return max(tokens - 1, 0) if self.states else tokens

    def _hold(self, request: Request, transfer_id: str) -> bool:
        """Test hook hold_decode: keep the request unallocated for a while."""
        faults = self.config.faults
        if not faults:
            return False
        first = self._held.setdefault(request.request_id, time.monotonic())
        return time.monotonic() - first < faults.seconds("hold_decode", transfer_id)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        with self.timer("update_state_after_alloc"):
            self._allocated(request, blocks, num_external_tokens)
            self._hand_over()

    def _allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._arrived:
            self._arrived.pop(request.request_id, None)  # allocated: nothing to hold
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or params.get(_DONE_MARK):
            return
        transfer_id = str(params.get("transfer_id") or request.request_id)
        if num_external_tokens <= 0:
            # decode's own cache holds the prompt: prefill's KV is not needed
            self._aborted.append(self._prefill_abort(transfer_id, request.request_id, params))
            params[_DONE_MARK] = True
            return
        # A preempted request allocates again: a new generation fences the old blocks.
        generation = self._generations.get(transfer_id, -1) + 1
        self._generations[transfer_id] = generation
        first_token = num_tokens = self._remote_tokens(request)
        first_token -= num_external_tokens
        block_ids = self._blocks_from(request, blocks, first_token)
        remote_ids = params.get("remote_block_ids") or ()
        self._recv.append(
            RecvSpec(
                transfer_id=transfer_id,
                request_id=request.request_id,
                block_ids=block_ids,
                num_tokens=num_tokens,
                first_token=first_token,
                prefill_host=str(params["remote_host"]),
                prefill_port=int(params["remote_port"]),
                prefill_tp=int(params.get("tp_size") or 1),
                prefill_pp=int(params.get("pp_size") or 1),
                generation=generation,
                remote_block_ids=tuple(int(b) for b in remote_ids),
                remote_num_tokens=int(params.get("remote_num_tokens") or 0),
                remote_engine_id=str(params.get("remote_engine_id") or ""),
                remote_grant=str(params.get("kvpush_grant") or ""),
            )
        )
        self._receiving[request.request_id] = transfer_id
        params[_DONE_MARK] = True

    def _blocks_from(
        self, request: Request, blocks: KVCacheBlocks, first_token: int
    ) -> tuple[int, ...]:
        """Decode's blocks for the tokens from `first_token` on, every group's concatenated.

        One group of full attention: the blocks without a hash (the prefix-cache hits have
        one). Several, or a sliding window: each group's list from the block of
        `first_token`, vLLM's null block standing for those a window does not keep. A list
        kvpush cannot pair (a cached block past the hit, groups of unequal length) is left
        empty: the transfer then fails with the reason, and nothing is written.
        """
        if len(self.group_ids) == 1 and not self.windowed:
            group = blocks.blocks[self.group_ids[0]]
            return tuple(b.block_id for b in group if b.block_hash is None)
        first = first_token // self.block_size
        lists = [blocks.blocks[g][first:] for g in self.group_ids]
        cached = any(b.block_hash is not None and not b.is_null for ids in lists for b in ids)
        if cached or len({len(ids) for ids in lists}) != 1:
            log.error(
                "request %s: decode's KV cache groups hold %s blocks from token %d%s; "
                "kvpush cannot pair them with prefill's, the request fails",
                request.request_id,
                [len(ids) for ids in lists],
                first_token,
                " (some already cached)" if cached else "",
            )
            return ()
        return tuple(b.block_id for ids in lists for b in ids)

    def flat_block_ids(self, request: Request, block_ids: tuple[list[int], ...]) -> list[int]:
        """Prefill: a finished request's block lists of the groups kvpush moves, one after
        the other (empty, and logged, when their lengths differ: nothing can pair them)."""
        lists = [block_ids[g] for g in self.group_ids]
        if len({len(ids) for ids in lists}) != 1:
            log.error(
                "request %s: prefill's KV cache groups hold %s blocks; kvpush cannot pair "
                "them with decode's, its KV is not sent",
                request.request_id,
                [len(ids) for ids in lists],
            )
            return []
        return [b for ids in lists for b in ids]

    @staticmethod
    def _prefill_abort(transfer_id: str, request_id: str, params: dict[str, Any]) -> AbortSpec:
        """Tell the prefill that holds KV for this request to free it (no blocks here)."""
        return AbortSpec(
            transfer_id,
            request_id,
            str(params.get("remote_host") or ""),
            int(params.get("remote_port") or 0),
            int(params.get("tp_size") or 1),
            int(params.get("pp_size") or 1),
        )

    def _hand_over(self) -> None:
        """With the node in this process, what the hook just decided goes to it now: its
        thread starts a finished prefill's WRITE (or decode's registration) while vLLM
        finishes the step, instead of at the next step's `bind_connector_metadata`."""
        if self.local is not None:
            self.local(self._recv, self._send, self._aborted)
            self._recv, self._send, self._aborted = [], [], []

    def build_connector_meta(self, scheduler_output: Any) -> KvpushMetadata:
        if self._arrived:  # scheduled this step without blocks: prefill keeps its KV
            with self.timer("hold"):
                self._recv.extend(_held(request) for request in self._arrived.values())
                self._arrived.clear()
                self._hand_over()  # in this process: now, in order with what follows
        if not (self._recv or self._send or self._aborted):
            return EMPTY_METADATA  # most steps: nothing to ship, nothing allocated, untimed
        with self._meta_span:
            meta = KvpushMetadata(self._recv, self._send, self._aborted)
            self._recv, self._send, self._aborted = [], [], []
            return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        with self.timer("request_finished"):
            answer = self._finished(request, block_ids)
            self._hand_over()
            return answer

    def _finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        self._held.pop(request.request_id, None)
        if self._arrived:
            self._arrived.pop(request.request_id, None)
        transfer_id = str(params.get("transfer_id") or request.request_id)
        if request.request_id in self._receiving:
            # Decode ended (e.g. client gone) before its KV arrived: its worker stops
            # the transfer, and vLLM frees the blocks once it reports the request.
            del self._receiving[request.request_id]
            self._generations.pop(transfer_id, None)
            self._aborted.append(AbortSpec(transfer_id, request.request_id))
            return False, None
        self._generations.pop(transfer_id, None)
        if not self.is_producer and params.get("do_remote_prefill"):
            if not params.get(_DONE_MARK) and "remote_host" in params:
                # Ended before it got blocks: nothing to stop here, but prefill may
                # hold KV for it; tell prefill so it frees it now, not at lease end.
                self._aborted.append(self._prefill_abort(transfer_id, request.request_id, params))
            return False, None
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        if self._not_ours(params, request):
            self._aborted.append(AbortSpec(transfer_id, request.request_id))
            return False, {MISROUTED_PARAM: self.engine_id}  # the proxy fails it at once
        if not _finished_normally(request) or not block_ids:
            self._aborted.append(AbortSpec(transfer_id, request.request_id))
            return False, None
        outputs = request.output_token_ids
        # a prompt less its last token (state layers) samples no token of the answer
        sampled = outputs[0] if outputs and not params.get(_TRUNCATED_MARK) else NO_TOKEN
        now = time.monotonic()
        spec = SendSpec(
            transfer_id=transfer_id,
            request_id=request.request_id,
            block_ids=tuple(block_ids),
            num_tokens=request.num_computed_tokens,
            sampled=sampled,
            finished_at=now,
        )
        self._send.append(spec)
        self._sending[request.request_id] = now
        if self.direct is not None:
            self.direct.send(spec)  # one non-blocking datagram per rank
        if self.config.mode == "push":
            return True, None
        coordinates: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_engine_id": self.engine_id,
            "remote_host": self.config.host,
            "remote_port": self.port,
            "remote_block_ids": list(block_ids),
            "remote_num_tokens": request.num_computed_tokens,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
        }
        if sampled != NO_TOKEN:  # decode reproduces it (the proxy may stream it first)
            coordinates[FIRST_TOKEN_PARAM] = sampled
        if self.config.secret:  # lets decode refuse coordinates altered on the way
            coordinates["kvpush_grant"] = grant(
                self.config.secret,
                self.engine_id,
                transfer_id,
                tuple(block_ids),
                request.num_computed_tokens,
                self.tp_size,
                self.pp_size,
            )
        return True, coordinates

    def _not_ours(self, params: dict[str, Any], request: Request) -> bool:
        """Push: decode registered with another prefill engine than this one, so no WRITE
        of this prefill would ever pair up; its KV is freed at once."""
        meant = params.get(ENGINE_PARAM)
        if self.config.mode != "push" or not meant or meant == self.engine_id:
            return False
        log.error(
            "kvpush: request %s was meant for prefill engine %s, but ran on %s; its KV is "
            "freed and its answer says so, for the proxy to fail the request. A "
            "data-parallel prefill must run each request on the engine the proxy chose "
            "(vLLM's X-data-parallel-rank header); check the proxy's engine= for this server",
            request.request_id,
            meant,
            self.engine_id,
        )
        return True

    def update_connector_output(
        self, finished_sending: Iterable[str], finished_recving: Iterable[str]
    ) -> None:
        with self._output_span:
            for request_id in finished_sending:
                self._sending.pop(request_id, None)
            for request_id in finished_recving:
                self._receiving.pop(request_id, None)

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping while prefill blocks wait for their write, so the
        # worker's completions are collected (and the blocks freed) promptly.
        return bool(self._sending or self._send or self._recv or self._aborted)


def _held(request: Request) -> HoldSpec:
    """What decode's workers need to keep prefill's KV for a request without blocks."""
    params = request.kv_transfer_params or {}
    return HoldSpec(
        str(params.get("transfer_id") or request.request_id),
        request.request_id,
        str(params["remote_host"]),
        int(params.get("remote_port") or 0),
        int(params.get("tp_size") or 1),
        int(params.get("pp_size") or 1),
    )


def _without_last_token(request: Request) -> None:
    """Prefill, with state layers: a request for decode computes its prompt less the last
    token, so its state is the one before that token, which decode then computes."""
    params = request.kv_transfer_params
    tokens = request.prompt_token_ids
    if not params or not params.get("do_remote_decode") or tokens is None or len(tokens) < 2:
        return
    if params.get(_TRUNCATED_MARK):  # a preempted request comes back: once is enough
        return
    del tokens[-1]
    del request._all_token_ids[-1]
    request.num_prompt_tokens -= 1
    params[_TRUNCATED_MARK] = True


def _first_token_from_write(request: Request) -> bool:
    """Push: the proxy asked decode to reproduce prefill's first token (`vllm_xargs`)."""
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    return extra is not None and FIRST_TOKEN_OF_ARG in extra


def _finished_normally(request: Request) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
