"""The direct hand-off of a finished prefill (`kvpush.node.direct`), over real Unix sockets."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.node import direct
from kvpush.node.direct import (
    DirectReceiver,
    DirectSender,
    FirstCopies,
    pack,
    private_dir,
    unpack,
)
from kvpush.node.specs import SendSpec

SPEC = SendSpec("t1", "req-1", (5, 6, 700_000), 300, sampled=4242, finished_at=12.5)


def test_a_spec_crosses_as_one_datagram_and_comes_out_marked_direct() -> None:
    got = unpack(pack("prefill-0", SPEC), "prefill-0")
    assert got == SendSpec("t1", "req-1", (5, 6, 700_000), 300, 4242, 12.5, direct=True)
    assert unpack(pack("e", SendSpec("t", "r", (1,), 1)), "e").sampled == -1  # no token


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (pack("prefill-1", SPEC), "from engine 'prefill-1'"),
        (b"\x02" + pack("prefill-0", SPEC)[1:], "version 2"),
        (pack("prefill-0", SPEC)[:-3], "truncated"),
        (pack("prefill-0", SPEC)[:10], "shorter than a header"),
        (pack("prefill-0", SendSpec("t1", "req-1", (), 0)), "no request or no blocks"),
        (pack("prefill-0", SendSpec("t1", "", (1,), 0)), "no request or no blocks"),
    ],
)
def test_a_datagram_not_from_this_engines_scheduler_is_refused_with_why(
    data: bytes, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        unpack(data, "prefill-0")


@pytest.fixture
def tmp_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temp directory of the test's own, short (a socket's path is at most 107 bytes)."""
    short = Path(f"/tmp/kvpush-test-{os.getpid()}-{time.monotonic_ns() % 10**6}")
    short.mkdir(mode=0o700)
    monkeypatch.setattr(direct.tempfile, "gettempdir", lambda: str(short))
    yield short
    for path in sorted(short.rglob("*"), reverse=True):
        path.unlink() if not path.is_dir() else path.rmdir()
    short.rmdir()


def test_the_sockets_directory_must_be_this_users_alone(tmp_sockets: Path) -> None:
    path, why = private_dir()
    assert path == tmp_sockets / f"kvpush-{os.getuid()}" and not why
    assert path.stat().st_mode & 0o777 == 0o700
    path.chmod(0o755)
    assert private_dir() == (None, f"{path} is open to other users (mode 0o755)")
    path.rmdir()
    path.write_text("not a directory")
    assert private_dir()[0] is None


class Inbox:
    def __init__(self) -> None:
        self.specs: list[SendSpec] = []
        self.rejected: list[str] = []

    def wait(self, n: int, timeout: float = 5.0) -> None:
        started = time.monotonic()
        while len(self.specs) + len(self.rejected) < n:
            assert time.monotonic() - started < timeout, "timed out"
            time.sleep(0.001)


@pytest.fixture
def receiver(tmp_sockets: Path) -> Iterator[tuple[DirectReceiver, Inbox]]:
    inbox = Inbox()
    got = DirectReceiver.open(
        "prefill-0", "127.0.0.1", 5600, lambda s, at: inbox.specs.append(s), inbox.rejected.append
    )
    assert got is not None
    yield got, inbox
    got.stop()


def test_the_scheduler_reaches_each_rank_and_the_worker_takes_only_its_engines(
    receiver: tuple[DirectReceiver, Inbox],
) -> None:
    rx, inbox = receiver
    assert oct(os.stat(rx.path).st_mode & 0o777) == "0o600"
    # two ranks: 5600 listens, 5601 has no socket (a rank on another host)
    sender = DirectSender.open("prefill-0", "127.0.0.1", [5600, 5601])
    assert sender is not None
    assert sender.send(SPEC) == 1 and (sender.sent, sender.failed) == (1, 1)
    inbox.wait(1)
    assert inbox.specs == [unpack(pack("prefill-0", SPEC), "prefill-0")]
    # another engine's scheduler sending to this socket (same path, by hand)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other:
        other.sendto(pack("prefill-9", SPEC), rx.path)
    inbox.wait(2)
    assert inbox.rejected == ["bad_direct_handoff"] and len(inbox.specs) == 1
    sender.close()


def test_a_stopped_worker_leaves_no_socket_and_the_scheduler_carries_on(
    receiver: tuple[DirectReceiver, Inbox],
) -> None:
    rx, _ = receiver
    sender = DirectSender.open("prefill-0", "127.0.0.1", [5600])
    assert sender is not None
    rx.stop()
    assert not rx.is_alive() and not os.path.exists(rx.path)
    assert sender.send(SPEC) == 0  # refused at once, never blocks


def test_a_live_socket_is_never_taken_over_and_a_dead_ones_file_is(
    receiver: tuple[DirectReceiver, Inbox],
) -> None:
    rx, _ = receiver
    assert DirectReceiver.open("prefill-0", "127.0.0.1", 5600, print, print) is None
    # a dead process's socket file: bound once, closed without unlinking
    directory, _ = private_dir()
    assert directory is not None
    stale = direct.socket_path(directory, "prefill-0", "127.0.0.1", 5700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as dead:
        dead.bind(stale)
    inbox = Inbox()
    again = DirectReceiver.open(
        "prefill-0", "127.0.0.1", 5700, lambda s, at: inbox.specs.append(s), print
    )
    assert again is not None
    try:
        sender = DirectSender.open("prefill-0", "127.0.0.1", [5700])
        assert sender is not None and sender.send(SPEC) == 1
        inbox.wait(1)
    finally:
        again.stop()


def test_of_two_copies_the_first_goes_on_and_one_that_never_gets_its_twin_is_forgotten() -> None:
    copies = FirstCopies(keep_s=10.0)

    def spec(request_id: str, finished_at: float = 5.0) -> SendSpec:
        return SendSpec("t", request_id, (1,), 1, finished_at=finished_at)

    assert copies.first(spec("a"), 0.0) and not copies.first(spec("a"), 0.001)  # twins
    assert copies.first(spec("b"), 1.0) and copies.first(spec("c"), 2.0) and len(copies) == 2
    # a client reusing a request id: another finish time, another prefill
    assert copies.first(spec("c", 6.0), 2.5) and len(copies) == 3
    assert copies.first(spec("d"), 11.5) and len(copies) == 3  # b's twin never came: gone
    assert not copies.first(spec("c"), 11.6) and len(copies) == 2
