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
    allow_amx()
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


def allow_amx() -> bool:
    """Ask Linux for the AMX tile state in this process where the CPU has AMX; True if the
    process may use it afterwards.

    vLLM's CPU attention picks its AMX kernel whenever the CPU reports AMX tiles
    (Sapphire Rapids and later), but Linux grants a process the tile state only when it
    asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and the first tile instruction before that
    kills it with SIGILL. Something else usually asks first: oneDNN on its first AMX
    matmul, torch.compile's warm-up. With `--enforce-eager` (every kvpush benchmark and
    test) the attention kernel comes first and the model worker dies on its first request
    ("Worker proc VllmWorker-0 died unexpectedly"), with vLLM's connectors and without a
    connector alike. Asking here, in each of vLLM's processes, changes nothing where AMX
    is absent or already granted.
    """
    try:
        import torch

        if not torch.cpu._is_amx_tile_supported():
            return False
        granted = bool(torch.cpu._init_amx())
    except Exception as exc:  # never stop a vLLM over it: log, and let vLLM go on
        log.warning("kvpush: could not ask Linux for the AMX tile state: %s", exc)
        return False
    if not granted:
        log.warning(
            "kvpush: this CPU reports AMX but Linux refused this process the tile state; "
            "vLLM's CPU attention may die of an illegal instruction (SIGILL)"
        )
    return granted
