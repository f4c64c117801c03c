"""``field simulate`` (issue 47, item 2): simulated devices answer held-out tasks in the runtime, a scripted
user rates each answer as the task's checker judges it (with a share of noise and of unrated turns), and
each device writes its own preference store, which ``feedback export``, ``feedback collect`` and
``feedback ab`` read as a real fleet's.

The model's answers are scripted by question (right on the tasks the test picks, wrong on the others), so
what the ratings must be is known here without the project's checker."""

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest

from slm_align import simulate_field
from slm_align.data.agent_tasks import make_tasks
from slm_align.data.function_tasks import canonical_arguments, function_tasks
from slm_align.data.preferences import read_preference_rows
from slm_align.modeling.models import DEFAULT_MODEL_DIR, load_tokenizer, resolve_source
from slm_align.ondevice.agent import task_eval
from slm_align.ondevice.agent.prompt import turn_end
from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.gguf.adapter_check import chain_digest
from slm_align.runs import sha256_file
from tests.helpers import export_bundled, run_cli

pytest.importorskip("llama_cpp")
NO_CALL = "No function fits that."
LONG = 256
"""Tokens per reply: room for three calls (96, the default, cuts them)."""
CONTEXT = 2048
"""The scripted models' context: nothing is decoded, the longest rows' prompts and replies fit."""


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """The bundled model exported once to GGUF Q8_0."""
    return export_bundled(tmp_path_factory.mktemp("artifacts"), ("gguf", "Q8_0"))["gguf"]


def question(row: dict) -> str:
    return (row.get("messages") or row["prompt"])[-1]["content"]


@pytest.fixture(scope="module")
def rows():
    """Function rows (every category) and calculator rows, one per question."""
    found = {}
    for row in function_tasks(train=1, heldout=30, seed=0)["heldout"] + make_tasks(30, seed=4):
        found.setdefault(question(row), row)
    return list(found.values())


@pytest.fixture(scope="module")
def tasks(rows, tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks") / "heldout.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def right_questions(rows) -> set:
    """The questions the scripted model answers right: every other row."""
    return {question(row) for index, row in enumerate(rows) if index % 2 == 0}


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def function_reply(row: dict, right: bool) -> str:
    """Right: the ground truth's calls (or a decline where none fits); wrong: the other way round."""
    calls = [call_text(name, canonical_arguments(allowed))
             for entry in row["ground_truth"] for name, allowed in entry.items()]
    if right:
        return "\n".join(calls) or NO_CALL
    if calls:
        return NO_CALL
    return call_text(row["tools"][0]["function"]["name"], {})


def calculator_reply(row: dict, right: bool, prompt_text: str) -> str:
    """The calculator call first; once its result is in the prompt, the answer (off by one when wrong)."""
    call = call_text("calculator", {"expression": row["expression"]})
    if call not in prompt_text:
        return call
    value = float(Fraction(row["answer"])) + (0 if right else 1)
    return f"The answer is {value:g}."


class AnswerBook:
    """A real backend whose replies are looked up by the question in the prompt: ``right(row, backend)``
    says whether this answer is right."""

    def __init__(self, inner, rows, right):
        self.inner = inner
        self.rows = {question(row): row for row in rows}
        self.right = right

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reply(self, prompt_text: str) -> str:
        asked = max((q for q in self.rows if q in prompt_text), key=len)
        row = self.rows[asked]
        right = self.right(row, self.inner)
        if "ground_truth" in row:
            return function_reply(row, right)
        return calculator_reply(row, right, prompt_text)

    def generate(self, prompt, params, grammar=None):
        yield from self.inner.tokenize(self.reply(self.inner.detokenize(prompt)), add_special=False)
        yield next(iter(turn_end(self.inner) or self.inner.eos_ids))


def scripted(monkeypatch, rows, right):
    """Every model the simulation opens answers from an :class:`AnswerBook`."""
    real = task_eval.load_model

    def load(artifact, **options):
        model = real(artifact, **{**options, "n_ctx": CONTEXT})
        model.backend = AnswerBook(model.backend, rows, right)
        return model
    monkeypatch.setattr(task_eval, "load_model", load)


def by_questions(questions):
    def right(row, backend):
        return question(row) in questions
    return right


def stored(path: Path) -> list:
    """A store's turns as ``(question, completion, model_id, feedback kinds, consent)``."""
    with PreferenceStore(path, create=False) as store:
        return [(next(m["content"] for m in turn.messages if m["role"] == "user"), turn.completion,
                 turn.model_id, [f.kind for f in turn.feedback], turn.consent) for turn in store.turns()]


def test_with_no_noise_every_right_answer_is_up_and_every_wrong_one_down(gguf, tasks, rows, tmp_path,
                                                                          monkeypatch):
    right = right_questions(rows)
    scripted(monkeypatch, rows, by_questions(right))
    summary = simulate_field(gguf, tasks, tmp_path / "field", devices=3, turns_per_device=12, noise=0.0,
                             unrated=0.0, seed=1, max_tokens=LONG)
    files = sorted(path.name for path in (tmp_path / "field").iterdir())
    assert files == ["device-001.db", "device-002.db", "device-003.db", "summary.json"]
    turns = [turn for name in files[:3] for turn in stored(tmp_path / "field" / name)]
    assert len(turns) == 36 and all(consent for *_, consent in turns)
    assert all(kinds == (["up"] if asked in right else ["down"]) for asked, _, _, kinds, _ in turns)
    calculator = [turn for turn in turns if turn[1].startswith("The answer is")]
    functions = [turn for turn in turns if not turn[1].startswith("The answer is")]
    assert calculator and functions  # both families ran: tool rounds, and calls judged by BFCL's rules
    ups = sum(asked in right for asked, *_ in turns)
    assert 0 < ups < 36
    assert (summary["turns"], summary["rated"], summary["ups"], summary["downs"]) == (36, 36, ups, 36 - ups)
    assert summary["flipped"] == 0 and summary["successes"] == ups
    assert summary["arms"]["current"]["success_rate"] == pytest.approx(ups / 36)
    assert json.loads((tmp_path / "field" / "summary.json").read_text())["ups"] == ups


def test_noise_flips_its_share_of_ratings_and_unrated_turns_get_none(gguf, tasks, rows, tmp_path, monkeypatch):
    right = right_questions(rows)
    scripted(monkeypatch, rows, by_questions(right))
    summary = simulate_field(gguf, tasks, tmp_path / "field", devices=4, turns_per_device=100, noise=0.3,
                             unrated=0.2, seed=2, max_tokens=LONG)
    turns = [turn for device in range(1, 5) for turn in stored(tmp_path / "field" / f"device-00{device}.db")]
    rated = [turn for turn in turns if turn[3]]
    flipped = sum(kinds != (["up"] if asked in right else ["down"]) for asked, _, _, kinds, _ in rated)
    n = len(turns)
    assert n == 400 and all(len(turn[3]) <= 1 for turn in turns)
    assert abs((n - len(rated)) / n - 0.2) <= 3 * math.sqrt(0.2 * 0.8 / n)  # binomial, 3 sigma
    assert abs(flipped / len(rated) - 0.3) <= 3 * math.sqrt(0.3 * 0.7 / len(rated))
    assert summary["flipped"] == flipped and summary["unrated_turns"] == n - len(rated)
    assert summary["ups"] == sum(turn[3] == ["up"] for turn in rated)


def test_each_store_is_read_by_feedback_export_and_collected_with_its_device(gguf, tasks, rows, tmp_path,
                                                                            monkeypatch, capsys):
    scripted(monkeypatch, rows, by_questions(right_questions(rows)))
    field = tmp_path / "field"
    code, out, err = run_cli(capsys, "field", "simulate", "--artifact", gguf, "--tasks", tasks, "--devices", 3,
                             "--turns-per-device", 10, "--noise", 0, "--unrated", 0.3, "--seed", 3,
                             "--max-new-tokens", LONG, "--out", field, "--json")
    assert code == 0, err
    summary = json.loads(out)
    rated = {entry["device"]: entry["rated"] for entry in summary["stores"]}
    assert sum(rated.values()) == summary["rated"] < 30
    for device, count in rated.items():
        code, _, err = run_cli(capsys, "feedback", "export", field / f"{device}.db", "--out",
                               tmp_path / f"{device}.jsonl")
        assert code == 0, err
        assert len((tmp_path / f"{device}.unpaired.jsonl").read_text().splitlines()) == count
    code, out, err = run_cli(capsys, "feedback", "collect", *sorted(field.glob("*.db")), "--out", tmp_path / "round2",
                             "--json")
    assert code == 0, err
    collected = json.loads(out)
    assert collected["per_device"] == rated and collected["rows"]["unpaired"] == summary["rated"]
    lines = [json.loads(line) for line in (tmp_path / "round2" / "unpaired.jsonl").read_text().splitlines()]
    assert {row["device"] for row in lines} == set(rated) and sum(row["label"] for row in lines) == summary["ups"]
    offered = {question(row): row["tools"] for row in rows}
    asked = [next(m["content"] for m in line["prompt"] if m["role"] == "user") for line in lines]
    assert [line["tools"] for line in lines] == [offered[text] for text in asked]  # what each prompt offered
    tokenizer = load_tokenizer(resolve_source(str(DEFAULT_MODEL_DIR)))
    read = read_preference_rows(tmp_path / "round2" / "unpaired.jsonl", tokenizer).labelled
    assert all(line["tools"][0]["function"]["name"] in item.prompt for line, item in zip(lines, read))


def test_the_same_seed_makes_the_same_fleet(gguf, tasks, rows, tmp_path, monkeypatch):
    scripted(monkeypatch, rows, by_questions(right_questions(rows)))
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        summary = simulate_field(gguf, tasks, tmp_path / name, devices=2, turns_per_device=15, noise=0.3,
                                 unrated=0.3, seed=seed, max_tokens=LONG)
        runs[name] = ([stored(tmp_path / name / f"device-00{d}.db") for d in (1, 2)], dict(summary, out=None))
    assert runs["a"] == runs["b"]
    assert runs["a"][0] != runs["c"][0]
    devices = runs["a"][0]
    assert [turn[0] for turn in devices[0]] != [turn[0] for turn in devices[1]]  # each device its own tasks


def test_a_fleet_ab_test_promotes_the_candidate_that_is_right(files, tasks, rows, tmp_path, monkeypatch, capsys):
    def candidate_on(row, backend):
        return any(adapter["file"] == "candidate.gguf" for adapter in backend.adapters)
    scripted(monkeypatch, rows, candidate_on)
    artifact = f"{files['base']}+{files['current']}"
    summary = simulate_field(artifact, tasks, tmp_path / "ab", devices=4, turns_per_device=30, noise=0.0,
                             unrated=0.0, candidate=[files["candidate"]], seed=4, max_tokens=LONG)
    arms = summary["arms"]
    assert arms["candidate"]["success_rate"] == 1.0 and arms["current"]["success_rate"] == 0.0
    assert arms["candidate"]["turns"] + arms["current"]["turns"] == 120 and min(a["turns"] for a in arms.values()) > 20
    assert summary["ab"]["device_decisions"] == {"collecting": 4}  # 30 conversations: no device decides alone
    code, out, err = run_cli(capsys, "feedback", "ab", *sorted((tmp_path / "ab").glob("*.db")), "--json")
    assert code == 0, err
    decision = json.loads(out)
    assert decision["decision"] == "promote" and decision["devices"] == 4
    current = chain_digest(sha256_file(files["base"]), [sha256_file(files["current"])])
    assert summary["ab"]["current_id"] == current  # the artifact's own adapter is the current arm
    assert (decision["current_id"], decision["candidate_id"]) == (summary["ab"]["current_id"],
                                                                  summary["ab"]["candidate_id"])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The bundled model as a GGUF base with two LoRA adapters made for it."""
    from slm_align.modeling.models import DEFAULT_MODEL_DIR
    from slm_align.ondevice.gguf.adapter_writer import write_lora_gguf
    from slm_align.ondevice.gguf.writer import write_gguf
    from tests.helpers import save_lora

    root = tmp_path_factory.mktemp("field-ab")
    base = write_gguf(DEFAULT_MODEL_DIR, root / "base.gguf")
    found = {"base": base}
    for seed, name in ((1, "current"), (2, "candidate")):
        lora = save_lora(DEFAULT_MODEL_DIR, root / f"lora-{name}", ["q_proj", "v_proj"], seed)
        found[name] = write_lora_gguf(lora, DEFAULT_MODEL_DIR, root / f"{name}.gguf", base_gguf=base)
    return found


BAD = {
    "no such artifact": (["--artifact", "{root}/missing.gguf"], "not found"),
    "noise above 1": (["--noise", "1.5"], "--noise"),
    "unrated below 0": (["--unrated", "-0.1"], "--unrated"),
    "no device": (["--devices", "0"], "--devices"),
    "no turn": (["--turns-per-device", "0"], "--turns-per-device"),
    "missing candidate": (["--candidate", "{root}/nope.gguf"], "candidate adapter"),
    "candidate share 1": (["--candidate", "{gguf}", "--candidate-share", "1"], "--candidate-share"),
    "no such tasks": (["--tasks", "{root}/nope.jsonl"], "not found"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, gguf, tasks, tmp_path, capsys):
    args, expected = BAD[case]
    args = [arg.format(root=tmp_path, gguf=gguf) for arg in args]
    given = {args[i]: args[i + 1] for i in range(0, len(args), 2)}
    base = {"--artifact": str(gguf), "--tasks": str(tasks), "--out": str(tmp_path / "field"), **given}
    code, _, err = run_cli(capsys, "field", "simulate", *[item for pair in base.items() for item in pair])
    assert code == 2 and expected in err and err.count("\n") == 1, err
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_an_existing_out_is_kept_unless_overwrite(gguf, tasks, rows, tmp_path, capsys, monkeypatch):
    scripted(monkeypatch, rows, by_questions(set()))
    out = tmp_path / "field"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["field", "simulate", "--artifact", gguf, "--tasks", tasks, "--devices", 1, "--turns-per-device", 2,
            "--out", out]
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "--overwrite" in err and err.count("\n") == 1
    assert [path.name for path in out.iterdir()] == ["keep.txt"]
    code, _, err = run_cli(capsys, *args, "--overwrite")
    assert code == 0, err
    assert sorted(path.name for path in out.iterdir()) == ["device-001.db", "summary.json"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["field"]  # no scratch folder left


def test_agent_load_ab_tests_the_candidate_against_the_artifacts_own_adapters(files, tmp_path):
    """``Agent.load(BASE+ADAPTER, candidate=...)``: the current arm is the base with its adapter, not the bare
    base (as ``adapters=`` gives it)."""
    from slm_align.ondevice.agent.runtime import Agent

    agent = Agent.load(f"{files['base']}+{files['current']}", threads=1, n_ctx=256, candidate=[files["candidate"]],
                       store=tmp_path / "prefs.db", consent=True)
    base = sha256_file(files["base"])
    assert agent.ab.trial.current_id == chain_digest(base, [sha256_file(files["current"])])
    assert agent.ab.trial.candidate_id == chain_digest(base, [sha256_file(files["candidate"])])
    agent.store.close()


def test_the_candidate_may_be_a_round_as_it_ships(files, gguf, tasks, rows, tmp_path, monkeypatch, capsys):
    """``--candidate`` takes one artifact form on the artifact's base (here BASE+ADAPTER; a manifest and a
    bundle resolve the same way): its adapters are the candidate arm. One on another base, or such a form
    mixed with adapter files, is one line and exit 2."""
    scripted(monkeypatch, rows, by_questions(set()))
    args = ["field", "simulate", "--artifact", f"{files['base']}+{files['current']}", "--tasks", tasks,
            "--devices", 1, "--turns-per-device", 4, "--max-new-tokens", LONG, "--json"]
    code, out, err = run_cli(capsys, *args, "--candidate", f"{files['base']}+{files['candidate']}",
                             "--out", tmp_path / "ab")
    assert code == 0, err
    ab = json.loads(out)["ab"]
    assert ab["candidate_id"] == chain_digest(sha256_file(files["base"]), [sha256_file(files["candidate"])])
    assert ab["candidate"] == [str(files["candidate"])]
    for candidate, expected in (([f"{gguf}+{files['candidate']}"], "another base"),
                                ([f"{files['base']}+{files['candidate']}", files["candidate"]], "pass one")):
        code, out, err = run_cli(capsys, *args, *[item for path in candidate for item in ("--candidate", path)],
                                 "--out", tmp_path / "bad")
        assert code == 2 and expected in err and err.count("\n") == 1, err
        assert not (tmp_path / "bad").exists()
