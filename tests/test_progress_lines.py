"""Long work that speaks in a log: with stderr not a terminal, stages write start, progress and end lines;
--json keeps stdout to the JSON; --quiet prints nothing but errors."""

import json
import time

import pytest

from slm_align.progress import LineProgress, duration, stage_lines
from tests.helpers import run_cli


@pytest.fixture
def every_step(monkeypatch):
    monkeypatch.setenv("SLM_ALIGN_PROGRESS_SECONDS", "0")  # a line per update: a short run still shows progress


def progress_lines(stderr: str) -> list[str]:
    return [line.split("] ", 1)[1] for line in stderr.splitlines() if line.startswith("[slm-align ")]


def test_line_progress_says_start_progress_and_end_at_its_cadence(capsys, monkeypatch):
    monkeypatch.setenv("SLM_ALIGN_PROGRESS_SECONDS", "3600")
    with LineProgress() as progress:
        task = progress.add_task("RL (grpo)", total=4, completed=0, status="")
        progress.update(task, completed=1, status="reward 0.100")  # within the cadence: quiet
        progress.update(task, completed=4, status="reward 0.400")  # the last step: always said
    lines = progress_lines(capsys.readouterr().err)
    assert lines[0] == "RL (grpo): start, 4 steps"
    assert lines[1].startswith("RL (grpo): step 4/4 (reward 0.400), ")
    assert lines[2].startswith("RL (grpo): done, 4 steps in ") and len(lines) == 3


def test_a_short_stage_says_one_line_and_a_refused_one_none(capsys, monkeypatch):
    """The start line of a stage without steps waits one cadence: bad input refused before then leaves only the
    error line; a stage done before then says its end with what it did."""
    monkeypatch.setenv("SLM_ALIGN_PROGRESS_SECONDS", "3600")
    with pytest.raises(ValueError):
        with stage_lines("headroom gate", "the prior and the reward"):
            raise ValueError("bad input")
    assert progress_lines(capsys.readouterr().err) == []
    with stage_lines("headroom gate", "the prior and the reward"):
        pass
    lines = progress_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("headroom gate: done in ")
    assert lines[0].endswith(" (the prior and the reward)")


def test_a_long_stage_says_its_start_after_one_cadence(capsys, monkeypatch):
    monkeypatch.setenv("SLM_ALIGN_PROGRESS_SECONDS", "0.05")
    with stage_lines("evaluation", "2 prompts"):
        time.sleep(0.5)
    lines = progress_lines(capsys.readouterr().err)
    assert lines[0] == "evaluation: start, 2 prompts"
    assert lines[1].startswith("evaluation: done in ") and len(lines) == 2


def test_durations_read_like_a_clock():
    assert [duration(s) for s in (4.4, 75.2, 3725)] == ["4s", "1m15s", "1h02m"]


def test_sft_in_a_log_writes_start_progress_and_end_lines(tmp_path, stories, capsys, every_step):
    code, stdout, stderr = run_cli(capsys, "sft", "--data", stories, "--max-steps", "3", "--out", tmp_path / "run")
    assert code == 0
    lines = progress_lines(stderr)
    assert lines[0] == "sft: start, 3 steps"
    assert any(line.startswith("sft: step 2/3") for line in lines)
    assert any(line.startswith("sft: step 3/3") and "elapsed" in line for line in lines)
    assert lines[-1].startswith("sft: done, 3 steps in ")
    assert "sft" in stdout  # the summary as before


def test_json_keeps_stdout_to_the_json_and_quiet_prints_nothing(tmp_path, stories, capsys, every_step):
    code, stdout, stderr = run_cli(capsys, "sft", "--data", stories, "--max-steps", "2", "--out", tmp_path / "a",
                                   "--json")
    assert code == 0 and json.loads(stdout)["stage"] == "sft"
    assert progress_lines(stderr)[0] == "sft: start, 2 steps"
    code, stdout, stderr = run_cli(capsys, "sft", "--data", stories, "--max-steps", "2", "--out", tmp_path / "b",
                                   "--quiet")
    assert code == 0 and stdout == "" and progress_lines(stderr) == []
    assert (tmp_path / "b" / "sft" / "manifest.json").is_file()
    code, stdout, stderr = run_cli(capsys, "sft", "--data", tmp_path / "missing.txt", "--out", tmp_path / "c",
                                   "--quiet")
    assert code == 2 and stderr.startswith("error: ")  # errors still speak


def test_train_and_export_in_a_log_say_each_stage(tmp_path, stories, capsys, every_step):
    out = tmp_path / "run"
    code, _, stderr = run_cli(capsys, "train", "--algo", "grpo", "--data", stories, "--set", "sft.max_steps=2",
                              "--reward-steps", "2", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
                              "--max-new-tokens", "8", "--report-prompts", "2", "--force", "--out", out)
    assert code == 0, stderr
    lines = progress_lines(stderr)
    for stage in ("sft", "reward model", "headroom gate", "RL (grpo)", "held-out reward", "evaluation"):
        assert any(line.startswith(f"{stage}: start") for line in lines), stage
        assert any(line.startswith(f"{stage}: done") for line in lines), stage
    assert any(line.startswith("RL (grpo): step 1/2") for line in lines)
    code, _, stderr = run_cli(capsys, "export", out, "--target", "gguf", "--quant", "F32")
    assert code == 0, stderr
    lines = progress_lines(stderr)
    assert [line.split(":")[0] for line in lines if ": start" in line] == ["export", "export verification"]
    assert lines[-1].startswith("export verification: done in ")
