"""Target-side progress: drive this node's NIXL agent while a peer moves KV through it.

kvpush's transfers are initiator-driven (`kvpush.dataplane.transport`): the side that
posts a WRITE or READ polls it, and with shared memory (`cma`, `posix`) or RDMA the bytes
move with no help from the target. UCX's TCP transport - what two machines without RDMA
use, and what UCX picks between hosts it cannot reach by shared memory - is not
one-sided: the target's UCX worker must run to accept the connection, take the bytes of a
WRITE off the socket (or send those of a READ) and acknowledge them. A target that never
calls into NIXL leaves every transfer hanging until its timeout.

So the target of each transfer progresses its agent while one may be under way, and only
then; idle, nothing runs. Each call into NIXL takes the GIL from the model worker's main
thread, so "may be under way" is kept narrow:
- decode in push: from the moment a prefill rank says a WRITE into it is still in flight
  (`Writing`, sent by prefill `TELL_AFTER_S` after posting it; with shared memory or RDMA
  a small WRITE is done by then and nothing is said) until the transfer settles, and
  while a failed transfer is fenced. Progressing for as long as decode merely waited for
  prefill to compute slowed every token of the requests decoding meanwhile: decode TPOT
  p50 7.9 and 8.8 ms in two runs of `kvpush bench hooks --setups kvpush-push --requests
  12 --concurrency 3`, 5.7 ms with decode's progress switched off by hand (loopback, where
  shared memory needs none), 6.7 ms with this rule;
- prefill in pull: while it holds leases (decode may READ them at any time), and for
  `transfer_timeout_s + fence_s` after one expired or after a decode renewed a lease no
  longer held (its decode may still have a READ of it pending, which it keeps, renewing,
  until it ends: `LeaseKeeper.serve_until`).
The part wakes the thread (`on_target`) when that starts, and nothing else does. It stops
once nothing is in flight and `LINGER_S` passed since the last wake. While running it calls
NIXL every `INTERVAL_S`: one short call, which is all the TCP transport needs to keep
socket buffers moving (measured: ~0.8 GB/s over a veth link between two network namespaces, see
`tests/integration/test_nixl_hosts.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvpush.dataplane import threads
from kvpush.dataplane.transport import NixlTransport, TransferError
from kvpush.node.pull import LeaseKeeper
from kvpush.node.push import PushWriter
from kvpush.node.receiver import Receiver

log = logging.getLogger("kvpush.worker")

INTERVAL_S = 0.0005  # between calls into NIXL while a transfer may be under way
CHECK_S = 0.01  # how often the part is asked whether anything is still in flight
LINGER_S = 0.05  # how long a wake keeps the thread running, busy or not


class TargetProgress(threading.Thread):
    """Calls `progress` every INTERVAL_S while `busy()` or within LINGER_S of a wake."""

    def __init__(self, progress: Callable[[], object], busy: Callable[[], bool], name: str):
        super().__init__(name=name, daemon=True)
        self._progress = progress
        self._busy = busy
        self._event = threading.Event()
        self._until = 0.0
        self._stopping = False
        self.calls = 0  # calls into NIXL so far (tests read it)

    def wake(self) -> None:
        """From any thread: a transfer may start soon; progress until it is over."""
        self._until = time.monotonic() + LINGER_S
        self._event.set()

    def stop(self) -> None:
        self._stopping = True
        self._event.set()
        if self.is_alive():
            self.join(timeout=5)

    def run(self) -> None:
        threads.background()
        while not self._stopping:
            self._event.wait()
            self._event.clear()
            check = 0.0
            while not self._stopping:
                now = time.monotonic()
                if now >= check:
                    if now >= self._until and not self._busy():
                        break
                    check = now + CHECK_S
                try:
                    self._progress()
                except TransferError as exc:  # the transport closed under us: shutting down
                    log.debug("%s: stopped: %s", self.name, exc)
                    return
                except Exception:  # a NIXL error must not kill the thread silently
                    log.exception("%s: progressing NIXL failed", self.name)
                self.calls += 1
                time.sleep(INTERVAL_S)


def for_part(
    transport: NixlTransport, part: PushWriter | LeaseKeeper | Receiver
) -> TargetProgress | None:
    """The target progress `part` needs, started; None where this node only initiates
    (prefill in push, decode in pull)."""
    busy: Callable[[], bool]
    if isinstance(part, Receiver) and not part.pull:
        arrivals, writing = part.arrivals, part.writing
        busy = lambda: bool(writing) or arrivals.fenced > 0  # noqa: E731
    elif isinstance(part, LeaseKeeper):
        leases, keeper = part.leases, part
        busy = lambda: leases.active > 0 or time.monotonic() < keeper.serve_until  # noqa: E731
    else:
        return None
    progress = TargetProgress(transport.get_notifs, busy, f"{part.name}-target-progress")
    progress.start()
    part.on_target = progress.wake
    return progress
