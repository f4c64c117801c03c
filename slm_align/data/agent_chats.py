"""Generated tool-use conversations, rendered as the agent runtime renders them: what the bundled
model is pretrained on beside the demo stories, so that it can learn the call syntax at all.

Five kinds, all seeded and deterministic:

- calculator: an arithmetic or unit question (:mod:`slm_align.data.agent_tasks`), the call, the
  calculator's real observation, the answer;
- direct: the same kind of question answered at once, without the tool (the right number, which a
  model of a few million parameters can only guess at on new questions): the habit of answering from
  memory that agent training has to replace by a call;
- clock: a time question, the ``current_time`` call, an observation in the clock's own format for a
  generated date (the real clock reads the wall time, which a reproducible build cannot), the
  answer;
- error: a call the tool refuses (a division by zero, an unknown time zone), the registry's real
  failure text as the observation, an answer that says so;
- no tool: a greeting or a story request, answered in plain text with no call.

Each conversation is OpenAI's form (the call once, in ``tool_calls``) and is rendered with
:func:`conversation_text`, which puts calls where the template expects them
(:func:`slm_align.ondevice.templates.chat.template_form`) and renders with the runtime's own
:func:`slm_align.ondevice.templates.chat.render`.
"""

from __future__ import annotations

import functools
import random
from datetime import datetime, timedelta, timezone
from typing import Callable, Optional

from slm_align.data.agent_tasks import final_answer_text, leak_keys, make_tasks, memory_row
from slm_align.data.demo_corpus import generate_story
from slm_align.ondevice.templates.chat import render, template_form, template_traits
from slm_align.ondevice.tools.builtin import default_tools, time_text
from slm_align.ondevice.tools.calls import ToolCall
from slm_align.ondevice.tools.registry import ToolRegistry

_ZONES = ("UTC", "Europe/Paris", "Europe/London", "Asia/Tokyo", "America/New_York",
          "Australia/Sydney")
_CLOCK_QUESTIONS = ("What time is it in {place}?", "What is the time in {place} now?",
                    "Tell me the current time in {place}.", "What day is it in {place}?")
_BAD_ZONES = ("Mars/Olympus", "Europe/Atlantis", "Moon/Base")
_GREETINGS = (("Hello!", "Hello! How can I help you today?"), ("Hi", "Hi! What can I do for you?"),
              ("Thank you.", "You are welcome."), ("Who are you?", "I am a small assistant. I can "
                                                                   "use a calculator and a clock."))
_STORY_REQUESTS = ("Tell me a story.", "Tell me a short story.", "Can you tell me a story?")
KINDS = ("calculator", "direct", "clock", "error", "no_tool")
"""The kinds of conversation, in the order :data:`SHARES` weighs them."""
SHARES = (0.3, 0.3, 0.15, 0.1, 0.15)
"""How often each kind is drawn."""


def conversation_text(messages: list[dict], template: str, eos_token: Optional[str] = None) -> str:
    """One whole conversation as the runtime renders it with ``template`` (no generation prompt)."""
    formed = template_form(messages, template_traits(template))
    return render(template, formed, None, eos_token, add_generation_prompt=False)


def generate_conversations(n: int, seed: int, exclude: frozenset = frozenset()) -> list[list[dict]]:
    """``n`` conversations drawn by :data:`SHARES`; calculator questions whose question or
    expression is in ``exclude`` (a task set's :func:`~slm_align.data.agent_tasks.leak_keys`) are
    skipped."""
    rng = random.Random(seed)
    tasks = [task for task in make_tasks(n + len(exclude), seed=seed + 1)
             if not _held_out(task, exclude)]
    makers: dict[str, Callable[[random.Random], list[dict]]] = {
        "clock": clock_chat, "error": error_chat, "no_tool": no_tool_chat}
    conversations = []
    for _ in range(n):
        kind = rng.choices(KINDS, weights=SHARES)[0]
        if kind == "calculator":
            conversations.append(calculator_chat(tasks.pop()))
        elif kind == "direct":
            conversations.append(direct_chat(tasks.pop()))
        else:
            conversations.append(makers[kind](rng))
    return conversations


def _held_out(task: dict, exclude: frozenset) -> bool:
    return bool(leak_keys([task]) & exclude)


def calculator_chat(task: dict) -> list[dict]:
    """A task row's question, its calculator call, the real observation and the answer."""
    call = ToolCall(task["tool"], {"expression": task["expression"]})
    return _tool_chat(task["prompt"][-1]["content"], call, final_answer_text(task["answer"]))


def direct_chat(task: dict) -> list[dict]:
    """A task row's question answered at once, without a call."""
    return memory_row(task)["messages"]


def clock_chat(rng: random.Random) -> list[dict]:
    """A time question, the clock call, the clock's text for a generated moment, and the answer."""
    zone = rng.choice(_ZONES)
    place = zone.split("/")[-1].replace("_", " ")
    moment = datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(minutes=rng.randrange(365 * 24 * 60))
    observation = time_text(moment, zone)  # "2026-03-04T15:05:00+09:00 (Wednesday, Asia/Tokyo)"
    weekday = observation.split("(", 1)[1].split(",", 1)[0]
    answer = f"It is {observation[11:16]} on {weekday} in {place}."  # copied from the observation
    call = ToolCall("current_time", {"timezone": zone})
    return _chat(rng.choice(_CLOCK_QUESTIONS).format(place=place), call, observation, answer)


def error_chat(rng: random.Random) -> list[dict]:
    """A call the tool refuses, the registry's real failure text, and an answer that says so."""
    if rng.random() < 0.5:
        a = rng.randint(2, 99)
        question = f"What is {a} divided by 0?"
        call = ToolCall("calculator", {"expression": f"{a} / 0"})
    else:
        zone = rng.choice(_BAD_ZONES)
        question = f"What time is it in {zone.split('/')[-1]}?"
        call = ToolCall("current_time", {"timezone": zone})
    observation = _tools().execute(call)
    answer = f"I could not get an answer: {observation.error}."
    return _chat(question, call, observation.content, answer)


def no_tool_chat(rng: random.Random) -> list[dict]:
    """A greeting or a story request, answered in plain text."""
    if rng.random() < 0.4:
        question, answer = rng.choice(_GREETINGS)
    else:
        question, answer = rng.choice(_STORY_REQUESTS), generate_story(rng)
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _tool_chat(question: str, call: ToolCall, answer: str) -> list[dict]:
    """A question, the call, the real tool's observation, and the answer."""
    return _chat(question, call, _tools().execute(call).content, answer)


@functools.cache
def _tools() -> ToolRegistry:
    """The built-in tools, built once for every conversation (the calculator and the clock keep no
    state)."""
    return default_tools()


def _chat(question: str, call: ToolCall, observation: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [call.as_dict()]},
            {"role": "tool", "name": call.name, "content": observation},
            {"role": "assistant", "content": answer}]
