"""Agent tools: schemas from type hints, parsing model output, safe execution,
built-in tools, grammar."""

from __future__ import annotations

import ctypes
import enum
import json
import os
import stat
import subprocess
import sys
import threading
from datetime import datetime
from typing import Literal, Optional

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.tools.builtin import NoteStore, calculator, current_time, default_tools
from slm_align.ondevice.tools.calls import Observation, Tool, ToolCall
from slm_align.ondevice.tools.grammar import _GrammarBuilder, gbnf_grammar
from slm_align.ondevice.tools.registry import ToolRegistry


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


def forecast(
    city: str,
    days: int = 1,
    unit: Unit = Unit.CELSIUS,
    detail: Literal["short", "long"] = "short",
    hours: list[int] = [],  # noqa: B006 (never mutated; shows that a list default is left out)
    extra: Optional[float] = None,
    metrics: dict[str, bool] = {},  # noqa: B006
    verbose: bool = False,
) -> dict:
    """Weather forecast for a city.

    More text that is not the description.

    Args:
        city: Name of the city,
            for example "Oslo".
        days (int): How many days ahead.

    Returns:
        The forecast.
    """
    return {"city": city, "days": days, "unit": unit.value, "is_enum": isinstance(unit, Unit)}


@pytest.fixture
def registry() -> ToolRegistry:
    tools = default_tools()
    tools.register(forecast)
    return tools


# --- schema ---------------------------------------------------------------------------------------


def test_schema_follows_type_hints_defaults_and_docstring(registry):
    spec = next(s for s in registry.specs() if s["function"]["name"] == "forecast")
    assert spec["type"] == "function"
    function = spec["function"]
    assert function["description"] == "Weather forecast for a city."
    params = function["parameters"]
    assert params["type"] == "object" and params["additionalProperties"] is False
    assert params["required"] == ["city"]
    props = params["properties"]
    assert list(props) == ["city", "days", "unit", "detail", "hours", "extra", "metrics", "verbose"]
    assert props["city"] == {"type": "string", "description": 'Name of the city, for example "Oslo".'}
    assert props["days"] == {"type": "integer", "description": "How many days ahead.", "default": 1}
    assert props["unit"] == {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}
    assert props["detail"] == {"type": "string", "enum": ["short", "long"], "default": "short"}
    assert props["hours"] == {"type": "array", "items": {"type": "integer"}}
    assert props["extra"] == {"type": ["number", "null"], "default": None}
    assert props["metrics"] == {"type": "object", "additionalProperties": {"type": "boolean"}}
    assert props["verbose"] == {"type": "boolean", "default": False}


def test_register_works_as_decorator_with_and_without_options():
    tools = ToolRegistry()

    @tools.register
    def echo(text: str) -> str:
        """Repeat the text."""
        return text

    @tools.register(name="shout", description="Upper-case the text.")
    def loud(text: str) -> str:
        return text.upper()

    assert echo("a") == "a" and loud("a") == "A"  # the decorator returns the function itself
    assert tools.names == ["echo", "shout"]
    assert [s["function"]["description"] for s in tools.specs()] == ["Repeat the text.", "Upper-case the text."]
    assert tools.execute(ToolCall("shout", {"text": "hi"})).content == "HI"


def test_explicit_schema_is_used_as_given():
    tools = ToolRegistry()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]}
    tools.register(lambda n: n * 2, name="double", description="Double n.", schema=schema)
    assert tools.specs()[0]["function"]["parameters"] is schema
    assert tools.execute(ToolCall("double", {"n": 4})).content == "8"
    assert not tools.execute(ToolCall("double", {"n": -1})).ok


def _one_line_user_error(register) -> str:
    with pytest.raises(UserError) as info:
        register()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_registrations_are_one_line_user_errors():
    tools = ToolRegistry()

    def takes_set(values: set) -> str:
        """Unsupported."""

    def untyped(value) -> str:
        """No annotation."""

    def undocumented(value: str) -> str:
        return value

    def varargs(*values: str) -> str:
        """Star args."""

    assert "set" in _one_line_user_error(lambda: tools.register(takes_set))
    assert "annotation" in _one_line_user_error(lambda: tools.register(untyped))
    assert "description" in _one_line_user_error(lambda: tools.register(undocumented))
    assert "*args" in _one_line_user_error(lambda: tools.register(varargs))
    assert "invalid" in _one_line_user_error(lambda: tools.register(forecast, name="bad name!"))
    tools.register(forecast)
    assert "already registered" in _one_line_user_error(lambda: tools.register(forecast))
    bad_schema = {"type": "object", "properties": {"x": {"type": "nonsense"}}}
    assert "schema" in _one_line_user_error(lambda: tools.register(forecast, name="f2", schema=bad_schema))
    assert len(tools) == 1


def test_enum_arguments_reach_the_function_as_members(registry):
    observation = registry.execute(ToolCall("forecast", {"city": "Oslo", "unit": "fahrenheit"}))
    assert observation.ok
    assert json.loads(observation.content) == {"city": "Oslo", "days": 1, "unit": "fahrenheit", "is_enum": True}


# --- parsing --------------------------------------------------------------------------------------

CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "current_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'


def test_parse_one_hermes_call_keeps_the_text_around_it(registry):
    parsed = registry.parse_calls(f"Let me compute that.\n{CALC}\nOne moment.")
    assert parsed.calls == [ToolCall("calculator", {"expression": "1+1"})]
    assert parsed.text == "Let me compute that.\nOne moment."
    assert parsed.errors == [] and parsed.wants_tools


def test_parse_two_hermes_calls_in_order(registry):
    parsed = registry.parse_calls(f"{CALC}\n{TIME}")
    assert [call.name for call in parsed.calls] == ["calculator", "current_time"]
    assert parsed.calls[1].arguments == {"timezone": "UTC"}
    assert parsed.text == ""


def test_parse_bare_json_call_and_plain_text(registry):
    parsed = registry.parse_calls('  {"name": "calculator", "arguments": {"expression": "2+2"}}\n')
    assert parsed.calls == [ToolCall("calculator", {"expression": "2+2"})] and parsed.text == ""
    plain = registry.parse_calls("The answer is {4}. Nothing to call.")
    assert plain.calls == [] and plain.errors == [] and not plain.wants_tools
    assert plain.text == "The answer is {4}. Nothing to call."


def test_parse_smollm2_list_form_and_several_calls_in_one_block(registry):
    calc = '{"name": "calculator", "arguments": {"expression": "1+1"}}'
    time = '{"name": "current_time", "arguments": {"timezone": "UTC"}}'
    expected = [ToolCall("calculator", {"expression": "1+1"}), ToolCall("current_time", {"timezone": "UTC"})]
    for reply in (f"<tool_call>[{calc}, "
                  f"{time}]</tool_call>", f"<tool_call>\n{calc}\n{time}\n</tool_call>",
                  f"[{calc}, {time}]", f"Checking.\n<tool_call>[{calc}]</tool_call>\n{TIME}"):
        parsed = registry.parse_calls(reply)
        assert parsed.calls == expected and parsed.errors == [], reply
    mixed = registry.parse_calls(f'<tool_call>[{calc}, {{"name": "nope", "arguments": '
                                 f'{{}}}}]</tool_call>')
    assert mixed.calls == expected[:1] and [error.name for error in mixed.errors] == ["nope"]
    assert registry.parse_calls("<tool_call>[]</tool_call>").errors and not registry.parse_calls("[1, 2]").wants_tools


def test_parse_call_whose_closing_tag_was_cut_off(registry):
    parsed = registry.parse_calls('<tool_call>\n{"name": "calculator", "arguments": '
                                  '{"expression": "3*3"}}')
    assert parsed.calls == [ToolCall("calculator", {"expression": "3*3"})]


@pytest.mark.parametrize(
    "reply, name, words",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',
         "", "malformed JSON"),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
         "rm_rf", "unknown tool 'rm_rf'"),
        ('<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>',
         "calculator", "must be a JSON object"),
        ('<tool_call>["calculator"]</tool_call>', "", '"name"'),
        ('{"name": "calculator", "arguments": {"expression": "1",}}', "", "malformed JSON"),
    ],
)
def test_malformed_calls_become_error_observations(registry, reply, name, words):
    parsed = registry.parse_calls(reply)
    assert parsed.calls == [] and parsed.wants_tools
    [error] = parsed.errors
    assert (error.ok, error.name) == (False, name)
    assert words in error.error and error.content.startswith("Error: ")


def test_good_and_bad_calls_in_one_reply_are_kept_apart(registry):
    parsed = registry.parse_calls(f'{CALC}\n<tool_call>{{"name": "nope", "arguments": {{}}}}</tool_call>')
    assert [call.name for call in parsed.calls] == ["calculator"]
    assert [error.name for error in parsed.errors] == ["nope"]


# --- execution ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, words",
    [
        ({}, "'city' is a required property"),
        ({"city": 3}, "3 is not of type 'string'"),
        ({"city": "Oslo", "detail": "medium"}, "'medium' is not one of"),
        ({"city": "Oslo", "hours": [1, "two"]}, "'two' is not of type 'integer'"),
        ({"city": "Oslo", "colour": "red"}, "'colour' was unexpected"),
    ],
)
def test_schema_violations_become_readable_error_observations(registry, arguments, words):
    observation = registry.execute(ToolCall("forecast", arguments))
    assert observation.ok is False and observation.name == "forecast"
    assert words in observation.error
    assert "expected forecast(city: string" in observation.content


def test_unknown_tool_and_non_object_arguments_do_not_raise(registry):
    assert "unknown tool" in registry.execute(ToolCall("missing", {})).error
    assert "must be a JSON object" in registry.execute(ToolCall("calculator", ["1+1"])).error


def test_a_tool_that_raises_becomes_an_error_observation():
    tools = ToolRegistry()

    @tools.register
    def explode(reason: str) -> str:
        """Always fails."""
        raise RuntimeError(f"boom: {reason}")

    observation = tools.execute(ToolCall("explode", {"reason": "test"}))
    assert observation == Observation("explode", False, "Error: explode failed: "
                                                        "RuntimeError: boom: test",
                                      "explode failed: RuntimeError: boom: test")


def test_results_become_text_and_are_capped():
    tools = ToolRegistry(max_observation_chars=100)

    @tools.register
    def data(n: int) -> object:
        """Return n items."""
        return {"items": list(range(n))}

    assert tools.execute(ToolCall("data", {"n": 3})).content == '{"items": [0, 1, 2]}'
    long = tools.execute(ToolCall("data", {"n": 500}))
    assert long.ok and len(long.content) == 100 and "truncated" in long.content
    assert long.content.startswith('{"items": [0, 1, 2')
    assert long.as_message() == {"role": "tool", "name": "data", "content": long.content}


# --- calculator -----------------------------------------------------------------------------------


def test_calculator_computes_arithmetic():
    assert calculator("2*(3+4)**2/7") == "14"
    assert calculator("-(7 // 2) + 7 % 3 - 2**-1") == "-2.5"
    assert calculator("sqrt(16) + round(pi, 2)") == "7.14"
    assert calculator("max(1, 2**10)") == "1024"


@pytest.mark.parametrize(
    "code",
    [
        "__import__('os').system('x')",
        "().__class__",
        "open('f')",
        "[x for x in ()]",
        "'a'*10",
        "lambda: 1",
        "(1).real",
        "x",
        "(1, 2)[0]",
        "True + 1",
        "(-8) ** (1/3)",
        "10**3000 * 10**3000",
        "1" * 600,
    ],
)
def test_calculator_refuses_code_and_huge_results(registry, code):
    observation = registry.execute(ToolCall("calculator", {"expression": code}))
    assert observation.ok is False
    assert observation.content.startswith("Error: calculator failed: ")


def test_calculator_refuses_a_tower_of_powers_without_computing_it(registry):
    outcome = {}
    worker = threading.Thread(
        target=lambda: outcome.update(o=registry.execute(ToolCall("calculator", {"expression": "9**9**9"}))),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=30)  # a guard against a hang, not a speed claim: the refusal is immediate
    assert not worker.is_alive()
    assert outcome["o"].ok is False and "too large" in outcome["o"].error


def test_division_by_zero_is_an_error_observation(registry):
    assert "ZeroDivisionError" in registry.execute(ToolCall("calculator", {"expression": "1/0"})).error


# --- clock ----------------------------------------------------------------------------------------


def test_current_time_in_utc_and_a_named_zone():
    stamp = current_time().split(" ")[0]
    assert datetime.fromisoformat(stamp).utcoffset().total_seconds() == 0
    assert current_time("Asia/Tokyo").split(" ")[0].endswith("+09:00")


@pytest.mark.parametrize("zone", ["Mars/Olympus_Mons", "../../etc/passwd", ""])
def test_unknown_time_zone_is_an_error_observation(registry, zone):
    observation = registry.execute(ToolCall("current_time", {"timezone": zone}))
    assert observation.ok is False and "unknown time zone" in observation.error


# --- notes ----------------------------------------------------------------------------------------


def test_notes_are_saved_private_read_back_and_listed(tmp_path):
    store = NoteStore(tmp_path / "notes")
    assert "saved" in store.save_note("Shopping list", "eggs\nmilk")
    assert store.save_note("a: b?", "odd title") and store.read_note("a: b?") == "odd title"
    path = tmp_path / "notes" / "Shopping list.txt"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store.read_note("Shopping list") == "eggs\nmilk"
    store.save_note("Shopping list", "bread")
    assert store.read_note("Shopping list") == "bread"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store.list_notes() == ["Shopping list", "a_ b_"]
    assert sorted(os.listdir(tmp_path / "notes")) == ["Shopping list.txt", "a_ b_.txt"]  # no temporaries left


@pytest.mark.parametrize("title", ["../x", "/etc/passwd", "notes/../../x", "..", ".hidden", "bad\x00name", " "])
def test_note_store_refuses_paths(tmp_path, title):
    tools = default_tools(tmp_path / "notes")
    for call in (ToolCall("save_note", {"title": title, "text": "x"}), ToolCall("read_note", {"title": title})):
        observation = tools.execute(call)
        assert observation.ok is False, (title, observation)
    assert not (tmp_path / "x").exists()
    assert os.listdir(tmp_path / "notes") == []


def test_note_store_refuses_a_symlink_pointing_outside(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    folder = tmp_path / "notes"
    store = NoteStore(folder)
    (folder / "leak.txt").symlink_to(secret)
    tools = default_tools(folder)
    read = tools.execute(ToolCall("read_note", {"title": "leak"}))
    write = tools.execute(ToolCall("save_note", {"title": "leak", "text": "overwritten"}))
    assert not read.ok and "outside" in read.error and "top secret" not in read.content
    assert not write.ok and "outside" in write.error
    assert secret.read_text() == "top secret"
    assert store.list_notes() == []


def test_note_size_and_missing_note_are_error_observations(tmp_path):
    tools = default_tools(tmp_path)
    too_long = tools.execute(ToolCall("save_note", {"title": "big", "text": "x" * 10_001}))
    assert not too_long.ok and "too long" in too_long.error
    tools.execute(ToolCall("save_note", {"title": "one", "text": "1"}))
    missing = tools.execute(ToolCall("read_note", {"title": "two"}))
    assert not missing.ok and "no note titled 'two'" in missing.error and "one" in missing.error
    assert json.loads(tools.execute(ToolCall("list_notes", {})).content) == ["one"]


def test_notes_folder_that_is_a_file_is_a_user_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError):
        NoteStore(tmp_path / "file")


def test_default_tools_offer_notes_only_with_a_folder(tmp_path):
    assert default_tools().names == ["calculator", "current_time"]
    names = default_tools(tmp_path).names
    assert names == ["calculator", "current_time", "save_note", "read_note", "list_notes"]


# --- grammar --------------------------------------------------------------------------------------


def test_grammar_names_every_tool_and_property(tmp_path, registry):
    registry_with_notes = default_tools(tmp_path)
    registry_with_notes.register(forecast)
    grammar = registry_with_notes.gbnf_grammar()
    assert grammar.startswith("root ::= ")
    for name in registry_with_notes.names:
        assert f'"\\"{name}\\""' in grammar  # the JSON string literal of the name
    for prop in ("expression", "timezone", "title", "text", "city", "unit"):
        assert f'"\\"{prop}\\""' in grammar
    assert '"\\"celsius\\"" | "\\"fahrenheit\\""' in grammar


class _CountingRules(dict):
    """A grammar builder's rules that count the names looked up in them."""

    lookups = 0

    def __contains__(self, name):
        self.lookups += 1
        return super().__contains__(name)


def _wide_tool(properties: int) -> Tool:
    """A tool whose properties are named by one CJK character each: every rule name cleans to ``wide-args``."""
    names = {chr(0x4E00 + i): {"type": "string"} for i in range(properties)}
    return Tool("wide", "A wide form.", {"type": "object", "properties": names}, lambda **_: None)


def test_grammar_rule_names_are_found_in_linear_lookups():
    """Issue 36: rule names of keys that clean to one base were found by trying every taken suffix again,
    quadratic (6,000 such properties kept the event loop for 36 s); now each base resumes where it stopped."""
    builder = _GrammarBuilder()
    builder.rules = _CountingRules()
    grammar = builder.build([_wide_tool(2000)])
    assert len(builder.rules) > 3 * 1999  # a member, an "after" and a "without" rule per property
    assert builder.rules.lookups < 2 * len(builder.rules)  # was about 6,000,000
    assert grammar == gbnf_grammar([_wide_tool(2000)])  # the same names every time
    names = [line.split(" ::= ")[0] for line in gbnf_grammar([_wide_tool(3)]).splitlines()]
    assert names[3:11] == ["wide-args", "wide-args-2", "wide-args-after", "wide-args-without", "wide-args-3",
                           "wide-args-after-2", "wide-args-without-2", "wide-args-4"]


@pytest.fixture(scope="module")
def llama_vocab(tmp_path_factory):
    """llama.cpp loaded with just the bundled model's vocabulary: enough to
    parse and run a grammar."""
    llama_cpp = pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from slm_align.modeling.models import DEFAULT_MODEL_DIR
    from slm_align.ondevice.gguf.writer import write_gguf

    path = write_gguf(DEFAULT_MODEL_DIR, tmp_path_factory.mktemp("gguf") / "vocab.gguf")
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return llama_cpp, llm, llama_cpp.llama_model_get_vocab(llm.model)


def _grammar_sampler(llama_vocab, grammar: str):
    llama_cpp, _, vocab = llama_vocab
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    assert sampler, "llama.cpp could not parse the grammar"
    return sampler


def _llama_accepts(llama_vocab, grammar: str, text: str) -> bool:
    """Whether llama.cpp's grammar sampler lets the tokens of ``text``,
    then end-of-text, through."""
    llama_cpp, llm, vocab = llama_vocab
    sampler = _grammar_sampler(llama_vocab, grammar)
    tokens = llm.tokenize(text.encode(), add_bos=False, special=False)
    try:
        for token in tokens + [llama_cpp.llama_vocab_eos(vocab)]:
            candidates = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 0.0, 0.0))
            array = llama_cpp.llama_token_data_array(candidates, 1, -1, False)
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
            if candidates[0].logit == float("-inf"):
                return False
            llama_cpp.llama_sampler_accept(sampler, token)
        return True
    finally:
        llama_cpp.llama_sampler_free(sampler)


def test_grammar_compiles_with_llama_cpp(tmp_path, registry, llama_vocab):
    llama_cpp = llama_vocab[0]
    for grammar in (registry.gbnf_grammar(), default_tools(tmp_path).gbnf_grammar(), ToolRegistry().gbnf_grammar()):
        assert llama_cpp.LlamaGrammar.from_string(grammar, verbose=False) is not None
        llama_cpp.llama_sampler_free(_grammar_sampler(llama_vocab, grammar))


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@pytest.mark.parametrize(
    "reply",
    [
        "Free text, where 3 < 5 is allowed.",
        _call("calculator", '{"expression": "2*(3+4)"}'),
        _call("current_time", "{}") + "\n" + _call("current_time", '{"timezone": "Asia/Tokyo"}'),
        _call("forecast", '{"city": "Oslo"}'),
        _call("forecast", '{"city": "Oslo", "unit": "fahrenheit", "hours": [1, 2], "extra": null}'),
        _call("forecast",
              '{"city": "O\\"slo", "days": -3, "extra": 2.5e3, "metrics": {"rain": '
              'true}, "verbose": false}'),
        '<tool_call>{\n  "name": "calculator",\n  "arguments": {\n    "expression": '
        '"1"\n  }\n}</tool_call>',
    ],
)
def test_llama_cpp_grammar_admits_calls_that_follow_the_schemas(registry, llama_vocab, reply):
    assert registry.parse_calls(reply).errors == []
    assert _llama_accepts(llama_vocab, registry.gbnf_grammar(), reply)


@pytest.mark.parametrize(
    "reply",
    [
        _call("calculator", "{}"),  # a required argument is missing
        _call("rm_rf", "{}"),
        _call("calculator", '{"expression": 1}'),
        _call("forecast", '{"unit": "celsius", "city": "Oslo"}'),  # out of order
        _call("forecast", '{"city": "Oslo", "unit": "kelvin"}'),
        _call("forecast", '{"city": "Oslo", "days": 1.5}'),
        _call("forecast", '{"city": "Oslo",}'),
        "Sure! " + _call("calculator", '{"expression": "1"}'),  # text, then a call: neither one nor the other
        "<b>tags</b> are not free text",
        "",
    ],
)
def test_llama_cpp_grammar_rejects_what_breaks_the_schemas(registry, llama_vocab, reply):
    assert not _llama_accepts(llama_vocab, registry.gbnf_grammar(), reply)


def test_required_and_named_grammars_admit_calls_only(registry, llama_vocab):
    required = registry.gbnf_grammar(required=True)
    named = registry.gbnf_grammar(required=True, names=["current_time"])
    calc = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    clock = '<tool_call>{"name": "current_time", "arguments": {}}</tool_call>'
    assert _llama_accepts(llama_vocab, required, calc) and _llama_accepts(llama_vocab, required, clock)
    assert not _llama_accepts(llama_vocab, required, "Free text instead.")
    assert _llama_accepts(llama_vocab, named, clock) and not _llama_accepts(llama_vocab, named, calc)
    assert not _llama_accepts(llama_vocab, required, _call("calculator", '{"expression": "1"}').replace(" ", "\t"))


# --- on-device footprint --------------------------------------------------------------------------


def test_tools_import_neither_torch_nor_transformers():
    code = (
        "import sys; import slm_align.ondevice.tools.registry, slm_align.ondevice.tools.builtin; "
        "print([m for m in ('torch', 'transformers') if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    assert result.stdout.strip() == "[]"


def test_a_tool_past_its_timeout_is_an_error_observation_and_a_raising_one_too():
    release = threading.Event()
    registry = ToolRegistry(timeout_s=0.2)

    @registry.register
    def stuck(x: int) -> str:
        """Wait until released.

        Args:
            x: Ignored.
        """
        release.wait(30)
        return "late"

    @registry.register
    def broken(x: int) -> str:
        """Fail.

        Args:
            x: Ignored.
        """
        raise ValueError("no such item")

    late = registry.execute(ToolCall("stuck", {"x": 1}))
    release.set()
    assert not late.ok and "stuck did not finish within 0.2 s" in late.content
    failed = registry.execute(ToolCall("broken", {"x": 1}))
    assert not failed.ok and "no such item" in failed.content
    with pytest.raises(UserError, match="timeout_s must be above 0"):
        ToolRegistry(timeout_s=0)
