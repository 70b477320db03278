"""kvpush's vLLM plugin: registers "KvpushConnector" with vLLM's connector factory.

Declared in pyproject.toml as the `kvpush` entry point of the `vllm.general_plugins` group;
vLLM calls `register` once in each of its processes (API server, engine core, workers), so
`--kv-transfer-config '{"kv_connector": "KvpushConnector", ...}'` finds the class with no
`kv_connector_module_path`. vLLM filters plugins by `VLLM_PLUGINS` when that is set: it
must then name `kvpush`.

vLLM calls a plugin without catching its errors, so a failure here would stop every vLLM
in the environment, including those not using kvpush: `register` only records a lazy
module path (nothing of the connector is imported) and logs instead of raising. The
environment checks run when the class is first resolved (`kvpush.vllm.preflight`).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

CONNECTOR = "KvpushConnector"
MODULE = "kvpush.vllm"


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as exc:
        log.warning("kvpush: %s not registered with vLLM: %s", CONNECTOR, exc)
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR, MODULE, CONNECTOR)
    except ValueError:
        # vLLM refuses a name registered before; vLLM loads plugins once per process, so
        # this is a second call (a test, or a host registering kvpush itself): keep the first.
        log.debug("kvpush: %s was already registered with vLLM", CONNECTOR)
