"""Tool turns through real chat templates (tests/fixtures/chat_templates, as the models ship them):
the runtime stores a call once, renders it the way each template expects, and after a tool round
the model continues the ids it was fed and sampled, with only the template's text inserted."""

from pathlib import Path

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent.prompt import PromptFitter, turn_end
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.templates.artifact import use_chat_template
from slm_align.ondevice.templates.chat import render, template_form, template_traits
from slm_align.ondevice.tools.builtin import default_tools
from tests.helpers import export_bundled

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "chat_templates"
EXPRESSION = "17 * 23"
RESULT = "391"


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def openai_conversation(answer: str) -> list[dict]:
    """The tool conversation as an OpenAI client sends it: the call once, in ``tool_calls``."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": EXPRESSION}}}
    return [{"role": "user", "content": "What is 17 times 23?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": RESULT},
            {"role": "assistant", "content": answer}]


@pytest.mark.parametrize("name, calls, tools, results", [
    ("qwen2.5-instruct", True, True, True), ("qwen3", True, True, True), ("llama-3.2-instruct", True, True, True),
    ("smollm2-135m-instruct", False, False, True), ("gemma-3-it", False, False, False)])
def test_what_each_real_template_does_with_a_tool_conversation(name, calls, tools, results):
    traits = template_traits(template(name))
    assert (traits.renders_tool_calls, traits.renders_tools, traits.tool_results is None) == (calls, tools, results)


class CharBackend:
    """A backend of one token per character and no control tokens: ids decode back to the text
    exactly, so a prompt can be compared with a template's own rendering."""

    kind = "test"
    n_ctx = 100_000
    eos_ids = {0}
    bos_token = None
    eos_token = None
    chat_template_origin = "test"

    def __init__(self, chat_template: str):
        self.chat_template = chat_template

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def detokenize(self, ids) -> str:
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "qwen3", "llama-3.2-instruct", "smollm2-135m-instruct"])
def test_the_call_is_stored_once_and_rendered_as_the_template_renders_openai_messages(name):
    text = template(name)
    conversation = openai_conversation("17 times 23 is 391.")
    backend = CharBackend(text)
    tools = default_tools().specs()
    ids, window = PromptFitter(backend, tools).fit(conversation, max_tokens=16)
    runtime = backend.detokenize(ids)
    own = render(text, template_form(conversation, template_traits(text)), None, None, tools)
    assert runtime == own and window == conversation
    assert runtime.count(EXPRESSION) == 1  # the call once, whichever way the template shows it
    if template_traits(text).renders_tool_calls:  # the template's own rendering of OpenAI's messages, untouched
        assert runtime == render(text, conversation, None, None, tools)
    else:  # a template that shows content only gets the call as the model writes it
        assert '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>' in runtime


def test_a_template_that_cannot_show_tool_results_is_refused_in_one_line():
    agent = Agent(CharBackend(template("gemma-3-it")), "m", tools=default_tools())
    with pytest.raises(UserError, match="cannot show tool results.*--chat-template chatml") as refused:
        agent.chat("What is 17 times 23?")
    assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    return export_bundled(tmp_path_factory.mktemp("turns"), ("gguf", "F32"))["gguf"]


class ScriptedModel:
    """The bundled GGUF's tokenizer and cache, with completions scripted: each reply's tokens, then
    the end of the turn as a model trained on the template writes it."""

    def __init__(self, backend, replies):
        self.inner = backend
        self.replies = list(replies)
        self.prompts = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompt, params, grammar=None):
        self.prompts.append(list(prompt))
        yield from self.inner.tokenize(self.replies.pop(0), add_special=False)
        yield next(iter(turn_end(self.inner)))


def call_as_rendered(text: str) -> str:
    """The assistant's call turn as the template renders it: what a model trained on it writes."""
    conversation = template_form(openai_conversation("")[:2], template_traits(text))
    before = render(text, conversation[:1], None, None, default_tools().specs())
    after = render(text, conversation, None, None, default_tools().specs(), add_generation_prompt=False)
    return after[len(before):].split("<|im_end|>")[0]


@pytest.mark.parametrize("name", ["chatml", "qwen2.5-instruct", "qwen3", "smollm2-135m-instruct"])
def test_after_a_tool_round_the_model_continues_its_own_ids_with_the_templates_text_between(gguf, name):
    from slm_align.ondevice.agent.open_artifact import open_backend

    backend = open_backend(gguf, n_ctx=2048)  # Qwen's templates describe the tools at length
    if name != "chatml":
        use_chat_template(backend, str(TEMPLATES / f"{name}.jinja"))
    written = call_as_rendered(backend.chat_template)
    model = ScriptedModel(backend, [written, "It is 391."])
    agent = Agent(model, "m", tools=default_tools(), sampling=SamplingParams(temperature=0.0, max_tokens=128))
    reply = agent.chat("What is 17 times 23?")
    assert reply.text == "It is 391." and [c["content"] for c in reply.tool_calls] == [RESULT]
    assert agent.messages[1].get("tool_calls", [{}])[0].get("function", {}).get("name") in ("calculator", None)
    first, second = model.prompts
    kinds = [kind for kind, _ in agent.trace]
    assert kinds == ["prompt", "sampled", "inserted", "sampled"]
    pieces = dict(zip(kinds[:3], [ids for _, ids in agent.trace[:3]]))
    sampled = pieces["sampled"]
    assert second[:len(first) + len(sampled)] == first + sampled  # the sampled ids, never re-tokenised
    assert sampled[-1] in turn_end(backend) and backend.detokenize(sampled[:-1]) == written
    full, _ = PromptFitter(backend, default_tools().specs()).fit(agent.messages[:3], max_tokens=128)
    inserted = pieces["inserted"]
    assert second[len(first) + len(sampled):] == inserted
    assert backend.detokenize(full).endswith(backend.detokenize(inserted))  # the template's text, nothing else
    assert backend.detokenize(inserted).count(RESULT) == 1  # the observation, among the inserted ids
    if name != "qwen3":  # a template that shows the history as it was written: the same ids a render gives
        assert second == full
    else:  # Qwen3 drops an earlier turn's (empty) thinking from the history; the model saw what it wrote
        assert "<think>" in backend.detokenize(sampled) and "<think>" not in backend.detokenize(full)
