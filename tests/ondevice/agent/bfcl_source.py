"""bfcl-eval's own functions, taken from its installed files without importing the package (its
modules import numpy pins and API clients we do not install): the source of each named function is
cut out of the file with :mod:`ast` and run in a namespace holding the module-level names it needs,
themselves run from bfcl-eval's pure constant modules."""

import ast
import copy
import importlib.util
import json
import re
from pathlib import Path


def package_dir() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")
    return Path(next(iter(spec.submodule_search_locations)))


def _run_module(path: Path) -> dict:
    """A module of plain constants and enums, run on its own."""
    namespace: dict = {"__name__": path.stem}
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)
    return namespace


def functions_from(path: Path, names, namespace: dict) -> dict:
    """The functions ``names`` of the file at ``path``, defined in ``namespace``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert {node.name for node in wanted} == set(names), f"{path} lacks some of {names}"
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def bfcl_namespace() -> dict:
    """bfcl-eval's ``convert_to_tool`` and its language-hint pre-processing, with what they use."""
    root = package_dir()
    constants = _run_module(root / "constants" / "type_mappings.py")
    enums = _run_module(root / "constants" / "enums.py")
    namespace = {"copy": copy, "re": re, "json": json, "GORILLA_TO_OPENAPI": constants["GORILLA_TO_OPENAPI"],
                 "ModelStyle": enums["ModelStyle"], "Language": enums["Language"]}
    functions_from(root / "model_handler" / "utils.py", ["_cast_to_openai_type", "convert_to_tool"], namespace)
    functions_from(root / "utils.py", ["is_java", "is_js", "_get_language_specific_hint",
                                       "_func_doc_language_specific_pre_processing"], namespace)
    return namespace


def bfcl_offered_tools(functions: list, category: str) -> list:
    """What BFCL's OpenAI completions handler sends as ``tools`` for an entry of ``category``."""
    ns = bfcl_namespace()
    hinted = ns["_func_doc_language_specific_pre_processing"](copy.deepcopy(functions), category)
    return ns["convert_to_tool"](hinted, ns["GORILLA_TO_OPENAPI"], ns["ModelStyle"].OPENAI_COMPLETIONS)
