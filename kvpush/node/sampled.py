"""First output tokens prefill sampled, as `WriteDone` brought them, until decode's first step.

Push only. The proxy may stream prefill's first token to the client before decode's first
step; decode must then produce that same token, not one of its own (with sampling they
differ). Prefill's writer sends the token with each rank's `WriteDone`; decode's receiver
thread records it here, in the worker process, before the transfer counts as arrived; and
kvpush's logits processor (`kvpush.vllm.first_token`), in the same process, reads it when
the request joins the batch, which vLLM does only after the KV arrived.

Bounded: an entry whose request never ran (aborted while waiting) falls out after
`CAPACITY` newer ones. Entries are read, not taken, so a request preempted before its first
token finds its token again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvpush.node.results import HookTimer

CAPACITY = 65_536


class SampledTokens:
    """transfer id -> the first output token prefill sampled for it."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._tokens: OrderedDict[str, int] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def put(self, transfer_id: str, token: int) -> None:
        with self._lock:
            self._tokens[transfer_id] = token
            self._tokens.move_to_end(transfer_id)
            while len(self._tokens) > self._capacity:
                self._tokens.popitem(last=False)

    def get(self, transfer_id: str) -> int | None:
        with self._lock:
            return self._tokens.get(transfer_id)

    def __len__(self) -> int:
        return len(self._tokens)


SAMPLED = SampledTokens()  # this process's, shared by its node's receiver and vLLM's sampler
# The logits processor's time on the worker's main thread, where vLLM samples: drained
# into the node's stats with its hooks' (`worker.first_token`), timed only when it pins.
PIN_TIMER = HookTimer("worker")
