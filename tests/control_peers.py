"""Helpers for control-channel tests: a recording handler and hand-made socket clients."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.core.protocol import Hello, LeaseRenew, Message, ReadDone
from kvpush.dataplane.control import Peer


class Recorder:
    """Answers LeaseRenew with ReadDone (and a Hello with `hello`, if given), records
    everything and answers nothing else. A LeaseRenew for transfer "boom" raises."""

    def __init__(self, hello: Hello | None = None) -> None:
        self.hello = hello
        self.received: list[tuple[Message, Peer]] = []
        self.arrived = threading.Event()

    @property
    def messages(self) -> list[Message]:
        return [msg for msg, _ in self.received]

    def __call__(self, msg: Message, peer: Peer) -> Message | None:
        self.received.append((msg, peer))
        self.arrived.set()
        if isinstance(msg, LeaseRenew):
            if msg.transfer_id == "boom":
                raise RuntimeError("handler bug")
            return ReadDone(msg.transfer_id, msg.generation, 0, 1, True, "")
        if isinstance(msg, Hello):
            return self.hello
        return None


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def read_until_closed(sock: socket.socket, timeout: float = 2.0) -> bytes:
    """Everything until the server closes. A server closing with unread bytes makes the
    kernel reset the connection; that counts as closed too."""
    sock.settimeout(timeout)
    received = b""
    with sock:
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass
    return received


def wait_for(done: Callable[[], bool], timeout: float = 3.0) -> float:
    """Poll `done` until true; returns the seconds it took."""
    started = time.monotonic()
    while not done():
        assert time.monotonic() - started < timeout, "timed out"
        time.sleep(0.005)
    return time.monotonic() - started


@dataclass
class Files:
    """PEM files of one node: its certificate and key, and the CA that signed it."""

    cert: str
    key: str
    ca: str


def issue(folder: Path, ca_name: str, node_name: str) -> Files:
    """A new CA (EC P-256) and one node certificate it signed, valid for a day, written to
    `folder`. Needs `cryptography`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def cert(subject: str, key: Any, issuer: str, signer: Any, ca: bool) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    node_key = ec.generate_private_key(ec.SECP256R1())
    node, ca = folder / node_name, folder / ca_name
    files = Files(f"{node}.crt", f"{node}.key", f"{ca}.crt")
    pem = serialization.Encoding.PEM
    Path(files.ca).write_bytes(cert(ca_name, ca_key, ca_name, ca_key, True).public_bytes(pem))
    Path(files.cert).write_bytes(
        cert(node_name, node_key, ca_name, ca_key, False).public_bytes(pem)
    )
    Path(files.key).write_bytes(
        node_key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return files
