"""A GGUF's chat templates are compiled and rendered only in our sandbox: opening the file in
llama-cpp-python compiles none of them (its ``Llama.__init__`` compiles every
``tokenizer.chat_template*`` with plain Jinja, which folds ``7 ** (3 * 10 ** 7)`` while compiling:
44 s before anything could refuse it), named ones (``tool_use``) included; `chat`, `evaluate-agent`
and `serve` refuse a bomb in the default template in one line (exit 2) and never compile a named one
or one replaced by ``--chat-template``. Every ``llama_cpp.Llama`` of the package is made by
slm_align/ondevice/agent/llama_open.py.

Behaviour, not time: Jinja's ``Environment.compile`` is watched, and a compile outside our sandbox
fails the test at once (where it would otherwise take 44 s)."""

import ast
import io
import json
import sys
from pathlib import Path

import jinja2
import pytest

from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.ondevice.gguf.writer import write_gguf
from slm_align.ondevice.templates import chat as chat_templates
from slm_align.ondevice.templates.chat import CHATML_TEMPLATE
from slm_align.ondevice.templates.sandbox import BoundedSandbox
from tests.helpers import run_cli

pytest.importorskip("llama_cpp")

BOMB = "{% if (7 ** (3 * 10 ** 7)) > 1 %}{% endif %}" + CHATML_TEMPLATE
"""ChatML behind an integer power that plain Jinja computes while it compiles (44 s, 1.4 GB of digits)."""
BIG = "{% set a = 'A' * 10 ** 8 %}" + CHATML_TEMPLATE
"""ChatML behind a 100 MB string that plain Jinja folds while it compiles."""
PACKAGE = Path(__file__).resolve().parents[3] / "slm_align"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """The bundled model as GGUF F16 with: a bomb as its template and as its named tool_use
    template (``bomb``); ChatML with a bomb and a folded 100 MB string as named templates
    (``named``). Written by gguf-py's writer, as llama.cpp's converter writes named templates."""
    root = tmp_path_factory.mktemp("gguf-templates")
    bomb = [{"name": "default", "template": BOMB}, {"name": "tool_use", "template": BOMB}]
    named = [{"name": "default", "template": CHATML_TEMPLATE}, {"name": "tool_use", "template": BOMB},
             {"name": "rag", "template": BIG}]
    return {"bomb": write_gguf(DEFAULT_MODEL_DIR, root / "bomb.gguf", "F16", chat_template=bomb),
            "named": write_gguf(DEFAULT_MODEL_DIR, root / "named.gguf", "F16", chat_template=named)}


@pytest.fixture
def compiled(monkeypatch):
    """The sources Jinja compiles from now on, by environment class; a compile outside
    :class:`BoundedSandbox` fails at once instead of folding the bomb."""
    seen = []
    original = jinja2.Environment.compile
    chat_templates._compile.cache_clear()  # each test sees its own compiles
    chat_templates.template_traits.cache_clear()

    def watched(self, source, *args, **kwargs):
        seen.append((type(self).__name__, source if isinstance(source, str) else "<parsed>"))
        if not isinstance(self, BoundedSandbox):
            raise AssertionError(f"a template was compiled outside the sandbox by {type(self).__name__}")
        return original(self, source, *args, **kwargs)

    monkeypatch.setattr(jinja2.Environment, "compile", watched)
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["bomb", "named"])
def test_opening_a_gguf_compiles_none_of_its_templates_and_keeps_their_text(ggufs, compiled, name):
    from slm_align.ondevice.agent.llama_backend import LlamaCppBackend

    backend = LlamaCppBackend(ggufs[name], n_ctx=64)
    assert compiled == []
    templates = backend.llm.chat_templates
    assert templates["tokenizer.chat_template.tool_use"] == BOMB
    assert backend.chat_template == (BOMB if name == "bomb" else CHATML_TEMPLATE)
    assert backend.llm._chat_handlers == {}  # llama-cpp-python made no formatter of its own
    assert not any(key.startswith("tokenizer.chat_template") for key in backend.llm.metadata)
    assert backend.llm.metadata["general.architecture"] == "llama"  # the rest of the metadata as before


def chat_cli(capsys, monkeypatch, typed, *args):
    monkeypatch.setattr(sys, "stdin", io.StringIO(typed))
    return run_cli(capsys, "chat", *args)


@pytest.mark.timeout(120)
def test_a_bomb_in_the_models_template_is_refused_in_one_line_by_chat_evaluate_agent_and_serve(
        capsys, monkeypatch, ggufs, compiled, tmp_path):
    problem = "the model's own chat template was stopped: it made an integer of more than 16,384 bits"
    code, out, err = chat_cli(capsys, monkeypatch, "hello\n", ggufs["bomb"])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and problem in err, err
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    code, out, err = run_cli(capsys, "evaluate-agent", tasks, "--artifact", ggufs["bomb"])
    assert code == 2 and problem in err and err.count("\n") == 1, err
    code, out, err = run_cli(capsys, "serve", ggufs["bomb"], "--port", "0")
    assert code == 2 and problem in err and err.count("\n") == 1, err
    assert {kind for kind, _ in compiled} == {"BoundedSandbox"}  # tried in the sandbox only
    assert all(source == BOMB for _, source in compiled)  # the default one; the named one never


@pytest.mark.timeout(120)
def test_a_template_replaced_by_chat_template_chatml_is_never_compiled(capsys, monkeypatch, ggufs, compiled):
    code, out, err = chat_cli(capsys, monkeypatch, "hello\n", ggufs["bomb"], "--chat-template", "chatml",
                              "--max-new-tokens", "4", "--json")
    assert code == 0 and "reply" in json.loads(out), err
    from slm_align.ondevice.agent.server import create_app

    app = create_app(ggufs["bomb"], chat_template="chatml")
    app.state.service.close()
    assert compiled and BOMB not in {source for _, source in compiled}


@pytest.mark.timeout(120)
def test_named_templates_are_never_compiled_and_the_default_one_serves(capsys, monkeypatch, ggufs, compiled):
    code, out, err = chat_cli(capsys, monkeypatch, "hello\n", ggufs["named"], "--max-new-tokens", "4", "--json")
    assert code == 0 and "reply" in json.loads(out), err
    from slm_align.ondevice.agent.server import create_app

    app = create_app(ggufs["named"])
    app.state.service.close()
    sources = {source for _, source in compiled}
    assert CHATML_TEMPLATE in sources and BOMB not in sources and BIG not in sources


def constructs_llama(tree: ast.AST) -> bool:
    """``tree`` imports ``Llama`` from llama_cpp or calls ``llama_cpp.Llama``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "llama_cpp":
            if any(alias.name == "Llama" for alias in node.names):
                return True
        if isinstance(node, ast.Attribute) and node.attr == "Llama":
            return True
    return False


def test_every_llama_of_the_package_is_opened_by_the_one_loader():
    constructing = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                          if constructs_llama(ast.parse(path.read_text(encoding="utf-8"))))
    assert constructing == ["ondevice/agent/llama_open.py"]
