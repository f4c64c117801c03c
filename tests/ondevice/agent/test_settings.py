"""The agent's parameter objects: :class:`ChatSettings` and :class:`Recording` say how an agent
converses and where its turns go; their fields by name are a shorthand that builds the same agent,
and a keyword that no object has is refused as Python refuses one."""

from __future__ import annotations

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import ChatSettings, Recording, SamplingParams, take_options

FIELDS = ("system", "sampling", "max_tool_rounds", "use_grammar", "answer_grammar", "logprobs",
          "describe_tools", "store", "consent")


class QuietBackend:
    """Enough of a backend to make an agent (nothing is generated)."""

    kind = "gguf"
    n_ctx = 512
    eos_ids = {0}


def state(agent: Agent) -> dict:
    return {name: getattr(agent, name) for name in FIELDS}


def test_the_objects_and_their_fields_by_name_make_the_same_agent():
    sampling = SamplingParams(temperature=0.0, max_tokens=8)
    store = object()
    settings = ChatSettings(system="Be brief.", sampling=sampling, max_tool_rounds=1, grammar=False,
                            answer_grammar='root ::= "yes" | "no"', logprobs=2, describe_tools=True)
    by_object = Agent(QuietBackend(), "m", settings=settings, recording=Recording(store, consent=True))
    by_name = Agent(QuietBackend(), "m", system="Be brief.", sampling=sampling, max_tool_rounds=1,
                    grammar=False, answer_grammar='root ::= "yes" | "no"', logprobs=2,
                    describe_tools=True, store=store, consent=True)
    assert state(by_object) == state(by_name)
    assert state(by_name) == {"system": "Be brief.", "sampling": sampling, "max_tool_rounds": 1,
                              "use_grammar": False, "answer_grammar": 'root ::= "yes" | "no"',
                              "logprobs": 2, "describe_tools": True, "store": store, "consent": True}


def test_a_field_by_name_replaces_the_objects_and_the_defaults_are_the_runtimes():
    agent = Agent(QuietBackend(), "m", settings=ChatSettings(system="A", max_tool_rounds=2), system="B")
    assert (agent.system, agent.max_tool_rounds) == ("B", 2)
    plain = Agent(QuietBackend(), "m")
    assert state(plain) == {"system": None, "sampling": SamplingParams(), "max_tool_rounds": 4,
                            "use_grammar": True, "answer_grammar": None, "logprobs": None,
                            "describe_tools": False, "store": None, "consent": False}


def test_an_unknown_keyword_is_refused_as_python_refuses_one():
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        Agent(QuietBackend(), "m", temprature=0.0)


def test_a_grammar_on_an_onnx_model_is_still_refused_in_one_line():
    class Onnx(QuietBackend):
        kind = "onnx"

    with pytest.raises(UserError, match="need a GGUF model"):
        Agent(Onnx(), "m", answer_grammar='root ::= "yes"')


def test_take_options_takes_only_the_objects_fields():
    options = {"consent": True, "system": "S"}
    assert take_options(Recording(), options) == Recording(consent=True)
    assert options == {"system": "S"}
    assert take_options(ChatSettings(), {}) == ChatSettings()
