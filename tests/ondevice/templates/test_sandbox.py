"""Chat templates render bounded: a template that loops, grows a value without end or fails is one
ChatTemplateError naming it, within the bounds of slm_align.ondevice.templates.sandbox; real templates render
exactly as Jinja's own sandbox renders them (as transformers does)."""

from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from slm_align.errors import UserError
from slm_align.ondevice.templates import chat as chat_templates
from slm_align.ondevice.templates.chat import ChatTemplateError, check_template, chosen_chat_template, render
from slm_align.ondevice.templates.sandbox import TEMPLATE_CHARS, TEMPLATE_STEPS, TemplateLimit

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "chat_templates"
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>adding</think>4"}, {"role": "user", "content": "And 3+3?"}]
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate <expression>",
                                           "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}]
NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
                "{% endfor %}{% endfor %}{% endfor %}")

STOPPED = [
    (NESTED_LOOPS, f"more than {TEMPLATE_STEPS:,} steps"),
    ("{% for a in range(1000) %}{% for b in range(1000) %}{% for c in range(1000) %}x{% endfor %}{% endfor %}"
     "{% endfor %}", "steps"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}", "(a loop"),
    ("{{ 'A' * 100000000000 }}", f"a value of more than {TEMPLATE_CHARS:,} characters"),
    ("{{ ['A'] * 10 ** 10 }}", "a value of more than"),
    ("{{ 'ab'.center(10000000000) }}", "a value of more than"),
    ("{{ 'ab'|center(10000000000) }}", "a value of more than"),
    ("{{ ('a' * 1000000)|replace('a', 'aaaaaaaaaa') }}", "a value of more than"),
    ("{% set l = ['x' * 1000000] * 100 %}{{ l|join }}", "a value of more than"),
    ("{{ '%999999999d' % 1 }}", "formats a field wider than"),
    ("{{ '{:>999999999}'.format(1) }}", "formats a field wider than"),
    ("{{ 7 ** 100000000 }}", "an integer of more than"),
    ("{{ 1|round(-1000000000, 'ceil') }}", "rounds to more than"),
    ("{{ [1]|batch(1000000000, 'x')|list }}", "a value of more than"),
    # a string or a list doubled in a loop: refused when it passes the size bound, long before memory runs out
    ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "a value of more than"),
    ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
     "a value of more than"),
    ("{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(64) %}{% set ns.a = [ns.a, ns.a] %}"
     "{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}", "a value of more than"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", f"text grew past {TEMPLATE_CHARS:,} characters"),
    ("{% set s = 'x' * 3000000 %}{% for i in range(1000) %}{% set t = s|upper %}{% endfor %}",
     "characters in all"),
    # single built-in calls, checked before they run: what they would make, what they would cost
    ("{{ strftime_now('%1000Y' * 660000) }}", "formats a date with a pattern of more than 256 characters"),
    ("{{ strftime_now('%1000Y') }}", "formats a date with a field width"),
    ("{{ ('\u00e9' * 20000).encode('punycode') }}", "it calls encode('punycode'); only utf-8"),
    ("{{ 'abc'.encode('utf-8').decode('idna') }}", "it calls decode('idna')"),
    ("{{ 'abc'.encode('ascii', 'namereplace') }}", "errors='namereplace'"),
    ("{{ ('a' * 1000000)|wordwrap(1) }}", "wraps words longer than the width: more than 500,000,000"),
    ("{{ ('a' * 2000000).strip('b' * 1000 + 'a') }}", "strips a set of characters"),
    ("{{ ('a' * 2000000)|trim('b' * 1000 + 'a') }}", "strips a set of characters"),
    ("{{ (('a' * 4000000).encode('utf-8') * 2)|length }}", "a value of more than"),  # bytes count as characters
    ("{{ 'a'.encode('utf-8').center(5000000)|length }}", "a value of more than"),
    ("{{ (2).to_bytes(5000000, 'big')|length }}", "a value of more than"),
    ("{% set s = 'ab' * 300000 %}{{ s|sort|length }}", f"more than {TEMPLATE_STEPS:,} steps"),  # n log n
    ("{% set s = 'ab' * 600000 %}{{ s|unique|list|length }}", f"more than {TEMPLATE_STEPS:,} steps"),
    ("{{ ('x.com ' * 20000)|urlize|length }}", "urlizes more than 100,000 characters"),
    ("{{ ('a ' * 1500000)|title|length }}", f"more than {TEMPLATE_STEPS:,} steps"),  # Python per word
    ("{{ ('<a>' * 1100000)|striptags|length }}", f"more than {TEMPLATE_STEPS:,} steps"),
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("template, problem", STOPPED)
def test_a_template_past_a_bound_is_stopped_with_one_line_naming_it(template, problem):
    with pytest.raises(ChatTemplateError) as refused:
        render(template, MESSAGES, None, None, origin="spin.jinja (sha256 0123456789ab)")
    message = str(refused.value)
    assert message.startswith("the chat template spin.jinja (sha256 0123456789ab) was stopped: ")
    assert problem in message and "--chat-template chatml" in message and "\n" not in message
    assert isinstance(refused.value.cause, TemplateLimit) and isinstance(refused.value, UserError)


FAILING = [
    ("{% include 'other.jinja' %}", "is not a valid chat template (line 1: {% include %} needs another template file"),
    ("{% extends 'base.jinja' %}", "{% extends %} needs another template file"),
    ("{% from 'macros.jinja' import m %}", "{% from ... import %} needs another template file"),
    ("{{ messages.foo.bar }}", "failed to render (UndefinedError: 'list object' has no attribute 'foo')"),
    ("{{ 'A' * 1e11 }}", "failed to render (TypeError: can't multiply sequence by non-int of type 'float')"),
    ("{% for m in messages %}", "is not a valid chat template (line 1: Unexpected end of template"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "failed to render (RecursionError"),
    ("{{ lipsum(1000000) }}", "'lipsum' is undefined"),
]


@pytest.mark.parametrize("template, problem", FAILING)
def test_a_template_that_fails_is_one_line_naming_it_never_a_traceback(template, problem):
    with pytest.raises(ChatTemplateError, match="^the model's own chat template ") as refused:
        render(template, MESSAGES, None, None, origin="artifact")
    assert problem in str(refused.value) and "\n" not in str(refused.value)


def test_raise_exception_still_refuses_the_conversation_in_the_templates_words():
    with pytest.raises(UserError, match="^the chat template refused the conversation: roles must alternate$"):
        render("{{ raise_exception('roles must alternate') }}", MESSAGES, None, None)


def test_each_render_has_its_own_budget():
    """A template that takes most of the step budget renders again and again: the bound is per render."""
    busy = "{% for a in range(600) %}{% for b in range(600) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
    assert [render(busy, MESSAGES, None, None) for _ in range(3)] == ["Be terse."] * 3


def plain_render(source, **variables):
    """The template rendered by Jinja's own immutable sandbox with our globals: what it rendered before
    the bounds (and what transformers renders)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=chat_templates._raise, strftime_now=chat_templates._strftime_now)
    env.filters["tojson"] = chat_templates._tojson
    return env.from_string(source).render(**variables)


@pytest.mark.parametrize("name", sorted(path.name for path in FIXTURES.glob("*.jinja")))
def test_real_templates_render_as_before(name):
    source = (FIXTURES / name).read_text(encoding="utf-8")
    long = MESSAGES + [{"role": "assistant", "content": "6"}, {"role": "user", "content": "x " * 5000}] * 200
    for messages, tools in [(MESSAGES, None), (MESSAGES, TOOLS), (long, TOOLS)]:
        expected = plain_render(source, messages=messages, tools=tools, bos_token="<s>", eos_token="</s>",
                                add_generation_prompt=True)
        assert render(source, messages, "<s>", "</s>", tools) == expected


HELD = [
    "{{ strftime_now('%d %b %Y') }} {{ strftime_now('%%10Y %-d') }}",
    "{{ 'h\u00e9llo'.encode('utf-8')|length }}{{ 'x'.encode('latin-1').decode('ascii') }}"
    "{{ 'ab'.encode('utf-16-le').decode('utf-16-le', 'replace') }}{{ 'ab'.encode('utf-8').hex() }}",
    "{{ ('lorem ipsum dolor ' * 100)|wordwrap(7) }}{{ ('a b ' * 10000)|wordwrap(1)|length }}",
    "{{ ('  x  ')|trim }}{{ 'xxhixx'.strip('x') }}{{ ('ab' * 1000).lstrip('ab') }}",
    "{{ range(1000)|list|reverse|sort|join(',') }}{{ messages|map(attribute='role')|unique|join(',') }}",
    "{{ ('a b-c (d) ' * 1000)|title }}{{ ('<b>x</b> &amp; ' * 1000)|striptags }}",
    "{{ (5).to_bytes(2, 'big')|length }}{{ messages|selectattr('role', 'equalto', 'user')|list|length }}",
]
"""Built-in calls within their bounds: rendered as Jinja's own sandbox renders them."""


@pytest.mark.parametrize("source", HELD)
def test_built_in_calls_within_their_bounds_render_as_before(source):
    variables = {"messages": MESSAGES, "tools": None, "bos_token": "", "eos_token": "", "add_generation_prompt": True}
    assert render(source, MESSAGES, None, None) == plain_render(source, **variables)


SMALL_JINJA = ("{% for m in messages %}{{ loop.index }}:{{ m.role|upper }}={{ m['content']|trim }}"
               "{% if not loop.last %}|{% endif %}{% endfor %}{% set parts = [1, 2] + [3] %}"
               "{{ parts|sum }}{{ parts|map('string')|join(',') }}{{ '%s-%d' % ('a', 3) }}{{ '{}!'.format('b') }}"
               "{% set ns = namespace(s='') %}{% for k, v in {'a': 1}.items() %}{% set ns.s = ns.s ~ k ~ v %}"
               "{% endfor %}{{ ns.s }}{% for x in [] %}no{% else %}none{% endfor %}"
               "{% for x in [[1, [2]]] recursive %}{{ x if x is number else loop(x) }}{% endfor %}{{ 'ab' * 2 }}")


def test_the_language_a_template_uses_is_unchanged():
    variables = {"messages": MESSAGES[:2], "tools": None, "bos_token": "", "eos_token": "",
                 "add_generation_prompt": True}
    expected = plain_render(SMALL_JINJA, **variables)
    assert expected.startswith("1:SYSTEM=Be terse.|2:USER=What is 2+2?61,2,3a-3b!a1none12abab")
    assert render(SMALL_JINJA, MESSAGES[:2], None, None) == expected


@pytest.mark.timeout(20)
def test_a_template_file_that_loops_or_fails_is_refused_as_the_option_is_read(tmp_path):
    looping = tmp_path / "loop.jinja"
    looping.write_text(NESTED_LOOPS)
    with pytest.raises(ChatTemplateError, match=r"^the chat template loop.jinja \(sha256 \w{12}\) was stopped"):
        chosen_chat_template(str(looping))
    including = tmp_path / "include.jinja"
    including.write_text("{% include 'x' %}")
    with pytest.raises(ChatTemplateError, match="include.jinja .*needs another template file"):
        chosen_chat_template(str(including))
    check_template(None)  # no template: nothing to try
    check_template(chat_templates.CHATML_TEMPLATE, "chatml")


def test_a_conversation_beyond_the_size_bound_is_refused_as_the_conversations_fault_not_the_templates():
    with pytest.raises(UserError, match="^the conversation holds 4,000,001 characters") as refused:
        render(chat_templates.CHATML_TEMPLATE, [{"role": "user", "content": "x" * (TEMPLATE_CHARS + 1)}], None, None)
    assert not isinstance(refused.value, ChatTemplateError)
    assert len(render(chat_templates.CHATML_TEMPLATE, [{"role": "user", "content": "x" * 3_000_000}], None, None)) > 3e6
