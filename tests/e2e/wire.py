"""What crosses a link: every TCP payload through some interfaces, per connection direction.

A raw packet socket (root) on each of the given interfaces; a thread reads IPv4/TCP
frames and appends each new payload byte to its flow, (source, source port, destination,
destination port), skipping what was seen before (retransmissions, and the same packet
seen on two interfaces of one bridge). Enough to ask "did this string cross, and in which
direction", not a general TCP reassembler: on a local bridge segments arrive in order.
A busy host can still drop frames before the thread reads them (the socket's buffer
fills): the stream then goes on past the hole, and `sizes` counts the bytes each flow
carried by TCP's sequence numbers, holes included.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
SO_RCVBUFFORCE = 33  # Linux; Python's socket module does not name it
KEEP = 16 << 20  # bytes kept per flow (KV moves by UCX in flows of their own)

Flow = tuple[str, int, str, int]  # source, source port, destination, destination port


@dataclass
class _Stream:
    data: bytearray = field(default_factory=bytearray)
    end: int | None = None  # sequence number after the last byte appended
    seen: int = 0  # payload bytes taken (data keeps the first KEEP of them)
    missed: int = 0  # bytes of the flow in frames the capture never saw


class Capture(threading.Thread):
    """Capture TCP payloads on `interfaces` until `stop`; a context manager."""

    def __init__(self, interfaces: Iterable[str]) -> None:
        super().__init__(name="capture", daemon=True)
        self.socks = []
        for name in interfaces:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            sock.bind((name, 0))
            try:  # root may go past net.core.rmem_max
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
            self.socks.append(sock)
        self._streams: dict[Flow, _Stream] = {}
        self._lock = threading.Lock()
        self._stopping = False

    def __enter__(self) -> Capture:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopping = True
        self.join(timeout=5)
        for sock in self.socks:
            sock.close()

    def run(self) -> None:
        while not self._stopping:
            ready, _, _ = select.select(self.socks, [], [], 0.2)
            for sock in ready:
                try:
                    frame = sock.recv(1 << 18)
                except OSError:
                    continue
                self._take(frame)

    def _take(self, frame: bytes) -> None:
        if len(frame) < 34 or struct.unpack("!H", frame[12:14])[0] != ETH_P_IP:
            return
        ip = frame[14:]
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack("!H", ip[2:4])[0]
        if ip[9] != socket.IPPROTO_TCP:
            return
        src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
        tcp = ip[ihl:total]
        sport, dport, seq = struct.unpack("!HHI", tcp[:8])
        payload = tcp[(tcp[12] >> 4) * 4 :]
        if not payload:
            return
        with self._lock:
            stream = self._streams.setdefault((src, sport, dst, dport), _Stream())
            if stream.end is not None:
                ahead = (seq - stream.end) % 2**32
                if ahead < 2**31:  # at the end, or past it: frames in between were missed
                    stream.missed += ahead
                else:  # starts before the end: a retransmission, or the same frame again
                    new = (seq + len(payload) - stream.end) % 2**32
                    if new == 0 or new >= 2**31 or new > len(payload):
                        return
                    payload = payload[len(payload) - new :]
                    seq = stream.end
            stream.end = (seq + len(payload)) % 2**32
            if len(stream.data) < KEEP:
                stream.data += payload[: KEEP - len(stream.data)]
            stream.seen += len(payload)

    def flows(self) -> dict[Flow, bytes]:
        with self._lock:
            return {flow: bytes(s.data) for flow, s in self._streams.items()}

    def sizes(self) -> dict[Flow, int]:
        """Bytes each flow carried so far, by sequence number (frames missed included)."""
        with self._lock:
            return {flow: s.seen + s.missed for flow, s in self._streams.items()}

    def between(self, ports: Iterable[int]) -> dict[Flow, bytes]:
        """The flows with one of `ports` at either end."""
        wanted = set(ports)
        return {f: data for f, data in self.flows().items() if {f[1], f[3]} & wanted}
