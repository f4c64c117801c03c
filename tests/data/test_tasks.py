"""Task datasets: every format, conversational prompts through the chat template, columns
kept, split without leaks."""

import json

import pytest
from transformers import AutoTokenizer

from slm_align.data.tasks import TaskSet, read_tasks, split_tasks
from slm_align.errors import UserError
from slm_align.modeling.models import DEFAULT_MODEL_DIR

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
CLOCK = {"type": "function", "function": {
    "name": "current_time", "description": "The time.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "default": "UTC"}}}}}
# A template that shows the tools it is given, as tool-aware templates (Qwen2.5, SmolLM2) do.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>\n{% "
    "endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if "
    "add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def chat_row(question, answer, tools=(CALCULATOR,)):
    return {"prompt": [{"role": "user", "content": question}], "tools": list(tools), "answer": answer,
            "tool": "calculator"}


def expected_prompt(tokenizer, question, tools=None):
    """transformers' rendering, with the runtime's fallback for the tools when the template drops them."""
    from slm_align.ondevice.templates.chat import shown_tools

    messages = shown_tools(tokenizer.chat_template, [{"role": "user", "content": question}], tools)
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def test_prompt_and_answer_jsonl_keeps_every_other_column(tmp_path):
    rows = [{"prompt": f"What is {i} + {i}?",
             "answer": str(2 * i), "level": i % 3} for i in range(5)]
    tasks = read_tasks(write_jsonl(tmp_path / "t.jsonl", rows), tokenizer=None)
    assert tasks.prompts == [row["prompt"] for row in rows]
    assert tasks.columns[3] == {"answer": "6", "level": 0}
    assert tasks.column_names() == {"answer", "level"}
    assert len(tasks) == 5


def test_prompt_only_json_and_a_custom_prompt_field(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"data": [{"question": "Say hi."}, {"question": "Count to 3."}]}))
    tasks = read_tasks(tmp_path / "t.json", prompt_field="question")
    assert tasks.prompts == ["Say hi.", "Count to 3."]
    assert tasks.columns == [{}, {}]
    assert tasks.column_names() == set()


def test_conversational_prompts_render_with_the_chat_template(tmp_path, tokenizer):
    tasks = read_tasks(write_jsonl(tmp_path / "t.jsonl", [chat_row("What is 17 * 23?",
                                                                   "391")]), tokenizer)
    assert tasks.prompts == [expected_prompt(tokenizer, "What is 17 * 23?", [CALCULATOR])]
    assert tasks.prompts[0].endswith("<|im_start|>assistant\n")
    assert tasks.columns[0] == {"tools": [CALCULATOR], "answer": "391", "tool": "calculator"}


def test_tools_reach_a_tool_aware_template(tmp_path, tokenizer):
    tokenizer.chat_template = TOOLS_TEMPLATE
    tasks = read_tasks(write_jsonl(tmp_path / "t.jsonl", [chat_row("2+2?", "4", [CALCULATOR, CLOCK])]), tokenizer)
    assert tasks.prompts == ["<tools>calculator;current_time;</tools>\n<user>2+2?\n<assistant>"]


def test_a_tokenizer_without_template_uses_the_default_one(tmp_path, tokenizer):
    with_template = expected_prompt(tokenizer, "Hello?")
    tokenizer.chat_template = None
    tasks = read_tasks(write_jsonl(tmp_path / "t.jsonl", [{"messages": [{"role": "user", "content": "Hello?"}]}]),
                       tokenizer)
    assert tasks.prompts == [with_template]  # the bundled model's template is the default ChatML one


def test_messages_drop_a_final_assistant_turn(tmp_path, tokenizer):
    row = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!"}], "id": 7}
    tasks = read_tasks(write_jsonl(tmp_path / "t.jsonl", [row]), tokenizer)
    assert tasks.prompts[0].endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert "Hello!" not in tasks.prompts[0]
    assert tasks.columns == [{"id": 7}]


def test_parquet_with_tools_of_different_shapes(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [chat_row("What is 3 * 4?", "12"), chat_row("What time is it?", "noon", [CLOCK])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    tasks = read_tasks(tmp_path / "t.parquet", tokenizer)
    assert tasks.prompts == [expected_prompt(tokenizer, q, tools) for q, tools in (("What is 3 * 4?", [CALCULATOR]),
                                                                                   ("What time is it?", [CLOCK]))]
    # parquet merges both tools' schemas into one struct, filling the other's keys
    # with None: they are removed
    assert [row["tools"] for row in tasks.columns] == [[CALCULATOR], [CLOCK]]
    assert tasks.column_names() == {"tools", "answer", "tool"}


def test_tools_stored_as_json_text_are_decoded(tmp_path, tokenizer):
    row = {**chat_row("1+1?", "2"), "tools": json.dumps([CALCULATOR])}
    tasks = read_tasks(write_jsonl(tmp_path / "t.jsonl", [row]), tokenizer)
    assert tasks.columns[0]["tools"] == [CALCULATOR]


def test_datasets_directory(tmp_path, tokenizer):
    import datasets

    rows = [chat_row(f"What is {i} * 9?", str(9 * i)) for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    tasks = read_tasks(tmp_path / "ds", tokenizer)
    assert tasks.prompts == [expected_prompt(tokenizer, f"What is {i} * 9?",
                                             [CALCULATOR]) for i in range(4)]
    assert [row["answer"] for row in tasks.columns] == ["0", "9", "18", "27"]
    assert tasks.columns[1]["tools"] == [CALCULATOR]


def test_identical_rows_collapse_and_conflicting_ones_are_one_line(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?", "answer": "6"},
                                              {"prompt": "2+2?", "answer": "4"}])
    assert read_tasks(path).prompts == ["2+2?", "3+3?"]
    write_jsonl(path, [{"prompt": "2+2?", "answer": "4"}, {"prompt": "2+2?", "answer": "5"}])
    with pytest.raises(UserError) as caught:
        read_tasks(path)
    message = str(caught.value)
    assert "\n" not in message
    assert f"{path}:2: same prompt as {path}:1 but a different 'answer' ('4' vs '5')" in message


@pytest.mark.parametrize("line, expected", [
    ('["not", "an", "object"]', "expected an object with a 'prompt' column, got list"),
    ('{"question": "hi"}', "no 'prompt' column (found: question)"),
    ('{"prompt": "  "}', "column 'prompt' is empty"),
    ('{"prompt": 42}', "'prompt' must be text or a non-empty list"),
    ('{"prompt": [{"content": "hi"}]}', "each message in 'prompt' needs a 'role'"),
    ('{"messages": [{"role": "user", "content": ["a"]}]}',
     "a user message in 'messages' has no text 'content'"),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "holds only an assistant turn"),
    ('{"prompt": "hi", "tools": {"name": "x"}}', "'tools' must be a list of tool objects"),
    ('{"prompt": "hi", "tools": "[oops"}', "'tools' is text but not JSON"),
    ('{"prompt": "hi", "tools": [{"type": "function", "function": {}}]}',
     "a tool in 'tools' has no name"),
    ('{"prompt": "hi", "tools": [{"name": "f", "parameters": {"type": 7}}]}',
     "tool 'f': invalid JSON schema"),
    ('{"prompt": "hi", "completions": "x"}', "column 'completions' clashes"),
    ('{"prompt": "hi"', "not valid JSON"),
])
def test_bad_rows_are_one_line_naming_the_row(tmp_path, tokenizer, line, expected):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(UserError) as caught:
        read_tasks(path, tokenizer)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:2: ")
    assert expected in message


def test_conversations_need_a_tokenizer_and_a_template_that_renders_them(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [chat_row("2+2?", "4")])
    with pytest.raises(UserError, match="needs a tokenizer"):
        read_tasks(path, tokenizer=None)
    tokenizer.chat_template = "{{ raise_exception('no tools here') }}"
    with pytest.raises(UserError, match="the chat template cannot "
                                        "render this conversation") as caught:
        read_tasks(path, tokenizer)
    assert "\n" not in str(caught.value)


def test_empty_data_is_a_user_error(tmp_path):
    (tmp_path / "t.jsonl").write_text("\n")
    with pytest.raises(UserError, match="holds no rows"):
        read_tasks(tmp_path / "t.jsonl")


def test_columns_for_repeated_prompts_in_any_order():
    tasks = TaskSet(["a", "b", "c"], [{"answer": "1"}, {"answer": "2", "tool": "calculator"}, {"answer": "3"}])
    assert tasks.columns_for(["c", "a", "c", "b"]) == {"answer": ["3", "1", "3", "2"],
                                                       "tool": [None, None, None, "calculator"]}
    assert tasks.column_names() == {"answer"}
    assert tasks.subset([2, 0]) == TaskSet(["c", "a"], [{"answer": "3"}, {"answer": "1"}])
    with pytest.raises(UserError, match="no task row has the prompt 'zzz'"):
        tasks.columns_for(["a", "zzz"])


def test_split_never_leaks_and_is_seeded():
    prompts = [f"task {i}" for i in range(50)]
    tasks = TaskSet(prompts + prompts[:10], [{"answer": str(i)} for i in range(50)] + [{"answer": "x"}] * 10)
    train, heldout = split_tasks(tasks, seed=1, heldout_fraction=0.2, max_heldout=8)
    assert not set(train.prompts) & set(heldout.prompts)
    assert len(set(heldout.prompts)) == 8  # 20% of 50 distinct prompts is 10, capped at 8
    assert len(train) + len(heldout) == len(tasks)
    pairs = [(p, c["answer"]) for part in (train, heldout) for p, c in zip(part.prompts, part.columns)]
    assert sorted(pairs) == sorted((p, c["answer"]) for p, c in zip(tasks.prompts, tasks.columns))  # rows intact
    again = split_tasks(tasks, seed=1, heldout_fraction=0.2, max_heldout=8)
    assert again == (train, heldout)
    assert split_tasks(tasks, seed=2, heldout_fraction=0.2, max_heldout=8)[1].prompts != heldout.prompts


def test_split_sizes():
    tasks = TaskSet(["a", "b", "c"], [{}, {}, {}])
    assert [len(part) for part in split_tasks(tasks, 0, 0.0, 10)] == [3, 0]
    assert [len(part) for part in split_tasks(tasks, 0, 0.01, 10)] == [2, 1]  # at least one held out
    with pytest.raises(UserError, match="need more than 1"):
        split_tasks(TaskSet(["a"], [{}]), 0, 0.5, 10)
    with pytest.raises(UserError, match=r"heldout fraction must be in \[0, 1\)"):
        split_tasks(tasks, 0, 1.0, 10)
