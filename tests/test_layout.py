"""The layout's rules: no import cycle, the core never imports the CLI, no private name
crosses a module boundary, no module over 400 lines."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "leantrain"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node, what sits under ``if TYPE_CHECKING:`` included: an import cycle hidden
    from the interpreter is still one module needing the other."""
    for node in ast.iter_child_nodes(tree):
        yield node
        yield from _runtime_nodes(node)


def _imports(path: Path):
    """(imported module, imported names) for every import in the file, any depth."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for target, names in _imports(path):
            if not target.startswith("leantrain"):
                continue
            for name in names:  # `from pkg import submodule` depends on the submodule
                if f"{target}.{name}" in MODULES:
                    graph[mod].add(f"{target}.{name}")
            if target in MODULES and not (path.name == "__init__.py" and target == mod):
                graph[mod].add(target)
    return graph


def test_no_import_cycle():
    graph = _graph()
    graph.pop("leantrain")  # the top-level package re-exports; nothing imports it back
    for g in graph.values():
        g.discard("leantrain")
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if n.endswith("__init__") or n not in graph:
                continue
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_core_never_imports_the_cli():
    for mod, path in MODULES.items():
        if mod.startswith("leantrain.cli") or mod == "leantrain.__main__":
            continue
        for target, _ in _imports(path):
            assert not target.startswith("leantrain.cli"), f"{mod} imports {target}"


def test_no_private_name_crosses_a_module():
    for mod, path in MODULES.items():
        for target, names in _imports(path):
            if target.startswith("leantrain"):
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                assert not private, f"{mod} imports {private} from {target}"


def test_no_module_over_400_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
