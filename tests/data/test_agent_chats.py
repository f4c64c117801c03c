"""The conversations the bundled model is pretrained on: real observations, rendered as the runtime renders them,
none of the quickstart's held-out questions, the same for the same seed."""

import re

from slm_align.data.agent_chats import KINDS, conversation_text, error_chat, generate_conversations
from slm_align.data.agent_tasks import leak_keys, make_tasks, split_tasks
from slm_align.ondevice.templates.chat import CHATML_TEMPLATE
from slm_align.ondevice.tools.builtin import calculator, current_time
from slm_align.ondevice.tools.calls import ToolCall
from slm_align.ondevice.tools.parse import call_text

CLOCK_TEXT = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d \(\w+day, [\w/]+\)")


def kind_of(chat: list[dict]) -> str:
    if len(chat) == 2:
        return "direct" if chat[1]["content"].startswith("The answer is ") else "no_tool"
    if chat[2]["content"].startswith("Error:"):
        return "error"
    return chat[1]["tool_calls"][0]["function"]["name"]


def test_every_kind_is_drawn_and_each_observation_is_what_the_tool_returns():
    chats = generate_conversations(300, seed=5)
    answers = {task["prompt"][0]["content"]: task["answer"] for task in make_tasks(300, seed=6)}  # what they draw from
    kinds = {kind_of(chat) for chat in chats}
    assert kinds == {"calculator", "direct", "current_time", "error", "no_tool"} and len(KINDS) == 5
    for chat in chats:
        if kind_of(chat) == "calculator":
            expression = chat[1]["tool_calls"][0]["function"]["arguments"]["expression"]
            assert chat[2]["content"] == calculator(expression)
            assert chat[3]["content"] == f"The answer is {chat[2]['content']}."
        if kind_of(chat) == "current_time":
            assert CLOCK_TEXT.fullmatch(chat[2]["content"])
            assert chat[2]["content"][11:16] in chat[3]["content"]  # the answer copies the observed time
        if kind_of(chat) == "direct":  # answered without the tool, with the number the tool would give
            assert chat[1]["content"] == f"The answer is {answers[chat[0]['content']]}."
    assert CLOCK_TEXT.fullmatch(current_time("Asia/Tokyo"))  # the real clock writes the same shape


def test_a_refused_call_carries_the_registry_failure_text():
    import random

    chats = [error_chat(random.Random(seed)) for seed in range(6)]
    observations = {chat[2]["content"] for chat in chats}
    assert any("division by zero" in text for text in observations)
    assert any("unknown time zone" in text for text in observations)
    assert all(text.startswith("Error: ") and text[7:] in chat[3]["content"]
               for text, chat in zip([c[2]["content"] for c in chats], chats))


def test_conversations_leave_out_the_excluded_questions_and_repeat_for_a_seed():
    train, heldout = split_tasks(50, 50, seed=0)
    exclude = frozenset(leak_keys(heldout))
    chats = generate_conversations(400, seed=9, exclude=exclude)
    tasks = [{"expression": chat[1]["tool_calls"][0]["function"]["arguments"]["expression"],
              "prompt": chat[:1]} for chat in chats if kind_of(chat) == "calculator"]
    asked = {chat[0]["content"] for chat in chats if kind_of(chat) == "direct"}
    assert tasks and asked and not leak_keys(tasks) & exclude and not asked & exclude
    assert generate_conversations(400, seed=9, exclude=exclude) == chats
    assert generate_conversations(400, seed=10, exclude=exclude) != chats


def test_a_tool_chat_renders_the_call_as_the_model_writes_it_and_the_observation_as_a_tool_turn():
    chat = [{"role": "user", "content": "What is 6 * 7?"},
            {"role": "assistant", "content": "", "tool_calls": [ToolCall("calculator", {"expression": "6 * 7"})
                                                                .as_dict()]},
            {"role": "tool", "name": "calculator", "content": "42"},
            {"role": "assistant", "content": "The answer is 42."}]
    call = call_text([ToolCall("calculator", {"expression": "6 * 7"})])
    assert conversation_text(chat, CHATML_TEMPLATE) == (
        "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n"
        f"<|im_start|>assistant\n{call}<|im_end|>\n"
        "<|im_start|>tool\n42<|im_end|>\n"
        "<|im_start|>assistant\nThe answer is 42.<|im_end|>\n")
