"""Reward functions: built-ins, a user's own function loaded as module:function, weights."""

import functools
import random
import textwrap

import pytest

from slm_align.data.tasks import TaskSet
from slm_align.errors import UserError
from slm_align.ondevice.rewards.answers import exact_answer, extract_answer
from slm_align.ondevice.rewards.builtin import BUILTINS, combine, length_window, load_reward_fn
from slm_align.ondevice.rewards.columns import check_columns, required_columns, with_columns
from slm_align.ondevice.rewards.protocol import CombinedReward
from slm_align.ondevice.rewards.tool_calls import json_tool_call, tool_task
from slm_align.ondevice.tools.builtin import default_tools

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
    completions = ['call: {"name": "add", "arguments": {"a": 1, "b": 2}} done',
                   '{"name": "add", "arguments": {}}',
                   "no json {here", '{"name": "sub", "arguments": {"a": 1, "b": 2}}']
    assert json_tool_call([""] * 4, completions, schema=schema) == [1.0, 0.5, 0.0, 0.5]
    assert json_tool_call([""], ['{"name": "x", "arguments": {}}']) == [1.0]


def test_exact_answer_reads_the_answer_column_and_compares_numbers_by_value():
    completions = ["The total is 350.0", "Answer: 1,000 apples",
                   "#### 72", "so it is 351", "The capital is Paris.",
                   "Not Paris, Lyon", "Today is 2024-01-05.", "no idea"]
    answers = ["350", 1000, "Natalia sold 48 + 24 = 72 clips.\n#### 72",
               "350", "paris", "Paris", "2024-01-05", None]
    assert exact_answer([""] * 8, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert exact_answer([""], ["Answer: 1,234,567"], answer=["1234567"]) == [1.0]
    with pytest.raises(UserError, match="got 1 answers for 2 completions"):
        exact_answer(["", ""], ["1", "2"], answer=["1"])


def test_json_tool_call_validates_against_the_rows_own_tools():
    calc = {"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
    completions = ['<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>',
                   # valid
                   '<tool_call>{"name": "calculator", "arguments": {"expr": 6}}</tool_call>',
                   # bad arguments
                   '<tool_call>{"name": "weather", "arguments": {"city": '
                   '"Oslo"}}</tool_call>',  # not a row tool
                   '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"</tool_call>',
                   # malformed
                   '{"name": "weather", '
                   '"arguments": {"city": "Oslo"}}']  # no tools column: the generic shape
    tools = [[calc]] * 4 + [None]
    assert json_tool_call([""] * 5, completions, tools=tools) == [1.0, 0.5, 0.5, 0.0, 1.0]


CALL = '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def call(name, arguments):
    return CALL.format(name=name, arguments=arguments)


@pytest.mark.parametrize("completion, score", [
    ("The answer is 391.", 0.0),  # no call
    ("<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": </tool_call>",
     0.25),  # bad JSON
    (call("calculator", '{"expr": "17 * 23"}'), 0.25),  # arguments break the schema
    (call("weather", '{"city": "Oslo"}'), 0.25),  # a tool the task does not have
    (call("current_time", '{"timezone": "UTC"}'), 0.5),  # valid call, wrong tool
    (call("calculator", '{"expression": "17 * 24"}'), 0.75),  # right tool, wrong answer
    (call("calculator", '{"expression": "17 / 0"}'), 0.75),  # right tool, the tool fails
    (call("calculator", '{"expression": "17 * 23"}'), 1.0),  # right answer
    ("Let me compute. " + call("calculator", '{"expression": "23 * 17"}') + " then " + call("x", "{}"), 1.0),
    ('{"name": "calculator", "arguments": {"expression": "391.0"}}',
     1.0),  # a bare call as the whole reply
])
def test_tool_task_scale(completion, score):
    tools = default_tools().specs()
    assert tool_task(["p"], [completion], answer=["391"], tools=[tools], tool=["calculator"]) == [score]


def test_tool_task_without_tools_or_tool_columns_uses_the_builtin_tools():
    completions = [call("current_time", '{"timezone": "UTC"}'), call("calculator", '{"expression": "1,5"}'),
                   call("calculator", '{"expression": "2**10"}'), call("calculator", '{"expression": "1/3"}')]
    answers = ["UTC", "1.5", "1,024", "0.3333333333333333"]
    assert tool_task([""] * 4, completions, answer=answers) == [1.0, 0.75, 1.0, 1.0]


def test_tool_task_runs_a_users_tool_from_a_bound_registry():
    registry = default_tools()

    @registry.register
    def weather(city: str) -> str:
        """Weather in a city."""
        return f"sunny in {city}"

    tools = [registry.get("weather").spec()]
    completions = [call("weather", '{"city": "Oslo"}')]
    assert tool_task([""], completions, answer=["sunny"], tools=[tools]) == [0.75]  # built-ins cannot run it
    bound = functools.partial(tool_task, registry=registry)
    assert bound([""], completions, answer=["sunny"], tools=[tools]) == [1.0]


def test_tool_task_is_a_builtin():
    assert BUILTINS["tool_task"] is tool_task
    assert load_reward_fn("tool_task@2")[1:] == (tool_task, 2.0)


def test_columns_reach_a_custom_reward_through_with_columns():
    seen = {}

    def answer_in_completion(prompts, completions, answer, **context):
        seen.update(prompts=list(prompts), answer=list(answer), context=context)
        return [float(a in c) for c, a in zip(completions, answer)]

    tasks = TaskSet([f"q{i}" for i in range(4)], [{"answer": str(10 * i), "level": i} for i in range(4)])
    prompts = [p for p in tasks.prompts for _ in range(3)]  # GRPO: a group of 3 per prompt
    random.Random(0).shuffle(prompts)
    completions = [f"it is {10 * int(p[1:])}" if i % 2 else "dunno" for i, p in enumerate(prompts)]
    reward = with_columns(answer_in_completion, tasks)
    scores = reward(prompts, completions, truncated=[False] * 12)
    assert seen["answer"] == [str(10 * int(p[1:])) for p in prompts]
    assert seen["context"] == {"level": [int(p[1:]) for p in prompts], "truncated": [False] * 12}
    assert scores == [float(i % 2) for i in range(12)]
    with pytest.raises(UserError, match="no task row has the prompt 'q9'"):
        reward(["q9"], ["x"])


def test_with_columns_keeps_the_breakdown_of_a_combined_reward():
    def strict(prompts, completions, answer):  # no **kwargs: columns it does not name are left out
        return [float(c == a) for c, a in zip(completions, answer)]

    tasks = TaskSet(["a", "b"], [{"answer": "1", "tools": None}, {"answer": "2", "tools": None}])
    reward = with_columns(combine(["exact_answer"], callables=[(strict, 0.5)]), tasks)
    parts = reward.breakdown(["b", "a", "b"], ["2", "2", "Answer: 2"], truncated=[False] * 3)
    assert parts == {"exact_answer": [1.0, 0.0, 1.0], "strict": [1.0, 0.0, 0.0]}
    assert reward(["b", "a", "b"], ["2", "2", "Answer: 2"]) == [1.5, 0.0, 1.0]
    assert [name for name, _, _ in reward.terms] == ["exact_answer", "strict"]
    assert not hasattr(with_columns(strict, tasks), "breakdown")


def test_a_column_named_like_a_context_argument_is_refused():
    reward = with_columns(length_window, TaskSet(["a"], [{"truncated": "yes"}]))
    with pytest.raises(UserError, match="task column 'truncated'"):
        reward(["a"], ["x"], truncated=[False])


def test_required_columns():
    def custom(prompts, completions, answer, *, tool, level=1, truncated=None, **rest):
        return [0.0] * len(completions)

    def positional_names(p, c, solution):
        return [0.0] * len(c)

    assert required_columns(custom) == {"answer", "tool"}
    assert required_columns(positional_names) == {"solution"}
    assert required_columns(exact_answer) == {"answer"}
    assert required_columns(tool_task) == {"answer"}
    assert required_columns(json_tool_call) == set()
    assert required_columns(functools.partial(custom, tool="calculator")) == {"answer"}
    combined = CombinedReward([("custom", custom, 1.0), ("json_tool_call", json_tool_call, 1.0),
                               ("positional_names", positional_names, 1.0)])
    assert required_columns(combined) == {"answer", "tool", "solution"}
    assert required_columns(with_columns(combined, TaskSet([], []))) == {"answer", "tool", "solution"}


def test_a_missing_column_is_one_line_before_training():
    def custom(prompts, completions, solution, **_):
        return [0.0] * len(completions)

    reward = combine(["exact_answer", "length_window"], callables=[(custom, 1.0)])
    check_columns(reward, {"answer", "solution", "tools"})
    with pytest.raises(UserError) as caught:
        check_columns(reward, {"tools"})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("reward exact_answer needs column answer; reward custom needs column "
                              "solution, which the task data lacks")
    assert "(its columns: tools)" in message
    with pytest.raises(UserError, match=r"tool_task needs column answer.*\(its columns: none besides the prompt"):
        check_columns(tool_task, set())


def episode(answer: str, *calls: tuple[str, bool]) -> dict:
    """An episode as rewards see it: its calls (name, ok) and final answer."""
    return {"messages": [], "calls": [{"name": name, "arguments": {}, "ok": ok, "content": ""} for name, ok in calls],
            "rounds": len(calls), "truncated": False, "answer": answer}


def test_task_success_judges_the_final_answer_as_evaluate_agent_does():
    views = [episode("It is 5.", ("calculator", True)), episode("It is 6.", ("calculator", True)), episode("5")]
    assert BUILTINS["task_success"]([""] * 3, ["ignored"] * 3, answer=["5"] * 3, episodes=views) == [1.0, 0.0, 1.0]
    assert BUILTINS["task_success"](["", ""], ["The answer is 1,200.", "12"], answer=["1200", "13"]) == [1.0, 0.0]


def test_tool_task_on_episodes_scores_the_episode_by_its_category():
    views = [episode("5", ("calculator", True)), episode("7", ("calculator", True)), episode("7", ("clock", True)),
             episode("7", ("calculator", False)), episode("7")]
    scores = tool_task([""] * 5, ["<tool_call>{}</tool_call>"] * 5, answer=["5"] * 5, tool=["calculator"] * 5,
                       episodes=views)
    assert scores == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_call_format_is_the_share_of_calls_that_ran_and_needs_episodes():
    views = [episode("", ("calculator", True), ("calculator", False)), episode(""), episode("", ("clock", True))]
    assert BUILTINS["call_format"]([""] * 3, [""] * 3, episodes=views) == [0.5, 0.0, 1.0]
    with pytest.raises(UserError, match="call_format scores agent episodes"):
        BUILTINS["call_format"]([""], [""])


def test_environment_reward_asks_each_episodes_environment():
    class Env:
        def __init__(self, value):
            self.value = value

        def get_reward(self):
            return self.value

    assert BUILTINS["environment_reward"](["", ""], ["", ""], environments=[Env(0.25), Env(2)]) == [0.25, 2.0]
    with pytest.raises(UserError, match="get_reward"):
        BUILTINS["environment_reward"]([""], [""], environments=[None])


def test_episodes_and_environments_are_never_required_columns():
    def needs_episodes(prompts, completions, episodes, environments):
        return [0.0]

    assert required_columns(needs_episodes) == set()
