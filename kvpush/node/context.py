"""What every part of a node is handed: a small frozen context, never its owner.

A node is one TP rank's kvpush: its NIXL agent, its control server and its background
threads (`kvpush.node.worker`). Each thread gets the `Context` below at start, so the
parts depend on what they use - settings, identity, the transport, the handshake they
send, where they report - and not on each other.
"""

from __future__ import annotations

import ssl
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpush.core.planning import KVLayout
from kvpush.core.protocol import Hello, producer_rank
from kvpush.dataplane.control import ControlClient
from kvpush.node.config import KvpushConfig
from kvpush.node.results import Results

if TYPE_CHECKING:
    from kvpush.dataplane.transport import Indices, Pieces


@dataclass(frozen=True, slots=True)
class Identity:
    engine_id: str
    role: str  # "prefill" or "decode"
    model: str
    tp_rank: int
    tp_size: int
    # vLLM's data-parallel index of this engine: each DP engine's ranks get their own ports
    dp_index: int = 0
    # the pipeline stage (a prefill split over stages holds some of the layers on each)
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def port_offset(self) -> int:
        """This rank's control port, counted from the configured base port: the ports of
        one engine are consecutive (one per TP rank, stage after stage), and DP engines
        follow each other."""
        ranks = self.tp_size * self.pp_size
        return self.dp_index * ranks + producer_rank(self.pp_rank, self.tp_rank, self.tp_size)


class Transfer(Protocol):
    """A posted WRITE or READ (`kvpush.dataplane.transport.Transfer`)."""

    what: str

    def poll(self) -> bool: ...

    def release(self) -> bool: ...


class Transport(Protocol):
    """The data plane a node moves KV with (`kvpush.dataplane.transport.NixlTransport`)."""

    def add_peer(self, metadata: bytes, name: str | None = None) -> str: ...

    def remove_peer(self, name: str) -> None: ...

    def cut_connections_from(self, ips: Collection[str]) -> int: ...

    def prepare_peer_blocks(
        self,
        peer: str,
        local_blocks: Pieces,
        remote_blocks: Pieces,
        remote_mem: str | None = None,
    ) -> None: ...

    def write_blocks(
        self, peer: str, local_idx: Indices, remote_idx: Indices, notif: bytes = b""
    ) -> Transfer: ...

    def read_blocks(
        self, peer: str, local_idx: Indices, remote_idx: Indices, notif: bytes = b""
    ) -> Transfer: ...

    def write(
        self,
        peer: str,
        src: Pieces,
        dst: Pieces,
        notif: bytes = b"",
        remote_mem: str | None = None,
    ) -> Transfer: ...

    def read(
        self,
        peer: str,
        src_remote: Pieces,
        dst_local: Pieces,
        notif: bytes = b"",
        remote_mem: str | None = None,
    ) -> Transfer: ...


@dataclass(frozen=True, slots=True)
class Context:
    """One node's settings, identity, transport, handshake and where its threads report."""

    config: KvpushConfig
    identity: Identity
    transport: Transport
    hello: Hello
    results: Results
    tls: ssl.SSLContext | None = None  # the control channel's client side, if TLS is on

    def control_client(self, host: str, port: int, timeout: float = 5.0) -> ControlClient:
        """A client for a peer's control port, with this node's secret and TLS settings."""
        return ControlClient(
            host,
            port,
            secret=self.config.secret,
            timeout=timeout,
            max_frame=self.config.control.max_frame,
            tls=self.tls,
            idle_s=self.config.client_idle_s,
        )

    @property
    def port(self) -> int:
        """This rank's control port: the configured port plus the rank's offset."""
        return self.config.port + self.identity.port_offset

    @property
    def layout(self) -> KVLayout:
        return self.hello.layout
