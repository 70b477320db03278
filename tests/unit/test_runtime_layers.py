"""The runtime's layers, read from the imports: vllm -> node -> dataplane -> core.

`kvpush.core` is pure (wire protocol, state machines, planning); `kvpush.dataplane` moves
bytes and frames; `kvpush.node` is one TP rank's kvpush without vLLM; `kvpush.vllm` is the
only adapter to vLLM. Each layer imports only the ones below it, none imports a tool
(proxy, bench, plan, testbed, cli), and no two runtime files import each other in a circle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvpush

ROOT = Path(kvpush.__file__).parent
LAYERS = ("core", "dataplane", "node", "vllm")  # lowest first
TOOLS = ("proxy", "bench", "plan", "testbed", "cli", "args", "report", "extras")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of the file (lazy imports count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def runtime_files() -> dict[str, set[str]]:
    return {
        module_name(path): imports(path)
        for layer in LAYERS
        for path in sorted((ROOT / layer).rglob("*.py"))
    }


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "kvpush" else None


def test_each_layer_imports_only_the_layers_below_it() -> None:
    problems = []
    for module, names in runtime_files().items():
        own = LAYERS.index(layer_of(module) or "")
        for name in names:
            target = layer_of(name)
            if target in TOOLS:
                problems.append(f"{module} imports the tool {name}")
            elif target in LAYERS and LAYERS.index(target) > own:
                problems.append(f"{module} imports {name}, a layer above it")
    assert problems == []


def test_nothing_below_the_adapter_imports_vllm_or_torch() -> None:
    problems = [
        f"{module} imports {name}"
        for module, names in runtime_files().items()
        if layer_of(module) != "vllm"
        for name in names
        if name.split(".")[0] in ("vllm", "torch")
    ]
    assert problems == []


def test_no_import_circle_between_runtime_files() -> None:
    files = runtime_files()
    graph = {
        module: {n for n in names if n in files and n != module} for module, names in files.items()
    }
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join([*path, module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_node_runs_where_vllm_cannot_be_imported() -> None:
    """What the worker-pair tests rely on: every node module imports with vLLM blocked."""
    modules = [m for m in runtime_files() if layer_of(m) in ("core", "dataplane", "node")]
    program = (
        "import sys, importlib\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'vllm':\n"
        "            raise ImportError('vLLM is blocked here')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
