"""The layer rule over slm_align's import graph: a module imports only its own
layer or the layers below.

Every import counts, also one inside a function (an import put there to dodge a cycle is still an
arrow). The layers, top to bottom, are listed once, here; docs/architecture.md describes them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "slm_align"

LAYERS = {
    "interface": {"cli", "__main__", "__init__", "environment"},
    "pipeline": {"pipeline", "quickstart"},
    "stages": {"sft", "reward", "headroom", "rl", "preference", "evaluate", "export"},
    "models": {"modeling", "generation", "perplexity", "training", "data", "envelope", "agent"},
    "libraries": {"tools", "rewards", "devices", "chat_templates", "template_sandbox", "gguf_fields", "gguf_cache",
                  "gguf_tokenizer", "gguf_adapters"},
    "ground": {"errors", "named", "atomic", "tomlcompat", "config", "recipe_overrides", "runs", "progress", "stats",
               "ab_test", "plots", "tracking", "accelerator"},
}
"""Each room (a subpackage or a top-level module of slm_align) and its layer, top to bottom."""

EXCEPTIONS = {}
"""(importing room, imported room) -> why an arrow may point up. At most three."""

RANK = {room: rank for rank, rooms in enumerate(reversed(list(LAYERS.values()))) for room in rooms}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def imported_modules(path: Path) -> set[str]:
    """The slm_align modules ``path`` imports (absolute and relative imports, at
    any depth of the file)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[: len(package) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found |= {f"{base}.{alias.name}" for alias in node.names}  # a submodule, or a name of ``base``
    return {module for module in found if module.split(".")[0] == "slm_align"}


def room(module: str) -> str:
    """The first level under slm_align (``slm_align.rl.ppo`` -> ``rl``); the package
    itself is ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def real_modules() -> dict[str, Path]:
    return {module_name(path).removesuffix(".__init__"): path for path in PACKAGE.rglob("*.py")}


def resolve(module: str, known: dict[str, Path]) -> str:
    """The module a dotted import name lands in (``slm_align.runs.StageResult``
    -> ``slm_align.runs``)."""
    while module not in known:
        module = module.rpartition(".")[0]
    return module


def graph() -> dict[str, set[str]]:
    known = real_modules()
    edges = {}
    for module, path in known.items():
        targets = {resolve(name, known) for name in imported_modules(path)}
        edges[module] = targets - {module}
    return edges


def test_every_room_has_a_layer():
    rooms = {room(module) for module in real_modules()}
    assert rooms - set(RANK) == set(), "add the new room to LAYERS"
    assert set(RANK) - rooms == set(), "a room in LAYERS no longer exists"


def test_no_import_points_up_a_layer():
    upward = set()
    for module, targets in graph().items():
        for target in targets:
            pair = (room(module), room(target))
            if RANK[pair[1]] > RANK[pair[0]] and pair not in EXCEPTIONS:
                upward.add(f"{module} -> {target}")
    assert sorted(upward) == []
    assert len(EXCEPTIONS) <= 3


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("level", ["module", "room"])
def test_no_import_cycles(level):
    edges = graph()
    if level == "room":
        rooms: dict[str, set[str]] = {}
        for module, targets in edges.items():
            rooms.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
        edges = rooms
    assert cycles(edges) == []


def test_the_check_sees_an_upward_import_and_a_cycle():
    assert "slm_align.pipeline" in graph()["slm_align.cli.train"]  # imported inside a function
    assert RANK["cli"] > RANK["pipeline"] > RANK["rl"] > RANK["envelope"] > RANK["tools"] > RANK["errors"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
