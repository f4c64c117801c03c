"""RL on task data: the rows' columns reach the rewards in rollouts, the gate and evaluation; RL may
start from the model as given; --algo auto follows the gate's advice."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from slm_align.ondevice.rewards.answers import exact_answer
from slm_align.ondevice.rewards.builtin import BUILTINS
from tests.helpers import run_cli

SEEN_ENV = "SLM_ALIGN_TEST_SEEN"


def answer_in_prompt_length(prompts, completions, answer, level, **_):
    """Needs the 'answer' and 'level' columns; appends what arrived (one JSON line per call)
    to $SLM_ALIGN_TEST_SEEN."""
    with open(os.environ[SEEN_ENV], "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"prompts": list(prompts), "answer": list(answer), "level": list(level)}) + "\n")
    return [float(len(completion.split()) % 3) + 0.1 * int(a) for completion, a in zip(completions, answer)]


def _seen(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _tasks(path, n: int = 40):
    rows = []
    for i in range(n):
        rows.append({"prompt": [{"role": "user", "content": f"What is {i} plus {i + 1}?"}], "answer": str(2 * i + 1),
                     "level": i % 3})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


SMALL = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6",
         "--report-prompts", "4", "--json"]
QUICK = "[rl]\neval_prompts = 4\n[headroom]\nspread_prompts = 4\nmax_new_tokens = 6\nmax_documents = 8\n"


def _quick_config(tmp_path: Path) -> Path:
    path = tmp_path / "quick.toml"
    path.write_text(QUICK, encoding="utf-8")
    return path


@pytest.mark.slow
def test_columns_reach_rewards_in_the_gate_rollouts_and_evaluation_without_sft(tmp_path, capsys, monkeypatch):
    tasks = _tasks(tmp_path / "tasks.jsonl")
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv(SEEN_ENV, str(seen))
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", "--no-sft", "--tasks", tasks, "--reward",
                             "tests.rl.test_tasks:answer_in_prompt_length", "--algo", "auto", "--out", run, "--force",
                             "--gate-samples", "2", "--config", _quick_config(tmp_path), "--watchdog", "off",
                             *SMALL)  # the watchdog's probes would add calls; its own tests cover them
    assert code == 0, err
    summary = json.loads(out)
    manifest = json.loads((run / "rl" / "manifest.json").read_text())
    assert manifest["inputs"]["sft"] is None and not (run / "sft").exists()  # started from the model as given
    assert manifest["inputs"]["tasks"] and manifest["inputs"]["rl"]["algo"] in ("ppo", "grpo")
    headroom = json.loads((run / "headroom.json").read_text())
    assert manifest["inputs"]["rl"]["algo"] == headroom["info"]["recommendation"]["algo"]
    assert manifest["metrics"]["gate"]["advice"] == headroom["info"]["recommendation"]
    calls = _seen(seen)
    # the gate (4 prompts x 2 samples), held-out reward before and after RL (4 each), one rollout (2
    # x 2), the report's two policies (4 each): every call got each prompt's own answer and level
    assert [len(call["prompts"]) for call in calls] == [8, 4, 4, 4, 4, 4]
    for call in calls:
        for prompt, answer, level in zip(call["prompts"], call["answer"], call["level"]):
            i = int(prompt.split("What is ")[1].split(" plus")[0])
            assert answer == str(2 * i + 1) and level == i % 3
    report = json.loads((run / "eval" / "report.json").read_text())
    assert [row["name"] for row in report["policies"]] == ["base", "rl"]
    assert summary["evaluation"][0]["baseline"] == "base"


@pytest.mark.slow
def test_exact_answer_runs_from_the_cli_on_prompt_answer_rows(tmp_path, capsys, monkeypatch):
    """The built-in exact_answer, watched: every call gets each prompt's own answer, and the iteration's
    reward/mean is the mean of what it returned for the rollout's 4 samples."""
    calls = []

    def watched(prompts, completions, answer=None, **columns):
        scores = exact_answer(prompts, completions, answer=answer, **columns)
        calls.append((list(prompts), list(answer), scores))
        return scores

    watched.columns = exact_answer.columns
    monkeypatch.setitem(BUILTINS, "exact_answer", watched)
    tasks = _tasks(tmp_path / "tasks.jsonl")
    code, out, err = run_cli(capsys, "train", "--no-sft", "--tasks", tasks, "--reward", "exact_answer",
                             "--algo", "grpo", "--out", tmp_path / "run", "--force",
                             "--config", _quick_config(tmp_path), *SMALL)
    assert code == 0, err
    for prompts, answers, _ in calls:
        for prompt, answer in zip(prompts, answers):
            first = int(re.search(r"What is (\d+) plus", prompt).group(1))
            assert answer == str(2 * first + 1)  # the row's own answer, aligned with its prompt
    metrics = [json.loads(line) for line in (tmp_path / "run" / "rl" / "metrics.jsonl").read_text().splitlines()]
    rollout_means = [sum(scores) / len(scores) for _, _, scores in calls if len(scores) == 4]
    assert rollout_means and len(metrics) == 1 and metrics[0]["reward/mean"] in rollout_means


def test_a_reward_missing_its_column_is_one_line_before_any_work(tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(30)), encoding="utf-8")
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", "--no-sft", "--tasks", tasks, "--reward", "exact_answer", "--out", run)
    assert code == 2 and "answer" in err and err.count("\n") == 1 and out == ""
    assert not (run / "rl").exists() and not (run / "rl.partial").exists()


def test_no_sft_without_a_reward_is_refused(tmp_path, capsys):
    tasks = _tasks(tmp_path / "tasks.jsonl")
    code, _, err = run_cli(capsys, "train", "--no-sft", "--tasks", tasks, "--out", tmp_path / "run")
    assert code == 2 and "--no-sft" in err and err.count("\n") == 1
