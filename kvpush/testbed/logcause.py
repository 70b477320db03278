"""Why a vLLM server died, in one line, from its log: what `kvpush up` and the benchmarks
print when a server exits or its engine is gone."""

from __future__ import annotations

import re

_ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")
# an exception kvpush raised to explain itself: a class of kvpush's, or a message of its own
_KVPUSH_CLASS = re.compile(r"\bkvpush(?:\.\w+)*\.([A-Z]\w*): (.+)$")
_FATAL = re.compile(r"Fatal Python error: (.+)$")
_FRAME = re.compile(r'File "(?:.*/site-packages/)?([^"]+)", line (\d+) in (\S+)')
_WORKER_DIED = re.compile(r"Worker proc \S+ died unexpectedly.*$")
# what in a log says a server's engine is gone (kvpush.bench.compare.trouble)
FATAL_SIGNS = ("Fatal Python error", "died unexpectedly", "EngineCore encountered a fatal")


def root_cause(log: str) -> str:
    """The line of a server log that most likely says why it died.

    A process killed by a signal first: the testbed runs servers with Python's fault
    handler, which names the signal and the crashing thread's stack (quoted: its innermost
    frame outside torch). Then kvpush's own explanation, an exception raised by kvpush's
    code (an unsupported model, a bad setting), which also kills the worker. Then vLLM's
    line saying its worker died; then the first exception message outside warnings
    (vLLM logs the root cause before the errors it causes); else the last line mentioning
    an error (argparse's "error: ..."); else the last line.
    """
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        fatal = _FATAL.search(line)
        if fatal is None:
            continue
        after = lines[i + 1 :]
        start = next((j for j, x in enumerate(after) if x.startswith("Current thread")), 0)
        frames = [m for x in after[start:] if (m := _FRAME.search(x))]
        # the innermost frame outside torch's dispatch: the op that was called
        frame = next((m for m in frames if not m.group(1).startswith("torch/")), None)
        frame = frame or (frames[0] if frames else None)
        where = f" in {frame.group(1)} line {frame.group(2)}, {frame.group(3)}" if frame else ""
        return f"Fatal Python error: {fatal.group(1)}{where}"[:300]
    for line in lines:
        if " WARNING " in line:
            continue
        own = _KVPUSH_CLASS.search(line) or _ERROR_LINE.search(line)
        if own and (own.re is _KVPUSH_CLASS or own.group(2).startswith("kvpush ")):
            return f"{own.group(1)}: {own.group(2)}"[:1000]  # written to be read whole
    for line in lines:
        died = _WORKER_DIED.search(line)
        if died:
            return died.group(0)[:300]
    for line in lines:
        match = _ERROR_LINE.search(line)
        if match and " WARNING " not in line:
            return f"{match.group(1)}: {match.group(2)}"[:300]
    for line in reversed(lines):
        if "error" in line.lower():
            return line[:300]
    return lines[-1][:300] if lines else "(empty log)"
