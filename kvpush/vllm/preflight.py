"""What the connector needs from the environment, checked when vLLM resolves its class.

kvpush does not install vLLM, torch or NIXL (their builds are CUDA- or CPU-specific; a vLLM
environment brings its own), so the first thing the connector does is check them, in each
process that builds it: a vLLM in the supported range (stated here and only here), and an
importable NIXL. Each failure is one line that says what to do.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

# vLLM's connector API is internal and changes between minor releases; kvpush is tested on
# 0.32.0 and supports the 0.32 series.
VLLM_LOWEST = (0, 32, 0)
VLLM_BELOW = (0, 33, 0)
SUPPORTED_VLLM = f">={'.'.join(map(str, VLLM_LOWEST))},<{'.'.join(map(str, VLLM_BELOW))}"
ALLOW_ENV = "KVPUSH_ALLOW_UNSUPPORTED_VLLM"


class EnvironmentProblem(RuntimeError):
    """The environment cannot run the connector; the message (one line) says why and what to do."""


def release(version: str) -> tuple[int, ...] | None:
    """The release numbers of a version string ("0.32.1.dev3+g12ab.cpu" -> (0, 32, 1))."""
    match = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    if match is None:
        return None
    numbers = tuple(int(part) for part in match.group(1).split("."))
    return numbers + (0,) * (3 - len(numbers))


def check_vllm(version: str, env: Mapping[str, str] = os.environ) -> None:
    """Refuse a vLLM outside `SUPPORTED_VLLM`, unless `ALLOW_ENV` is set (then warn loudly)."""
    numbers = release(version)
    if numbers is not None and VLLM_LOWEST <= numbers < VLLM_BELOW:
        return
    if env.get(ALLOW_ENV, "") not in ("", "0"):
        log.warning(
            "!!! kvpush: running on UNSUPPORTED vLLM %s (supported: %s) because %s is set; "
            "the connector may fail or misbehave in ways no test has seen !!!",
            version,
            SUPPORTED_VLLM,
            ALLOW_ENV,
        )
        return
    raise EnvironmentProblem(
        f"kvpush supports vLLM {SUPPORTED_VLLM}, but this is vLLM {version}: install a "
        f"supported vLLM, or set {ALLOW_ENV}=1 to try anyway"
    )


def check_nixl(import_module: Callable[[str], object] = importlib.import_module) -> None:
    """Refuse to start without an importable NIXL (the `nixl` package and a backend wheel)."""
    try:
        import_module("nixl._api")
    except (ImportError, OSError) as exc:
        cause = " ".join(str(exc).split()) or type(exc).__name__
        raise EnvironmentProblem(
            f"kvpush's connector needs NIXL, which is not importable here ({cause}): "
            "pip install nixl"
        ) from exc


@functools.cache
def preflight() -> None:
    """Both checks, once per process (a failed check runs again on the next call)."""
    import vllm

    check_vllm(str(getattr(vllm, "__version__", "unknown")))
    check_nixl()
