"""The bundled calculator task and agent evaluation in the runtime: generation, split, SFT rows that
render as the runtime renders, failure categories, and `evaluate-agent` end to end."""

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest

from slm_align.data.agent_tasks import (
    leaks,
    make_tasks,
    sft_chats,
    sft_rows,
    split_tasks,
    tool_call_text,
    write_agent_tasks,
)
from slm_align.data.encoding import render as render_example
from slm_align.data.readers import row_to_example
from slm_align.errors import UserError
from slm_align.ondevice.agent import task_eval
from slm_align.ondevice.agent.prompt import turn_end
from slm_align.ondevice.agent.task_eval import (
    FAILURES,
    compare,
    open_agent,
    run_task,
    sample_seed,
    summarize,
)
from slm_align.ondevice.rewards.episodes import answers_match, classify
from slm_align.ondevice.templates.chat import CHATML_TEMPLATE, render, shown_tools, template_form, template_traits
from slm_align.ondevice.tools.builtin import calculator, default_tools
from slm_align.progress import CADENCE_ENV
from slm_align.stats import pass_at_k, wilson_interval
from tests.helpers import export_bundled, run_cli, tree_digest

OPERATIONS = {"+": Fraction.__add__, "-": Fraction.__sub__, "*": Fraction.__mul__, "/": Fraction.__truediv__}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """The bundled model exported once to GGUF Q8_0."""
    pytest.importorskip("llama_cpp")
    return export_bundled(tmp_path_factory.mktemp("artifacts"), ("gguf", "Q8_0"))["gguf"]


class ScriptedBackend:
    """A real backend whose completions are scripted, to drive the tool loop deterministically."""

    def __init__(self, backend, replies):
        self.inner = backend
        self.replies = list(replies)
        self.prompts = []
        self.params = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompt, params, grammar=None):
        """The next scripted reply's tokens, then the end of the turn as a model trained on the
        template writes it (the template's closing token; EOS when it closes with plain text)."""
        self.prompts.append(prompt)
        self.params.append(params)
        yield from self.inner.tokenize(self.replies.pop(0), add_special=False)
        yield next(iter(turn_end(self.inner) or self.inner.eos_ids))


def scripted_agent(artifact, replies):
    """The evaluation agent on ``artifact`` with its completions scripted
    (its token counter kept)."""
    agent = open_agent(artifact, max_tokens=200)
    agent.backend.inner = ScriptedBackend(agent.backend.inner, replies)
    return agent


def independent_value(expression: str) -> Fraction:
    first, op, second = expression.split()
    return OPERATIONS[op](Fraction(first), Fraction(second))


def canonical(expression: str) -> tuple:
    first, op, second = expression.split()
    if op in "+*":
        return (op, frozenset((Fraction(first), Fraction(second))))
    return (op, Fraction(first), Fraction(second))


def test_generation_is_deterministic_and_seeded():
    assert split_tasks(60, 20, seed=3) == split_tasks(60, 20, seed=3)
    assert split_tasks(60, 20, seed=3) != split_tasks(60, 20, seed=4)
    kinds = {row["prompt"][0]["content"].split()[0] for row in make_tasks(200)}
    assert len(kinds) > 8  # several templates, arithmetic and units


def test_split_shares_no_question_and_no_expression():
    train, heldout = split_tasks(300, 100, seed=0)
    assert len(train) == 300 and len(heldout) == 100 and leaks(train, heldout) is None
    questions = [row["prompt"][0]["content"] for row in train + heldout]
    expressions = [canonical(row["expression"]) for row in train + heldout]
    assert len(set(questions)) == len(questions) and len(set(expressions)) == len(expressions)
    assert leaks(train, train[:1]) is not None


def test_answers_are_right_and_what_the_calculator_says():
    for row in make_tasks(300, seed=1):
        value = independent_value(row["expression"])
        assert Fraction(row["answer"]) == value
        assert calculator(row["expression"]) == row["answer"]
        assert row["tool"] == "calculator" and row["tools"] == default_tools().specs()[:1]
        assert all(len(part.replace(".", "")) <= 4 for part in row["expression"].split()[::2])


def test_sft_rows_are_two_chats_per_task_and_parse_as_the_runtime_parses():
    task = make_tasks(1, seed=2)[0]
    call_row, answer_row = sft_rows(task)
    assert [m["role"] for m in call_row["messages"]] == ["user", "assistant"]
    assert [m["role"] for m in answer_row["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert call_row["messages"][-1]["tool_calls"] == answer_row["messages"][1]["tool_calls"]  # stored once
    written = call_text_of(call_row)  # what a model under a ChatML template writes
    parsed = default_tools().parse_calls(written)
    assert not parsed.errors and parsed.calls[0].arguments == {"expression": task["expression"]}
    assert answers_match(answer_row["messages"][-1]["content"], task["answer"])


def call_text_of(row: dict) -> str:
    """The call turn of an SFT row as a ChatML template renders it: the call's text as content."""
    return template_form(row["messages"], template_traits(CHATML_TEMPLATE))[-1]["content"]


def test_write_agent_tasks_and_refuse_to_overwrite(tmp_path, capsys):
    paths = write_agent_tasks(tmp_path / "calc", n_train=10, n_heldout=4, seed=0)
    lines = {name: path.read_text().splitlines() for name, path in paths.items()}
    assert [len(lines[name]) for name in ("sft", "train", "heldout")] == [20, 10, 4]
    assert all("answer" in json.loads(line) for line in lines["heldout"])
    code, _, err = run_cli(capsys, "tasks", "make", "--out", tmp_path / "calc")
    assert code == 2 and "already exist" in err and err.count("\n") == 1
    assert paths["train"].read_text().splitlines() == lines["train"]


def test_memory_share_answers_that_share_of_tasks_without_the_tool(tmp_path, capsys):
    train = make_tasks(200, seed=3)
    chats = sft_chats(train, memory_share=0.5, seed=3)
    direct = [row for row in chats if len(row["messages"]) == 2 and "tool_calls" not in row["messages"][-1]]
    assert 80 <= len(direct) <= 120 and len(chats) == 2 * len(train) - len(direct)
    answers = {task["prompt"][0]["content"]: task["answer"] for task in train}
    for row in direct:  # the teacher's answer from memory is right: only the tool is left out
        assert answers_match(row["messages"][-1]["content"], answers[row["messages"][0]["content"]])
    assert sft_chats(train, 0.5, seed=3) == chats != sft_chats(train, 0.5, seed=4)  # drawn with the seed
    assert sft_chats(train, 0.0, seed=3) == [row for task in train for row in sft_rows(task)]
    assert all(len(row["messages"]) == 2 for row in sft_chats(train, 1.0, seed=3))
    code, out, _ = run_cli(capsys, "tasks", "make", "--out", tmp_path / "calc", "--train", "40", "--heldout", "4",
                           "--memory-share", "1", "--json")
    assert code == 0 and json.loads(out)["rows"] == {"sft": 40, "train": 40, "heldout": 4}
    code, _, err = run_cli(capsys, "tasks", "make", "--out", tmp_path / "bad", "--memory-share", "1.5")
    assert code == 2 and "memory-share" in err and not (tmp_path / "bad").exists()
    with pytest.raises(UserError, match="between 0 and 1"):
        sft_chats(train, -0.1)


def test_sft_rows_render_as_the_runtime_renders(gguf, tokenizer):
    task = make_tasks(1, seed=5)[0]
    call_row, answer_row = sft_rows(task)
    final = answer_row["messages"][-1]["content"]
    agent = scripted_agent(gguf, [call_text_of(call_row), final])
    result = run_task(agent, task)
    assert result.category == "success" and result.rounds == 1
    backend = agent.backend.inner.inner
    tools = agent.tools.specs()
    traits = template_traits(backend.chat_template)

    def shown(messages):  # ChatML drops tools: SFT and the runtime both show the fallback
        return shown_tools(backend.chat_template, messages, tools)

    assert shown([]) != []
    runtime_text = render(backend.chat_template, shown(template_form(agent.messages, traits)), backend.bos_token,
                          backend.eos_token, tools, add_generation_prompt=False)
    for row, turns in ((answer_row, agent.messages), (call_row, agent.messages[:2])):
        example = row_to_example("sft", row)
        prompt, completion = render_example(example, tokenizer)  # what SFT trains on
        expected = render(backend.chat_template, shown(template_form(turns, traits)), backend.bos_token,
                          backend.eos_token, tools, add_generation_prompt=False)
        assert prompt + completion == expected
        model_prompt = render(backend.chat_template, shown(template_form(turns[:-1], traits)), backend.bos_token,
                              backend.eos_token, tools)
        assert prompt == model_prompt  # the text the model continues at inference
    assert runtime_text.endswith(final + "<|im_end|>\n")
    seen = [backend.detokenize(ids) for ids in agent.backend.inner.prompts]  # what the runtime fed the model
    assert seen == [render_example(row_to_example("sft", row), tokenizer)[0] for row in (call_row, answer_row)]


HAND_WRITTEN = [  # (calls, final text, category) for the task "17 * 23" -> 391
    ([{"name": "calculator", "arguments": {"expression": "17 * 23"}, "ok": True, "content": "391"}],
     "The answer is 391.", "success"),
    ([], "391", "success"),
    ([], "I think it is 400.", "no_call"),
    ([{"name": "", "arguments": None, "ok": False, "content": "Error: malformed JSON"}], "Sorry.", "malformed_call"),
    ([{"name": "calculator", "arguments": {"expression": "__import__(1)"}, "ok": False, "content": "Error: no"}],
     "Sorry.", "malformed_call"),
    ([{"name": "current_time", "arguments": {}, "ok": True, "content": "2025-01-01T00:00:00"}], "2025",
     "wrong_tool"),
    ([{"name": "rm_rf", "arguments": None, "ok": False, "content": "Error: unknown tool"}], "Done.", "wrong_tool"),
    ([{"name": "calculator", "arguments": {"expression": "17 + 23"}, "ok": True, "content": "40"}],
     "The answer is 40.", "wrong_answer"),
]


@pytest.mark.parametrize("calls, final, category", HAND_WRITTEN)
def test_failure_categories_on_hand_written_turns(calls, final, category):
    assert classify(calls, final, "391", "calculator") == category


def test_answers_match_numerically():
    assert answers_match("The answer is 391.", "391") and answers_match("It is 350.0", "350")
    assert answers_match("1,200 grams", "1200") and not answers_match("It is 12", "13")
    assert not answers_match("", "391")


def test_compare_gives_a_paired_interval_and_a_verdict():
    from slm_align.ondevice.agent.task_eval import TaskResult

    def results(category, n=20):
        return [TaskResult("q", "1", "r", category, 1, 1, 1, 10) for _ in range(n)]

    better = compare(results("no_call"), results("success"))
    assert better["success_delta"] == 1.0 and better["ci95"] == [1.0, 1.0] and better["verdict"] == "better"
    same = compare(results("success"), results("success"))
    assert same["ci95"] == [0.0, 0.0] and same["verdict"].startswith("no clear difference")


def test_task_eval_counts_on_a_scripted_backend(gguf):
    tasks = make_tasks(5, seed=7)
    calls = [tool_call_text(task["expression"]) for task in tasks]
    script = [calls[0], f"The answer is {tasks[0]['answer']}.",
              "I do not know.",
              '<tool_call>{"name": "calculator", "arguments": {oops</tool_call>', "Sorry.",
              '<tool_call>{"name": "current_time", "arguments": {"timezone": "UTC"}}</tool_call>',
              "Noon.",
              calls[4], "The answer is 0.5."]
    agent = scripted_agent(gguf, script)
    results = [run_task(agent, task) for task in tasks]
    assert [r.category for r in results] == ["success", "no_call", "malformed_call", "wrong_tool", "wrong_answer"]
    summary = summarize(results)
    assert summary["success_rate"] == 0.2 and summary["call_rate"] == 0.8
    # the row offers the calculator alone: its current_time call fails, as in RL's episodes
    assert summary["valid_call_rate"] == 2 / 4 and summary["rounds_per_task"] == 4 / 5
    assert summary["failures"] == {"no_call": 1, "malformed_call": 1, "wrong_tool": 1, "wrong_answer": 1}
    assert all(r.tokens > 0 for r in results) and results[0].tokens > results[1].tokens


def test_evaluate_agent_end_to_end_on_the_bundled_export(gguf, tmp_path, capsys, monkeypatch):
    """The bundled export against a copy of it whose completions are scripted to solve every task: the
    comparison is the paired difference of the two."""
    from slm_align.ondevice.agent.loading import load_model

    code, out, err = run_cli(capsys, "tasks", "make", "--out", tmp_path / "calc", "--train", "8", "--heldout", "5",
                             "--json")
    assert code == 0, err
    heldout = json.loads(out)["files"]["heldout"]
    tasks = [json.loads(line) for line in Path(heldout).read_text().splitlines()][:3]
    solver = tmp_path / "solver.gguf"
    shutil.copyfile(gguf, solver)
    script = [reply for task in tasks for reply in (tool_call_text(task["expression"]), f"It is {task['answer']}.")]

    def load(artifact, **options):
        model = load_model(artifact, **options)
        if Path(artifact) == solver:
            model.backend = ScriptedBackend(model.backend, script)
        return model

    monkeypatch.setattr(task_eval, "load_model", load)
    report_path = tmp_path / "report.json"
    code, out, err = run_cli(capsys, "evaluate-agent", heldout, "--artifact", gguf, "--artifact", solver,
                             "--limit", "3", "--max-new-tokens", "24", "--out", report_path, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report == json.loads(report_path.read_text())
    assert report["n_tasks"] == 3 and len(report["artifacts"]) == 2 and len(report["comparisons"]) == 1
    first = report["artifacts"][0]
    for key in ("success_rate", "valid_call_rate", "call_rate", "rounds_per_task", "tokens_per_task", "failures"):
        assert key in first
    assert len(first["results"]) == 3 and sum(first["failures"].values()) + 3 * first["success_rate"] == 3
    solved = report["artifacts"][1]
    assert [r["category"] for r in solved["results"]] == ["success"] * 3 and solved["success_rate"] == 1.0
    comparison = report["comparisons"][0]
    assert comparison["success_delta"] == pytest.approx(1.0 - first["success_rate"])  # solver minus the export
    low, high = comparison["ci95"]
    assert 0 <= low <= comparison["success_delta"] <= high <= 1  # every paired difference is 0 or 1 here
    if first["success_rate"] == 0:  # nothing solved by the export: every task differs by exactly 1
        assert comparison["ci95"] == [1.0, 1.0] and comparison["verdict"] == "better"
    assert (report["samples"], report["decoding"], report["temperature"]) == (1, "greedy", 0.0)
    assert report["max_tool_rounds"] == 3 and set(report["intervals"]) >= {"success_ci95", "pass_at_1_ci95"}
    for row in report["artifacts"]:
        assert_consistent(row, samples=1, tasks=3)


def assert_consistent(row: dict, samples: int, tasks: int) -> None:
    """An artifact's figures are in their domains and are what its per-episode records say."""
    results = row["results"]
    n = len(results)
    assert (row["tasks"], row["episodes"]) == (tasks, n) and n == tasks * samples
    assert sorted((r["task"], r["sample"]) for r in results) == [(t, s) for t in range(tasks) for s in range(samples)]
    successes = sum(r["category"] == "success" for r in results)
    assert row["successes"] == successes and row["success_rate"] == successes / n
    low, high = row["success_ci95"]
    assert [low, high] == list(wilson_interval(successes, n)) and 0 <= low <= row["success_rate"] <= high <= 1
    assert row["call_rate"] == sum(r["calls"] > 0 for r in results) / n and 0 <= row["call_rate"] <= 1
    calls, valid = sum(r["calls"] for r in results), sum(r["valid_calls"] for r in results)
    assert (row["calls"], row["valid_calls"]) == (calls, valid)
    assert row["valid_call_rate"] == (valid / calls if calls else None)
    assert row["rounds_per_task"] == pytest.approx(sum(r["rounds"] for r in results) / n)
    assert row["tokens_per_task"] == pytest.approx(sum(r["tokens"] for r in results) / n)
    assert all(0 <= r["rounds"] <= 3 and r["tokens"] >= 0 and r["valid_calls"] <= r["calls"] for r in results)
    for name in FAILURES:
        count = sum(r["category"] == name for r in results)
        assert row["failures"][name] == count and row["failure_shares"][name] == count / n
    assert sum(row["failures"].values()) + successes == n
    keys = ("pass_at_k", "pass_at_k_ci95", "pass_at_1", "pass_at_1_ci95")
    if samples == 1:
        assert all(row[key] is None for key in keys) and all(r["seed"] is None for r in results)
        return
    per_task = [[r["category"] == "success" for r in results if r["task"] == t] for t in range(tasks)]
    assert row["pass_at_k"] == pytest.approx(sum(pass_at_k(samples, sum(g), samples) for g in per_task) / tasks)
    assert row["pass_at_k"] == pytest.approx(sum(any(g) for g in per_task) / tasks)  # n = k: any success
    assert row["pass_at_1"] == pytest.approx(row["success_rate"])  # equal samples per task
    for key in ("pass_at_k", "pass_at_1"):
        low, high = row[f"{key}_ci95"]
        assert 0 <= low <= row[key] <= high <= 1
    assert [r["seed"] for r in results] == [sample_seed(0, r["task"], r["sample"]) for r in results]


def test_samples_2_runs_each_task_twice_with_seeded_sampling_and_reports_pass_at_k(gguf, tmp_path, capsys,
                                                                                    monkeypatch):
    """A scripted model through the CLI: 3 tasks x 2 samples, 10 completions, the per-task
    successes [1, 0, 2] of 2; pass@2 = mean(1, 0, 1), pass@1 = mean(1/2, 0, 1)."""
    from slm_align.ondevice.agent.loading import load_model

    tasks = make_tasks(3, seed=11)
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    call = [tool_call_text(task["expression"]) for task in tasks]
    script = [call[0], f"The answer is {tasks[0]['answer']}.",  # task 0: success
              "I do not know.",  # task 0: no call
              "I do not know.",  # task 1: no call
              '<tool_call>{"name": "calculator", "arguments": {oops</tool_call>', "Sorry.",  # task 1: malformed
              call[2], f"It is {tasks[2]['answer']}.", call[2], f"{tasks[2]['answer']}"]  # task 2: success twice
    backends = []

    def scripted(artifact, **options):
        model = load_model(artifact, **options)
        model.backend = ScriptedBackend(model.backend, script)
        backends.append(model.backend)
        return model

    monkeypatch.setattr(task_eval, "load_model", scripted)
    code, out, err = run_cli(capsys, "evaluate-agent", path, "--artifact", gguf, "--samples", "2",
                             "--temperature", "0.5", "--max-tool-rounds", "2", "--max-new-tokens", "200",
                             "--json")
    assert code == 0, err
    report = json.loads(out)
    backend = backends[0]
    assert len(backend.params) == 10 and backend.replies == []  # every scripted completion, no more
    assert (report["samples"], report["decoding"], report["temperature"]) == (2, "sampled", 0.5)
    assert report["max_tool_rounds"] == 2
    row = report["artifacts"][0]
    assert [r["category"] for r in row["results"]] == ["success", "no_call", "no_call", "malformed_call",
                                                       "success", "success"]
    assert_consistent(row, samples=2, tasks=3)
    assert row["pass_at_k"] == pytest.approx(2 / 3) and row["pass_at_1"] == pytest.approx(0.5)
    assert row["call_rate"] == pytest.approx(4 / 6) and row["valid_call_rate"] == 3 / 4
    assert [r["rounds"] for r in row["results"]] == [1, 0, 0, 1, 1, 1]
    seeds = [r["seed"] for r in row["results"] for _ in range(1 + r["rounds"])]  # one per completion
    assert [(p.temperature, p.seed) for p in backend.params] == [(0.5, seed) for seed in seeds]
    assert len(set(seeds)) == 6


def test_sampled_episodes_are_reproducible_and_print_pass_at_k(gguf, tmp_path, capsys):
    code, out, err = run_cli(capsys, "tasks", "make", "--out", tmp_path / "calc", "--train", "8", "--heldout", "5",
                             "--json")
    assert code == 0, err
    heldout = json.loads(out)["files"]["heldout"]
    args = ["evaluate-agent", heldout, "--artifact", gguf, "--limit", "2", "--max-new-tokens", "12",
            "--samples", "2", "--max-tool-rounds", "1"]
    reports = []
    for _ in range(2):
        code, out, err = run_cli(capsys, *args, "--json")
        assert code == 0, err
        reports.append(json.loads(out))
    assert reports[0] == reports[1]  # seeds from the task and the sample: the same episodes
    row = reports[0]["artifacts"][0]
    assert_consistent(row, samples=2, tasks=2)
    assert reports[0]["max_tool_rounds"] == 1 and all(r["rounds"] <= 1 for r in row["results"])
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    out = " ".join(out.split())
    for text in ("2 samples each at temperature 0.7", "up to 1 tool rounds", "pass@2", "pass@1", "[95% CI]", "call",
                 "valid", "/task", "failures", "bootstrap over tasks", "4 episodes"):
        assert text in out, text
    assert "success" not in out  # sampled: no greedy figure


def test_the_printed_table_names_the_commonest_failures(capsys):
    from slm_align.cli.tasks import print_agent_report, top_failures

    row = {"artifact": "a/model.gguf", "success_rate": 0.2, "success_ci95": [0.04, 0.62], "call_rate": 0.8,
           "valid_call_rate": None, "rounds_per_task": 0.8, "tokens_per_task": 12.0,
           "failures": {"no_call": 1, "malformed_call": 3, "wrong_tool": 0, "wrong_answer": 0},
           "failure_shares": {"no_call": 0.2, "malformed_call": 0.6, "wrong_tool": 0.0, "wrong_answer": 0.0}}
    assert top_failures(row) == "malformed 3 (60%)\nno call 1 (20%)"
    assert top_failures({**row, "failures": dict.fromkeys(row["failures"], 0)}) == "none"
    other = {**row, "artifact": "b/model.gguf", "success_rate": 0.4}
    comparison = {"baseline": "a/model.gguf", "candidate": "b/model.gguf", "success_delta": 0.2, "ci95": [-0.2, 0.6],
                  "verdict": "no clear difference (the interval includes zero)"}
    print_agent_report({"n_tasks": 5, "max_tool_rounds": 3, "samples": 1, "artifacts": [row, other],
                        "comparisons": [comparison]})
    out = " ".join(capsys.readouterr().out.split())
    assert "greedy, up to 3 tool rounds" in out and "[0.04, 0.62]" in out and "pass@" not in out
    assert "success" in out and "b/model.gguf vs a/model.gguf: success +0.200" in out  # names shared: folders shown


def test_evaluate_agent_bad_input_is_one_line_and_exit_2(gguf, tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "What is 2 + 2?"}) + "\n")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a model")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    empty = tmp_path / "empty-answer.jsonl"
    empty.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": ""}) + "\n")
    cases = [((tmp_path / "missing.jsonl", "--artifact", gguf), "not found"),
             ((tasks, "--artifact", gguf), "'answer'"),
             ((empty, "--artifact", gguf), "'answer' is empty"),
             ((good, "--artifact", tmp_path / "missing.gguf"), "not found"),
             ((good, "--artifact", broken), "cannot load")]  # bad flags: tests/behaviour/test_bad_input.py
    for args, expected in cases:
        code, _, err = run_cli(capsys, "evaluate-agent", *args)
        assert code == 2 and expected in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["tasks make", "evaluate-agent"])
def test_commands_have_help_with_examples(capsys, command):
    code, out, _ = run_cli(capsys, *command.split(), "--help")
    assert code == 0 and "Example" in out and "--json" in out


def test_task_evaluation_imports_no_torch():
    script = ("import sys, slm_align.ondevice.agent.task_eval, slm_align.data.agent_tasks, "
              "slm_align.cli.tasks\nprint([m for m in ('torch', "
              "'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=600).stdout
    assert out.strip() == "[]"


def test_evaluate_agent_out_never_replaces_an_input_or_an_existing_file(gguf, tmp_path, capsys):
    heldout = write_agent_tasks(tmp_path / "calc", n_train=4, n_heldout=2)["heldout"]
    model = tmp_path / "m.gguf"
    shutil.copyfile(gguf, model)
    earlier = tmp_path / "report.json"
    earlier.write_text("an earlier report")
    (tmp_path / "a-file").write_text("not a folder")
    cases = [(model, "is an input of this command"), (heldout, "is an input of this command"),
             (earlier, "exists; pass --overwrite"), (tmp_path, "is a directory"),
             (tmp_path / "missing" / "r.json", "does not exist"), (tmp_path / "a-file" / "r.json", "is a file")]
    before = tree_digest(tmp_path)
    for out, problem in cases:
        code, _, err = run_cli(capsys, "evaluate-agent", heldout, "--artifact", model, "--out", out, "--limit", "1")
        assert code == 2 and problem in err and err.count("\n") == 1, (out, err)
    assert tree_digest(tmp_path) == before  # the model and the tasks intact, nothing created
    code, _, err = run_cli(capsys, "evaluate-agent", heldout, "--artifact", model, "--out", earlier, "--overwrite",
                           "--limit", "1", "--max-new-tokens", "8")
    assert code == 0 and json.loads(earlier.read_text())["n_tasks"] == 1, err


def test_evaluate_agent_in_a_log_says_its_start_progress_and_end(gguf, tmp_path, capsys, monkeypatch):
    """Long evaluations spoke nothing for minutes (11 on the real SmolLM2): now a stage's lines, each model's
    episodes counted."""
    monkeypatch.setenv(CADENCE_ENV, "0")  # a line per episode
    heldout = write_agent_tasks(tmp_path / "calc", n_train=4, n_heldout=3)["heldout"]
    report = task_eval.evaluate_artifacts(heldout, [gguf], limit=3, max_tokens=8)
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines() if line.startswith("[slm-align ")]
    assert lines[0] == "evaluate-agent: start, 1 model(s) on 3 tasks x 1 episode(s)"
    counts = [line.split(", ")[0] for line in lines if " episodes" in line and "/3 " in line]
    named = "/".join(Path(gguf).parts[-2:])  # the folder too: exports of two runs share a file name
    successes = round(report["artifacts"][0]["success_rate"] * 3)
    assert [count.split(" (")[0] for count in counts] == [f"evaluate-agent: {named} {k}/3 episodes" for k in (1, 2, 3)]
    assert counts[-1].endswith(f"(success {successes}/3)")  # success so far, said with each count
    assert lines[-1].startswith("evaluate-agent: done in ")
    assert lines[-1].endswith(f"task success {report['artifacts'][0]['success_rate']:.3f}")


TOOLS_TEMPLATE = (  # ChatML that lists the tools' names in a system turn of its own (the context is small)
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for tool in tools %}{{ ' ' + tool['function']['name'] }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_every_artifact_is_shown_the_tools_and_the_report_says_how(gguf, tmp_path, monkeypatch):
    """The bundled export's ChatML drops ``tools``: the runtime's fallback writes them into the system
    message; a copy whose template lists them is shown them by its template, without the fallback."""
    from slm_align.ondevice.agent.loading import load_model
    from slm_align.ondevice.templates.chat import FALLBACK_HEADER, tools_system_text

    heldout = tmp_path / "tasks.jsonl"
    heldout.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5",
                                   "tool": "calculator"}) + "\n")
    listed = tmp_path / "listed.gguf"
    shutil.copyfile(gguf, listed)
    backends = {}

    def load(artifact, **options):
        model = load_model(artifact, **options)
        if Path(artifact) == listed:
            model.backend.chat_template, model.backend.chat_template_origin = TOOLS_TEMPLATE, "tools.jinja"
        model.backend = backends[Path(artifact)] = ScriptedBackend(model.backend, ["It is 5."])
        return model

    monkeypatch.setattr(task_eval, "load_model", load)
    report = task_eval.evaluate_artifacts(heldout, [gguf, listed], max_tokens=24)
    shown = [row["tools_shown"] for row in report["artifacts"]]
    assert shown == ["runtime fallback (its chat template drops tools)", "chat template"]
    prompts = {path: backend.inner.detokenize(backend.prompts[0]) for path, backend in backends.items()}
    header = FALLBACK_HEADER.split(" (")[0]
    fallback = tools_system_text(default_tools().specs())
    assert prompts[Path(gguf)].startswith(f"<|im_start|>system\n{fallback}<|im_end|>")
    assert "Tools: calculator current_time" in prompts[Path(listed)] and header not in prompts[Path(listed)]
    assert all(row["successes"] == 1 for row in report["artifacts"])


def test_a_reply_stopped_by_the_token_budget_is_counted_and_named(gguf, capsys):
    """A function row's reply cut at the token budget is counted as truncated (its call fails as malformed); the
    same call ending by itself is not; the printed report names the cut replies and the budget."""
    from slm_align.cli.tasks import print_agent_report
    from slm_align.data.function_tasks import canonical_arguments, function_tasks

    row = next(row for row in function_tasks(40, 10)["heldout"] if row["category"] == "simple")
    [(name, allowed)] = row["ground_truth"][0].items()
    call = json.dumps({"name": name, "arguments": canonical_arguments(allowed)})
    whole = f"<tool_call>{call}</tool_call>"
    agent = scripted_agent(gguf, [whole, f"<tool_call>{call[:-1]}, " + "\"note\": \"more\", " * 40 + "}}</tool_call>"])
    budget = len(agent.backend.tokenize(whole, add_special=False)) + 2
    agent.sampling = replace(agent.sampling, max_tokens=budget)
    results = [run_task(agent, row, task=index) for index in range(2)]
    assert [r.category for r in results] == ["success", "malformed_call"]
    assert [r.truncated for r in results] == [False, True] and results[1].tokens == budget
    summary = summarize(results)
    assert summary["truncated"] == 1
    print_agent_report({"n_tasks": 2, "max_tool_rounds": 0, "samples": 1, "max_tokens": budget,
                        "artifacts": [{**summary, "artifact": "a/model.gguf"}], "comparisons": []})
    out = " ".join(capsys.readouterr().out.split())
    assert f"model.gguf: 1 of 2 replies stopped at --max-new-tokens {budget}" in out
