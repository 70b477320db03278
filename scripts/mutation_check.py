"""The suite must prove the guards it relies on: break each one, expect tests to fail.

Each mutation removes or weakens one guard of kvpush's failure and security rules in a
copy of the repository (never in this checkout), runs the tests that should notice, and
passes only if they fail. A mutation the tests survive is a guard nothing checks.

    python scripts/mutation_check.py            # every mutation
    python scripts/mutation_check.py --list     # what they are
    python scripts/mutation_check.py fast-path  # the ones whose name contains this

Run by tests/unit/test_mutations.py in `make test`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


NODE_PARTS = "tests/unit/test_node_parts.py"
MUTATIONS = (
    Mutation(
        "negative-block-ids",  # a negative id addresses the previous region's memory
        "kvpush/core/planning.py",
        "min(block_ids) >= 0 and max(block_ids) < limit",
        "max(block_ids) < limit",
        ("tests/unit/test_planning.py",),
    ),
    Mutation(
        "fast-path-skips-the-block-check",
        "kvpush/node/peers.py",
        "planning.check_block_ids(f\"the {_side(op, key)} side's\", layout, used[key])",
        "pass",
        (NODE_PARTS,),
    ),
    Mutation(
        "stage-region-moves-every-group",  # a stage's region of one group's layer: garbage
        "kvpush/core/planning.py",
        "if not (partial(src) or partial(dst)):",
        "if True:",
        ("tests/unit/test_planning.py",),
    ),
    Mutation(
        "state-from-the-last-block-not-the-last-token",  # decode reads the last token's block
        "kvpush/core/planning.py",
        "s_at, d_at = last // src.block_tokens - s_first, last // dst.block_tokens - d_first",
        "s_at, d_at = len(s) - 1, len(d) - 1",
        ("tests/unit/test_kv_layouts.py",),
    ),
    Mutation(
        "prefill-computes-the-whole-prompt-of-a-state-model",  # decode adds the last twice
        "kvpush/vllm/scheduler.py",
        "            if self.states:\n                _without_last_token(request)",
        "            pass",
        ("tests/unit/test_vllm_adapter.py",),
    ),
    Mutation(
        "window-copied-from-blocks-the-source-freed",  # would copy the null block's bytes
        "kvpush/core/planning.py",
        "if held > start:",
        "if False:",
        ("tests/unit/test_kv_layouts.py",),
    ),
    Mutation(
        "write-after-the-registration-deadline",  # decode's fence relies on this check
        "kvpush/node/push.py",
        "if time.monotonic() > start.deadline:",
        "if False:",
        (NODE_PARTS,),
    ),
    Mutation(
        "registration-deadline-uncapped",
        "kvpush/core/rendezvous.py",
        "return min(reg.deadline_ms / 1000, self.max_wait_s)",
        "return reg.deadline_ms / 1000",
        ("tests/unit/test_rendezvous.py",),
    ),
    Mutation(
        "waiting-registrations-uncapped",
        "kvpush/core/rendezvous.py",
        "if len(self._waiting) >= self.max_waiting:",
        "if False:",
        ("tests/unit/test_rendezvous.py",),
    ),
    Mutation(
        "registration-not-bound-to-its-connection",
        "kvpush/node/worker.py",
        "if problem or hello is None:",
        "if hello is None:",
        (NODE_PARTS,),
    ),
    Mutation(
        "closed-connection-voids-nothing",
        "kvpush/node/push.py",
        "self.act(self.rendezvous.cancel(transfer_id, generation, why, now))",
        "pass",
        (NODE_PARTS,),
    ),
    Mutation(
        "cancel-acknowledged-where-the-message-says",
        "kvpush/node/worker.py",
        "ack = (hello.host, hello.port) if hello is not None and msg.ack_port else (\"\", 0)",
        "ack = (msg.ack_host, msg.ack_port)",
        (NODE_PARTS,),
    ),
    Mutation(
        "pull-confirms-what-it-never-leased",
        "kvpush/node/pull.py",
        'if verdict == "not_yet":\n            return Wait(msg.transfer_id, msg.generation)',
        'if verdict == "not_yet":\n            return msg',
        (NODE_PARTS,),
    ),
    Mutation(
        "decode-reads-from-any-engine",
        "kvpush/node/receiver.py",
        "if spec.remote_engine_id and peer.hello.engine_id != spec.remote_engine_id:",
        "if False:",
        (NODE_PARTS,),
    ),
    Mutation(
        "starts-without-a-secret",  # fail closed: no secret and no `insecure: true`
        "kvpush/node/config.py",
        "if secret is None and not insecure and require_secret:",
        "if False:",
        ("tests/unit/test_config_security.py",),
    ),
    Mutation(
        "greeting-never-times-out",  # a silent connection would hold its slot forever
        "kvpush/dataplane/control.py",
        "if conn.deadline > now:",
        "if True:",
        ("tests/unit/test_control_bounds.py",),
    ),
    Mutation(
        "client-proof-unchecked",  # anyone could talk without the secret
        "kvpush/dataplane/control.py",
        """            if not hmac.compare_digest(
                theirs, proof(self.secret, "client", conn.nonce, conn.peer_nonce)
            ):""",
        """            if False:""",
        ("tests/unit/test_control.py", "tests/unit/test_control_bounds.py"),
    ),
)


def timed_run(mutation: Mutation) -> tuple[bool, str, float]:
    started = time.monotonic()
    caught, last = run(mutation, sys.executable)
    return caught, last, time.monotonic() - started


def run(mutation: Mutation, python: str) -> tuple[bool, str]:
    """(caught, what happened) for `mutation` applied to a fresh copy of the repository."""
    with tempfile.TemporaryDirectory(prefix="kvpush-mutation-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT / "kvpush", copy / "kvpush")
        shutil.copytree(ROOT / "tests", copy / "tests", ignore=shutil.ignore_patterns("data"))
        shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
        target = copy / mutation.file
        source = target.read_text()
        if source.count(mutation.old) != 1:
            return False, f"{mutation.file} no longer holds the guarded code exactly once"
        target.write_text(source.replace(mutation.old, mutation.new))
        result = subprocess.run(
            [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutation.tests],
            cwd=copy,
            capture_output=True,
            text=True,
            timeout=600,
        )
    last = (result.stdout.strip().splitlines() or [""])[-1]
    return result.returncode != 0, last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only mutations whose name contains one")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or any(n in m.name for n in args.names)]
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:45} {m.file}")
        return 0
    survived = []
    # each mutation is its own copy and pytest process: one per core at a time
    workers = max(1, min(len(chosen), len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for mutation, (caught, last, took) in zip(
            chosen, pool.map(timed_run, chosen), strict=True
        ):
            mark = "caught  " if caught else "SURVIVED"
            print(f"{mark} {mutation.name:45} {took:5.1f} s  {last}", flush=True)
            if not caught:
                survived.append(mutation.name)
    if survived:
        print(f"{len(survived)} guard(s) no test checks: {', '.join(survived)}", file=sys.stderr)
        return 1
    print(f"all {len(chosen)} mutations caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
