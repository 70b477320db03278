"""vLLM's own NIXL connectors with NIXL's progress thread kept from spinning.

NIXL's Python agent starts a progress thread that polls UCX with no delay, so every vLLM
server using NixlConnector or NixlPushConnector loses a whole core to it, idle or not
(../shared/ENVIRONMENT.md). On a 2-core machine that thread shares a core with the model, so
a comparison against vLLM as shipped mixes two effects: the connector's design and the
spin. This module removes the second without editing vLLM: load vLLM's connector from here
    "kv_connector": "NixlConnector", "kv_connector_module_path": "kvpush.bench.nospin"
and every NIXL agent vLLM's connector creates in that process gets the settings kvpush
itself uses: no progress thread, and the UCX backend with `ucx_error_handling_mode=none`,
so transfers progress from the initiator's own polling (vLLM's connectors poll their
transfers and notifications on every engine step). Everything else is vLLM's code.
"""

from __future__ import annotations

from typing import Any

_CONNECTORS = ("NixlConnector", "NixlPushConnector")


def install() -> type:
    """Make vLLM's NIXL connectors build quiet agents in this process; returns the class."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    current: type = base_worker.NixlWrapper  # type: ignore[attr-defined]
    if getattr(current, "kvpush_nospin", False):
        return current
    if current is None:
        raise RuntimeError("NIXL is not importable here, so vLLM's NIXL connectors cannot run")

    class QuietNixlAgent(current):  # type: ignore[misc]
        """A NIXL agent without the spinning progress thread."""

        kvpush_nospin = True

        def __init__(self, name: str, config: Any = None, *args: Any, **kwargs: Any) -> None:
            if config is None:
                from nixl._api import nixl_agent_config

                config = nixl_agent_config()
            config.enable_pthread = False
            super().__init__(name, config, *args, **kwargs)

        def create_backend(self, backend: str, params: dict[str, str] | None = None) -> Any:
            params = dict(params or {})
            if backend == "UCX":
                params.setdefault("ucx_error_handling_mode", "none")
            return super().create_backend(backend, params)

    base_worker.NixlWrapper = QuietNixlAgent  # type: ignore[attr-defined]
    return QuietNixlAgent


def __getattr__(name: str) -> Any:
    if name in _CONNECTORS:
        install()
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        return KVConnectorFactory.get_connector_class_by_name(name)
    raise AttributeError(f"module 'kvpush.bench.nospin' has no attribute {name!r}")
