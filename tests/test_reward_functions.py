"""Reward functions: built-ins, a user's own function loaded as module:function, weights."""

import textwrap

import pytest

from slm_align.errors import UserError
from slm_align.reward.functions import (
    combine,
    exact_answer,
    extract_answer,
    json_tool_call,
    length_window,
    load_reward_fn,
)

USER_MODULE = textwrap.dedent('''
    # How a user writes a reward: a function of prompts and completions returning one float each.
    def mentions_ball(prompts, completions, **context):
        return [1.0 if "ball" in c else 0.0 for c in completions]
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_a_users_function_is_loaded_and_weighted(user_module):
    name, fn, weight = load_reward_fn(f"{user_module}:mentions_ball@0.5")
    assert (name, weight) == ("my_rewards:mentions_ball", 0.5)
    reward = combine([f"{user_module}:mentions_ball@0.5", "length_window@2"])
    completions = ["a red ball " * 10, "nothing here"]
    breakdown = reward.breakdown(["p", "p"], completions)
    assert breakdown["my_rewards:mentions_ball"] == [1.0, 0.0]
    assert reward(["p", "p"], completions) == pytest.approx([0.5 * 1.0 + 2 * 1.0, 0.0 + 2 * (2 / 20)])


def test_python_callables_combine_with_specs():
    reward = combine(callables=[(lambda prompts, completions, **_: [len(c) for c in completions], 0.1)])
    assert reward(["p"], ["abcd"]) == pytest.approx([0.4])


@pytest.mark.parametrize("spec, expected", [
    ("nomodule_xyz:fn", "cannot import module nomodule_xyz"),
    ("json:not_there", "has no not_there"),
    ("json:__doc__", "is not callable"),
    ("just_a_name", "use module:function"),
    ("length_window@heavy", "is not a number"),
])
def test_bad_reward_specs_are_user_errors(spec, expected):
    with pytest.raises(UserError, match=expected):
        load_reward_fn(spec)


def test_length_window_values():
    assert length_window([""] * 4, ["w " * 10, "w " * 50, "w " * 120, "w " * 200]) == [0.5, 1.0, 0.5, 0.0]


def test_exact_answer():
    assert extract_answer("so the sum is 1,234.") == "1234"
    assert extract_answer("Answer: Paris.") == "paris"
    completions = ["I think 2+2 = 4", "#### 5", "Answer: paris"]
    assert exact_answer([""] * 3, completions, references=["4", "4", "Paris"]) == [1.0, 0.0, 1.0]
    with pytest.raises(UserError, match="needs reference answers"):
        exact_answer([""], ["4"])


def test_json_tool_call():
    schema = {"type": "object", "required": ["name", "arguments"],
              "properties": {"name": {"const": "add"}, "arguments": {"type": "object", "required": ["a", "b"]}}}
    completions = ['call: {"name": "add", "arguments": {"a": 1, "b": 2}} done', '{"name": "add", "arguments": {}}',
                   "no json {here", '{"name": "sub", "arguments": {"a": 1, "b": 2}}']
    assert json_tool_call([""] * 4, completions, schema=schema) == [1.0, 0.5, 0.0, 0.5]
    assert json_tool_call([""], ['{"name": "x", "arguments": {}}']) == [1.0]
