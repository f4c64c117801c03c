"""BFCL as the yardstick: the loader offers every entry's functions exactly as bfcl-eval's OpenAI handler
converts them (bfcl-eval's own functions, cut from its installed files), `evaluate-agent` scores function rows
and `--bfcl` entries by BFCL's rules end to end, and bad input is one line, exit 2."""

import functools
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from slm_align.ondevice.agent import bfcl, task_eval
from slm_align.ondevice.agent.bfcl import CATEGORIES, load_bfcl, offered_tools
from slm_align.ondevice.tools.registry import ToolRegistry
from slm_align.ondevice.tools.specs import registry_for_row
from tests.helpers import export_bundled, run_cli
from tests.ondevice.agent.bfcl_source import bfcl_namespace
from tests.ondevice.agent.test_task_eval import ScriptedBackend

needs_bfcl = pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None,
                                reason="bfcl-eval is not installed (pip install --no-deps bfcl-eval==2026.3.23)")


@functools.lru_cache(maxsize=1)
def bfcl_own():
    return bfcl_namespace()


def bfcl_handler_tools(functions, category):
    """The tools bfcl-eval's OpenAI completions handler sends for an entry (its language hint, then
    convert_to_tool), run from bfcl-eval's own source."""
    import copy

    ns = bfcl_own()
    hinted = ns["_func_doc_language_specific_pre_processing"](copy.deepcopy(functions), category)
    return ns["convert_to_tool"](hinted, ns["GORILLA_TO_OPENAPI"], ns["ModelStyle"].OPENAI_COMPLETIONS)


@needs_bfcl
def test_the_loader_offers_every_entry_as_bfcls_openai_handler_does():
    rows = load_bfcl(CATEGORIES)
    counts = {category: sum(row["category"] == category for row in rows) for category in CATEGORIES}
    assert counts == {"simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200,
                      "irrelevance": 240}
    differing = [row["id"] for row in rows if row["tools"] != bfcl_handler_tools(row["functions"], row["category"])]
    assert differing == []
    floats = [tool for row in rows for tool in row["tools"]
              if any(p.get("format") == "float" for p in tool["function"]["parameters"]["properties"].values())]
    assert floats and all("." not in tool["function"]["name"] for row in rows for tool in row["tools"])
    assert all(row["ground_truth"] == [] for row in rows if row["category"] == "irrelevance")
    assert all(row["ground_truth"] for row in rows if row["category"] != "irrelevance")


@needs_bfcl
def test_every_offered_tool_registers_in_the_runtime():
    for row in load_bfcl(CATEGORIES):
        registry = registry_for_row(row["tools"], ToolRegistry())
        assert len(registry) == len(row["functions"])


def test_the_conversion_follows_bfcls_rules_on_a_hand_built_function():
    function = {"name": "geo.distance", "description": "Distance.", "parameters": {"type": "dict", "properties": {
        "points": {"type": "array", "items": {"type": "tuple"}, "description": "P."},
        "scale": {"type": "float", "description": "S."}, "opts": {"type": "dict", "description": "O."},
        "raw": {"type": "any", "description": "R."}}, "required": ["points"]}}
    tool = offered_tools([function])[0]["function"]
    assert tool["name"] == "geo_distance" and tool["description"].endswith("in Python 3 syntax.")
    properties = tool["parameters"]["properties"]
    assert properties["scale"] == {"type": "number", "format": "float", "description": "S. This is a float type value."}
    assert properties["points"]["items"] == {"type": "array"} and properties["opts"]["type"] == "object"
    assert properties["raw"]["type"] == "string" and tool["parameters"]["type"] == "object"
    assert function["name"] == "geo.distance"  # the entry is left as it was


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """The bundled model exported once to GGUF Q8_0."""
    pytest.importorskip("llama_cpp")
    return export_bundled(tmp_path_factory.mktemp("artifacts"), ("gguf", "Q8_0"))["gguf"]


def first_allowed(options):
    return next(value for value in options if value != "")


def truth_reply(row: dict) -> str:
    """The ground truth as the reply a model writes: one <tool_call> block per expected call."""
    names = {function["name"]: function["name"].replace(".", "_") for function in row.get("functions", [])}
    blocks = []
    for expected in row["ground_truth"]:
        name, allowed = next(iter(expected.items()))
        arguments = {key: first_allowed(options) for key, options in allowed.items() if options != [""]}
        blocks.append(json.dumps({"name": names.get(name, name), "arguments": arguments}))
    return "\n".join(f"<tool_call>{block}</tool_call>" for block in blocks) or "No function fits that."


def scripted_loader(solver: Path, replies):
    from slm_align.ondevice.agent.loading import load_model

    def load(artifact, **options):
        model = load_model(artifact, **options)
        if Path(artifact) == solver:
            model.backend = ScriptedBackend(model.backend, replies)
        return model
    return load


ALARM = {"type": "function", "function": {"name": "alarm_set", "description": "Set an alarm.", "parameters": {
    "type": "object", "properties": {"time": {"type": "string"}, "label": {"type": "string", "default": ""}},
    "required": ["time"]}}}
TIMER = {"type": "function", "function": {"name": "timer_start", "description": "Start a timer.", "parameters": {
    "type": "object", "properties": {"minutes": {"type": "integer"}}, "required": ["minutes"]}}}
FUNCTION_ROWS = [
    {"id": "functions_simple_0", "category": "simple", "messages": [{"role": "user", "content": "Wake me at 6:30"}],
     "tools": [ALARM], "ground_truth": [{"alarm_set": {"time": ["06:30", "6:30"], "label": ["", "gym"]}}]},
    {"id": "functions_parallel_0", "category": "parallel",
     "messages": [{"role": "user", "content": "Timers for 5 and 10 minutes"}], "tools": [TIMER],
     "ground_truth": [{"timer_start": {"minutes": [5]}}, {"timer_start": {"minutes": [10]}}]},
    {"id": "functions_irrelevance_0", "category": "irrelevance", "messages": [{"role": "user", "content": "Hi"}],
     "tools": [ALARM, TIMER], "ground_truth": []}]


def test_evaluate_agent_scores_function_rows_by_bfcls_rules(gguf, tmp_path, capsys, monkeypatch):
    tasks = tmp_path / "functions.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in FUNCTION_ROWS))
    solver = tmp_path / "solver.gguf"
    shutil.copyfile(gguf, solver)
    replies = ['<tool_call>{"name": "alarm_set", "arguments": {"time": "6:30"}}</tool_call>',
               '<tool_call>{"name": "timer_start", "arguments": {"minutes": 10}}</tool_call>\n'
               '<tool_call>{"name": "timer_start", "arguments": {"minutes": 5}}</tool_call>',  # any order
               "Hello! How can I help?"]
    monkeypatch.setattr(task_eval, "load_model", scripted_loader(solver, replies))
    code, out, err = run_cli(capsys, "evaluate-agent", tasks, "--artifact", gguf, "--artifact", solver,
                             "--max-new-tokens", "128", "--json")
    assert code == 0, err
    report = json.loads(out)
    solved = report["artifacts"][1]
    assert [r["category"] for r in solved["results"]] == ["success"] * 3 and solved["success_rate"] == 1.0
    assert [r["group"] for r in solved["results"]] == ["simple", "parallel", "irrelevance"]
    assert solved["by_category"]["parallel"] == {"episodes": 1, "successes": 1, "accuracy": 1.0,
                                                 "ci95": pytest.approx([0.2065, 1.0], abs=1e-4)}
    assert solved["calls"] == 3 and solved["valid_calls"] == 3 and solved["rounds_per_task"] == 0
    assert set(report["comparisons"][0]["by_category"]) == {"simple", "parallel", "irrelevance"}


@needs_bfcl
def test_evaluate_agent_bfcl_end_to_end(gguf, tmp_path, capsys, monkeypatch):
    rows = load_bfcl(["simple_python", "parallel", "irrelevance"], limit=2)
    solver = tmp_path / "solver.gguf"
    shutil.copyfile(gguf, solver)
    replies = [truth_reply(row) for row in rows]
    assert '"base": 10' in replies[0]
    replies[0] = replies[0].replace('"base": 10', '"base": "10"')  # simple_python_0: a string for an integer
    monkeypatch.setattr(task_eval, "load_model", scripted_loader(solver, replies))
    code, out, err = run_cli(capsys, "evaluate-agent", "--bfcl", "simple_python,parallel,irrelevance", "--limit", "2",
                             "--artifact", gguf, "--artifact", solver, "--max-new-tokens", "160")
    assert code == 0, err
    assert "Function calling by category" in out and "on parallel" in out
    code, out, err = run_cli(capsys, "evaluate-agent", "--bfcl", "simple_python,parallel,irrelevance", "--limit", "2",
                             "--artifact", solver, "--max-new-tokens", "160", "--json")
    report = json.loads(out)
    assert report["tasks"] == "BFCL v4: simple_python,parallel,irrelevance" and report["n_tasks"] == 6
    results = report["artifacts"][0]["results"]
    assert [r["group"] for r in results] == ["simple_python"] * 2 + ["parallel"] * 2 + ["irrelevance"] * 2
    by_category = report["artifacts"][0]["by_category"]
    assert {name: figures["successes"] for name, figures in by_category.items()} == {
        "simple_python": 1, "parallel": 2, "irrelevance": 2}
    assert results[0]["category"] == "wrong_answer" and "not of type integer" in results[0]["reason"]


def test_bad_bfcl_input_is_one_line_and_exit_2(gguf, tmp_path, capsys, monkeypatch):
    orphan = tmp_path / "orphan.jsonl"
    orphan.write_text(json.dumps({**FUNCTION_ROWS[0], "ground_truth": [{"alarm_cancel": {"id": [1]}}]}) + "\n")
    cases = [(("--bfcl", "simple_java"), "unknown BFCL category 'simple_java'"),
             ((orphan,), "names 'alarm_cancel', which is not among its tools"),
             ((), "pass a task file or --bfcl"),
             ((orphan, "--bfcl", "multiple"), "pass a task file or --bfcl")]
    for args, expected in cases:
        code, _, err = run_cli(capsys, "evaluate-agent", *args, "--artifact", gguf)
        assert code == 2 and expected in err and err.count("\n") == 1, err
    real = importlib.util.find_spec

    def without_bfcl(name, *rest):
        return None if name == "bfcl_eval" else real(name, *rest)

    monkeypatch.setattr(bfcl.importlib.util, "find_spec", without_bfcl)
    code, _, err = run_cli(capsys, "evaluate-agent", "--bfcl", "multiple", "--artifact", gguf)
    assert code == 2 and "pip install --no-deps bfcl-eval==2026.3.23" in err and err.count("\n") == 1, err


@needs_bfcl
def test_our_verdicts_equal_bfcls_own_checker_on_every_entry(monkeypatch):
    """bfcl-eval's ast_checker, run in this process as benchmarks/bfcl_official_runner.py runs it (its
    model_config, which imports every API client for one flag, replaced by that flag), against ours on the
    synthetic replies of benchmarks/bfcl_outputs.py to all 1,240 entries."""
    import sys

    benchmarks = Path(__file__).resolve().parents[3] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    import bfcl_official_runner as runner
    from bfcl_outputs import variants

    from slm_align.ondevice.rewards.function_match import check_calls

    monkeypatch.delitem(sys.modules, "bfcl_eval.eval_checker.ast_eval.ast_checker", raising=False)
    monkeypatch.setitem(sys.modules, "bfcl_eval.constants.model_config", None)
    runner.install_model_config()
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    empty = runner.utils_functions({"is_empty_output", "is_function_calling_format_output"})["is_empty_output"]
    differing, replies = [], 0
    for row in load_bfcl(CATEGORIES):
        for kind, calls in variants(row).items():
            output = [{call["name"]: call["arguments"]} for call in calls]
            if row["category"] == "irrelevance":
                theirs = empty(output)
            else:
                theirs = ast_checker(row["functions"], output, row["ground_truth"], Language.PYTHON, row["category"],
                                     runner.MODEL)["valid"]
            replies += 1
            if theirs != check_calls(calls, row["ground_truth"], row["functions"], row["category"]).ok:
                differing.append(f"{row['id']}:{kind}")
    assert replies == 9093 and differing == []
