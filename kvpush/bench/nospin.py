"""vLLM's own NIXL connectors with NIXL's progress thread kept from spinning.

NIXL's Python agent starts a progress thread and hard-codes its delay between polls to 0,
so every vLLM server using NixlConnector or NixlPushConnector loses a whole core to that
thread, idle or not (measured: one core at 100% per server). On a 2-core machine it
shares a core with the model, so a comparison against vLLM as shipped mixes two effects:
the connector's design and the spin. This module removes the second without editing vLLM
or NIXL: load vLLM's connector from here,
    "kv_connector": "NixlConnector", "kv_connector_module_path": "kvpush.bench.nospin"
and every NIXL agent created in that process keeps its progress thread but lets it sleep
DELAY_US microseconds between polls (NIXL's own `pthrDelay` setting, which the Python API
does not expose). The thread still drives UCX, so vLLM's connectors work as designed; each
progress step may just come up to DELAY_US later. Switching the thread off instead is not
an option: vLLM's push connector then never completes a transfer.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_CONNECTORS = ("NixlConnector", "NixlPushConnector")
DELAY_US = int(os.environ.get("KVPUSH_NOSPIN_DELAY_US", "100"))


class _PacedBinding:
    """NIXL's compiled binding module, except that agents get a progress-thread delay."""

    def __init__(self, binding: Any, delay_us: int) -> None:
        self._binding, self._delay_us = binding, delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._binding, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - NIXL's name
        config.pthrDelay = self._delay_us
        return self._binding.nixlAgent(name, config)


def install(delay_us: int = DELAY_US) -> Any:
    """Pace the progress thread of every NIXL agent vLLM creates in this process."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    agent_class = base_worker.NixlWrapper  # type: ignore[attr-defined]
    if agent_class is None:
        raise RuntimeError("NIXL is not importable here, so vLLM's NIXL connectors cannot run")
    api = sys.modules[agent_class.__module__]
    if not isinstance(api.nixlBind, _PacedBinding):
        api.nixlBind = _PacedBinding(api.nixlBind, delay_us)  # type: ignore[attr-defined]
    return api.nixlBind


def __getattr__(name: str) -> Any:
    if name in _CONNECTORS:
        install()
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        return KVConnectorFactory.get_connector_class_by_name(name)
    raise AttributeError(f"module 'kvpush.bench.nospin' has no attribute {name!r}")
