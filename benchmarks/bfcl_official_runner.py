"""BFCL's own verdicts on replies, run by ``bfcl.py --official`` in a venv holding only bfcl-eval (installed
with --no-deps): reads JSON lines ``{key, category, functions, ground_truth, calls}`` from the file named
on the command line and prints ``{key, valid, error_type}`` per line.

bfcl-eval's ``ast_checker`` runs unchanged; ``bfcl_eval.constants.model_config``, which it imports for one
flag (``underscore_to_dot``) and which imports every API client, is replaced by a one-entry mapping holding
that flag as model_config.py states it for BFCL's OpenAI function-calling model. ``is_empty_output`` and
``is_function_calling_format_output`` are cut from bfcl_eval/utils.py (whose imports need filelock and more).
Standard library only besides bfcl-eval.
"""

import ast
import importlib.util
import json
import sys
import types
from pathlib import Path

MODEL = "gpt-4o-2024-11-20-FC"
"""BFCL's OpenAI function-calling model: the handler whose tool conversion slm-align reproduces."""
ROOT = Path(next(iter(importlib.util.find_spec("bfcl_eval").submodule_search_locations)))


def underscore_to_dot(model: str) -> bool:
    """The model's ``underscore_to_dot`` flag as model_config.py writes it."""
    tree = ast.parse((ROOT / "constants" / "model_config.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == model and isinstance(value, ast.Call):
                    return next(k.value.value for k in value.keywords if k.arg == "underscore_to_dot")
    raise SystemExit(f"{model} is not in bfcl-eval's model_config.py")


def install_model_config() -> None:
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = {MODEL.replace("_", "/"): types.SimpleNamespace(
        underscore_to_dot=underscore_to_dot(MODEL))}
    sys.modules[stub.__name__] = stub


def utils_functions(names) -> dict:
    """Functions cut from bfcl_eval/utils.py."""
    tree = ast.parse((ROOT / "utils.py").read_text(encoding="utf-8"))
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    namespace: dict = {}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "bfcl_eval/utils.py", "exec"), namespace)
    return namespace


def main() -> None:
    install_model_config()
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    helpers = utils_functions({"is_empty_output", "is_function_calling_format_output"})
    for line in Path(sys.argv[1]).read_text(encoding="utf-8").splitlines():
        item = json.loads(line)
        output = [{call["name"]: call["arguments"]} for call in item["calls"]]
        if "irrelevance" in item["category"]:
            result = {"valid": helpers["is_empty_output"](output), "error_type": "irrelevance"}
        elif not helpers["is_function_calling_format_output"](output):
            result = {"valid": False, "error_type": "ast_decoder:decoder_wrong_output_format"}
        else:
            try:
                result = ast_checker(item["functions"], output, item["ground_truth"], Language.PYTHON,
                                     item["category"], MODEL)
            except Exception as exc:  # BFCL's checker raising on a reply: it would not score it valid
                result = {"valid": False, "error_type": f"raised {type(exc).__name__}: {exc}"}
        print(json.dumps({"key": item["key"], "valid": result["valid"], "error_type": result.get("error_type")}))


if __name__ == "__main__":
    main()
