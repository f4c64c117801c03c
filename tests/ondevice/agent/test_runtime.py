"""The on-device agent: both backends, multi-turn within the window, tools,
feedback, and no torch."""

import json
import re
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.sampling import apply_penalties, candidates, sample_token
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.templates.chat import CHATML_TEMPLATE
from slm_align.ondevice.tools.builtin import default_tools
from tests.helpers import export_bundled, finished_sft_run, most_repeated_name, run_cli

pytest.importorskip("llama_cpp")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
SCRIPTED = SamplingParams(temperature=0.0, max_tokens=200)  # room for a whole scripted tool call


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """The bundled (trained) model exported once to GGUF F16 and ONNX fp32."""
    return export_bundled(tmp_path_factory.mktemp("artifacts"), ("gguf", "F16"), ("onnx", "fp32"))


class ScriptedBackend:
    """A real backend whose completions are scripted, to drive the tool loop deterministically."""

    def __init__(self, backend, replies):
        self.inner, self.replies, self.prompts = backend, list(replies), []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompt, params, grammar=None):
        self.prompts.append(self.inner.detokenize(prompt))
        yield from self.inner.tokenize(self.replies.pop(0), add_special=False)
        yield next(iter(self.inner.eos_ids))


def test_both_backends_give_the_same_greedy_conversation(artifacts):
    agents = {kind: Agent.load(path, sampling=GREEDY, system="You tell stories.") for kind, path in artifacts.items()}
    for message in ("Tell me about a cat.", "And then what happened?"):
        replies = {kind: agent.chat(message).text for kind, agent in agents.items()}
        assert replies["gguf"] == replies["onnx"] and len(replies["gguf"].split()) >= 3


def test_streaming_pieces_add_up_to_the_reply_and_respect_stop(artifacts):
    agent = Agent.load(artifacts["onnx"], sampling=GREEDY)
    pieces = list(agent.stream("Tell me about a dog."))
    assert len(pieces) > 1 and "".join(pieces) == agent.last.text
    first_word = agent.last.text.split()[1]
    agent.reset()
    stopped = agent.chat("Tell me about a dog.", stop=[first_word]).text
    assert stopped == agent_text_before(pieces, first_word) and first_word not in stopped


def agent_text_before(pieces, word):
    text = "".join(pieces)
    return text[: text.find(word)]


def test_conversation_longer_than_the_window_keeps_working(artifacts):
    agent = Agent.load(artifacts["gguf"], n_ctx=192, sampling=GREEDY, system="SYSTEM-PROMPT")
    for turn in range(12):
        reply = agent.chat(f"Story number {turn}, please.")
        assert reply.text is not None
    assert len(agent.messages) == 1 + 2 * 12  # the history is kept; only the prompt window drops turns
    prompt, window = agent.prompt_tokens(agent.messages + [{"role": "user", "content": "next"}], 24)
    assert window[0]["content"] == "SYSTEM-PROMPT" and len(window) < len(agent.messages)
    assert len(prompt) + 24 <= 192


def test_repeat_penalty_cuts_repetition_and_both_backends_agree(artifacts):
    plain = Agent.load(artifacts["onnx"], sampling=replace(GREEDY, max_tokens=40)).chat("Tell me about a cat.").text
    name = most_repeated_name(plain)
    assert plain.count(name) >= 3  # greedily, the bundled model names its hero again and again
    for params in (dict(repeat_penalty=2.0, frequency_penalty=1.0), dict(repeat_penalty=2.0, frequency_penalty=1.0,
                                                                           presence_penalty=0.5)):
        sampling = replace(GREEDY, max_tokens=40, **params)
        replies = {kind: Agent.load(path, sampling=sampling).chat("Tell me about a cat.").text
                   for kind, path in artifacts.items()}
        assert replies["gguf"] == replies["onnx"] and replies["onnx"].count(name) < plain.count(name), params


def test_numpy_sampler_penalises_and_cuts_as_llama_cpp_does():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    penalized = apply_penalties(np.array([2.0, -2.0, 1.0, 0.0], dtype=np.float32),
                                SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
                                [0, 1, 1, 3] + [3] * 70)  # only the last 64 count: token 3's 64, not 0 and 1
    assert penalized.tolist() == [2.0, -2.0, 1.0, 0.0 * 2.0 - 64 * 0.5 - 0.25]
    assert candidates(logits, SamplingParams(top_k=0, top_p=1.0, min_p=0.5)).tolist() == [0, 1]
    assert candidates(logits, SamplingParams(top_k=3, top_p=1.0)).tolist() == [0, 1, 2]
    assert candidates(logits, SamplingParams(top_k=0, top_p=0.8)).tolist() == [0, 1]
    rng = np.random.default_rng(0)
    draws = {sample_token(logits, SamplingParams(temperature=1.5, top_p=1.0, top_k=0, min_p=0.25), rng)
             for _ in range(200)}
    assert draws == {0, 1, 2}
    assert sample_token(logits, SamplingParams(temperature=0, repeat_penalty=3.0), rng, [0]) == 1


def test_chat_command_takes_top_k_min_p_and_repeat_penalty(artifacts, monkeypatch, capsys):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("Tell me about a cat.\n"))
    code, out, err = run_cli(capsys, "chat", artifacts["onnx"], "--json", "--temperature", "0", "--max-new-tokens",
                             "80", "--top-k", "5", "--min-p", "0.05", "--repeat-penalty", "2.0")
    flags = SamplingParams(temperature=0, max_tokens=80, top_k=5, min_p=0.05, repeat_penalty=2.0)
    plain = Agent.load(artifacts["onnx"], sampling=replace(GREEDY, max_tokens=80)).chat("Tell me about a cat.").text
    expected = Agent.load(artifacts["onnx"], sampling=flags).chat("Tell me about a cat.").text
    assert code == 0 and json.loads(out)["reply"] == expected != plain  # the flags reached the sampler
    code, out, err = run_cli(capsys, "chat", artifacts["onnx"], "--repeat-penalty", "0.5")
    assert code == 2 and "--repeat-penalty" in err


def test_tool_call_is_parsed_executed_and_observed(artifacts):
    agent = Agent.load(artifacts["onnx"], sampling=SCRIPTED, tools=default_tools())
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'
    agent.backend = ScriptedBackend(agent.backend, [call, "It is 391."])
    reply = agent.chat("What is 17 times 23?")
    assert reply.text == "It is 391."
    assert reply.tool_calls == [{"name": "calculator", "arguments": {"expression": "17 * 23"}, "ok": True,
                                 "content": "391"}]
    assert "391" in agent.backend.prompts[1] and [m["role"] for m in agent.messages] == \
        ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize("bad", ['<tool_call>{"name": "calculator", "arguments": {oops</tool_call>',
                                 '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                                 '<tool_call>{"name": "calculator", "arguments": {"expression": '
                                 '"__import__(1)"}}</tool_call>'])
def test_malformed_or_refused_call_goes_back_as_an_observation(artifacts, bad):
    agent = Agent.load(artifacts["onnx"], sampling=SCRIPTED, tools=default_tools())
    agent.backend = ScriptedBackend(agent.backend, [bad, "Sorry, I could not compute that."])
    reply = agent.chat("Compute something.")
    assert reply.text == "Sorry, I could not compute that."
    assert len(reply.tool_calls) == 1 and reply.tool_calls[0]["ok"] is False
    assert agent.messages[2]["role"] == "tool" and agent.messages[2]["content"] in agent.backend.prompts[1]


def test_tool_rounds_are_capped(artifacts):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    agent = Agent.load(artifacts["onnx"], sampling=SCRIPTED, tools=default_tools(), max_tool_rounds=2)
    agent.backend = ScriptedBackend(agent.backend, [call, call, "Two."])
    assert agent.chat("Add.").text == "Two." and len(agent.last.tool_calls) == 2


def test_grammar_keeps_gguf_replies_well_formed(artifacts):
    agent = Agent.load(artifacts["gguf"], sampling=SamplingParams(temperature=1.0, max_tokens=40, seed=3),
                       tools=default_tools())
    for seed in range(3):
        reply = agent.chat("What is 2 plus 2?", seed=seed)
        assert all(call["ok"] or "failed" in call["content"] for call in reply.tool_calls)
        assert "<tool" not in reply.text  # free text cannot open a tag under the grammar


def test_feedback_lands_in_the_store_and_exports_for_the_reward_stage(artifacts, tmp_path, capsys, tiny_models,
                                                                      stories):
    db = tmp_path / "prefs.db"
    agent = Agent.load(artifacts["onnx"], store=db, consent=True, sampling=SamplingParams(max_tokens=16))
    for i in range(24):
        agent.chat(f"Tell me story {i}.")
        other = agent.alternative()
        agent.feedback("choice", other=other, preferred="this" if i % 2 else "other")
        agent.feedback("up" if i % 3 else "down")
    store = PreferenceStore(db)
    assert store.counts()["choice"] == 24 and store.counts()["consented"] == 24
    assert {t.model_id for t in store.turns()} == {agent.model_id}
    out = tmp_path / "round2.jsonl"
    code, _, _ = run_cli(capsys, "feedback", "export", db, "--out", out, "--json")
    assert code == 0
    run, _ = finished_sft_run(tmp_path / "run", tiny_models["llama"], stories, steps=2)
    code, stdout, err = run_cli(capsys, "train", "--stage", "reward", "--out", run, "--no-synthetic-pairs",
                                "--preferences", out, "--preferences", out.with_name("round2.unpaired.jsonl"),
                                "--reward-steps", "2", "--json")
    assert code == 0, err
    assert json.loads((run / "reward" / "manifest.json").read_text())["metrics"]["pairs"] > 0


def test_feedback_needs_a_recorded_answer(artifacts):
    agent = Agent.load(artifacts["onnx"], sampling=GREEDY)
    agent.chat("Hello.")
    with pytest.raises(UserError, match="no recorded answer"):
        agent.feedback("up")


def test_conversation_save_and_restore(artifacts, tmp_path):
    agent = Agent.load(artifacts["gguf"], sampling=GREEDY)
    agent.chat("Tell me about a cat.")
    agent.save(tmp_path / "conv.json")
    second = Agent.load(artifacts["onnx"], sampling=GREEDY)
    second.restore(tmp_path / "conv.json")
    assert second.messages == agent.messages
    assert second.chat("More!").text == agent.chat("More!").text
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="not a conversation"):
        second.restore(tmp_path / "bad.json")


def test_agent_runs_without_torch_or_transformers(artifacts):
    code = (
        "import sys\nfrom slm_align.ondevice.agent.runtime import Agent\n"
        "from slm_align.ondevice.agent.settings import SamplingParams\n"
        "from slm_align.ondevice.tools.builtin import default_tools\n"
        f"for path in ({str(artifacts['gguf'])!r}, {str(artifacts['onnx'])!r}):\n"
        "    agent = Agent.load(path, tools=default_tools(), sampling=SamplingParams(temperature=0, max_tokens=8))\n"
        "    assert agent.chat('Hi there.').text is not None\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def test_chat_command_records_feedback(artifacts, tmp_path, monkeypatch, capsys):
    import io

    db = tmp_path / "chat.db"
    monkeypatch.setattr(sys, "stdin", io.StringIO("Tell me a story.\n/good\n/compare\n/pick "
                                                  "2\n/edit A better one.\n/quit\n"))
    code, out, err = run_cli(capsys, "chat", artifacts["gguf"], "--store", db, "--consent", "--max-new-tokens", "12")
    assert code == 0 and "recorded: thumbs up" in err and "answer 2 preferred" in err
    counts = PreferenceStore(db).counts()
    assert (counts["up"], counts["choice"], counts["edit"], counts["consented"]) == (1, 1, 1, 1)


@pytest.mark.parametrize("args, expected", [
    (["chat", "{missing}"], "not an exported model"),
    (["feedback", "export", "{missing}", "--out", "{out}"], r"preference DB \S*nothing\.gguf not found"),
])
def test_bad_agent_input_is_one_line(capsys, tmp_path, args, expected):
    paths = {"{missing}": tmp_path / "nothing.gguf", "{out}": tmp_path / "o.jsonl"}
    code, out, err = run_cli(capsys, *[paths.get(a, a) for a in args])
    assert code == 2 and err.count("\n") == 1 and re.search(expected, err), err
    assert not paths["{out}"].exists() and not paths["{missing}"].exists()  # nothing written, no store created


def test_device_profile_sets_threads_and_a_context_that_fits(artifacts):
    from slm_align.ondevice.devices import estimate_fit, load_profile, model_facts

    profile = load_profile("rpi-zero2w")
    agent = Agent.load(artifacts["gguf"], device="rpi-zero2w", sampling=GREEDY)
    fit = estimate_fit(model_facts(artifacts["gguf"]), profile)
    assert agent.backend.llm.context_params.n_threads == profile.threads
    assert agent.backend.n_ctx == min(fit.max_context, 4096)
    with pytest.raises(UserError, match="unknown device|not found|no device"):
        Agent.load(artifacts["gguf"], device="toaster")


def test_a_call_with_no_round_left_never_reaches_the_user_as_call_text(artifacts):
    from slm_align.ondevice.agent.tool_text import UNANSWERED

    broken = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+"}}</tool_call>'
    agent = Agent.load(artifacts["onnx"], sampling=SCRIPTED, tools=default_tools(), max_tool_rounds=1)
    agent.backend = ScriptedBackend(agent.backend, [broken, "Let me try again. " + broken])
    pieces = list(agent.stream("Add one and nothing."))
    assert "".join(pieces) == agent.last.text == f"Let me try again. {UNANSWERED}"
    assert agent.last.tool_calls[0]["ok"] is False and agent.messages[-1]["content"] == agent.last.text
    bare = '{"name": "calculator", "arguments": {"expression": "1+1"}}'  # a bare call as the whole answer
    agent.backend = ScriptedBackend(agent.backend.inner, [broken, bare])
    assert agent.chat("Add.").text == UNANSWERED and "calculator" not in agent.last.text
    agent.backend = ScriptedBackend(agent.backend.inner, [broken, "It is 2."])  # a plain answer stays as written
    assert agent.chat("Add.").text == "It is 2."


def test_a_template_that_drops_tools_gets_the_runtimes_fallback_when_asked(artifacts, tmp_path):
    from slm_align.ondevice.agent.prompt import tools_shown
    from slm_align.ondevice.templates.chat import tools_system_text

    fallback = tools_system_text(default_tools().specs())
    seen = {}
    for describe in (False, True):
        agent = Agent.load(artifacts["onnx"], sampling=GREEDY, tools=default_tools(), system="Be brief.",
                           describe_tools=describe)
        agent.backend = ScriptedBackend(agent.backend, ["It is 2."])
        assert agent.chat("What is 1+1?").text == "It is 2."
        seen[describe] = agent.backend.prompts[0]
        assert tools_shown(agent.backend, describe) == ("runtime fallback (its chat template drops tools)"
                                                        if describe else "not shown (its chat template drops tools)")
    assert '"calculator"' not in seen[False]  # ChatML leaves the tools out
    assert seen[True] == seen[False].replace("system\nBe brief.", f"system\n{fallback}\n\nBe brief.")
    listing = tmp_path / "tools.jinja"
    listing.write_text("{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for tool in tools %}{{ ' ' + "
                       "tool['function']['name'] }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}" + CHATML_TEMPLATE)
    agent = Agent.load(artifacts["onnx"], sampling=GREEDY, tools=default_tools(), describe_tools=True,
                       chat_template=str(listing))
    agent.backend = ScriptedBackend(agent.backend, ["It is 2."])
    agent.chat("What is 1+1?")
    assert "Tools: calculator current_time" in agent.backend.prompts[0]  # listed by the template alone
    assert fallback.split("\n")[0] not in agent.backend.prompts[0]
    assert tools_shown(agent.backend, True) == "chat template"
