"""The call rule: a reply calls exactly when the model's probability of opening a call reaches the threshold,
on every backend that decodes for the runtime, and nowhere a tool cannot be called."""

from __future__ import annotations

import json

import numpy as np
import pytest

from slm_align.data.function_tasks import write_function_tasks
from slm_align.errors import UserError
from slm_align.ondevice.agent.call_calibration import row_scores
from slm_align.ondevice.agent.call_rule import (
    CALL_OPENING,
    CallVocabulary,
    opening_probability,
    restrict,
    rule_acts,
)
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.agent.task_eval import evaluate_artifacts, open_agent
from slm_align.ondevice.tools.builtin import default_tools
from slm_align.rollouts.policy_backend import check_exact
from tests.helpers import export_bundled, run_cli

PIECES = ["<", "<tool", "<tool_call>", "<tool_call>\n{", "<b", "tool", " ", "\n\n", "", "Sorry", " <"]


def test_openers_are_the_starts_of_a_call_and_blanks_are_whitespace():
    vocabulary = CallVocabulary.of(PIECES)
    assert [PIECES[i] for i in np.flatnonzero(vocabulary.openers)] == ["<", "<tool", CALL_OPENING, "<tool_call>\n{",
                                                                       " <"]
    assert [PIECES[i] for i in np.flatnonzero(vocabulary.blank)] == [" ", "\n\n"]


def test_the_opening_probability_is_the_softmax_mass_of_the_openers():
    logits = np.log(np.array([0.1, 0.15, 0.05, 0.2, 0.5], dtype=np.float32)) + 3.0  # a shift changes nothing
    openers = np.array([True, True, False, False, False])
    assert opening_probability(logits, openers) == pytest.approx(0.25, abs=1e-6)


def probabilities(p_open: float) -> np.ndarray:
    """Logits over PIECES where the openers hold ``p_open`` together and "Sorry" is the likeliest token."""
    openers = CallVocabulary.of(PIECES).openers
    weights = np.full(len(PIECES), 0.01)
    weights[openers] = p_open / openers.sum()
    weights[PIECES.index("Sorry")] = 0.0
    weights[PIECES.index("Sorry")] = 1 - weights.sum()
    return np.log(weights).astype(np.float32)


@pytest.mark.parametrize("p_open, calls", [(0.44, False), (0.51, True), (0.56, True)])
def test_restrict_bans_the_side_below_the_threshold(p_open, calls):
    vocabulary = CallVocabulary.of(PIECES)
    logits = probabilities(p_open)
    before = logits.copy()
    assert restrict(logits, 0.5, vocabulary) is calls
    banned = vocabulary.openers if not calls else ~vocabulary.openers
    assert np.all(np.isneginf(logits[banned]))
    assert np.array_equal(logits[~banned], before[~banned])  # what the rule allows keeps its logits
    # "Sorry" is the likeliest single token: greedy alone would decline at 0.56; the rule calls from 0.5 up
    assert (int(np.argmax(logits)) in np.flatnonzero(vocabulary.openers)) is calls


def test_a_probability_equal_to_the_threshold_calls():
    logits = np.zeros(2, dtype=np.float32)  # P(open) exactly 0.5
    assert restrict(logits, 0.5, CallVocabulary.of(["<", "No"])) is True
    assert np.isneginf(logits[1])


def test_a_tokenizer_without_openers_is_never_banned_everything():
    vocabulary = CallVocabulary.of(["a", "b", " "])
    logits = np.zeros(3, dtype=np.float32)
    assert restrict(logits, 0.0, vocabulary) is False
    assert np.all(np.isfinite(logits))


def test_the_rule_decides_while_the_reply_is_blank_only():
    vocabulary = CallVocabulary.of(PIECES)
    space, sorry = PIECES.index(" "), PIECES.index("Sorry")
    assert rule_acts(0.5, vocabulary, [])
    assert rule_acts(0.5, vocabulary, [space, space])
    assert not rule_acts(0.5, vocabulary, [space, sorry])
    assert not rule_acts(None, vocabulary, [])


def test_rl_episodes_refuse_the_rule():
    with pytest.raises(UserError, match="call rule"):
        check_exact(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, call_threshold=0.5))


# --- on real backends: the bundled model exported ------------------------------------------------


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    made = export_bundled(tmp_path_factory.mktemp("artifacts"), ("gguf", "Q8_0"), ("onnx", "fp32"))
    return made


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    """Function rows over functions the bundled model never saw: one function offered (simple) or none that
    fits (irrelevance), short enough for its 512 positions."""
    return write_function_tasks(tmp_path_factory.mktemp("functions"), train=20, heldout=8, seed=4,
                                mix={"simple": 1, "irrelevance": 1})["heldout"]


def opening_scores(agent: Agent, rows: list) -> list[float]:
    """Each row's opening score (choose-call-threshold's: the largest P(open) on the greedy walk over blanks),
    from the backend's own logits for the prompt the runtime renders."""
    return [score.score for score in row_scores(agent, rows)]


def openings(report: dict) -> list[bool]:
    """Whether each reply opens a call (its first visible character starts ``<tool_call>``)."""
    return [result["reply"].lstrip().startswith("<") for result in report["artifacts"][0]["results"]]


def judged(artifact, tasks, **settings) -> dict:
    return evaluate_artifacts(tasks, [artifact], threads=1, max_tokens=24, **settings)


@pytest.mark.parametrize("backend, batch", [("gguf", 1), ("gguf", 4), ("onnx", 1)])
def test_threshold_zero_always_opens_a_call_and_one_never(exports, heldout, backend, batch):
    free = openings(judged(exports[backend], heldout, batch=batch))
    always = openings(judged(exports[backend], heldout, batch=batch, call_threshold=0.0))
    never = openings(judged(exports[backend], heldout, batch=batch, call_threshold=1.0))
    assert always == [True] * len(free)
    assert never == [False] * len(free)
    assert free != always or free != never  # the rule changed replies the likeliest token decided


@pytest.mark.parametrize("backend", ["gguf", "onnx"])
def test_the_threshold_is_compared_with_the_models_own_probability(exports, heldout, backend):
    rows = [json.loads(line) for line in heldout.read_text().splitlines()][:3]
    agent = open_agent(exports[backend], max_tokens=24, max_tool_rounds=0, threads=1)
    for row, p in zip(rows, opening_scores(agent, rows)):
        for threshold, opens in ((p * 0.999, True), (min(1.0, p * 1.001 + 1e-9), False)):
            tasks = heldout.parent / "one.jsonl"
            tasks.write_text(json.dumps(row) + "\n")
            assert openings(judged(exports[backend], tasks, batch=1, call_threshold=threshold)) == [opens]


def test_batched_replies_equal_one_at_a_time_under_the_rule(exports, heldout):
    one = judged(exports["gguf"], heldout, batch=1, call_threshold=0.5)
    many = judged(exports["gguf"], heldout, batch=4, call_threshold=0.5)
    assert [r["reply"] for r in many["artifacts"][0]["results"]] == [r["reply"] for r in one["artifacts"][0]["results"]]
    assert one["call_threshold"] == 0.5


def test_the_rule_leaves_replies_that_cannot_call_alone(exports):
    agent = open_agent(exports["gguf"], max_tokens=12, threads=1)
    plain = "".join(agent.complete("Once upon a time"))
    ruled = "".join(agent.complete("Once upon a time", call_threshold=0.0))
    assert ruled == plain  # threshold 0 would force a call opening where the rule acted
    agent.tools = None
    without_tools = agent.chat("Hello there", call_threshold=0.0).text
    assert not without_tools.lstrip().startswith("<")


def test_evaluate_agent_refuses_a_threshold_outside_0_to_1(exports, heldout, tmp_path, capsys):
    out = tmp_path / "report.json"
    code, _, err = run_cli(capsys, "evaluate-agent", heldout, "--artifact", exports["gguf"], "--call-threshold",
                           "1.5", "--out", out)
    assert code == 2
    assert "--call-threshold must be a number from 0 to 1" in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("threshold, opens", [(0.0, True), (1.0, False)])
def test_serve_applies_the_rule_to_replies_that_may_call(exports, threshold, opens):
    from slm_align.ondevice.agent.server import create_app  # the server's extra (uvicorn, openai): here only
    from tests.ondevice.agent.server.test_serve import WEATHER_TOOL, Running

    ask = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "temperature": 0,
           "max_tokens": 12}
    with Running(create_app(exports["gguf"], call_threshold=threshold)) as running:
        with_tools = running.client().chat.completions.create(**ask, tools=[WEATHER_TOOL]).choices[0].message
        plain = running.client().chat.completions.create(**ask).choices[0].message
    with Running(create_app(exports["gguf"])) as running:
        free = running.client().chat.completions.create(**ask).choices[0].message
    opened = bool(with_tools.tool_calls) or (with_tools.content or "").lstrip().startswith("<")
    assert opened is opens
    assert plain.content == free.content  # no tools offered: the rule stays out (this model may still write a call)


class ThresholdsSeen:
    """A backend that records the call threshold each completion was asked to decode with."""

    def __init__(self, inner):
        self.inner = inner
        self.thresholds = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompt, params, grammar=None):
        self.thresholds.append(params.call_threshold)
        return self.inner.generate(prompt, params, grammar)


def test_the_rule_acts_on_tool_rounds_and_never_on_the_answer_after_the_last(exports):
    agent = open_agent(exports["gguf"], max_tokens=24, max_tool_rounds=1, threads=1, call_threshold=0.0)
    agent.tools = default_tools()
    agent.backend = ThresholdsSeen(agent.backend)
    agent.chat("What is 12 times 7?")
    # threshold 0 forces the first round to open a call; its tool ran, and the answer after the last round is free
    assert agent.backend.thresholds == [0.0, None]


def test_choose_call_threshold_predicts_the_replies_under_the_threshold_it_chose(exports, heldout, tmp_path, capsys):
    out = tmp_path / "threshold.json"
    code, stdout, _ = run_cli(capsys, "choose-call-threshold", heldout, "--artifact", exports["gguf"], "--threads", "1",
                              "--out", out, "--json")
    assert code == 0
    report = json.loads(stdout)
    assert json.loads(out.read_text())["threshold"] == report["threshold"]
    rows = heldout.read_text().splitlines()
    assert len(report["scores"]) == len(rows) and len(report["table"]) == 101
    assert report["balanced"] == max(row["balanced"] for row in report["table"])
    predicted = [score["score"] >= report["threshold"] for score in report["scores"]]
    replies = judged(exports["gguf"], heldout, batch=4, call_threshold=report["threshold"])
    assert openings(replies) == predicted


def test_choose_call_threshold_refuses_rows_it_cannot_choose_on(exports, heldout, tmp_path, capsys):
    calculator = tmp_path / "calc.jsonl"
    calculator.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    simple_only = tmp_path / "simple.jsonl"
    simple_only.write_text("".join(line + "\n" for line in heldout.read_text().splitlines()
                                   if json.loads(line)["ground_truth"]))
    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    for tasks, message in ((calculator, "not a function row"), (simple_only, "rows that call and rows that do not")):
        code, _, err = run_cli(capsys, "choose-call-threshold", tasks, "--artifact", exports["gguf"])
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "choose-call-threshold", heldout, "--artifact", exports["gguf"], "--out", kept)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert kept.read_text() == "{}"
