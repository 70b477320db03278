"""One end of a NIXL WRITE bandwidth measurement, run as its own process (possibly inside
a network namespace, `ip netns exec NS python -m tests.integration.nixl_peer ROLE`).

Lines of JSON on stdin and stdout, one per step, so the two ends can sit in different
namespaces while the test process in the middle relays what they exchange:

  target     MIB [idle|full]: registers MIB MiB (4 regions; "full": of a byte pattern, else
             zeros), prints {"metadata", "regions"};
             then answers each "digest" line with the SHA-256 of its memory, each "cut IP"
             line by cutting the connections from IP as kvpush's decode does
             (`NixlTransport.cut_connections_from`, printing {"cut": how many}), and exits
             at "exit"; meanwhile it progresses its NIXL agent as kvpush's targets do
             (`kvpush.node.progress`), which UCX's TCP transport needs ("idle": it does not)
  initiator  MIB REPEAT TIMEOUT: registers MIB MiB of a byte pattern, reads the target's
             line, loads the target and WRITEs its whole memory (4 pieces) REPEAT times,
             timing each; prints {"seconds": [...], "bytes", "digest"} (the digest of what
             it wrote), or {"error"} when a WRITE did not complete within TIMEOUT seconds
  canceller  MIB: as the initiator, but posts one WRITE of its whole memory, prints
             {"posted"}, and at the next line releases (cancels) it, printing
             {"released": NIXL accepted the release, "done": it had completed}; then each
             "write" line WRITEs the whole memory again and prints {"written": true} or
             {"error": kind}, loading the target again first after a disconnection
  reader     MIB: as the canceller, but READs the target's whole memory into its own
             (zeros) and answers "release", then "digest" (of its own memory) and
             "progress" (calls into NIXL for 2 s, as kvpush's decode does while it polls
             other transfers) lines; "poll SECONDS" polls the READ, unreleased, for up to
             that long and prints {"ended": "done", an error kind, or null, "after_s"}
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

from kvpush.dataplane.transport import NixlTransport, Transfer, TransferError
from kvpush.node.progress import TargetProgress

REGIONS = 4


def _say(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _digest(regions: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for region in regions:
        h.update(region.tobytes())
    return h.hexdigest()


def target(mib: int, idle: bool, full: bool = False) -> None:
    fill = 7 if full else 0
    regions = [np.full(mib * 2**20 // REGIONS, fill, dtype=np.uint8) for _ in range(REGIONS)]
    with NixlTransport("bw-target") as transport:
        transport.register_regions([(r.ctypes.data, r.nbytes) for r in regions])
        _say(
            {
                "metadata": transport.metadata().hex(),
                "regions": [[r.ctypes.data, r.nbytes] for r in regions],
            }
        )
        progress = TargetProgress(transport.get_notifs, lambda: True, "bw-target-progress")
        progress.start()
        if not idle:
            progress.wake()
        try:
            for line in sys.stdin:
                words = line.split()
                if words[:1] == ["digest"]:
                    _say({"digest": _digest(regions)})
                elif words[:1] == ["cut"]:
                    _say({"cut": transport.cut_connections_from(words[1:])})
                else:
                    break
        finally:
            progress.stop()


def initiator(mib: int, repeat: int, timeout: float) -> None:
    rng = np.random.default_rng(7)
    regions = [rng.integers(0, 256, mib * 2**20 // REGIONS, dtype=np.uint8) for _ in range(4)]
    with NixlTransport("bw-initiator") as transport:
        transport.register_regions([(r.ctypes.data, r.nbytes) for r in regions])
        peer_info = json.loads(sys.stdin.readline())  # after the slow start: both start at once
        peer = transport.add_peer(bytes.fromhex(peer_info["metadata"]))
        local = [(r.ctypes.data, r.nbytes) for r in regions]
        remote = [(int(a), int(n)) for a, n in peer_info["regions"]]
        seconds = []
        for _ in range(repeat):
            started = time.perf_counter()
            with transport.write(peer, local, remote) as transfer:
                try:
                    transport.wait(transfer, timeout=timeout)
                except TransferError as exc:
                    _say({"error": str(exc)})
                    return
            seconds.append(time.perf_counter() - started)
        _say({"seconds": seconds, "bytes": sum(n for _, n in local), "digest": _digest(regions)})


def canceller(mib: int) -> None:
    regions = [np.full(mib * 2**20 // REGIONS, 7, dtype=np.uint8) for _ in range(REGIONS)]
    with NixlTransport("bw-canceller") as transport:
        transport.register_regions([(r.ctypes.data, r.nbytes) for r in regions])
        peer_info = json.loads(sys.stdin.readline())
        peer = transport.add_peer(bytes.fromhex(peer_info["metadata"]))
        local = [(r.ctypes.data, r.nbytes) for r in regions]
        remote = [(int(a), int(n)) for a, n in peer_info["regions"]]
        transfer = transport.write(peer, local, remote)
        _say({"posted": True})
        sys.stdin.readline()
        _release(transfer)
        for line in sys.stdin:
            if line.strip() != "write":
                break
            try:
                with transport.write(peer, local, remote) as again:
                    transport.wait(again, timeout=20.0)
                _say({"written": True})
            except TransferError as exc:
                if exc.kind == "remote_disconnect":  # as kvpush's writer: load it again
                    peer = transport.add_peer(bytes.fromhex(peer_info["metadata"]), name=peer)
                _say({"error": exc.kind})


def _release(transfer: Transfer) -> None:
    try:
        done = transfer.poll()
    except TransferError:
        done = False
    _say({"released": transfer.release(), "done": done})


def _until_ended(transfer: Transfer, seconds: float) -> dict[str, object]:
    """Poll `transfer`, unreleased, for up to `seconds`: how it ended and when, if it did."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        try:
            if transfer.poll():
                return {"ended": "done", "after_s": time.monotonic() - started}
        except TransferError as exc:
            return {"ended": exc.kind, "after_s": time.monotonic() - started, "error": str(exc)}
        time.sleep(0.05)
    return {"ended": None, "after_s": time.monotonic() - started}


def reader(mib: int) -> None:
    regions = [np.zeros(mib * 2**20 // REGIONS, dtype=np.uint8) for _ in range(REGIONS)]
    with NixlTransport("bw-reader") as transport:
        transport.register_regions([(r.ctypes.data, r.nbytes) for r in regions])
        peer_info = json.loads(sys.stdin.readline())
        peer = transport.add_peer(bytes.fromhex(peer_info["metadata"]))
        local = [(r.ctypes.data, r.nbytes) for r in regions]
        remote = [(int(a), int(n)) for a, n in peer_info["regions"]]
        transfer = transport.read(peer, remote, local)
        _say({"posted": True})
        for line in sys.stdin:
            words = line.split()
            if words[:1] == ["release"]:
                _release(transfer)
            elif words[:1] == ["digest"]:
                _say({"digest": _digest(regions)})
            elif words[:1] == ["poll"]:
                _say(_until_ended(transfer, float(words[1])))
            elif words[:1] == ["progress"]:
                until = time.monotonic() + 2.0
                while time.monotonic() < until:
                    transport.get_notifs()
                    time.sleep(0.01)
                _say({"progressed": True})
            else:
                break


def main(argv: list[str]) -> None:
    role, mib = argv[0], int(argv[1])
    if role == "target":
        target(mib, idle=argv[2:] == ["idle"], full=argv[2:] == ["full"])
    elif role == "canceller":
        canceller(mib)
    elif role == "reader":
        reader(mib)
    else:
        initiator(mib, int(argv[2]), float(argv[3]))


if __name__ == "__main__":
    main(sys.argv[1:])
