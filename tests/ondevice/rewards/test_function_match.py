"""BFCL's AST rules (slm_align.ondevice.rewards.function_match) on hand-built calls, one rule at a time, and the
rewards function_call_match / function_call_graded that apply them to completions and episodes."""

import json

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.rewards.builtin import load_reward_fn
from slm_align.ondevice.rewards.columns import required_columns
from slm_align.ondevice.rewards.function_calls import (
    episode_calls,
    function_call_graded,
    function_call_match,
    reply_calls,
)
from slm_align.ondevice.rewards.function_match import (
    GRADED_CAP,
    check_calls,
    functions_from_tools,
    graded_score,
    standardize_string,
)

WEATHER = {"name": "weather.forecast", "description": "Forecast.", "parameters": {"type": "dict", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "threshold": {"type": "float"},
    "metric": {"type": "boolean"}, "fields": {"type": "array", "items": {"type": "string"}},
    "counts": {"type": "array", "items": {"type": "integer"}},
    "options": {"type": "dict", "properties": {"unit": {"type": "string"}}},
    "stops": {"type": "array", "items": {"type": "dict"}}}, "required": ["city", "days"]}}
TRUTH = {"weather.forecast": {"city": ["New York, NY", "NYC"], "days": [3], "threshold": [20.5, ""],
                              "metric": [True, ""], "fields": [["rain", "wind"], ""], "counts": [[1, 2], ""],
                              "options": [{"unit": ["C", "celsius"]}, ""],
                              "stops": [[{"at": ["home"]}, {"at": ["work"]}], ""]}}
NAME = "weather_forecast"


def verdict(arguments, name=NAME, category="simple_python"):
    return check_calls([{"name": name, "arguments": arguments}], [TRUTH], [WEATHER], category)


def ok(arguments, **kwargs) -> bool:
    return verdict(arguments, **kwargs).ok


BASE = {"city": "New York, NY", "days": 3}


def test_name_is_bfcl_name_with_dots_as_underscores():
    assert ok(BASE)
    assert not ok(BASE, name="weather.forecast")  # BFCL's OpenAI handler offers weather_forecast
    wrong = verdict(BASE, name="weather_now")
    assert not wrong.ok and wrong.failure == "wrong_tool"


@pytest.mark.parametrize("argument, value, passes", [
    ("days", 3, True), ("days", True, False), ("days", 3.0, False), ("days", "3", False),  # integer: an int only
    ("threshold", 20.5, True), ("threshold", 20, False), ("threshold", "20.5", False),  # float: int allowed (below)
    ("metric", True, True), ("metric", 1, False), ("metric", "true", False),  # boolean: a bool only
])
def test_type_rules(argument, value, passes):
    assert ok({**BASE, argument: value}) is passes


def test_an_int_is_accepted_for_a_float():
    truth = {"weather.forecast": {**TRUTH["weather.forecast"], "threshold": [20.0]}}
    arguments = {**BASE, "threshold": 20}
    assert check_calls([{"name": NAME, "arguments": arguments}], [truth], [WEATHER], "simple_python").ok
    assert not ok({**BASE, "days": 3.0})  # not the reverse: a float for an integer


@pytest.mark.parametrize("city, passes", [("New York, NY", True), ("new york ny", True), ("NEW-YORK/NY.", True),
                                          ("nyc", True), ("New York", False), ("Boston", False)])
def test_strings_compare_after_bfcl_standardisation(city, passes):
    assert ok({**BASE, "city": city}) is passes


def test_standardize_string_removes_bfcl_punctuation_only():
    assert standardize_string("April 1, 2024") == standardize_string("april 1,2024") == "april12024"
    assert standardize_string("It's_a-b*c^d/e.f") == 'it"sabcdef'
    assert standardize_string("a:b") == "a:b"


def test_a_bool_is_no_integer_even_where_it_equals_one():
    truth = {"weather.forecast": {"city": ["NYC"], "days": [1]}}
    assert check_calls([{"name": NAME, "arguments": {"city": "NYC", "days": 1}}], [truth], [WEATHER]).ok
    assert not check_calls([{"name": NAME, "arguments": {"city": "NYC", "days": True}}], [truth], [WEATHER]).ok


def test_required_optional_and_unknown_arguments():
    assert not verdict({"city": "NYC"}).ok  # days is required
    loose = {"weather.forecast": {"city": ["NYC"], "days": [3, ""]}}  # the answer would let it go; the function not
    missing = check_calls([{"name": NAME, "arguments": {"city": "NYC"}}], [loose], [WEATHER])
    assert not missing.ok and "required" in missing.reason
    assert ok({**BASE, "threshold": 20.5}) and ok(BASE)  # optional ("" allowed): given its value, or omitted
    assert not ok({**BASE, "threshold": 21.5})  # given, it must be an allowed value
    unknown = verdict({**BASE, "country": "US"})
    assert not unknown.ok and "unexpected" in unknown.reason
    truth = {"weather.forecast": {"city": ["NYC"], "days": [3], "metric": [False]}}  # listed without ""
    assert not check_calls([{"name": NAME, "arguments": BASE | {"city": "NYC"}}], [truth], [WEATHER]).ok
    assert not check_calls([{"name": NAME, "arguments": {**BASE, "city": "NYC", "threshold": 1.5}}], [truth],
                           [WEATHER]).ok  # in the function but not in the ground truth: unexpected


def test_lists_element_wise_in_order_and_typed():
    assert ok({**BASE, "fields": ["Rain", "WIND"]})
    assert not ok({**BASE, "fields": ["wind", "rain"]})
    assert ok({**BASE, "counts": [1, 2]})
    assert not ok({**BASE, "counts": [1]})
    assert ok({**BASE, "counts": [1.0, 2]})  # BFCL: an optional list ("" allowed) skips the element types
    truth = {"weather.forecast": {"city": ["NYC"], "days": [3], "counts": [[1, 2]]}}
    typed = {"city": "NYC", "days": 3, "counts": [1.0, 2]}
    assert not check_calls([{"name": NAME, "arguments": typed}], [truth], [WEATHER]).ok  # element type: integer
    assert check_calls([{"name": NAME, "arguments": {**typed, "counts": [1, 2]}}], [truth], [WEATHER]).ok


def test_dicts_key_by_key_and_lists_of_dicts():
    assert ok({**BASE, "options": {"unit": "Celsius"}})
    assert not ok({**BASE, "options": {"unit": "F"}})
    assert not ok({**BASE, "options": {"unit": "C", "wind": "kmh"}})
    assert not ok({**BASE, "options": {}})  # "unit" has no ""
    assert ok({**BASE, "stops": [{"at": "Home"}, {"at": "work"}]})
    assert not ok({**BASE, "stops": [{"at": "work"}, {"at": "home"}]})


ALARM = {"name": "alarm", "parameters": {"type": "dict", "properties": {"time": {"type": "string"}},
                                          "required": ["time"]}}
TIMER = {"name": "timer", "parameters": {"type": "dict", "properties": {"minutes": {"type": "integer"}},
                                          "required": ["minutes"]}}
PARALLEL = [{"alarm": {"time": ["06:30"]}}, {"alarm": {"time": ["07:00"]}}, {"timer": {"minutes": [5]}}]


def calls(*pairs):
    return [{"name": name, "arguments": arguments} for name, arguments in pairs]


def test_parallel_calls_match_in_any_order_and_count_matters():
    in_order = calls(("alarm", {"time": "06:30"}), ("alarm", {"time": "07:00"}), ("timer", {"minutes": 5}))
    shuffled = [in_order[2], in_order[1], in_order[0]]
    for category in ("parallel", "parallel_multiple"):
        assert check_calls(in_order, PARALLEL, [ALARM, TIMER], category).ok
        assert check_calls(shuffled, PARALLEL, [ALARM, TIMER], category).ok
        assert not check_calls(in_order[:2], PARALLEL, [ALARM, TIMER], category).ok
        assert not check_calls(in_order + in_order[:1], PARALLEL, [ALARM, TIMER], category).ok
        twice = [in_order[0], in_order[0], in_order[2]]
        assert not check_calls(twice, PARALLEL, [ALARM, TIMER], category).ok  # one call answers one expected call


def test_multiple_checks_the_one_call_against_the_expected_function():
    truth = [{"timer": {"minutes": [5]}}]
    assert check_calls(calls(("timer", {"minutes": 5})), truth, [ALARM, TIMER], "multiple").ok
    wrong = check_calls(calls(("alarm", {"time": "5"})), truth, [ALARM, TIMER], "multiple")
    assert not wrong.ok and wrong.failure == "wrong_tool"
    assert not check_calls(calls(("timer", {"minutes": 5}), ("timer", {"minutes": 5})), truth, [TIMER], "multiple").ok


def test_irrelevance_is_right_only_without_a_call():
    assert check_calls([], [], [ALARM], "irrelevance").ok
    called = check_calls(calls(("alarm", {"time": "06:30"})), [], [ALARM], "irrelevance")
    assert not called.ok and called.failure == "wrong_tool"
    assert check_calls([], [], [ALARM]).ok  # an empty ground truth is irrelevance
    missing = check_calls([], [{"timer": {"minutes": [5]}}], [TIMER])
    assert not missing.ok and missing.failure == "no_call"


def test_json_schema_tools_map_to_bfcl_types():
    tools = [{"type": "function", "function": {"name": "alarm_set", "description": "Set.", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer"}, "volume": {"type": "number"},
                                         "days": {"type": "array", "items": {"type": "string"}},
                                         "extra": {"type": "object", "properties": {}}}, "required": ["hour"]}}}]
    functions = functions_from_tools(tools)
    assert functions[0]["parameters"]["properties"] == {"hour": {"type": "integer"}, "volume": {"type": "float"},
                                                        "days": {"type": "array", "items": {"type": "string"}},
                                                        "extra": {"type": "dict"}}
    truth = [{"alarm_set": {"hour": [6], "volume": [1.0, ""]}}]
    assert check_calls(calls(("alarm_set", {"hour": 6, "volume": 1})), truth, functions).ok
    assert not check_calls(calls(("alarm_set", {"hour": 6.0})), truth, functions).ok


def test_malformed_calls_fail():
    broken = check_calls([{"name": NAME, "arguments": None}], [TRUTH], [WEATHER])
    assert not broken.ok and broken.failure == "malformed_call"


def test_graded_gives_partial_credit_below_a_match():
    right = calls((NAME, BASE))
    assert graded_score(right, [TRUTH], [WEATHER]) == 1.0
    one_value_wrong = graded_score(calls((NAME, {"city": "Boston", "days": 3})), [TRUTH], [WEATHER])
    wrong_name = graded_score(calls(("weather_now", BASE)), [TRUTH], [WEATHER])
    missing = graded_score(calls((NAME, {"city": "NYC"})), [TRUTH], [WEATHER])
    assert wrong_name == 0.0 and 0 < missing < one_value_wrong <= GRADED_CAP
    in_order = calls(("alarm", {"time": "06:30"}), ("alarm", {"time": "07:00"}), ("timer", {"minutes": 5}))
    two_of_three = graded_score(in_order[:2], PARALLEL, [ALARM, TIMER], "parallel")
    assert two_of_three == pytest.approx(GRADED_CAP * 2 / 3)
    assert graded_score(in_order[::-1], PARALLEL, [ALARM, TIMER], "parallel") == 1.0
    assert graded_score(in_order[:1], [], [ALARM, TIMER], "irrelevance") == 0.0


TOOLS = [{"type": "function", "function": {"name": "timer", "description": "Start a timer.", "parameters": {
    "type": "object", "properties": {"minutes": {"type": "integer"}}, "required": ["minutes"]}}}]


def test_function_call_match_reads_calls_with_the_runtime_parser():
    completions = ['<tool_call>{"name": "timer", "arguments": {"minutes": 5}}</tool_call>',
                   '{"name": "timer", "arguments": "{\\"minutes\\": 5}"}',  # bare, arguments as JSON text
                   '<tool_call>{"name": "timer", "arguments": {"minutes": 6}}</tool_call>',
                   '<tool_call>{"name": "timer", "arguments": {minutes</tool_call>',
                   "Five minutes, starting now."]
    truth = [[{"timer": {"minutes": [5]}}]] * len(completions)
    scores = function_call_match([""] * len(completions), completions, ground_truth=truth,
                                 tools=[TOOLS] * len(completions))
    assert scores == [1.0, 1.0, 0.0, 0.0, 0.0]
    irrelevant = function_call_match(["", ""], [completions[0], completions[4]], ground_truth=[[], "[]"],
                                     tools=[TOOLS, json.dumps(TOOLS)], category=["irrelevance", "irrelevance"])
    assert irrelevant == [0.0, 1.0]
    graded = function_call_graded([""] * 2, completions[1:3], ground_truth=truth[:2], tools=[TOOLS] * 2)
    assert graded[0] == 1.0 and 0 < graded[1] < 1


def test_on_episodes_the_first_reply_is_the_answer():
    call = {"type": "function", "function": {"name": "timer", "arguments": {"minutes": 5}}}
    again = {"type": "function", "function": {"name": "timer", "arguments": {"minutes": 7}}}
    messages = [{"role": "user", "content": "5 minute timer"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "Error: timer cannot be run here"},
                {"role": "assistant", "content": "", "tool_calls": [again]},
                {"role": "tool", "content": "Error"}, {"role": "assistant", "content": "Done."}]
    view = {"messages": messages, "calls": [], "rounds": 2, "truncated": False, "answer": "Done."}
    assert episode_calls(view) == [{"name": "timer", "arguments": {"minutes": 5}}]
    history = {"messages": [messages[0], messages[3], {"role": "user", "content": "again"},
                            {"role": "assistant", "content": "No."}], "rounds": 0, "answer": "No."}
    assert episode_calls(history) == []  # an assistant turn of the prompt is not the episode's
    truth = [[{"timer": {"minutes": [5]}}]] * 2
    scores = function_call_match(["", ""], ["Done.", "No."], ground_truth=truth, tools=[TOOLS] * 2,
                                 episodes=[view, history])
    assert scores == [1.0, 0.0]


def test_registered_by_name_with_its_columns():
    for name in ("function_call_match", "function_call_graded"):
        _, fn, weight = load_reward_fn(name)
        assert required_columns(fn) == {"ground_truth", "tools"} and weight == 1.0


def test_a_ground_truth_naming_no_offered_function_is_refused():
    with pytest.raises(UserError, match="'alarm', which is not among its tools"):
        function_call_match([""], ["x"], ground_truth=[[{"alarm": {"time": ["6"]}}]], tools=[TOOLS])
    with pytest.raises(UserError, match="ground_truth"):
        function_call_match([""], ["x"], ground_truth=[{"timer": {}}], tools=[TOOLS])


def test_reply_calls_marks_unreadable_calls():
    assert reply_calls('<tool_call>{"name": "a", "arguments": [1]}</tool_call>') == [{"name": "a", "arguments": None}]
    assert reply_calls("no call here") == []


def test_train_wiring_reads_function_rows_and_scores_with_their_columns(tmp_path, tokenizer):
    """What `train --reward function_call_match` runs: the task reader renders each row's messages with
    its tools, the columns reach the reward, and the rows' columns satisfy its requirements."""
    from slm_align.data.tasks import read_tasks
    from slm_align.ondevice.rewards.columns import check_columns, with_columns

    rows = [{"messages": [{"role": "user", "content": "5 minute timer"}], "tools": TOOLS, "category": "simple",
             "ground_truth": [{"timer": {"minutes": [5]}}]},
            {"messages": [{"role": "user", "content": "Hello"}], "tools": TOOLS, "category": "irrelevance",
             "ground_truth": []}]
    path = tmp_path / "functions.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tasks = read_tasks(path, tokenizer)
    reward = with_columns(load_reward_fn("function_call_match")[1], tasks)
    check_columns(reward, tasks.column_names())
    call = '<tool_call>{"name": "timer", "arguments": {"minutes": 5}}</tool_call>'
    assert reward(tasks.prompts, [call, call]) == [1.0, 0.0]
    assert reward(tasks.prompts, ["Sure.", "Hi there!"]) == [0.0, 1.0]
