"""The first token from prefill: the proxy's splice of the two streams, and decode's pin.

The splice is pure (bytes in, bytes out); the pin is kvpush's logits processor, run here on
real torch logits with vLLM's own SamplingParams and batch updates.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality

from kvpush.node.results import empty_data
from kvpush.node.sampled import PIN_TIMER, SAMPLED, SampledTokens
from kvpush.proxy import first_token
from kvpush.proxy.first_token import Splice
from kvpush.vllm.first_token import FirstToken, wanted_token


def prefill_answer(text: str, chat: bool = False, finish: str = "length") -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": "cmpl-7", "created": 5, "model": "m", "choices": [choice]}


def event(text: str | None, chat: bool = False, role: bool = False, **choice: Any) -> bytes:
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        body = {"index": 0, "delta": delta, "finish_reason": None, **choice}
    else:
        body = {"index": 0, "text": text, "finish_reason": None, **choice}
    return b"data: " + json.dumps({"id": "cmpl-7", "choices": [body]}).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def texts(stream: bytes) -> list[str]:
    out = []
    for block in stream.split(b"\n\n"):
        if block.startswith(b"data: {"):
            choice = json.loads(block[6:])["choices"][0]
            out.append(choice["text"] if "text" in choice else choice["delta"].get("content", ""))
    return out


def test_completions_first_token_from_prefill_then_decode_without_its_copy() -> None:
    splice = Splice(chat=False)
    early = splice.prefill_answer(prefill_answer(" The"))
    assert early is not None and texts(early) == [" The"]
    assert json.loads(early[6:])["id"] == "cmpl-7"
    rest = splice.decode_bytes(event(" The") + event(" cat") + event(" sat") + DONE)
    assert texts(rest) == [" cat", " sat"] and rest.endswith(DONE)
    assert not splice.mismatch and splice.sent_early


def test_events_split_anywhere_and_merged_tokens_are_spliced_the_same() -> None:
    splice = Splice(chat=False)
    splice.prefill_answer(prefill_answer(" The"))
    stream = event(" The cat") + event(" sat", finish_reason="length") + DONE
    out = b"".join(splice.decode_bytes(stream[i : i + 3]) for i in range(0, len(stream), 3))
    out += splice.flush()
    assert texts(out) == [" cat", " sat"] and out.endswith(DONE)
    # The first token's text spread over two events (a character split across tokens)
    splice = Splice(chat=False)
    splice.prefill_answer(prefill_answer("ab"))
    out = splice.decode_bytes(event("a") + event("bc") + DONE)
    assert texts(out) == ["c"] and not splice.mismatch


def test_chat_role_goes_out_once_whichever_leg_leads() -> None:
    # prefill first: its event carries the role, decode's role chunk is dropped
    splice = Splice(chat=True)
    early = splice.prefill_answer(prefill_answer("Hi", chat=True))
    assert early is not None
    assert json.loads(early[6:])["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    out = splice.decode_bytes(event("", chat=True, role=True) + event("Hi", chat=True) + DONE)
    assert out == DONE
    # decode's role chunk first (push: vLLM sends it at once), then prefill's token
    splice = Splice(chat=True)
    role = event("", chat=True, role=True)
    assert splice.decode_bytes(role) == role
    early = splice.prefill_answer(prefill_answer("Hi", chat=True))
    assert early is not None
    assert json.loads(early[6:])["choices"][0]["delta"] == {"content": "Hi"}
    out = splice.decode_bytes(event("Hi", chat=True) + event(" there", chat=True) + DONE)
    assert texts(out) == [" there"]


def test_decode_content_first_means_decode_alone() -> None:
    splice = Splice(chat=False)
    first = event(" The")
    assert splice.decode_bytes(first) == first
    assert splice.prefill_answer(prefill_answer(" The")) is None
    assert splice.decode_bytes(event(" cat")) == event(" cat")
    assert not splice.sent_early


@pytest.mark.parametrize(
    "answer",
    [
        prefill_answer("</s>", finish="stop"),  # stopped at its first token: decode tells
        prefill_answer("a\ufffd"),  # may end inside a character decode holds back
        prefill_answer("", chat=True),  # chat: what a reasoning or tool parser left
        {"error": "boom"},
        {"choices": []},
    ],
)
def test_prefill_answers_without_a_usable_first_token_leave_the_stream_to_decode(
    answer: dict[str, Any],
) -> None:
    splice = Splice(chat=False)
    assert splice.prefill_answer(answer) is None
    assert splice.decode_bytes(event("x") + DONE) == event("x") + DONE


def test_an_empty_first_token_goes_out_from_prefill_and_decode_s_copy_is_dropped() -> None:
    """A token whose bytes wait for the next token's (a byte-fallback or multi-byte
    character): vLLM's detokenizer gives it no text on both servers, and streams an empty
    event for it, so the client gets what one server would send."""
    splice = Splice(chat=False)
    early = splice.prefill_answer(prefill_answer(""))
    assert early is not None and texts(early) == [""] and splice.sent_early
    rest = splice.decode_bytes(event("") + event("\u00e9t\u00e9") + event(" x") + DONE)
    assert texts(rest) == ["\u00e9t\u00e9", " x"] and rest.endswith(DONE)
    assert not splice.mismatch
    # a decode that sends no event for the empty token: its text goes out whole
    splice = Splice(chat=False)
    splice.prefill_answer(prefill_answer(""))
    assert texts(splice.decode_bytes(event("\u00e9") + event(" x"))) == ["\u00e9", " x"]


def test_a_first_token_with_replacement_characters_inside_is_spliced() -> None:
    splice = Splice(chat=False)
    early = splice.prefill_answer(prefill_answer("\ufffd ease"))  # the tokenizer's own
    assert early is not None and texts(early) == ["\ufffd ease"]
    rest = splice.decode_bytes(event("\ufffd ease") + event(" x") + DONE)
    assert texts(rest) == [" x"] and not splice.mismatch


def test_a_different_first_token_at_decode_is_a_mismatch_and_nothing_is_lost() -> None:
    splice = Splice(chat=False)
    splice.prefill_answer(prefill_answer(" The"))
    out = splice.decode_bytes(event(" A") + event(" cat") + DONE)
    assert splice.mismatch and texts(out) == [" A", " cat"]


def test_final_usage_and_finish_events_survive_the_splice() -> None:
    splice = Splice(chat=False)
    splice.prefill_answer(prefill_answer("x"))
    last = event("x", finish_reason="length")
    usage = b'data: {"id": "cmpl-7", "choices": [], "usage": {"completion_tokens": 1}}\n\n'
    out = splice.decode_bytes(last + usage + DONE)
    assert json.loads(out.split(b"\n\n")[0][6:])["choices"][0]["finish_reason"] == "length"
    assert usage in out and out.endswith(DONE)


@pytest.mark.parametrize(
    ("body", "ok"),
    [
        ({"stream": True}, True),
        ({"stream": False}, False),
        ({}, False),
        ({"stream": True, "logprobs": 2}, False),
        ({"stream": True, "logprobs": True, "top_logprobs": 2}, False),
        ({"stream": True, "logprobs": False}, True),
        ({"stream": True, "echo": True}, False),
        ({"stream": True, "return_token_ids": True}, False),
        ({"stream": True, "return_token_ids": False}, True),
        ({"stream": True, "stream_options": {"include_usage": True}}, True),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, False),
    ],
)
def test_which_requests_may_get_their_first_token_from_prefill(
    body: dict[str, Any], ok: bool
) -> None:
    assert first_token.eligible(body) is ok


def test_decode_legs_are_pinned_without_losing_the_clients_xargs() -> None:
    body = {"prompt": "p", "vllm_xargs": {"mine": 1}}
    assert first_token.pin_push(body, "t-1")["vllm_xargs"] == {
        "mine": 1,
        "kvpush_first_token_of": "t-1",
    }
    assert body["vllm_xargs"] == {"mine": 1}, "the client's body is not changed"
    pinned = first_token.pin_pull(body, {"first_token_id": 7})
    assert pinned is not None and pinned["vllm_xargs"]["kvpush_first_token"] == 7
    assert first_token.pin_pull(body, {}) is None
    assert first_token.pin_pull(body, {"first_token_id": True}) is None


# --- decode's side: kvpush's logits processor --------------------------------------------


def params(**extra: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, extra_args=extra or None)


def update(
    added: list[tuple[int, SamplingParams, list[int]]] = (),  # type: ignore[assignment]
    removed: tuple[int, ...] = (),
    moved: tuple[tuple[int, int, MoveDirectionality], ...] = (),
    size: int = 4,
) -> BatchUpdate:
    return BatchUpdate(
        batch_size=size,
        removed=list(removed),
        added=[(i, p, [1, 2], out) for i, p, out in added],
        moved=list(moved),
    )


def pinned_rows(proc: FirstToken, rows: int = 4, vocab: int = 16) -> dict[int, int]:
    logits = torch.randn(rows, vocab)
    out = proc.apply(logits)
    found = {}
    for row in range(rows):
        finite = torch.isfinite(out[row]).nonzero().flatten().tolist()
        if len(finite) == 1:
            found[row] = finite[0]
    return found


def test_the_first_step_of_a_pinned_request_can_only_draw_prefills_token() -> None:
    proc = FirstToken(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    SAMPLED.put("t-push", 9)
    outputs: list[int] = []
    proc.update_state(
        update([(0, params(), []), (1, params(kvpush_first_token=5), outputs),
                (2, params(kvpush_first_token_of="t-push"), [])])
    )  # fmt: skip
    assert pinned_rows(proc) == {1: 5, 2: 9}
    logits = torch.full((4, 16), 3.0)
    proc.apply(logits)
    assert torch.multinomial(torch.softmax(logits[1], -1), 50, replacement=True).eq(5).all()
    outputs.append(5)  # the first token is out: row 1 samples freely from now on
    proc.update_state(None)
    assert pinned_rows(proc) == {2: 9}
    data = empty_data()
    PIN_TIMER.drain(data)  # its time on the worker's main thread, as the node reports it
    assert (
        data["hook_calls"]["worker.first_token"] >= 4 and data["hook_s"]["worker.first_token"] > 0
    )


def test_pins_follow_vllms_batch_moves_and_removals() -> None:
    proc = FirstToken(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    proc.update_state(
        update([(0, params(kvpush_first_token=3), []), (1, params(kvpush_first_token=4), [])])
    )
    proc.update_state(update(moved=((0, 1, MoveDirectionality.SWAP),)))
    assert pinned_rows(proc) == {0: 4, 1: 3}
    proc.update_state(update(moved=((1, 3, MoveDirectionality.UNIDIRECTIONAL),)))
    assert pinned_rows(proc) == {0: 4, 3: 3}
    proc.update_state(update(removed=(0,)))
    assert pinned_rows(proc) == {3: 3}
    proc.update_state(update([(3, params(), [])]))  # another request took row 3
    assert pinned_rows(proc) == {}


def test_requests_that_ask_nothing_or_too_late_are_left_alone() -> None:
    proc = FirstToken(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    proc.update_state(
        update([(0, params(kvpush_first_token_of="never-arrived"), []),
                (1, params(kvpush_first_token=2), [2, 7]),  # resumed after its first token
                (2, params(kvpush_first_token=99), [])])  # beyond the vocabulary
    )  # fmt: skip
    logits = torch.randn(4, 16)
    assert torch.equal(proc.apply(logits.clone()), logits)
    assert wanted_token(None) is None and wanted_token({"kvpush_first_token": -1}) is None


def test_bad_pins_are_refused_when_the_request_arrives() -> None:
    FirstToken.validate_params(params(kvpush_first_token=3))
    with pytest.raises(ValueError, match="token id"):
        FirstToken.validate_params(params(kvpush_first_token="3"))
    with pytest.raises(ValueError, match="transfer id"):
        FirstToken.validate_params(params(kvpush_first_token_of=3))


def test_the_token_store_is_bounded_and_read_without_taking() -> None:
    store = SampledTokens(capacity=2)
    store.put("a", 1)
    store.put("b", 2)
    assert store.get("a") == 1 and store.get("a") == 1  # a preempted request reads it again
    store.put("c", 3)
    assert store.get("a") is None and len(store) == 2
