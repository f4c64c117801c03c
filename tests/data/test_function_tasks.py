"""The function-calling task family: the library's breadth, valid BFCL-style rows in every category,
a held-out split of unseen functions, determinism, requests that say what the call must carry, and
functions disjoint from BFCL's own."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from datetime import datetime
from pathlib import Path

import jsonschema
import pytest

import slm_align
from slm_align.data import function_tasks as function_tasks_module
from slm_align.data.agent_chats import conversation_text
from slm_align.data.function_library import draw_request, function_named, library, template_problems, tool_schema
from slm_align.data.function_tasks import (
    CATEGORIES,
    category_counts,
    function_tasks,
    make_row,
    repeatable,
    split_functions,
    write_function_tasks,
)
from slm_align.data.function_values import draw, pools
from slm_align.errors import UserError
from slm_align.ondevice.templates.chat import CHATML_TEMPLATE
from slm_align.ondevice.tools.parse import read_calls
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def rows() -> dict:
    return function_tasks(train=400, heldout=150, seed=0)


def _types(schema: dict) -> set[str]:
    """Every JSON-schema type in ``schema`` (nested ones too), "enum" for an enum."""
    found = {schema.get("type", "")} | ({"enum"} if "enum" in schema else set())
    for sub in [*schema.get("properties", {}).values(), *([schema["items"]] if "items" in schema else [])]:
        found |= _types(sub)
    return found


def test_the_library_spans_150_functions_15_domains_and_every_schema_type():
    functions = library()
    assert len(functions) >= 150 and len({function["name"] for function in functions}) == len(functions)
    assert len({function["domain"] for function in functions}) >= 15
    parameters = [tool_schema(function)["function"]["parameters"] for function in functions]
    types = set().union(*(_types(schema) for schema in parameters))
    assert {"string", "integer", "number", "boolean", "array", "object", "enum"} <= types
    optional = [param for function in functions for name, param in function["params"].items()
                if name not in function["required"]]
    assert len(optional) >= 50 and all("default" in param for param in optional)
    for function in functions:
        jsonschema.Draft202012Validator.check_schema(tool_schema(function)["function"]["parameters"])
        assert len(function["asks"]) >= 2, function["name"]
    assert [problem for function in functions for problem in template_problems(function)] == []


def _calls(row: dict) -> list[tuple[str, dict]]:
    return [(name, arguments) for entry in row["ground_truth"] for name, arguments in entry.items()]


def _check_allowed(name: str, schema: dict, allowed: list, required: bool) -> None:
    """Every allowed value validates against ``schema``; "" (may be left out) never when required."""
    assert allowed, name
    assert not (required and "" in allowed), (name, allowed)
    for value in allowed:
        if value == "":
            continue
        if schema["type"] == "object":  # BFCL's form: a dict of allowed values per key
            for key, sub in schema["properties"].items():
                assert key in value, (name, key)
                _check_allowed(f"{name}.{key}", sub, value[key], key in schema.get("required", []))
        else:
            jsonschema.validate(value, schema)


def test_every_row_is_a_valid_bfcl_style_row(rows):
    for row in rows["train"] + rows["heldout"]:
        assert row["category"] in CATEGORIES and row["category"] in row["id"]
        assert row["messages"][0]["role"] == "user" and row["messages"][0]["content"]
        offered = {tool["function"]["name"]: tool["function"]["parameters"] for tool in row["tools"]}
        assert len(offered) == len(row["tools"])
        for parameters in offered.values():
            jsonschema.Draft202012Validator.check_schema(parameters)
        for name, arguments in _calls(row):
            assert name in offered, (row["id"], name)
            schema = offered[name]
            assert set(arguments) <= set(schema["properties"]) and set(schema["required"]) <= set(arguments)
            for argument, allowed in arguments.items():
                _check_allowed(argument, schema["properties"][argument], allowed,
                               argument in schema["required"])


def test_each_category_has_its_shape_and_the_default_mix(rows):
    for split, n in (("train", 400), ("heldout", 150)):
        counts = {category: 0 for category in CATEGORIES}
        for row in rows[split]:
            counts[row["category"]] += 1
            names = [name for name, _ in _calls(row)]
            shape = {"simple": len(row["tools"]) == 1 and len(names) == 1,
                     "multiple": len(row["tools"]) >= 2 and len(names) == 1,
                     "parallel": len(row["tools"]) == 1 and len(names) >= 2,
                     "parallel_multiple": len(set(names)) >= 2,
                     "irrelevance": row["ground_truth"] == [] and len(row["tools"]) >= 1}
            assert shape[row["category"]], row
        assert counts == category_counts(n) and all(counts.values())
    defaults = category_counts(1000)
    assert defaults == {"simple": 300, "multiple": 200, "parallel": 150, "parallel_multiple": 150,
                        "irrelevance": 200}


def test_multiple_offers_distractors_of_the_same_domain(rows):
    domain = {function["name"]: function["domain"] for function in library()}
    multiple = [row for row in rows["train"] if row["category"] == "multiple"]
    same = [row for row in multiple
            if len({domain[tool["function"]["name"]] for tool in row["tools"]}) == 1]
    assert len(same) > 0.8 * len(multiple)


def test_irrelevance_offers_one_domain_and_asks_for_a_function_of_another_group(monkeypatch):
    asked = []

    def recording(function, rng):
        asked.append(function)
        return draw_request(function, rng)

    monkeypatch.setattr(function_tasks_module, "draw_request", recording)
    rng = random.Random(0)
    functions = split_functions(0)[0]
    for _ in range(200):
        asked.clear()
        row = make_row("irrelevance", functions, rng)
        offered = [function_named(tool["function"]["name"]) for tool in row["tools"]]
        assert row["ground_truth"] == [] and len(asked) == 1
        assert len({function["domain"] for function in offered}) == 1
        assert asked[0]["group"] != offered[0]["group"] and asked[0] in functions


def test_held_out_functions_are_never_seen_in_training(rows):
    def names(split: str) -> set[str]:
        offered = {tool["function"]["name"] for row in rows[split] for tool in row["tools"]}
        return offered | {name for row in rows[split] for name, _ in _calls(row)}

    train_functions, heldout_functions = split_functions(0)
    assert names("train") <= {function["name"] for function in train_functions}
    assert names("heldout") <= {function["name"] for function in heldout_functions}
    assert names("train").isdisjoint(names("heldout")) and len(names("heldout")) >= 30
    heldout_domains = {function["domain"] for function in heldout_functions}
    assert heldout_domains == {function["domain"] for function in library()}
    assert split_functions(1)[1] != heldout_functions  # the split is seeded


def test_the_same_seed_writes_the_same_files(tmp_path):
    first = write_function_tasks(tmp_path / "a", train=60, heldout=20, seed=5)
    second = write_function_tasks(tmp_path / "b", train=60, heldout=20, seed=5)
    other = write_function_tasks(tmp_path / "c", train=60, heldout=20, seed=6)
    for name in ("sft", "train", "heldout"):
        assert first[name].read_bytes() == second[name].read_bytes() != other[name].read_bytes()
    assert [len(path.read_text().splitlines()) for path in first.values()] == [60, 60, 20]


_TWELVE_HOUR = re.compile(r"^(\d{1,2})(?::(\d\d))? ?(am|pm|AM|PM)$")


def _clock(said: str) -> str:
    """A said time as HH:MM, read independently of the generator."""
    match = _TWELVE_HOUR.match(said)
    if match is None:
        return said
    hour = int(match.group(1)) % 12 + (12 if match.group(3).lower() == "pm" else 0)
    return f"{hour:02d}:{int(match.group(2) or 0):02d}"


def _day(said: str) -> str:
    for form in ("%B %d, %Y", "%d %B %Y", "%Y-%m-%d"):
        try:
            return datetime.strptime(said, form).strftime("%Y-%m-%d")
        except ValueError:
            continue
    raise AssertionError(f"unreadable date {said!r}")


def test_said_times_and_dates_are_the_values_the_call_carries():
    rng = random.Random(0)
    for _ in range(300):
        time = draw({"gen": "time"}, rng)
        assert _clock(time.said) == time.value and time.allowed == (time.value,)
        date = draw({"gen": "date"}, rng)
        assert _day(date.said) == date.value
    numbers = [draw({"gen": "int:1:12"}, rng) for _ in range(200)]
    words = ("zero one two three four five six seven eight nine ten eleven twelve").split()
    assert all(value.said in (str(value.value), words[value.value]) for value in numbers)
    assert draw({"gen": "pool:city"}, random.Random(3)).allowed[0] in [
        entry["value"] for entry in pools()["city"]]


def test_every_request_says_each_required_value():
    rng = random.Random(1)
    for function in library():
        for _ in range(12):
            request = draw_request(function, rng)
            for name in function["required"]:
                param = function["params"][name]
                slots = [name] if param["type"] != "object" else [f"{name}.{key}" for key in param["required"]]
                for slot in slots:
                    assert request.said[slot].lower() in request.text.lower(), (function["name"], slot)


def test_equivalent_values_are_allowed_and_conversions_have_two_units():
    rng = random.Random(2)
    function = next(function for function in library() if function["name"] == "nav_city_distance")
    for _ in range(40):
        request = draw_request(function, rng)
        arguments = request.truth["nav_city_distance"]
        assert arguments["from_city"] != arguments["to_city"]
        if request.said["from_city"] == "NYC":
            assert {"New York", "NYC", "New York City"} <= set(arguments["from_city"])


def _satisfies(call: dict, allowed: dict) -> bool:
    """A call's arguments are among the allowed values, and none required is missing."""
    for name, values in allowed.items():
        if name not in call:
            if "" not in values:
                return False
            continue
        if isinstance(values[0], dict):
            if not any(_satisfies(call[name], option) for option in values if option != ""):
                return False
        elif call[name] not in values:
            return False
    return set(call) <= set(allowed)


def test_sft_chats_call_as_the_runtime_does_and_decline_irrelevant_requests(rows):
    assert len(rows["sft"]) == len(rows["train"])
    for chat, row in zip(rows["sft"], rows["train"]):
        assert chat["messages"][:-1] == row["messages"] and chat["tools"] == row["tools"]
        answer = chat["messages"][-1]
        assert answer["role"] == "assistant"
        if row["category"] == "irrelevance":
            assert "tool_calls" not in answer and answer["content"]
            continue
        calls = [(call["function"]["name"], call["function"]["arguments"]) for call in answer["tool_calls"]]
        assert all(call["type"] == "function" for call in answer["tool_calls"])
        assert [name for name, _ in calls] == [name for name, _ in _calls(row)]
        for (_, arguments), (_, allowed) in zip(calls, _calls(row)):
            assert _satisfies(arguments, allowed), (arguments, allowed)


def test_parallel_rows_never_repeat_a_switch():
    switches = [function for function in library() if not repeatable(function)]
    assert switches  # toggles and one-state setters exist, and are left out of parallel rows
    names = {function["name"] for function in switches}
    made = function_tasks(train=200, heldout=50, seed=4)
    for row in made["train"] + made["heldout"]:
        called = [name for name, _ in _calls(row)]
        assert not any(called.count(name) > 1 for name in names), row["id"]


def _bfcl_functions() -> list[dict]:
    """Every function document of BFCL v4's data files (found without importing bfcl_eval)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("bfcl-eval is not installed (pip install --no-deps bfcl-eval==2026.3.23)")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    found = []
    for path in [*data.glob("BFCL_v4_*.json"), *data.glob("multi_turn_func_doc/*.json")]:
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.startswith('{"'):
                continue
            entry = json.loads(line)
            found.extend(entry.get("function", [entry] if "description" in entry else []))
    return found


def _words(text: str) -> frozenset:
    return frozenset(re.findall(r"[a-z0-9]+", text.lower()))


def test_no_generated_function_is_one_of_bfcls():
    bfcl = _bfcl_functions()
    assert len(bfcl) > 1000
    bfcl_names = {function["name"].replace(".", "_").lower() for function in bfcl}
    bfcl_descriptions = {_words(function.get("description", "")) for function in bfcl}
    for function in library():
        assert function["name"].lower() not in bfcl_names, function["name"]
        ours = _words(function["description"])
        for theirs in bfcl_descriptions:
            overlap = len(ours & theirs) / max(1, len(ours | theirs))
            assert overlap < 0.8, (function["name"], function["description"], sorted(theirs))


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    for args in (("--kind", "recipes"), ("--kind", "functions", "--train", "0"),
                 ("--kind", "functions", "--train", "20001"), ("--kind", "functions", "--heldout", "5001"),
                 ("--kind", "functions", "--memory-share", "0.5")):
        code, _, err = run_cli(capsys, "tasks", "make", "--out", tmp_path / "bad", *args)
        assert code == 2 and err.count("\n") == 1 and err.startswith("error:"), (args, err)
        assert not (tmp_path / "bad").exists()
    with pytest.raises(UserError, match="--train must be 1 to"):
        write_function_tasks(tmp_path / "bad", train=0)
    assert not (tmp_path / "bad").exists()


def test_the_cli_and_the_public_function_write_the_family(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "tasks", "make", "--kind", "functions", "--out", tmp_path / "fn",
                           "--train", "50", "--heldout", "20", "--seed", "2", "--json")
    report = json.loads(out)
    assert code == 0 and report["kind"] == "functions"
    assert report["rows"] == {"sft": 50, "train": 50, "heldout": 20}
    assert report["categories"]["train"] == category_counts(50)
    assert slm_align.write_function_tasks is write_function_tasks
    again = write_function_tasks(tmp_path / "py", train=50, heldout=20, seed=2)
    assert again["train"].read_bytes() == (tmp_path / "fn" / "train.jsonl").read_bytes()
    code, _, err = run_cli(capsys, "tasks", "make", "--kind", "functions", "--out", tmp_path / "fn")
    assert code == 2 and "already exist" in err


def test_sft_calls_render_and_read_back_as_the_runtime_reads_them(rows):
    for chat in rows["sft"][:300]:
        answer = chat["messages"][-1]
        text = conversation_text(chat["messages"], CHATML_TEMPLATE)
        _, calls = read_calls(text.rsplit("<|im_start|>assistant", 1)[1])
        expected = [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
                    for call in answer.get("tool_calls", [])]
        assert calls == expected
