"""The vLLM adapter's scheduler-side hooks (the KV layout's reading: test_kv_layouts.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvpush.core.protocol import MISROUTED_PARAM as MISROUTED
from kvpush.core.protocol import NO_TOKEN
from kvpush.node.config import KvpushConfig
from kvpush.node.specs import AbortSpec, HoldSpec, RecvSpec
from kvpush.vllm.scheduler import SchedulerSide


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    status: Any = None
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    sampling_params: Any = None


def vllm_blocks(*groups: list[int], hashed: int = 0) -> KVCacheBlocks:
    """vLLM's own allocation result: one list of block ids per KV cache group (default one
    group of [3, 4]), the first `hashed` of each cached (prefix hits), block 0 the null
    block."""
    lists = groups or ([3, 4],)
    out = []
    for ids in lists:
        blocks = [KVCacheBlock(b, is_null=b == 0) for b in ids]
        for block in blocks[:hashed]:
            block._block_hash = b"hit"  # type: ignore[assignment]
        out.append(blocks)
    return KVCacheBlocks(tuple(out))


def decode_params() -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "transfer_id": "t1",
    }


def test_decode_registers_blocks_at_allocation_once() -> None:
    side = SchedulerSide(KvpushConfig(), "decode-0", is_producer=False)
    req = FakeRequest("cmpl-t1-0-abcdef12", list(range(10)), decode_params())
    assert side.get_num_new_matched_tokens(req, 0) == (10, True)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, vllm_blocks(), 10)  # type: ignore[arg-type]
    meta = side.build_connector_meta(SimpleNamespace())
    (spec,) = meta.recv
    assert (spec.transfer_id, spec.block_ids, spec.num_tokens, spec.prefill_port) == (
        "t1",
        (3, 4),
        10,
        5600,
    )
    # after the KV arrived vLLM asks again: nothing more to load, nothing re-registered
    assert side.get_num_new_matched_tokens(req, 10) == (0, False)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, vllm_blocks([5]), 0)  # type: ignore[arg-type]
    assert side.build_connector_meta(SimpleNamespace()).recv == []


def test_a_decode_prefix_hit_registers_only_the_uncached_tail() -> None:
    side = SchedulerSide(KvpushConfig(), "decode-0", is_producer=False)
    req = FakeRequest("d", list(range(100)), decode_params())
    # vLLM found 64 tokens (4 blocks) in decode's prefix cache
    assert side.get_num_new_matched_tokens(req, 64) == (36, True)  # type: ignore[arg-type]
    hits_and_new = vllm_blocks([1, 2, 5, 6, 7, 8, 9], hashed=4)  # as vLLM lists them
    side.update_state_after_alloc(req, hits_and_new, 36)  # type: ignore[arg-type]
    (spec,) = side.build_connector_meta(SimpleNamespace()).recv
    assert (spec.first_token, spec.num_tokens, spec.block_ids) == (64, 100, (7, 8, 9))


def hybrid_side(producer: bool, mode: str = "push") -> SchedulerSide:
    """Two KV cache groups (vLLM's hybrid KV cache manager: full attention, then a
    32-token window), blocks of 16 tokens."""
    name = "prefill-0" if producer else "decode-0"
    return SchedulerSide(
        KvpushConfig(mode=mode), name, is_producer=producer, group_ids=(0, 1), block_size=16
    )


def test_a_hybrid_decode_registers_each_groups_blocks_from_the_first_uncached_token() -> None:
    """A 100-token prompt, 32 tokens hit in decode's prefix cache. The window keeps tokens
    from 69 on, so vLLM lists its group's first four blocks as the null block 0."""
    side = hybrid_side(producer=False)
    req = FakeRequest("d", list(range(100)), decode_params())
    assert side.get_num_new_matched_tokens(req, 32) == (68, True)  # type: ignore[arg-type]
    blocks = vllm_blocks([11, 12, 5, 6, 7, 8, 9], [0, 0, 0, 0, 3, 4, 10], hashed=2)
    side.update_state_after_alloc(req, blocks, 68)  # type: ignore[arg-type]
    (spec,) = side.build_connector_meta(SimpleNamespace()).recv
    assert spec.first_token == 32
    assert spec.block_ids == (5, 6, 7, 8, 9, 0, 0, 3, 4, 10)


def test_a_windowed_decode_lists_its_blocks_by_position_not_by_hash() -> None:
    """Every layer windowed (one group): vLLM lists the window's dropped blocks as the null
    block, then the prefix-cache hits, then the new blocks. Leaving out the hashed ones
    would shift the new blocks to where the nulls were."""
    side = SchedulerSide(KvpushConfig(), "decode-0", is_producer=False, block_size=16,
                         windowed=True)  # fmt: skip
    req = FakeRequest("d", list(range(150)), decode_params())
    assert side.get_num_new_matched_tokens(req, 112) == (38, True)  # type: ignore[arg-type]
    blocks = vllm_blocks([0, 0, 0, 0, 0, 6, 9, 4, 5, 8], hashed=7)
    side.update_state_after_alloc(req, blocks, 38)  # type: ignore[arg-type]
    (spec,) = side.build_connector_meta(SimpleNamespace()).recv
    assert (spec.first_token, spec.block_ids) == (112, (4, 5, 8))


def test_hybrid_groups_kvpush_cannot_pair_name_no_block(caplog: pytest.LogCaptureFixture) -> None:
    side = hybrid_side(producer=False)
    req = FakeRequest("d", list(range(100)), decode_params())
    side.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    uneven = vllm_blocks([1, 2, 5, 6, 7, 8, 9], [0, 0, 0, 0, 3, 4])
    side.update_state_after_alloc(req, uneven, 100)  # type: ignore[arg-type]
    (spec,) = side.build_connector_meta(SimpleNamespace()).recv
    assert spec.block_ids == ()  # the transfer fails with the reason; nothing is written
    assert "cannot pair them with prefill's" in caplog.text


def test_a_hybrid_pull_prefill_answers_with_every_groups_blocks() -> None:
    from vllm.v1.request import RequestStatus

    prefill = hybrid_side(producer=True, mode="pull")
    done = FakeRequest(
        "p-1", list(range(40)), {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED,
        40,
    )  # fmt: skip
    flat = prefill.flat_block_ids(done, ([9, 2, 4], [0, 5, 6]))  # type: ignore[arg-type]
    _, params = prefill.request_finished(done, flat)  # type: ignore[arg-type]
    assert params is not None and params["remote_block_ids"] == [9, 2, 4, 0, 5, 6]
    (send,) = prefill.build_connector_meta(SimpleNamespace()).send
    assert send.block_ids == (9, 2, 4, 0, 5, 6)
    assert prefill.flat_block_ids(done, ([9, 2, 4], [5, 6])) == []  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt", [97, 100, 112])
def test_a_full_decode_prefix_hit_needs_no_transfer_and_frees_prefill(prompt: int) -> None:
    """vLLM caches whole blocks below the prompt's last token: with 16-token blocks a full
    hit leaves at most 16 tokens (`local_tail_tokens`), decode's to compute, as on one
    server; prefill is told to free its KV."""
    side = SchedulerSide(KvpushConfig(), "decode-0", is_producer=False)
    req = FakeRequest("d", list(range(prompt)), decode_params())
    hit = (prompt - 1) // 16 * 16
    assert side.get_num_new_matched_tokens(req, hit) == (0, False)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, vllm_blocks([7]), 0)  # type: ignore[arg-type]
    meta = side.build_connector_meta(SimpleNamespace())
    assert meta.recv == [] and meta.aborted == [AbortSpec("t1", "d", "127.0.0.1", 5600, 1)]
    # asked again (e.g. after a preemption): nothing to load, nothing to free twice
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, vllm_blocks([7]), 0)  # type: ignore[arg-type]
    assert side.build_connector_meta(SimpleNamespace()).aborted == []


@pytest.mark.parametrize(
    ("prompt", "hit", "tail", "config"),
    [
        (256, 128, 128, KvpushConfig()),  # vLLM's CPU blocks: a full hit leaves 128 tokens
        (300, 256, 44, KvpushConfig()),
        (130, 128, 0, KvpushConfig()),  # 2 tokens: decode's to compute
        (97, 96, 1, KvpushConfig(local_tail_tokens=0)),  # always from prefill
        (256, 128, 0, KvpushConfig(local_tail_tokens=128)),  # up to a whole CPU block local
    ],
)
def test_how_long_a_tail_decode_computes_itself_is_counted_in_tokens_not_blocks(
    prompt: int, hit: int, tail: int, config: KvpushConfig
) -> None:
    """A tail longer than `local_tail_tokens` comes from prefill, whatever the block size:
    on vLLM's CPU backend a full hit leaves up to 128 tokens, a prefill's worth of work
    inside decode's batch."""
    side = SchedulerSide(config, "decode-0", is_producer=False)
    req = FakeRequest("d", list(range(prompt)), decode_params())
    assert side.get_num_new_matched_tokens(req, hit) == (tail, tail > 0)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, vllm_blocks([7]), tail)  # type: ignore[arg-type]
    meta = side.build_connector_meta(SimpleNamespace())
    if tail:
        (spec,) = meta.recv
        assert (spec.first_token, spec.num_tokens) == (hit, prompt)
    else:
        assert meta.recv == [] and len(meta.aborted) == 1


@pytest.mark.parametrize("value", [-1, "16", 1.5, True])
def test_local_tail_tokens_must_be_a_whole_number(value: object) -> None:
    with pytest.raises(ValueError, match="local_tail_tokens must be a whole number"):
        KvpushConfig.from_extra({"local_tail_tokens": value, "insecure": True}, env={})
    config = KvpushConfig.from_extra({"local_tail_tokens": 64, "insecure": True}, env={})
    assert config.local_tail_tokens == 64


def test_a_full_hit_still_takes_the_tail_from_prefill_when_its_first_token_is_pinned() -> None:
    """Push, streamed through the proxy: decode must reproduce prefill's first token, which
    comes with prefill's WriteDone, so even a full hit waits for a (one-block) WRITE."""
    from vllm import SamplingParams

    side = SchedulerSide(KvpushConfig(), "decode-0", is_producer=False)
    pinned = SamplingParams(extra_args={"kvpush_first_token_of": "t1"})
    req = FakeRequest("d", list(range(100)), decode_params(), sampling_params=pinned)
    assert side.get_num_new_matched_tokens(req, 96) == (4, True)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, vllm_blocks([7]), 4)  # type: ignore[arg-type]
    (spec,) = side.build_connector_meta(SimpleNamespace()).recv
    assert (spec.first_token, spec.num_tokens, spec.block_ids) == (96, 100, (7,))


def test_a_short_prompt_without_a_hit_is_transferred() -> None:
    side = SchedulerSide(KvpushConfig(), "decode-0", is_producer=False)
    req = FakeRequest("d", list(range(10)), decode_params())
    assert side.get_num_new_matched_tokens(req, 0) == (10, True)  # type: ignore[arg-type]


def test_decode_abort_before_arrival_is_forwarded() -> None:
    side = SchedulerSide(KvpushConfig(), "decode-0", is_producer=False)
    req = FakeRequest("r", list(range(4)), decode_params())
    side.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, vllm_blocks(), 4)  # type: ignore[arg-type]
    side.build_connector_meta(SimpleNamespace())
    assert side.request_finished(req, [3, 4]) == (False, None)  # type: ignore[arg-type]
    assert side.build_connector_meta(SimpleNamespace()).aborted == [AbortSpec("t1", "r")]


def test_a_decode_request_without_blocks_at_the_step_end_is_held() -> None:
    """Arrived and allocated in one step: only its blocks go to the workers. Arrived and
    left waiting (decode's cache is full): a HoldSpec, once, then its blocks when it gets
    them. Ended before it ever had blocks: no hold, prefill is told to free its KV."""
    side = SchedulerSide(KvpushConfig(), "decode-0", is_producer=False)
    fast = FakeRequest("fast", list(range(4)), {**decode_params(), "transfer_id": "t-fast"})
    slow = FakeRequest("slow", list(range(4)), {**decode_params(), "transfer_id": "t-slow"})
    gone = FakeRequest("gone", list(range(4)), {**decode_params(), "transfer_id": "t-gone"})
    for req in (fast, slow, gone):
        side.on_new_request(req)  # type: ignore[arg-type]
    side.get_num_new_matched_tokens(fast, 0)  # type: ignore[arg-type]
    side.update_state_after_alloc(fast, vllm_blocks(), 4)  # type: ignore[arg-type]
    assert side.request_finished(gone, []) == (False, None)  # type: ignore[arg-type]
    meta = side.build_connector_meta(SimpleNamespace())
    assert [type(s).__name__ for s in meta.recv] == ["RecvSpec", "HoldSpec"]
    assert meta.recv[1] == HoldSpec("t-slow", "slow", "127.0.0.1", 5600, 1)
    assert meta.aborted == [AbortSpec("t-gone", "gone", "127.0.0.1", 5600, 1)]
    assert side.build_connector_meta(SimpleNamespace()).recv == [], "held once"
    side.get_num_new_matched_tokens(slow, 0)  # type: ignore[arg-type]
    side.update_state_after_alloc(slow, vllm_blocks(), 4)  # type: ignore[arg-type]
    (spec,) = side.build_connector_meta(SimpleNamespace()).recv
    assert isinstance(spec, RecvSpec) and spec.transfer_id == "t-slow"


def test_only_decode_requests_from_a_prefill_are_held() -> None:
    producer = SchedulerSide(KvpushConfig(), "prefill-0", is_producer=True)
    consumer = SchedulerSide(KvpushConfig(), "decode-0", is_producer=False)
    pull_prefill = {"do_remote_decode": True, "do_remote_prefill": False}
    requests = [
        (producer, FakeRequest("p", [1], pull_prefill)),
        (consumer, FakeRequest("plain", [1], None)),
        (consumer, FakeRequest("nowhere", [1], {"do_remote_prefill": True})),
    ]
    for side, req in requests:
        side.on_new_request(req)  # type: ignore[arg-type]
        assert side.build_connector_meta(SimpleNamespace()).recv == []


def test_prefill_holds_blocks_until_the_write_is_done() -> None:
    from vllm.v1.request import RequestStatus

    side = SchedulerSide(KvpushConfig(), "prefill-0", is_producer=True)
    req = FakeRequest(
        "p",
        list(range(4)),
        {"do_remote_decode": True, "transfer_id": "t1"},
        RequestStatus.FINISHED_LENGTH_CAPPED,
        4,
    )
    assert side.request_finished(req, [9]) == (True, None)  # type: ignore[arg-type]
    assert side.has_pending_push_work()
    (send,) = side.build_connector_meta(SimpleNamespace()).send
    assert (send.transfer_id, send.block_ids, send.num_tokens) == ("t1", (9,), 4)
    side.update_connector_output({"p"}, set())
    assert not side.has_pending_push_work()


def test_aborted_prefill_frees_at_once_and_tells_the_worker() -> None:
    from vllm.v1.request import RequestStatus

    side = SchedulerSide(KvpushConfig(), "prefill-0", is_producer=True)
    req = FakeRequest(
        "p", [1], {"do_remote_decode": True, "transfer_id": "t1"}, RequestStatus.FINISHED_ABORTED, 1
    )
    assert side.request_finished(req, [9]) == (False, None)  # type: ignore[arg-type]
    assert side.build_connector_meta(SimpleNamespace()).aborted == [AbortSpec("t1", "p")]


@pytest.mark.parametrize(
    ("meant", "answer"),
    [("prefill-0_dp1", (True, None)), ("prefill-0_dp0", (False, {MISROUTED: "prefill-0_dp1"}))],
)
def test_a_push_prefill_meant_for_another_engine_frees_its_kv_at_once(
    meant: str, answer: tuple[bool, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A data-parallel prefill's request that ran on another engine than the one decode
    registered with (the proxy's X-data-parallel-rank not honoured) would hold its KV for
    a WRITE that never pairs: it is freed at once, its answer names the engine that ran it
    (for the proxy to fail the request, which ends decode's wait), and the log says why."""
    from vllm.v1.request import RequestStatus

    side = SchedulerSide(KvpushConfig(), "prefill-0_dp1", is_producer=True, dp_index=1)
    params = {"do_remote_decode": True, "transfer_id": "t1", "kvpush_engine_id": meant}
    req = FakeRequest("p", [1, 2], params, RequestStatus.FINISHED_LENGTH_CAPPED, 2)
    with caplog.at_level(logging.ERROR, logger="kvpush.scheduler"):
        assert side.request_finished(req, [9]) == answer  # type: ignore[arg-type]
    meta = side.build_connector_meta(SimpleNamespace())
    if answer[0]:
        assert [s.transfer_id for s in meta.send] == ["t1"] and not caplog.records
    else:
        assert meta.send == [] and meta.aborted == [AbortSpec("t1", "p")]
        assert "meant for prefill engine prefill-0_dp0, but ran on prefill-0_dp1" in caplog.text


def test_config_rejects_unknown_keys_and_reads_the_side_channel_env() -> None:
    config = KvpushConfig.from_extra(
        {"mode": "push"}, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "6001", "KVPUSH_SECRET": "abc"}
    )
    assert (config.port, config.secret) == (6001, b"abc")
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        KvpushConfig.from_extra({"mdoe": "push"}, env={})
    with pytest.raises(ValueError, match="mode must be one of"):
        KvpushConfig.from_extra({"mode": "sideways"}, env={})


def test_push_waits_for_prefill_longer_than_a_transfer_takes() -> None:
    """A push request waits in prefill's queue while decode holds its blocks: its deadline
    is `prefill_timeout_s` (the proxy's request timeout by default), not a transfer's."""
    config = KvpushConfig.from_extra({"insecure": True}, env={})
    assert (config.transfer_timeout_s, config.prefill_timeout_s) == (30.0, 300.0)
    config = KvpushConfig.from_extra({"prefill_timeout_s": 45, "insecure": True}, env={})
    assert config.prefill_timeout_s == 45.0
    with pytest.raises(ValueError, match="prefill_timeout_s"):
        KvpushConfig.from_extra({"prefill_timeout_s": 0, "insecure": True}, env={})


def test_pull_prefill_keeps_its_blocks_and_answers_with_their_coordinates() -> None:
    from vllm.v1.request import RequestStatus

    config = KvpushConfig(mode="pull", host="10.0.0.5", port=7100)
    side = SchedulerSide(config, "prefill-0", is_producer=True, tp_size=2)
    req = FakeRequest(
        "p-1", list(range(6)), {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED, 6,
        [4711],
    )  # fmt: skip
    delay, params = side.request_finished(req, [9, 2])  # type: ignore[arg-type]
    assert delay and params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "p-1",
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.5",
        "remote_port": 7100,
        "remote_block_ids": [9, 2],
        "remote_num_tokens": 6,
        "tp_size": 2,
        "pp_size": 1,
        "first_token_id": 4711,  # the token it sampled, which decode is to reproduce
    }
    (send,) = side.build_connector_meta(SimpleNamespace()).send
    assert (send.transfer_id, send.block_ids, send.num_tokens) == ("p-1", (9, 2), 6)
    assert send.sampled == 4711  # push: it goes with WriteDone
    assert side.has_pending_push_work()
    side.update_connector_output({"p-1"}, set())
    assert not side.has_pending_push_work()


def test_pull_decode_records_where_to_read_from() -> None:
    from vllm.v1.request import RequestStatus

    prefill = SchedulerSide(KvpushConfig(mode="pull"), "prefill-0", is_producer=True)
    done = FakeRequest(
        "p-1", list(range(6)), {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED, 6
    )
    _, params = prefill.request_finished(done, [9, 2])  # type: ignore[arg-type]
    decode = SchedulerSide(KvpushConfig(mode="pull"), "decode-0", is_producer=False)
    req = FakeRequest("d-1", list(range(6)), dict(params or {}))  # what the proxy relays
    assert decode.get_num_new_matched_tokens(req, 0) == (6, True)  # type: ignore[arg-type]
    decode.update_state_after_alloc(req, vllm_blocks([4, 7]), 6)  # type: ignore[arg-type]
    (spec,) = decode.build_connector_meta(SimpleNamespace()).recv
    assert (spec.transfer_id, spec.block_ids, spec.remote_block_ids) == ("p-1", (4, 7), (9, 2))
    assert (spec.num_tokens, spec.remote_num_tokens, spec.prefill_port) == (6, 6, 5600)
    # the decode request finishing normally releases nothing of its own
    decode.update_connector_output(set(), {"d-1"})
    assert decode.request_finished(req, [4, 7]) == (False, None)  # type: ignore[arg-type]


def test_pull_prefill_signs_its_coordinates_when_a_secret_is_set() -> None:
    from vllm.v1.request import RequestStatus

    from kvpush.core.protocol import grant_ok

    config = KvpushConfig(mode="pull", secret=b"s3cret")
    prefill = SchedulerSide(config, "prefill-0", is_producer=True)
    done = FakeRequest(
        "p-1", list(range(6)), {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED, 6
    )
    _, params = prefill.request_finished(done, [9, 2])  # type: ignore[arg-type]
    assert params is not None
    assert grant_ok(b"s3cret", params["kvpush_grant"], "prefill-0", "p-1", (9, 2), 6, 1)
    decode = SchedulerSide(config, "decode-0", is_producer=False)
    req = FakeRequest("d-1", list(range(6)), dict(params))
    decode.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    decode.update_state_after_alloc(req, vllm_blocks([4, 7]), 6)  # type: ignore[arg-type]
    (spec,) = decode.build_connector_meta(SimpleNamespace()).recv
    assert (spec.remote_engine_id, spec.remote_grant) == ("prefill-0", params["kvpush_grant"])


def test_rejected_message_counts_reach_stats_once() -> None:
    from kvpush.node.context import Identity
    from kvpush.node.worker import WorkerSide

    worker = WorkerSide(KvpushConfig(), Identity("prefill-0", "prefill", "m", 0, 1))
    server = SimpleNamespace(rejected={"bad_mac": 3})
    worker.server = server  # type: ignore[assignment]
    assert worker.stats_data()["rejected"] == {"bad_mac": 3}
    assert worker.stats_data()["rejected"] == {}, "running totals must not be re-counted"
    server.rejected = {"bad_mac": 5, "too_large": 1}
    assert worker.stats_data()["rejected"] == {"bad_mac": 2, "too_large": 1}


def test_sleep_mode_is_refused_at_start_with_the_way_out() -> None:
    from kvpush.vllm.connector import refuse_sleep_mode

    refuse_sleep_mode(SimpleNamespace(enable_sleep_mode=False))
    with pytest.raises(ValueError, match="without --enable-sleep-mode"):
        refuse_sleep_mode(SimpleNamespace(enable_sleep_mode=True))


def test_split_requests_refused_where_kvpush_cannot_move_them_naming_what_works() -> None:
    """Prefill context parallelism on either side and pipeline stages on decode are
    refused; a pipeline-parallel prefill is served (each stage moves its own layers)."""
    from kvpush.vllm.connector import refuse_split_requests

    plain = SimpleNamespace(pipeline_parallel_size=1, prefill_context_parallel_size=1)
    for producer in (True, False):
        refuse_split_requests(plain, producer)
        refuse_split_requests(SimpleNamespace(), producer)  # a vLLM without these settings
    refuse_split_requests(SimpleNamespace(**{**vars(plain), "pipeline_parallel_size": 2}), True)
    for size, producers in (
        ("pipeline_parallel_size", (False,)),
        ("prefill_context_parallel_size", (True, False)),
    ):
        flag = "--" + size.replace("_", "-") + " 2"
        for producer in producers:
            with pytest.raises(ValueError, match=flag) as refused:
                refuse_split_requests(SimpleNamespace(**{**vars(plain), size: 2}), producer)
            assert "--tensor-parallel-size" in str(refused.value)


def vllm_request(tokens: int, params: dict[str, Any]) -> Any:
    """vLLM's own Request, as its front end builds it (kv_transfer_params in extra_args)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request("r-1", list(range(100, 100 + tokens)), sampling, None)


def test_a_state_model_prefill_computes_its_prompt_less_the_last_token_once() -> None:
    """Layers keeping a state (Mamba, linear attention) cannot take a token twice, and vLLM
    recomputes a prompt's last token on decode however much KV arrives: prefill leaves it
    out, so the state it sends is the one decode continues from. Its sampled token is then
    no token of the answer, and none goes to decode."""
    from vllm.v1.request import RequestStatus

    side = SchedulerSide(KvpushConfig(), "prefill-0", is_producer=True, states=True)
    req = vllm_request(10, {"do_remote_decode": True, "transfer_id": "t1"})
    side.on_new_request(req)
    assert (len(req.prompt_token_ids), req.num_prompt_tokens, req.num_tokens) == (9, 9, 9)
    side.on_new_request(req)  # back after a preemption: not cut again
    assert req.num_prompt_tokens == 9
    req.append_output_token_ids(7)
    req.num_computed_tokens = 9
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    side.request_finished(req, [3])
    (send,) = side.build_connector_meta(SimpleNamespace()).send
    assert (send.num_tokens, send.sampled) == (9, NO_TOKEN)
    for kept in (vllm_request(1, {"do_remote_decode": True}), vllm_request(10, {})):
        side.on_new_request(kept)  # one token, or not for decode: the whole prompt
        assert kept.num_prompt_tokens == len(kept.prompt_token_ids)
    plain = SchedulerSide(KvpushConfig(), "prefill-0", is_producer=True)
    whole = vllm_request(10, {"do_remote_decode": True})
    plain.on_new_request(whole)
    assert whole.num_prompt_tokens == 10


def test_a_state_model_decode_takes_all_but_the_last_token_and_computes_that() -> None:
    side = SchedulerSide(KvpushConfig(), "decode-0", is_producer=False, states=True)
    req = FakeRequest("d", list(range(10)), decode_params())
    assert side.get_num_new_matched_tokens(req, 0) == (9, True)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, vllm_blocks(), 9)  # type: ignore[arg-type]
    (spec,) = side.build_connector_meta(SimpleNamespace()).recv
    assert (spec.first_token, spec.num_tokens) == (0, 9)
    one = FakeRequest("d1", [5], decode_params())
    assert side.get_num_new_matched_tokens(one, 0) == (0, False)  # type: ignore[arg-type]
