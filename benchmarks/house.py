"""Measure the house: lines per module, the longest functions, the share of long lines.

Usage: python benchmarks/house.py [PACKAGE_DIR]   (default: slm_align)

Issue 15 asks for these figures before and after the re-layout; they come from the source text alone
(``ast`` for function extents), so the script runs anywhere the package is checked out.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LONG_LINE = 100


def function_lengths(path: Path) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            found.append((length, f"{path}:{node.lineno} {node.name}"))
    return found


def packed_statements(path: Path) -> tuple[int, int, int]:
    """(packed tuple assignments ``a, b = x, y``, chained conditional expressions,
    lambdas bound to names)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    packed = 0
    chained = 0
    bound_lambdas = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            packed += int(any(isinstance(target, ast.Tuple) for target in node.targets))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
            bound_lambdas += 1
        if isinstance(node, ast.IfExp) and isinstance(node.orelse, ast.IfExp):
            chained += 1
    return packed, chained, bound_lambdas


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "slm_align")
    files = sorted(root.rglob("*.py"))
    sizes = []
    functions = []
    total = 0
    long_lines = 0
    packed = [0, 0, 0]
    for path in files:
        for index, count in enumerate(packed_statements(path)):
            packed[index] += count
        lines = path.read_text(encoding="utf-8").splitlines()
        sizes.append((len(lines), str(path)))
        total += len(lines)
        long_lines += sum(1 for line in lines if len(line) > LONG_LINE)
        functions.extend(function_lengths(path))
    sizes.sort(reverse=True)
    functions.sort(reverse=True)
    print(f"modules: {len(files)}  lines: {total}  mean lines/module: {total / len(files):.0f}")
    print(f"lines over {LONG_LINE} characters: {long_lines} ({100 * long_lines / total:.1f}%)")
    print(f"packed tuple assignments: {packed[0]}  chained conditional expressions: {packed[1]}  "
          f"lambdas bound to names: {packed[2]}")
    print("largest modules:")
    for count, name in sizes[:8]:
        print(f"  {count:5d}  {name}")
    print("longest functions:")
    for count, name in functions[:8]:
        print(f"  {count:5d}  {name}")


if __name__ == "__main__":
    main()
