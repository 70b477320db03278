"""The client's first token from prefill, the rest from decode: one stream, spliced.

Prefill samples a request's first output token anyway (its leg runs with max_tokens=1). In
a streamed request the proxy sends that token to the client the moment prefill answers, and
decode's stream after it, less decode's own first token: the client sees its first token
without waiting for the KV handoff and decode's first step. This is sound because decode
is told to produce prefill's token (`vllm_xargs`, see `kvpush.vllm.first_token`): the
token stream is the one a single server would sample, whatever the sampling settings.

`Splice` is the pure part: fed prefill's JSON answer and decode's SSE bytes in the order
they arrive, it says what to write to the client. Prefill's token goes out only while
decode has sent no content yet (in push both legs run at once; a chat stream's role chunk
may come from decode first); once decode's own content leads, the stream is decode's
alone. Decode's events are parsed only until its first token's text is matched, then
passed on as bytes. A decode whose first token's text is not prefill's (a decode without
kvpush's logits processor that did not say so: another kvpush version) is counted as a
mismatch and passed on unchanged, and the proxy stops splicing (`Backends.first_token_of`);
a decode that says it samples its own first token (speculative decoding loads no
logits processor; `kvpush:info`) is never spliced. A first token without text (its
bytes complete a character only with the next token's) goes out as an empty event, as a
single server streams it, and decode's empty copy is dropped.
"""

from __future__ import annotations

import json
from typing import Any

from kvpush.core.protocol import (
    FIRST_TOKEN_ARG,
    FIRST_TOKEN_OF_ARG,
    FIRST_TOKEN_PARAM,
    is_token_id,
)

SOURCES = ("prefill", "decode")  # `kvpush proxy --first-token`
_REPLACEMENT = "\ufffd"  # text of a token that ends inside a UTF-8 character


def eligible(body: dict[str, Any]) -> bool:
    """Whether a client request may get its first token from prefill: streamed, and
    asking nothing per token that prefill's early event does not carry (logprobs, echo,
    token ids)."""
    if body.get("stream") is not True:
        return False
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs"):
        return False
    if body.get("echo") or body.get("prompt_logprobs") is not None:
        return False
    if body.get("return_token_ids"):  # each chunk's token ids, the prompt's in the first
        return False
    options = body.get("stream_options")
    return not (isinstance(options, dict) and options.get("continuous_usage_stats"))


def pin_args(body: dict[str, Any], key: str, value: int | str) -> dict[str, Any]:
    """`body` (a leg's shallow copy) with decode told which first token to produce."""
    extra = body.get("vllm_xargs")
    return {**body, "vllm_xargs": {**(extra if isinstance(extra, dict) else {}), key: value}}


def pin_push(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    return pin_args(body, FIRST_TOKEN_OF_ARG, transfer_id)


def pulled_token(params: dict[str, Any]) -> int | None:
    """The first token pull's prefill returned in its kv_transfer_params, if any."""
    token = params.get(FIRST_TOKEN_PARAM)
    return token if is_token_id(token) else None


def pin_pull(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any] | None:
    """Decode's pull leg pinned to the token prefill returned; None if it returned none."""
    token = pulled_token(params)
    return None if token is None else pin_args(body, FIRST_TOKEN_ARG, token)


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def _first_choice(payload: Any) -> dict[str, Any] | None:
    if not isinstance(payload, dict):
        return None
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    return choices[0]


class Splice:
    """What the client gets of prefill's answer and decode's stream (see the module doc)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.pending: str | None = None  # prefill's token text decode has yet to repeat
        self.sent_early = False  # prefill's token went to the client
        self.mismatch = False  # decode's first token was not prefill's
        self._role_sent = False  # chat: decode's role chunk went to the client
        self._content = False  # decode's own content reached the client
        self._passing = False  # nothing left to splice: decode's bytes go as they come
        self._buffer = b""

    def prefill_answer(self, answer: Any) -> bytes | None:
        """The event carrying prefill's first token, if it can still go first."""
        if self._content or self._passing or self.sent_early:
            return None
        choice = _first_choice(answer)
        if choice is None or choice.get("finish_reason") != "length":
            return None  # stopped at its first token (EOS, a stop string): decode's to tell
        if self.chat:
            message = choice.get("message")
            text = message.get("content") if isinstance(message, dict) else None
            if not isinstance(text, str) or not text or _REPLACEMENT in text:
                return None  # chat's content may be what a reasoning or tool parser left
        else:
            text = choice.get("text")
            # Prefill's text is what vLLM's detokenizer gave for the token, and decode's
            # gives the same for its copy: empty where the token's bytes wait for the
            # next token's (decode then streams an empty first event too), U+FFFD inside
            # where the tokenizer itself decodes bytes so. Only a text ending in U+FFFD
            # might be a partial character decode would hold back: decode's to tell.
            if not isinstance(text, str) or text.endswith(_REPLACEMENT):
                return None
        head = {key: answer[key] for key in ("id", "created", "model") if key in answer}
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if not self._role_sent:
                delta = {"role": "assistant", **delta}
            out = {**head, "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                "finish_reason": None}]}  # fmt: skip
        else:
            out = {**head, "object": "text_completion",
                   "choices": [{"index": 0, "text": text, "logprobs": None,
                                "finish_reason": None}]}  # fmt: skip
        self.pending, self.sent_early = text, True
        return _event(out)

    def decode_bytes(self, data: bytes) -> bytes:
        """What to write of these bytes of decode's stream."""
        if self._passing:
            return data
        self._buffer += data
        out = []
        while not self._passing:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                break
            event, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
            out.append(self._decode_event(event))
        if self._passing:
            out.append(self._buffer)
            self._buffer = b""
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest

    def _decode_event(self, event: bytes) -> bytes:
        line = event.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            return event
        try:
            payload = json.loads(line[5:])
        except ValueError:
            return event
        choice = _first_choice(payload)
        if choice is None:
            return event  # an error, a usage-only chunk: as it is
        if self.chat:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                return event
            text = delta.get("content")
        else:
            delta, text = None, choice.get("text")
        if self.pending is None:  # prefill's token has not gone out (yet)
            if isinstance(text, str) and text:
                self._content, self._passing = True, True
            elif delta is not None and "role" in delta:
                self._role_sent = True
            return event
        if isinstance(text, str) and (text or self._empty_copy(delta)):
            text = self._consume(text)
        elif delta is None or "role" not in delta:
            return event
        if delta is not None:
            delta.pop("role", None)  # prefill's event carried it
            if text is not None:
                delta["content"] = text
        else:
            choice["text"] = text
        empty = not text and choice.get("finish_reason") is None and not payload.get("usage")
        if empty and (delta is None or not any(v for v in delta.values())):
            return b""  # only decode's copy of the first token (or its role): drop
        return _event(payload)

    def _empty_copy(self, delta: dict[str, Any] | None) -> bool:
        """Whether an event without text is decode's copy of an empty first token that
        prefill's event already stood for (a chat's role chunk is not)."""
        return self.pending == "" and (delta is None or "role" not in delta)

    def _consume(self, text: str) -> str:
        pending = self.pending or ""
        if text.startswith(pending):
            text, pending = text[len(pending) :], ""
        elif pending.startswith(text):
            text, pending = "", pending[len(text) :]
        else:
            self.mismatch = True
            pending = ""
        self.pending = pending
        if not pending:
            self._passing = True
        return text
