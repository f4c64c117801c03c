"""The layer rule over slm_align's import graph: a module imports only its own
layer or the layers below.

Every import counts, also one inside a function (an import put there to dodge a cycle is still an
arrow). The layers, top to bottom, are listed once, here; docs/architecture.md describes them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "slm_align"

LAYERS = {
    "interface": {"cli", "__main__", "__init__"},
    "pipeline": {"pipeline", "quickstart"},
    "stages": {"sft", "reward_model", "headroom", "rl", "preference", "evaluate", "export"},
    "shared": {"rollouts", "envelope", "scoring"},
    "models": {"modeling", "data"},
    "runtime": {"ondevice.agent"},
    "device libraries": {"ondevice", "ondevice.templates", "ondevice.tools", "ondevice.rewards", "ondevice.devices",
                         "ondevice.gguf", "ondevice.rows"},
    "ground": {"config", "runs", "errors", "atomic", "progress", "stats", "plots", "tracking"},
}
"""Each room (a subpackage or a top-level module of slm_align; inside the device wing, ``ondevice/``,
each of its subpackages) and its layer, top to bottom. docs/architecture.md's layer table lists
exactly these rooms (a test below holds it)."""

STAGES = LAYERS["stages"]
"""Rooms of one layer may import each other, except stages: what two stages share lives a layer down."""

GROUPS = {"ondevice"}
"""Packages whose subpackages are rooms of their own (the device wing's parts keep their layers)."""

EXCEPTIONS = {}
"""(importing room, imported room) -> why an arrow may point up. At most three."""

RANK = {room: rank for rank, rooms in enumerate(reversed(list(LAYERS.values()))) for room in rooms}

MAX_LOOSE_MODULES = 12
"""Top-level modules of slm_align/ (files, not packages): the tree shows the layers."""


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
    """The first level under slm_align (``slm_align.rl.ppo`` -> ``rl``), the second in a group
    (``slm_align.ondevice.agent.runtime`` -> ``ondevice.agent``); the package itself is ``__init__``."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in GROUPS:
        return ".".join(parts[1:3])
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


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """Every import that points up a layer, or from one stage into another."""
    found = set()
    for module, targets in edges.items():
        for target in targets:
            pair = (room(module), room(target))
            across_stages = pair[0] != pair[1] and set(pair) <= STAGES
            if (RANK[pair[1]] > RANK[pair[0]] or across_stages) and pair not in EXCEPTIONS:
                found.add(f"{module} -> {target}")
    return sorted(found)


def test_no_import_points_up_a_layer_or_across_stages():
    assert upward_imports(graph()) == []
    assert EXCEPTIONS == {}


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


CLI_STARTUP = "a command imports its work when it runs, so `slm-align --help` loads none of it"
PACKAGE_CYCLE = ("dodges an import cycle through the package __init__, which imports this module; "
                 "cli/ and ondevice/agent/server/ were another branch's this round: to fix there")
ON_DEMAND = "imports model code, backends or parity checks for the target or source that runs; no cycle"
OTHER_BRANCH = "no cycle; its folder was another branch's this round: to move to the top there"

FUNCTION_IMPORTS = {
    "slm_align.cli": PACKAGE_CYCLE,
    "slm_align.cli.bundle": PACKAGE_CYCLE,
    "slm_align.cli.env_cmd": PACKAGE_CYCLE,
    "slm_align.cli.devices": CLI_STARTUP,
    "slm_align.cli.env_report": CLI_STARTUP,
    "slm_align.cli.export": CLI_STARTUP,
    "slm_align.cli.field": CLI_STARTUP,
    "slm_align.cli.render": CLI_STARTUP,
    "slm_align.cli.runtime": CLI_STARTUP,
    "slm_align.cli.tasks": CLI_STARTUP,
    "slm_align.cli.train": CLI_STARTUP,
    "slm_align.ondevice.agent.server.app": PACKAGE_CYCLE,
    "slm_align.export.converters.calibration": ON_DEMAND,
    "slm_align.export.converters.executorch": ON_DEMAND,
    "slm_align.export.converters.imatrix": ON_DEMAND,
    "slm_align.export.converters.merge": ON_DEMAND,
    "slm_align.export.packaging.bundle": ON_DEMAND,
    "slm_align.export.packaging.bundle_files": ON_DEMAND,
    "slm_align.export.publishing.adapter_export": ON_DEMAND,
    "slm_align.export.publishing.model_export": ON_DEMAND,
    "slm_align.export.publishing.parity": ON_DEMAND,
    "slm_align.export.publishing.sources": ON_DEMAND,
    "slm_align.export.publishing.verification": ON_DEMAND,
    "slm_align.export.targets.base": ON_DEMAND,
    "slm_align.export.targets.executorch": ON_DEMAND,
    "slm_align.export.targets.genai": ON_DEMAND,
    "slm_align.modeling.models": ON_DEMAND,
    "slm_align.headroom.stage": OTHER_BRANCH,
    "slm_align.modeling.generation": OTHER_BRANCH,
    "slm_align.ondevice.agent.llama_backend": OTHER_BRANCH,
    "slm_align.ondevice.agent.loading": OTHER_BRANCH,
    "slm_align.ondevice.agent.runtime": OTHER_BRANCH,
}
"""Modules that may import slm_align modules inside a function, and why. An import put inside a
function to dodge a cycle hides the cycle from a reader; lazy imports of heavy libraries that are not
ours (torch, trl, llama_cpp) stay allowed everywhere."""


def function_imports(path: Path) -> set[str]:
    """The slm_align modules ``path`` imports inside a function (``slm_align...`` or relative)."""
    found = set()
    for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names
                          if alias.name.split(".")[0] == "slm_align"}
            elif isinstance(node, ast.ImportFrom):
                if node.level or (node.module or "").split(".")[0] == "slm_align":
                    found.add(node.module or ".")
    return found


def test_no_import_of_ours_inside_a_function_but_the_named_ones():
    found = {module for module, path in real_modules().items() if function_imports(path)}
    assert sorted(found - set(FUNCTION_IMPORTS)) == [], "import it at the top of the module"
    assert sorted(set(FUNCTION_IMPORTS) - found) == [], "drop the exemption: the module no longer needs it"


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    source = tmp_path / "lazy.py"
    lines = ["import torch", "", "", "def load():", "    import trl",
             "    from slm_align.data.readers import iter_rows", "    from . import rows",
             "    return trl, iter_rows, rows, torch", ""]
    source.write_text("\n".join(lines))
    assert function_imports(source) == {"slm_align.data.readers", "."}
    source.write_text("from slm_align.data.readers import iter_rows\n\n\ndef load():\n    import torch\n")
    assert function_imports(source) == set()


def test_the_check_sees_an_upward_import_and_a_cycle():
    assert "slm_align.pipeline" in graph()["slm_align.cli.train"]  # imported inside a function
    assert RANK["cli"] > RANK["pipeline"] > RANK["rl"] > RANK["envelope"] > RANK["ondevice.tools"] > RANK["errors"]
    assert upward_imports({"slm_align.errors": {"slm_align.cli.train"}}) == ["slm_align.errors -> slm_align.cli.train"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_the_check_sees_a_stage_importing_another_stage():
    edges = {"slm_align.rl.llama_sampler": {"slm_align.export.stage", "slm_align.rl.ppo", "slm_align.modeling.models"},
             "slm_align.ondevice.agent.runtime": {"slm_align.ondevice.tools.registry"}}
    assert upward_imports(edges) == ["slm_align.rl.llama_sampler -> slm_align.export.stage"]
    assert room("slm_align.ondevice.gguf.writer") == "ondevice.gguf"
    assert room("slm_align.ondevice") == "ondevice"


def test_few_loose_modules_at_the_top():
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def architecture_table() -> dict[str, set[str]]:
    """docs/architecture.md's layer table: ``| layer | rooms |`` rows under the "Layers" heading,
    each room in backticks (a package with its slash, ``rl/``; a module with ``.py``)."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] not in LAYERS:
            continue
        rooms = re.findall(r"`([^`]+)`", cells[1])
        table[cells[0]] = {name.removesuffix("/").removesuffix(".py").replace("/", ".") for name in rooms}
    return table


def test_the_architecture_docs_list_the_layer_table():
    assert architecture_table() == LAYERS
