"""The shape of the code, as DESIGN.md states it: read from the source (imports at any depth,
lazy ones inside functions too), so a change that breaks it fails here.

- no import circle between the modules of megatron/;
- megatron/checkpointing imports neither megatron/training nor megatron/arguments, and
  nothing under megatron/ imports tools/;
- no sys.exit or fail() in the library packages (only entry points end the process);
- no function over 50 lines in megatron/, tools/ or tasks/;
- megatron/fused/__init__.py only re-exports.
"""
import ast
from pathlib import Path
from typing import Dict, List, Set

from tests.data_setup import ROOT

LIBRARY = ("model", "mpu", "checkpointing", "data", "optimizer", "pipeline", "distributed",
           "fused", "tokenizer", "config", "text_generation")
MAX_LINES = 50


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(*folders: str) -> Dict[str, ast.Module]:
    trees = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            trees[_module_name(path)] = ast.parse(path.read_text(), str(path))
    return trees


def _imported(tree: ast.Module, name: str, is_package: bool, known: Set[str]) -> Set[str]:
    """The modules of `known` that module `name` imports, at any depth of its code. `from
    P import X` names the module P.X when that is one, else P itself."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def _graph() -> Dict[str, Set[str]]:
    trees = _sources("megatron")
    known = set(trees)
    packages = {_module_name(p) for p in (ROOT / "megatron").rglob("__init__.py")}
    return {name: _imported(tree, name, name in packages, known) for name, tree in trees.items()}


def _circle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import circle of `graph` (a list of modules, first == last), or []."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return []

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return []


def test_no_import_circle_in_megatron():
    circle = _circle(_graph())
    assert not circle, "import circle: " + " -> ".join(circle)


def test_layers_point_down():
    graph = _graph()
    for name, imports in graph.items():
        if name.startswith("megatron.checkpointing"):
            upward = {m for m in imports
                      if m.startswith(("megatron.training", "megatron.arguments"))}
            assert not upward, f"{name} imports {sorted(upward)}"
    for name, tree in _sources("megatron").items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""]
                assert not any(n == "tools" or n.startswith("tools.") for n in names), \
                    f"{name} imports tools/"


def _calls(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                yield f"{func.value.id}.{func.attr}", node.lineno
            elif isinstance(func, ast.Name):
                yield func.id, node.lineno


def test_library_packages_never_end_the_process():
    for name, tree in _sources(*(f"megatron/{p}" for p in LIBRARY)).items():
        ends = [f"{call} (line {line})" for call, line in _calls(tree)
                if call in ("sys.exit", "fail", "exit", "quit")]
        assert not ends, f"{name} ends the process: {', '.join(ends)}; raise a typed error"


def test_no_function_over_50_lines():
    long = []
    for folder in ("megatron", "tools", "tasks"):
        for name, tree in _sources(folder).items():
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        long.append(f"{name}.{node.name} ({lines} lines)")
    assert not long, "functions over 50 lines: " + ", ".join(long)


def test_fused_init_only_re_exports():
    tree = ast.parse((ROOT / "megatron" / "fused" / "__init__.py").read_text())
    body = tree.body[1:] if isinstance(tree.body[0], ast.Expr) else tree.body  # docstring
    others = [type(node).__name__ for node in body
              if not isinstance(node, (ast.Import, ast.ImportFrom))
              and not (isinstance(node, ast.Assign)
                       and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__all__"])]
    assert not others, f"megatron/fused/__init__.py holds more than imports: {others}"
