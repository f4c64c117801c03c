"""Parameter objects where a call would take 9 or more: no function of slm_align outside the CLI
takes 9 or more parameters (``self`` and ``cls`` not counted, ``*args`` and ``**options`` one
each). Typer's commands in ``slm_align/cli/`` take one parameter per option and are exempt."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "slm_align"

LIMIT = 9
"""A function with this many parameters or more groups them into objects."""

EXEMPT = {"cli"}
"""Top-level folders of slm_align whose functions are exempt: Typer commands, one parameter per
option."""

def parameter_count(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Its parameters: positional, keyword-only, ``*args`` and ``**options``; a leading ``self`` or
    ``cls`` is not counted."""
    arguments = function.args
    names = [arg.arg for arg in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (arguments.vararg is not None) + (arguments.kwarg is not None)


def functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function of a module with its qualified name (``Class.method``, ``outer.inner``)."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def long_signatures(root: Path = PACKAGE) -> dict[str, int]:
    """``path:function`` -> parameters, for each function outside the exempt folders with
    :data:`LIMIT` or more."""
    long = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in EXEMPT:
            continue
        for name, function in functions(ast.parse(path.read_text(encoding="utf-8"))):
            count = parameter_count(function)
            if count >= LIMIT:
                long[f"{relative.as_posix()}:{name}"] = count
    return long


def test_no_function_outside_the_cli_takes_nine_parameters_or_more():
    found = long_signatures()
    advice = "group these parameters into objects (frozen dataclasses, a doc line per field)"
    assert not found, f"{advice}: {found}"


def test_the_count_takes_every_kind_of_parameter_and_skips_self(tmp_path):
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "commands.py").write_text("def command(a, b, c, d, e, f, g, h, i): pass\n")
    (tmp_path / "wing.py").write_text(
        "def short(a, b, c, d, e, f, g, h): pass\n"
        "def starred(a, b, c, d, e, f, g, *args, **options): pass\n"
        "def keyword_only(a, /, b, *, c, d, e, f, g, h, i): pass\n"
        "class Agent:\n"
        "    def __init__(self, a, b, c, d, e, f, g, h): pass\n"
        "    @classmethod\n"
        "    def load(cls, a, b, c, d, e, f, g, h, i): pass\n"
        "    def outer(self):\n"
        "        def inner(a, b, c, d, e, f, g, h, i, j): pass\n")
    assert long_signatures(tmp_path) == {"wing.py:starred": 9, "wing.py:keyword_only": 9,
                                         "wing.py:Agent.load": 9, "wing.py:Agent.outer.inner": 10}
