"""Decode's first output token is the one prefill sampled: vLLM's logits processor for it.

Prefill computes the request's first output token anyway; the proxy streams it to the
client as soon as prefill answers, instead of waiting for the KV handoff and decode's first
step (`kvpush proxy --first-token prefill`). That is only sound if decode then produces the
same token: with greedy sampling it would (up to ties), with any other sampling it would
not. So decode's first step is pinned to prefill's token, for requests that ask for it
through `vllm_xargs` (SamplingParams.extra_args), which the proxy sets on decode's leg:

- `kvpush_first_token`: the token itself (pull: prefill returned it in kv_transfer_params);
- `kvpush_first_token_of`: a transfer id (push: decode registered before prefill answered;
  the token comes with prefill's `WriteDone`, see `kvpush.node.sampled`).

vLLM loads this class in every server of an environment where kvpush is installed (the
`vllm.logits_processors` entry point). For requests that do not ask, it does nothing: one
dictionary check per engine step. vLLM's speculative decoding loads no custom logits
processors: such a decode says so on /metrics (`kvpush:info{first_token="own"}`,
`kvpush.vllm.stats`), and the proxy then streams decode's own first token.

Pinning means: every other token's logit becomes -inf and this one's 0, whatever earlier
processors did, so any sampler (greedy, temperature, top-k/p, penalties, a grammar's mask
applied before) draws exactly this token. Logprobs (computed from the raw logits by
default) are left as they were; the proxy does not pin requests that ask for logprobs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

from kvpush.core.protocol import FIRST_TOKEN_ARG, FIRST_TOKEN_OF_ARG, is_token_id
from kvpush.node.sampled import PIN_TIMER, SAMPLED

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

log = logging.getLogger("kvpush.connector")


def wanted_token(extra_args: dict[str, Any] | None) -> int | None:
    """The token a request's first step must produce, if it asks for one and it is known."""
    if not extra_args:
        return None
    token = extra_args.get(FIRST_TOKEN_ARG)
    if is_token_id(token):
        return token
    transfer_id = extra_args.get(FIRST_TOKEN_OF_ARG)
    if isinstance(transfer_id, str):
        found = SAMPLED.get(transfer_id)
        if found is None:
            log.warning(
                "kvpush: no first token from prefill for transfer %s; decode samples its own",
                transfer_id[:64],
            )
        return found
    return None


class FirstToken(LogitsProcessor):
    """Pins the first sampled token of the requests that carry one (see the module doc)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra = sampling_params.extra_args or {}
        token = extra.get(FIRST_TOKEN_ARG)
        if token is not None and not is_token_id(token):
            raise ValueError(f"vllm_xargs.{FIRST_TOKEN_ARG} must be a token id (an int >= 0)")
        transfer_id = extra.get(FIRST_TOKEN_OF_ARG)
        if transfer_id is not None and not isinstance(transfer_id, str):
            raise ValueError(f"vllm_xargs.{FIRST_TOKEN_OF_ARG} must be a transfer id (a string)")

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (token, the request's live list of output tokens)
        self.rows: dict[int, tuple[int, list[int]]] = {}
        self._span = PIN_TIMER("first_token")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes what greedy sampling picks

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        rows = self.rows
        for index in batch_update.removed:
            rows.pop(index, None)
        for index, params, _prompt, outputs in batch_update.added:
            rows.pop(index, None)
            if params is None or not params.extra_args or outputs:
                continue
            with self._span:
                token = wanted_token(params.extra_args)
            if token is not None:
                rows[index] = (token, outputs)
        for a, b, direction in batch_update.moved:
            at_a, at_b = rows.pop(a, None), rows.pop(b, None)
            if at_a is not None:
                rows[b] = at_a
            if direction == MoveDirectionality.SWAP and at_b is not None:
                rows[a] = at_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        with self._span:
            return self._pin(logits)

    def _pin(self, logits: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        for row, (token, outputs) in list(self.rows.items()):
            if outputs:  # its first token is out: nothing more to pin
                del self.rows[row]
                continue
            if row >= logits.shape[0] or token >= vocab:
                log.warning("kvpush: first token %d does not fit logits %s", token, logits.shape)
                del self.rows[row]
                continue
            logits[row].fill_(float("-inf"))
            logits[row, token] = 0.0
        return logits
