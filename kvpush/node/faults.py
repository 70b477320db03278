"""Test hooks: inject faults into chosen transfers, so end-to-end tests can exercise the
failure paths with real servers. Off unless the environment variable KVPUSH_FAULTS is set;
never set it in production.

    KVPUSH_FAULTS="drop_registration,nixl_error,delay_write=2.0"

lists the faults a server may inject, with a duration in seconds where one applies. A
listed fault fires only for transfers whose transfer id contains "fault-<name>" (the proxy
keeps a client's X-Request-Id as the prefix of the transfer id, so a test picks the fault
per request with a header like "X-Request-Id: t7-fault-nixl_error"); every other request is
served normally, so one deployment serves many scenarios. Each hook only changes *when* or
*whether* a real code path runs; the paths themselves are the production ones.

  hold_decode=S        decode: the scheduler reports the request's KV as not yet known for
                       S s, so its blocks are not allocated and nothing is registered
  drop_registration    prefill: a registration is dropped on arrival (lost on the way)
  hold_prefill=S       prefill (push): a finished prefill reaches the writer S s late, so
                       the registration waits for it
  delay_write=S        the initiator (prefill in push, decode in pull) observes a transfer
                       it posted as in flight for at least S s more (its bytes may move
                       meanwhile: only the completion is seen late)
  delay_post=S         the initiator posts a transfer S s late, though it counts as in flight
                       (and its timeout runs) from the start: no byte of it can move
                       before then, so a link cut meanwhile catches all of it still to send
  nixl_error           the initiator's transfer completes with an error state, as NIXL
                       reports a failed transfer
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

log = logging.getLogger("kvpush.faults")

ENV = "KVPUSH_FAULTS"
WITH_SECONDS = ("hold_decode", "hold_prefill", "delay_write", "delay_post")
WITHOUT = ("drop_registration", "nixl_error")


@dataclass(frozen=True, slots=True)
class Faults:
    """The faults a server may inject (see the module docstring); empty: none."""

    enabled: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Faults:
        enabled: dict[str, float] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            name, sep, value = item.partition("=")
            if name in WITH_SECONDS and sep:
                try:
                    seconds = float(value)
                except ValueError:
                    seconds = -1.0
                if seconds < 0:
                    raise ValueError(f"{ENV}: {name} needs a duration in seconds, got {value!r}")
                enabled[name] = seconds
            elif name in WITHOUT and not sep:
                enabled[name] = 0.0
            else:
                raise ValueError(
                    f"{ENV}: unknown fault {item!r}; known: "
                    + ", ".join([f"{n}=SECONDS" for n in WITH_SECONDS] + list(WITHOUT))
                )
        return cls(enabled)

    def __bool__(self) -> bool:
        return bool(self.enabled)

    def fires(self, name: str, transfer_id: str) -> bool:
        """Whether fault `name` applies to this transfer."""
        hit = name in self.enabled and f"fault-{name}" in transfer_id
        if hit:
            log.warning("test hook %s: injecting %s into transfer %s", ENV, name, transfer_id)
        return hit

    def seconds(self, name: str, transfer_id: str) -> float:
        """The duration of fault `name` for this transfer (0: it does not fire)."""
        return self.enabled[name] if self.fires(name, transfer_id) else 0.0
