"""``evaluate-agent --batch N``: a GGUF model's episodes decoded together give the report one at a time gives."""

from __future__ import annotations

import json

import pytest

from slm_align.data.agent_tasks import make_tasks
from slm_align.ondevice.agent import task_batch
from slm_align.ondevice.agent.llama_batch import LlamaBatchDecoder
from slm_align.ondevice.agent.task_eval import evaluate_artifacts
from tests.helpers import export_bundled, run_cli

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """The bundled model exported once to GGUF Q8_0."""
    return export_bundled(tmp_path_factory.mktemp("artifacts"), ("gguf", "Q8_0"))["gguf"]


@pytest.fixture()
def tasks(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in make_tasks(10, seed=3)))
    return path


@pytest.fixture()
def widest(monkeypatch):
    """The most conversations any step of a batched decoder advanced together."""
    seen = [0]

    class Counting(LlamaBatchDecoder):
        def step(self, feeds):
            seen[0] = max(seen[0], len(feeds))
            return super().step(feeds)

    monkeypatch.setattr(task_batch, "LlamaBatchDecoder", Counting)
    return seen


@pytest.fixture()
def stepped(monkeypatch):
    """The ids each step of a batched decoder fed per slot, one list of lengths a step."""
    steps = []

    class Recording(LlamaBatchDecoder):
        def step(self, feeds):
            steps.append([len(ids) for ids in feeds.values()])
            return super().step(feeds)

    monkeypatch.setattr(task_batch, "LlamaBatchDecoder", Recording)
    return steps


def episodes(report: dict) -> list[dict]:
    return report["artifacts"][0]["results"]


@pytest.mark.parametrize("samples", [1, 2])
def test_batched_episodes_give_the_report_one_at_a_time_gives(gguf, tasks, widest, samples):
    settings = dict(max_tokens=24, samples=samples, temperature=0.9, threads=1)
    alone = evaluate_artifacts(tasks, [gguf], batch=1, **settings)
    assert widest[0] == 0  # one at a time: no batched decoder
    together = evaluate_artifacts(tasks, [gguf], batch=4, **settings)
    assert 1 < widest[0] <= 4
    assert episodes(together) == episodes(alone) and len(episodes(alone)) == 10 * samples
    assert together == alone
    assert len({row["reply"] for row in episodes(alone)}) > 1


def test_greedy_batched_steps_never_mix_a_prompt_with_one_id_decodes(gguf, tasks, stepped):
    """Prompts go first (``Engine(prompts_first=True)``): a step holds prompts only or one-id
    decodes only, as one conversation alone runs them. A step mixing both runs llama.cpp's
    matrix-matrix kernel for the one-id rows, whose rounding flipped 4 of 48 greedy replies of
    SmolLM2 (docs/benchmarks.md); so the replies are the same as one at a time."""
    settings = dict(max_tokens=24, temperature=0.0, threads=1)
    alone = evaluate_artifacts(tasks, [gguf], batch=1, **settings)
    together = evaluate_artifacts(tasks, [gguf], batch=4, **settings)
    assert together == alone
    prompts = [step for step in stepped if max(step) > 1]
    decodes = [step for step in stepped if max(step) == 1]
    assert prompts and [step for step in decodes if len(step) > 1]  # both kinds ran, decodes batched
    assert [step for step in prompts if min(step) == 1] == []


def test_batch_below_1_is_refused_in_one_line(gguf, tasks, capsys):
    code, _, err = run_cli(capsys, "evaluate-agent", tasks, "--artifact", gguf, "--batch", "0")
    assert code == 2 and "--batch must be an integer >= 1" in err and err.count("\n") == 1, err


def test_the_cli_batches_by_default(gguf, tasks, capsys, widest):
    code, out, err = run_cli(capsys, "evaluate-agent", tasks, "--artifact", gguf, "--max-new-tokens", "16",
                             "--json")
    assert code == 0, err
    assert widest[0] == task_batch.DEFAULT_BATCH and len(episodes(json.loads(out))) == 10
