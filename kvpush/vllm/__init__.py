"""The vLLM adapter: `KvpushConnector`, loaded out of tree by vLLM.

    "kv_connector": "KvpushConnector"

vLLM finds the name through kvpush's plugin (`kvpush.vllm.plugin`, an entry point in
`vllm.general_plugins`); `"kv_connector_module_path": "kvpush.vllm"` works as well. Either
way vLLM takes the class from this module, and the first access checks the environment
(`kvpush.vllm.preflight`: a supported vLLM, an importable NIXL) before importing it. The
connector is imported on first access, so the adapter's light modules (config, layout) can
be used without importing vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvpushConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvpushConnector":
        from kvpush.vllm.preflight import preflight

        preflight()
        from kvpush.vllm.connector import KvpushConnector

        return KvpushConnector
    raise AttributeError(f"module 'kvpush.vllm' has no attribute {name!r}")
