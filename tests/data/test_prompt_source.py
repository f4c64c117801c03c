"""Where RL and the gate take their prompts from (data/prompt_source.py): task files split, answers
kept for the held-out texts, rewards checked against the columns."""

from __future__ import annotations

import json

import pytest

from slm_align.config import load_recipe
from slm_align.data.prompt_source import PromptSource, prompt_source
from slm_align.errors import UserError


def write_tasks(path, n: int, answer: bool = True):
    rows = [{"prompt": f"What is {i} + {i}? ", **({"answer": str(2 * i)} if answer else {})} for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def recipe_for(tasks):
    return load_recipe(overrides={"data.tasks": str(tasks), "data.eval_fraction": 0.2})


def test_train_prompts_are_built_once_on_first_use():
    """make_train runs lazily and once (mutation: built in __init__, or not cached)."""
    calls = []

    def make():
        calls.append(1)
        return ["p"]

    source = PromptSource(make, ["h"], "test")
    assert calls == []
    assert source.train == ["p"] and source.train == ["p"]
    assert calls == [1]


def test_heldout_texts_append_answers_when_known():
    """Prompts followed by their answers; prompts alone without answers (mutation: answers ignored)."""
    assert PromptSource(list, ["a ", "b "], "t", heldout_answers=("1", "2")).heldout_texts() == ["a 1", "b 2"]
    assert PromptSource(list, ["a "], "t").heldout_texts() == ["a "]


def test_corpus_prompts_have_no_columns():
    """Mutation: columns() crashes on tasks=None."""
    assert PromptSource(list, [], "t").columns() == set()


def test_task_file_is_split_without_leaks_and_keeps_answers(tmp_path):
    """Train and held-out prompts are disjoint and cover the file; held-out answers match their prompts
    (mutation: answers misaligned, or the split leaking)."""
    source = prompt_source(recipe_for(write_tasks(tmp_path / "t.jsonl", 30)), tokenizer=None)
    assert not set(source.train) & set(source.heldout)
    assert len(source.train) + len(source.heldout) == 30
    for prompt, answer in zip(source.heldout, source.heldout_answers):
        number = int(prompt.split()[2])
        assert answer == str(2 * number)
    assert source.columns() == {"answer"}
    assert "(30 prompts)" in source.description


def test_missing_task_file_is_a_one_line_refusal(tmp_path):
    """Mutation: FileNotFoundError escapes."""
    with pytest.raises(UserError, match=r"task file .*nope.jsonl not found; pass an existing"):
        prompt_source(recipe_for(tmp_path / "nope.jsonl"), tokenizer=None)


def test_too_few_tasks_to_split_are_refused(tmp_path):
    """Two prompts cannot give training and two held-out prompts (mutation: an empty split accepted)."""
    with pytest.raises(UserError, match="2 distinct prompts are too few"):
        prompt_source(recipe_for(write_tasks(tmp_path / "t.jsonl", 2)), tokenizer=None)


def test_reward_needing_a_missing_column_is_refused_before_sampling(tmp_path):
    """exact_answer needs 'answer': refused on a file without it, accepted with it (mutation: check skipped)."""
    without = prompt_source(recipe_for(write_tasks(tmp_path / "a.jsonl", 30, answer=False)), tokenizer=None)
    with pytest.raises(UserError, match="needs column answer"):
        without.reward(["exact_answer"])
    with_answers = prompt_source(recipe_for(write_tasks(tmp_path / "b.jsonl", 30)), tokenizer=None)
    reward = with_answers.reward(["exact_answer"])
    prompt = with_answers.heldout[0]
    right = with_answers.heldout_answers[0]
    scores = reward([prompt, prompt], [right, "wrong"])
    assert scores[0] > scores[1]
