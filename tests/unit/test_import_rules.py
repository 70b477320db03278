"""Which part of kvpush may import which, checked on every module's imports (read with ast).

kvpush is layered, bottom up:
- the runtime, loaded into vLLM's processes: `kvpush.core` (pure), then `kvpush.dataplane`,
  then `kvpush.node`, then `kvpush.vllm`;
- the tools, above the runtime and never imported by it: `kvpush.proxy`, `kvpush.testbed`,
  `kvpush.bench`, `kvpush.plan`, and the entry point `kvpush.cli`;
- ground-level helpers every tool shares (`kvpush.args`, `kvpush.report`), which import
  nothing above them.
Every import counts, wherever it is written: at the top, inside a function (the tools
import heavy modules late) or under `if TYPE_CHECKING:`. Imports by name at run time
(`importlib.import_module`, a connector's module path) are not seen.

To add a rule, write a test over `MODULES` (module name -> the kvpush modules it imports).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

import kvpush

ROOT = Path(kvpush.__file__).parent
RUNTIME_LAYERS = ("kvpush.core", "kvpush.dataplane", "kvpush.node", "kvpush.vllm")  # bottom up
TOOLS = ("kvpush.proxy", "kvpush.testbed", "kvpush.bench", "kvpush.plan")
ENTRY = "kvpush.cli"
GROUND = ("kvpush", "kvpush.args", "kvpush.report")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def imported(name: str, path: Path) -> set[str]:
    """The kvpush modules `name` imports; `from package import module` counts as the
    module, `from module import name` as the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                whole = f"{base}.{alias.name}"
                found.add(whole if whole in FILES else base)
    return {m for m in found if m == "kvpush" or m.startswith("kvpush.")}


MODULES = {name: imported(name, path) for name, path in FILES.items()}


def within(module: str, prefixes: str | Iterable[str]) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else tuple(prefixes)
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def under(prefixes: str | Iterable[str]) -> list[str]:
    return [name for name in MODULES if within(name, prefixes)]


def tool_of(module: str) -> str | None:
    return next((tool for tool in TOOLS if within(module, tool)), None)


def registers_a_command(path: Path) -> bool:
    """A command-line module: it adds a subcommand (`register(subparsers)`)."""
    tree = ast.parse(path.read_text(), str(path))
    return any(isinstance(node, ast.FunctionDef) and node.name == "register" for node in tree.body)


COMMAND_MODULES = {name for name, path in FILES.items() if registers_a_command(path)} | {ENTRY}


def breaches(modules: Iterable[str], allowed: Callable[[str, str], bool]) -> list[str]:
    """'a imports b' for every import of `modules` that `allowed(importer, imported)` refuses."""
    return sorted(
        f"{name} imports {target}"
        for name in modules
        for target in MODULES[name]
        if not allowed(name, target)
    )


def test_the_rules_see_the_modules_they_speak_of() -> None:
    assert "kvpush.core.protocol" in MODULES and "kvpush.proxy.server" in MODULES
    assert "kvpush.core.protocol" in MODULES["kvpush.proxy.rewrite"]
    assert "kvpush.plan.model" in MODULES["kvpush.plan.cli"]
    assert {"kvpush.proxy.cli", "kvpush.bench.cli", "kvpush.testbed.up"} <= COMMAND_MODULES
    assert "kvpush.testbed.topology" not in COMMAND_MODULES


def test_core_imports_nothing_of_kvpush_but_core() -> None:
    assert breaches(under("kvpush.core"), lambda _, target: within(target, "kvpush.core")) == []


def test_the_runtime_imports_no_tool() -> None:
    """The tools run beside vLLM; nothing loaded into vLLM's processes may need them."""
    above = (*TOOLS, ENTRY)
    assert breaches(under(RUNTIME_LAYERS), lambda _, target: not within(target, above)) == []


def test_runtime_layers_import_only_their_own_and_lower_layers() -> None:
    def layer(module: str) -> int | None:
        return next((i for i, p in enumerate(RUNTIME_LAYERS) if within(module, p)), None)

    def downward(name: str, target: str) -> bool:
        mine, theirs = layer(name), layer(target)
        return theirs is None or mine is None or theirs <= mine

    assert breaches(under(RUNTIME_LAYERS), downward) == []


def test_ground_level_helpers_import_only_ground_level_modules() -> None:
    ground = [name for name in GROUND if name in MODULES]
    assert breaches(ground, lambda _, target: target in GROUND) == []


def test_no_tool_imports_another_tools_command_line() -> None:
    """Tools share code through modules below their command lines (e.g. kvpush.report,
    kvpush.testbed.topology), never through another tool's CLI module."""

    def allowed(name: str, target: str) -> bool:
        return target not in COMMAND_MODULES or tool_of(target) == tool_of(name)

    ground = [name for name in GROUND if name in MODULES]
    assert breaches([*under(TOOLS), *ground], allowed) == []


def cycles(modules: Iterable[str]) -> list[list[str]]:
    """The import cycles among `modules` (their strongly connected components), as sorted
    lists; a module importing itself is a cycle of one."""
    nodes = set(modules)
    graph = {name: sorted(MODULES[name] & nodes) for name in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return sorted(found)


def test_cycles_are_found() -> None:
    saved = {name: MODULES[name] for name in ("kvpush.proxy.balance", "kvpush.proxy.rewrite")}
    try:
        MODULES["kvpush.proxy.rewrite"] = {*saved["kvpush.proxy.rewrite"], "kvpush.proxy.balance"}
        assert ["kvpush.proxy.balance", "kvpush.proxy.rewrite"] in cycles(under("kvpush.proxy"))
    finally:
        MODULES.update(saved)


@pytest.mark.parametrize("package", ["kvpush.proxy", *RUNTIME_LAYERS])
def test_no_import_cycle_within(package: str) -> None:
    assert cycles(under(package)) == []


def test_no_import_cycle_across_the_runtime() -> None:
    assert cycles(under(RUNTIME_LAYERS)) == []


def third_party(path: Path) -> set[str]:
    """The top-level names of every module `path` imports outside kvpush."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found - {"kvpush"}


def test_only_the_vllm_adapter_imports_vllm_or_torch() -> None:
    """The node runs (and is tested) where vLLM is absent; only kvpush.vllm adapts it."""
    below = under(RUNTIME_LAYERS[:-1])
    assert [m for m in below if third_party(FILES[m]) & {"vllm", "torch"}] == []


def test_the_node_imports_where_vllm_cannot_be() -> None:
    """What the worker-pair tests rely on: every module below the adapter imports with
    vLLM blocked."""
    program = (
        "import sys, importlib\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'vllm':\n"
        "            raise ImportError('vLLM is blocked here')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for name in {under(RUNTIME_LAYERS[:-1])!r}:\n"
        "    importlib.import_module(name)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_proxys_parts_do_not_reach_back_to_the_server() -> None:
    """The server assembles the parts; the parts get what they need passed in."""
    parts = [m for m in under("kvpush.proxy") if m not in ("kvpush.proxy.server", *COMMAND_MODULES)]
    assert breaches(parts, lambda _, target: target != "kvpush.proxy.server") == []
