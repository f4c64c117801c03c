"""Long work that speaks in a log: with stderr not a terminal, stages write start, progress and end
lines; --json keeps stdout to the JSON; --quiet prints nothing but errors."""

import io
import json
import re
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from rich.console import Console

from slm_align import progress as progress_module
from slm_align.export.publishing.parity import perplexity_change
from slm_align.progress import CADENCE_ENV, LineProgress, counted, duration, stage_lines
from slm_align.runs import artifact_manifest
from tests.helpers import run_cli

TRAIN = ("train", "--algo", "grpo", "--set", "sft.max_steps=2", "--reward-steps", "2", "--steps", "2",
         "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--report-prompts", "2",
         "--micro-batch-size", "2", "--force")


@pytest.fixture
def every_step(monkeypatch):
    monkeypatch.setenv(CADENCE_ENV, "0")  # a line per update: a short run still shows progress


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
    """The start line of a stage without steps waits one cadence: bad input refused before then
    leaves only the error line; a stage done before then says its end with what it did and its
    figures; a loop it counts within the cadence says nothing."""
    monkeypatch.setenv(CADENCE_ENV, "3600")
    with pytest.raises(ValueError):
        with stage_lines("headroom gate", "the prior and the reward"):
            raise ValueError("bad input")
    assert progress_lines(capsys.readouterr().err) == []
    with stage_lines("headroom gate", "the prior and the reward") as stage:
        with counted("perplexity", 8, "documents") as count:
            for _ in range(8):
                count.advance()
        stage.figures = "PASS, held-out perplexity 3.210 (< 30)"
    lines = progress_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("headroom gate: done in ")
    assert lines[0].endswith(" (the prior and the reward): PASS, held-out perplexity 3.210 (< 30)")


def wait_for(condition, seconds: float = 60.0) -> None:
    """Poll ``condition`` until it holds (a timer thread's work, however loaded the machine); fail after
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {seconds:.0f} s")
        time.sleep(0.01)


def test_a_counted_loop_speaks_every_cadence_after_the_stage_start(capsys, monkeypatch):
    """k/N, elapsed and remaining time once per cadence, never before the stage's start line (said
    by a timer thread at the same moment); outside a stage the count shows nothing."""
    monkeypatch.setenv(CADENCE_ENV, "0.05")
    with stage_lines("evaluation", "sft on 2 prompts and 4 documents"):
        with counted("perplexity", 4, "documents") as count:
            for _ in range(4):
                time.sleep(0.07)
                count.advance()
    with counted("sampling", 4, "tokens") as outside:
        outside.advance()
    lines = progress_lines(capsys.readouterr().err)
    assert lines[0] == "evaluation: start, sft on 2 prompts and 4 documents"
    progress = lines[1:-1]
    assert [line.split(",")[0] for line in progress] == [f"evaluation: perplexity {k}/4 documents" for k in range(1, 5)]
    assert "s elapsed, about " in progress[0] and progress[0].endswith(" left")
    assert lines[-1].startswith("evaluation: done in ") and not outside.active


def test_on_a_terminal_a_counted_loop_is_a_bar_not_lines(monkeypatch):
    screen = io.StringIO()
    monkeypatch.setattr(progress_module, "stderr", Console(file=screen, force_terminal=True, width=100))
    monkeypatch.setenv(CADENCE_ENV, "0")
    with stage_lines("headroom gate", "the prior's perplexity on 2 documents") as stage:
        with counted("perplexity", 2, "documents") as count:
            wait_for(lambda: "headroom gate: perplexity" in screen.getvalue())  # the bar's refresh thread drew it
            count.advance(2)
        stage.figures = "PASS"
    assert "[slm-align" not in screen.getvalue()  # a bar, no log lines


def test_a_long_stage_says_its_start_after_one_cadence(capsys, monkeypatch):
    monkeypatch.setenv("SLM_ALIGN_PROGRESS_SECONDS", "0.05")
    said = []
    with stage_lines("evaluation", "2 prompts"):
        wait_for(lambda: said.append(capsys.readouterr().err) or "evaluation: start" in "".join(said))
    lines = progress_lines("".join(said) + capsys.readouterr().err)
    assert lines[0] == "evaluation: start, 2 prompts"
    assert lines[1].startswith("evaluation: done in ") and len(lines) == 2


def test_counting_sampled_tokens_changes_no_sample(capsys, every_step):
    """Inside a stage, sampling counts its tokens (a stopping criterion that stops nothing): the
    same seed draws the same completions as outside one, where nothing is counted (RL rollouts)."""
    import torch

    from slm_align.modeling.generation import sample
    from slm_align.modeling.models import DEFAULT_MODEL_DIR, load_model, load_tokenizer, resolve_source

    source = resolve_source(str(DEFAULT_MODEL_DIR))
    model = load_model(source)
    tokenizer = load_tokenizer(source)
    prompts = ["Once upon a time", "The cat sat", "A little girl"]
    outside = sample(model, tokenizer, prompts, 6, temperature=1.0, seed=3)
    assert progress_lines(capsys.readouterr().err) == []
    with stage_lines("evaluation", "3 prompts"):
        inside = sample(model, tokenizer, prompts, 6, temperature=1.0, seed=3)
    lines = progress_lines(capsys.readouterr().err)
    assert lines[1].startswith("evaluation: sampling 1/6 tokens of 3 completions, ")
    assert torch.equal(inside.completion_ids, outside.completion_ids) and inside.completions == outside.completions


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
    evaluation = [i for i, line in enumerate(lines) if line.startswith("sft: evaluation")]
    last_step = next(i for i, line in enumerate(lines) if line.startswith("sft: step 3/3"))
    assert evaluation and last_step < evaluation[0] and evaluation[-1] == len(lines) - 2  # then done, not before
    assert sum(line.startswith("sft: evaluation: start") for line in lines) == 1  # the epoch's end, reused
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


def cli(*args) -> tuple[int, str, str]:
    """:func:`run_cli` for module-scoped runs (no capsys there): exit code, stdout, stderr."""
    from slm_align.cli import main

    out = io.StringIO()
    err = io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    return exit_info.value.code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def logged(tmp_path_factory, stories):
    """A short GRPO run, then its F32 GGUF export, both with --json and stderr a log at cadence 0:
    the run directory and each command's (exit code, stdout, stderr)."""
    out = tmp_path_factory.mktemp("logged") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CADENCE_ENV, "0")
        train = cli(*TRAIN, "--data", stories, "--out", out, "--json")
        export = cli("export", out, "--target", "gguf", "--quant", "F32", "--json")
    return out, {"train": train, "export": export}


def stage_lines_of(stderr: str, stage: str) -> list[str]:
    return [line for line in progress_lines(stderr) if line.startswith(f"{stage}: ")]


def test_train_with_json_keeps_stdout_to_the_json_and_says_each_stage(logged):
    out, runs = logged
    code, stdout, stderr = runs["train"]
    assert code == 0, stderr
    assert json.loads(stdout)["dir"] == str(out / "rl")  # stdout is the JSON and nothing else
    lines = progress_lines(stderr)
    for stage in ("sft", "reward model",
                  "headroom gate", "RL (grpo)", "held-out reward", "evaluation"):
        assert any(line.startswith(f"{stage}: start") for line in lines), stage
        assert any(line.startswith(f"{stage}: done") for line in lines), stage
    assert any(line.startswith("RL (grpo): step 1/2") for line in lines)


def test_each_rl_step_says_its_sampling_and_its_update_in_a_log(logged):
    """Inside a GRPO iteration, at cadence 0: its sampled tokens and its update's micro-batches, with the step's
    number; before issue 44 a log heard nothing between two iterations."""
    lines = progress_lines(logged[1]["train"][2])
    for step in (1, 2):
        assert any(line.startswith(f"RL (grpo) step {step}/2: sampling 1/8 tokens of ") for line in lines), step
        update = [line for line in lines if line.startswith(f"RL (grpo) step {step}/2: update ")]
        done = len(update)  # one line per micro-batch at cadence 0, the last one k/k
        assert done == 4, update  # 2 epochs of one minibatch of 4 rows, 2 rows at a time
        assert update[-1].startswith(f"RL (grpo) step {step}/2: update {done}/{done} micro-batches"), update


def test_the_gate_counts_documents_and_samples_and_ends_with_its_figures(logged):
    out, runs = logged
    gate = json.loads((out / "headroom.json").read_text())
    lines = stage_lines_of(runs["train"][2], "headroom gate")
    documents = gate["info"]["eval_documents"]
    samples = gate["info"]["spread_samples"]
    assert lines[0].startswith("headroom gate: start, the prior's perplexity on "
                               f"{documents} documents, ")
    assert f"headroom gate: perplexity {documents}/{documents} documents" in [line.split(",")[0] for line in lines]
    assert any(re.match(rf"headroom gate: sampling 1/\d+ tokens of {samples} completions, ", line) for line in lines)
    assert any(re.match(r"headroom gate: reward accuracy, chosen \d+/\d+ texts, ", line) for line in lines)
    assert any(re.match(r"headroom gate: reward model \d+/\d+ texts, ", line) for line in lines)
    figures = "; ".join(f"{f['name']} {f['value']:.3f} ({f['comparison']} {f['threshold']:g})"
                        for f in gate["figures"])
    assert lines[-1].startswith("headroom gate: done in ")
    assert lines[-1].endswith(f": {gate['verdict']}, {figures}")


def test_evaluation_and_heldout_reward_count_and_end_with_their_figures(logged):
    out, runs = logged
    stderr = runs["train"][2]
    report = json.loads((out / "eval" / "report.json").read_text())
    lines = stage_lines_of(stderr, "evaluation")
    assert any(line.startswith("evaluation: sampling 1/8 "
                               "tokens of 2 completions, ") for line in lines)
    assert any(re.match(r"evaluation: perplexity \d+/\d+ documents, ", line) for line in lines)
    ends = [line.split(": ", 2)[2] for line in lines if line.startswith("evaluation: done in ")]
    assert ends == [f"{p['name']}: reward mean {p['reward_mean']:.3f} (std {p['reward_std']:.3f}), "
                    f"perplexity {p['ppl']:.3f}" for p in report["policies"]]
    rl = json.loads((out / "rl" / "manifest.json").read_text())["metrics"]
    lines = stage_lines_of(stderr, "held-out reward")
    assert any(line.startswith("held-out reward: sampling 1/8 tokens of ") for line in lines)
    ends = [line.split(": ", 2)[2] for line in lines if line.startswith("held-out reward: done in ")]
    assert ends[0] == f"mean reward {rl['heldout_reward_sft']:.3f}"
    assert ends[-1] == f"mean reward {rl['heldout_reward_rl']:.3f}"


def test_export_with_json_counts_its_verification_and_ends_with_the_agreement(logged):
    code, stdout, stderr = logged[1]["export"]
    assert code == 0, stderr
    verification = json.loads(stdout)["metrics"]["verification"]  # stdout is the JSON and nothing else
    lines = progress_lines(stderr)
    assert [line.split(":")[0] for line in lines if ": start" in line] == ["export", "export verification"]
    prompts = verification["prompts"]
    assert [line.split(",")[0] for line in lines if re.match(r"export verification: greedy decoding \d", line)] == \
        ["export verification: greedy "
         f"decoding {k}/{prompts} prompts" for k in range(1, prompts + 1)]
    assert lines[-1].startswith("export verification: done in ")
    assert lines[-1].endswith(f": passed, tokenizer identical, greedy {prompts}/{prompts} prompts "
                              f"identical for 32 tokens, top-1 agreement "
                              f"{verification['agreement']:.3f} over "
                              f"{verification['agreement_positions']} tokens, held-out "
                              f"{perplexity_change(verification)}")


def test_bench_in_a_log_says_its_runs_and_ends_with_its_figures(logged, capsys, every_step):
    artifact = json.loads(logged[1]["export"][1])["dir"]
    code, stdout, stderr = run_cli(capsys, "bench", artifact, "--threads", "1", "--prompt-tokens", "8",
                                   "--decode-tokens", "4", "--repeats", "2", "--json")
    assert code == 0, stderr
    bench = json.loads(stdout)["bench"]
    lines = progress_lines(stderr)
    assert lines[0].startswith("bench: start, model-F32.gguf: load, a warm-up and 2 "
                               "runs of a 8-token prompt")
    assert [line.split(",")[0] for line in lines[1:-1]] == ["bench: measured 1/2 runs",
                                                            "bench: measured 2/2 runs"]
    assert lines[-1].startswith("bench: done in ")
    assert f", decode {bench['decode_tokens_per_second']:.1f} tokens/s, " in lines[-1]


def test_quiet_train_and_export_print_nothing_but_errors(logged, capsys, every_step):
    """Rerun on the finished run, the evaluation measures again (its report is rewritten; the gate's
    report, measured with the same inputs, is reused as it is) and an export is replaced, all without
    a word; bad input still says its one error line."""
    out, runs = logged
    gate = (out / "headroom.json").stat().st_mtime_ns
    evaluated = (out / "eval" / "report.json").stat().st_mtime_ns
    code, stdout, stderr = run_cli(capsys, *TRAIN, "--out", out, "--quiet")
    assert (code, stdout, stderr) == (0, "", "")
    assert (out / "eval" / "report.json").stat().st_mtime_ns > evaluated
    assert (out / "headroom.json").stat().st_mtime_ns == gate
    manifest = artifact_manifest(Path(json.loads(runs["export"][1])["dir"]))
    exported = manifest.stat().st_mtime_ns
    code, stdout, stderr = run_cli(capsys, "export", out, "--target", "gguf", "--quant", "F32", "--overwrite",
                                   "--quiet")
    assert (code, stdout, stderr) == (0, "", "")
    assert manifest.stat().st_mtime_ns > exported
    code, stdout, stderr = run_cli(capsys, "export", out / "missing", "--target", "gguf", "--quiet")
    assert code == 2 and stdout == "" and stderr.startswith("error: ") and stderr.count("\n") == 1
    code, stdout, stderr = run_cli(capsys, *TRAIN, "--data", out / "missing.txt", "--out", out / "other", "--quiet")
    assert code == 2 and stdout == "" and stderr.startswith("error: ") and stderr.count("\n") == 1


class FakeClock:
    """The ``time`` of :mod:`slm_align.progress` on a clock the test moves: ``monotonic()`` is the
    seconds the test set, ``strftime`` the real one."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    @staticmethod
    def strftime(pattern: str) -> str:
        return time.strftime(pattern)


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(progress_module, "time", fake)
    monkeypatch.setenv(CADENCE_ENV, "30")
    return fake


def test_a_long_step_says_a_line_every_cadence_while_its_rollouts_advance(capsys, clock):
    """An RL iteration of 8 episodes of 10 s each: without a word until its end before, now its
    count, elapsed and remaining time once 30 s have passed (fake clock), and no start or end
    lines of its own."""
    from slm_align.progress import within_step

    with LineProgress() as progress:
        task = progress.add_task("RL (grpo)", total=2, completed=0, status="")
        with within_step(progress, "RL (grpo) step 1/2"):
            with counted("episodes", 8, "agent episodes") as count:
                for _ in range(8):
                    clock.now += 10
                    count.advance(status="reward 0.5")
        clock.now += 5
        progress.update(task, completed=1, status="reward 0.500")  # 25 s after the last line: quiet
    lines = progress_lines(capsys.readouterr().err)
    assert lines[0] == "RL (grpo): start, 2 steps"
    assert lines[1:3] == ["RL (grpo) step 1/2: episodes 3/8 agent episodes (reward 0.5), 30s elapsed, about 50s left",
                          "RL (grpo) step 1/2: episodes 6/8 agent episodes (reward 0.5), 1m00s elapsed, about 20s left"]
    assert lines[3].startswith("RL (grpo): done, 1 steps in ") and len(lines) == 4


def test_train_steps_lets_each_steps_rollouts_speak(capsys, clock, tmp_path):
    """The envelope's step loop (PPO, GRPO, DPO, KTO) runs each step within the loop's lines: a step of
    40 s of sampling says a line at its 30th second, with the step's number."""
    from slm_align.envelope.loop import StepPlan, StepRecord, train_steps
    from slm_align.tracking import Tracker

    class Run:
        step = 0

    run = Run()

    def next_step() -> dict:
        with counted("sampling", 4, "tokens of 2 completions") as count:
            for _ in range(4):
                clock.now += 10
                count.advance()
        run.step += 1
        return {"reward": 0.0}

    class World:
        main = True

    plan = StepPlan(next_step, 2, title="RL (grpo)", status=lambda metrics: "")
    train_steps(run, plan, StepRecord(tmp_path, state=dict, save_every=10, world=World(), tracker=Tracker()))
    lines = progress_lines(capsys.readouterr().err)
    heartbeats = [line for line in lines if ": sampling " in line]
    assert [line.split(",")[0] for line in heartbeats] == [
        "RL (grpo) step 1/2: sampling 3/4 tokens of 2 completions",
        "RL (grpo) step 2/2: sampling 2/4 tokens of 2 completions"]  # 30 s after the first, and again
