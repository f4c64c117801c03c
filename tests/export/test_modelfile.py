"""The Ollama Modelfile beside an exported GGUF: the chat template translated from Jinja to
Ollama's Go templates (pinned on hand-checked cases), stop tokens, default parameters, SYSTEM;
untranslatable templates say so."""

import json
import re

import pytest

from slm_align.export.publishing.modelfile import Untranslatable, build_modelfile, translate_template
from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.ondevice.templates.chat import CHATML_TEMPLATE, GEMMA_TEMPLATE
from tests.helpers import ARCHITECTURES, export_bundled, run_cli

# Hand-checked: for each message, the Jinja template prints the same markers around
# .Role and .Content, and the generation prompt (add_generation_prompt) is what Ollama
# always renders at the end.
CHATML_OLLAMA = ("{{ range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
                 "<|im_start|>assistant\n")
GEMMA_OLLAMA = ('{{ $role := "" }}{{ range .Messages }}{{ if eq .Role "assistant" }}{{ $role = "model" }}'
                '{{ else }}{{ $role = "user" }}{{ end }}<start_of_turn>{{ $role }}\n{{ .Content }}<end_of_turn>\n'
                "{{ end }}<start_of_turn>model\n")


def test_the_bundled_models_chatml_template_translates():
    translation = translate_template((DEFAULT_MODEL_DIR / "chat_template.jinja").read_text())
    assert translation.template == CHATML_OLLAMA
    assert translation.turn_start == "<|im_start|>" and translation.turn_end == "<|im_end|>"


def test_the_test_architectures_chat_templates_translate(tokenizer):
    """Every tiny architecture of the tests carries the bundled tokenizer's template (ChatML)."""
    assert len(ARCHITECTURES) == 6
    assert translate_template(tokenizer.chat_template).template == CHATML_OLLAMA


def test_gemmas_turns_translate_with_a_role_variable():
    """The template a Gemma 3 GGUF without one gets (the real test model): roles
    mapped with if/else and set."""
    translation = translate_template(GEMMA_TEMPLATE)
    assert translation.template == GEMMA_OLLAMA
    assert translation.turn_start == "<start_of_turn>" and translation.turn_end == "<end_of_turn>"


def test_elif_not_equal_and_attribute_access_translate():
    source = ("{% for m in messages %}{% if m.role == 'system' %}[S]{{ m.content }}{% elif 'user' "
              "!= m.role %}[A]{{ m.content }}</s>{% else %}[U]{{ m.content }}{% "
              "endif %}\n{% endfor %}")
    assert translate_template(source).template == (
        '{{ range .Messages }}{{ if eq .Role "system" }}[S]{{ .Content }}{{ else if ne .Role "user" }}[A]'
        "{{ .Content }}</s>{{ else }}[U]{{ .Content }}{{ end }}{{ end }}")  # trim_blocks: no newline after endif


def test_block_whitespace_is_trimmed_as_transformers_renders_it():
    """trim_blocks and lstrip_blocks: the newline after a block tag and the indentation
    before it are not output."""
    source = "{% for message in messages %}\n  {% if message['role'] == 'user' %}\nU: {{ message['content'] }}\n" \
             "  {% endif %}\n{% endfor %}"
    assert translate_template(source).template == '{{ range .Messages }}{{ if eq .Role "user" }}U: {{ .Content }}\n' \
                                                  "{{ end }}{{ end }}"


def test_literal_braces_are_printed_as_go_strings():
    source = "{% for message in messages %}{{ '{{' + message['content'] + '}}' }}{% endfor %}"
    assert translate_template(source).template == '{{ range .Messages }}{{ "{{" }}{{ .Content }}{{ "}}" }}{{ end }}'


UNTRANSLATABLE = {
    "bos token": ("{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}",
                  "'bos_token'"),
    "loop index": ("{% for message in messages %}{{ loop.index }}{{ "
                   "message['content'] }}{% endfor %}",
                   "'loop.index'"),
    "filter": ("{% for message in messages %}{{ message['content'] | trim }}{% endfor %}",
               "filter 'trim'"),
    "first message": ("{% if messages[0]['role'] == 'system' %}S{% endif %}{% for m in messages "
                      "%}{{ m.content }}{% endfor %}", "'messages[...][...]'"),
    "tools": ("{% for message in messages %}{{ message['content'] }}{% endfor %}{% "
              "if tools %}T{% endif %}",
              "'tools'"),
    "macro": ("{% macro x() %}{% endmacro %}{% for m in messages %}{{ m.content }}{% endfor %}",
              "Macro"),
    "no loop": ("{{ 'hello' }}", "no loop over the messages"),
    "syntax error": ("{% for message in messages %}", "does not parse"),
}


@pytest.mark.parametrize("case", sorted(UNTRANSLATABLE))
def test_templates_beyond_the_subset_are_refused_with_the_reason(case):
    source, reason = UNTRANSLATABLE[case]
    with pytest.raises(Untranslatable, match=re.escape(reason)):
        translate_template(source)


def test_a_condition_that_does_not_translate_is_named_as_the_template_writes_it():
    """SmolLM2's template adds its default system prompt under ``loop.first and messages[0]['role'] != 'system'``:
    the note names that condition, not Jinja's node class ("tests And")."""
    from pathlib import Path

    smollm2 = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "smollm2-135m-instruct.jinja").read_text()
    note = build_modelfile("model-Q4_1.gguf", smollm2, {}).note
    assert "the chat template tests the condition \"loop.first and messages[0]['role'] != 'system'\", which has " \
        "no Ollama translation here" in note
    with pytest.raises(Untranslatable, match=re.escape('the condition "not messages[0].role is defined or x > 2"')):
        translate_template("{% for m in messages %}{% if not messages[0].role is defined or x > 2 %}A{% endif %}"
                           "{% endfor %}")


def test_an_untranslatable_template_leaves_out_template_and_says_so_in_one_line():
    modelfile = build_modelfile("model-Q8_0.gguf", UNTRANSLATABLE["bos token"][0], {"num_ctx": 512})
    assert modelfile.text == "FROM ./model-Q8_0.gguf\nPARAMETER num_ctx 512\n"
    assert "TEMPLATE" not in modelfile.text and "\n" not in modelfile.note and "'bos_token'" in modelfile.note


def test_modelfile_has_from_template_stops_parameters_and_system():
    modelfile = build_modelfile("model-Q4_K_M.gguf", CHATML_TEMPLATE, {"num_ctx": 512, "temperature": 0.7},
                                system="You tell short stories.")
    assert modelfile.note is None
    assert modelfile.text == (f'FROM ./model-Q4_K_M.gguf\nTEMPLATE """{CHATML_OLLAMA}"""\n'
                              'PARAMETER stop "<|im_start|>"\nPARAMETER stop "<|im_end|>"\n'
                              "PARAMETER num_ctx 512\nPARAMETER temperature 0.7\n"
                              'SYSTEM """You tell short stories."""\n')


def test_export_writes_the_modelfile_beside_the_gguf(tmp_path):
    gguf = export_bundled(tmp_path, ("gguf", "Q8_0"))["gguf"]
    modelfile = (tmp_path / "model-Q8_0.Modelfile").read_text()
    manifest = json.loads((tmp_path / "model-Q8_0.gguf.json").read_text())
    assert modelfile.startswith(f"FROM ./{gguf.name}\n") and f'TEMPLATE """{CHATML_OLLAMA}"""' in modelfile
    assert "PARAMETER num_ctx 512\n" in modelfile  # the bundled model's max_position_embeddings
    assert manifest["metrics"]["modelfile"] == {"path": "model-Q8_0.Modelfile", "note": None}


def test_export_system_prompt_reaches_the_modelfile_and_bad_ones_are_refused(capsys, tmp_path):
    code, out, err = run_cli(capsys, "export", DEFAULT_MODEL_DIR, "--quant", "F32", "--no-verify", "--out", tmp_path,
                             "--system", "Be brief.")
    assert code == 0, err
    assert 'SYSTEM """Be brief."""' in (tmp_path / "model-F32.Modelfile").read_text()
    assert "model-F32.Modelfile" in out
    for args, expected in ((["--system", 'say """hi"""'], '--system holds """'),
                           (["--target", "onnx", "--system", "Be brief."], "only --target gguf")):
        code, _, err = run_cli(capsys, "export", DEFAULT_MODEL_DIR, "--out", tmp_path / "refused", *args)
        assert code == 2 and expected in err and err.count("\n") == 1 and not (tmp_path / "refused").exists()


NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
                "{% endfor %}{% endfor %}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}")


@pytest.mark.timeout(120)
def test_a_template_that_loops_is_translated_without_running_it_and_refused_as_an_export_option(capsys, tmp_path):
    """The Modelfile is translated from the template's syntax tree, never rendered: a looping template
    costs nothing there. Given with --chat-template it is refused (one line, exit 2) before anything is
    written, by the bounded trial render every --chat-template FILE gets."""
    modelfile = build_modelfile("model-Q8_0.gguf", NESTED_LOOPS, {})
    assert "TEMPLATE" not in modelfile.text and "loops over something other than the messages" in modelfile.note
    looping = tmp_path / "loop.jinja"
    looping.write_text(NESTED_LOOPS)
    code, _, err = run_cli(capsys, "export", DEFAULT_MODEL_DIR, "--target", "gguf", "--quant", "F16", "--no-verify",
                           "--chat-template", looping, "--out", tmp_path / "refused")
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "refused").exists()
    assert "the chat template loop.jinja (sha256 " in err and "more than 1,000,000 steps" in err


@pytest.fixture(scope="module")
def go_renderer(tmp_path_factory):
    from tests.go_template import build_renderer

    return build_renderer(tmp_path_factory.mktemp("go"))


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi <there> & \"you\""}],
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple."},
     {"role": "user", "content": "Another one,\nplease."}],
]


@pytest.mark.parametrize("name, jinja", [("bundled chatml", (DEFAULT_MODEL_DIR / "chat_template.jinja").read_text()),
                                         ("gemma turns", GEMMA_TEMPLATE), ("chatml", CHATML_TEMPLATE)])
def test_the_modelfile_template_renders_in_go_as_the_models_own_template_does(go_renderer, name, jinja):
    """The translation executed by Go's text/template (Ollama's engine), not compared with a pinned string:
    each conversation's prompt equals the Jinja template's own rendering with the generation prompt."""
    from slm_align.ondevice.templates.chat import render
    from tests.go_template import render_go

    translated = translate_template(jinja).template
    for messages in CONVERSATIONS:
        expected = render(jinja, messages, bos_token="", eos_token="", add_generation_prompt=True)
        assert render_go(go_renderer, translated, messages) == expected, name
