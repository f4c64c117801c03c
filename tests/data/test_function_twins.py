"""Twins of the function-calling family (``tasks make --kind functions --twins``): each training
irrelevance row has exactly one twin, the same request with the function it asks for offered too and
that function's call as the truth; the reward flips between the two; the held-out split, the size of
the training split and its irrelevance share are unchanged; twins off writes what it wrote before."""

from __future__ import annotations

import hashlib
import json

import pytest

from slm_align.atomic import jsonl_text
from slm_align.data.function_library import function_named
from slm_align.data.function_tasks import (
    CATEGORIES,
    canonical_arguments,
    category_counts,
    function_tasks,
    twin_counts,
    write_function_tasks,
)
from slm_align.errors import UserError
from slm_align.ondevice.rewards.function_calls import function_call_match
from tests.helpers import run_cli

MAIN_HASHES = {"sft": "d98fab4b7485c9997cba209dd2c8842d780cea71a037756f7cb63a65f1b29cbe",
               "train": "f8dd1828182808549400a26e2fa16b263830f9428a385a6c24a25ae36a1686b4",
               "heldout": "290cfb97577ec8e00b9e25d4411c4a441b3576b127a30db7e55d2314ef76fb81"}
"""sha256 of each file's text for ``function_tasks(train=200, heldout=40, seed=3)`` computed on main
(3d581d9) before twins existed: the default path must not move a byte."""


@pytest.fixture(scope="module")
def twinned() -> dict:
    return function_tasks(train=200, heldout=40, seed=3, twins=True)


def _text(row: dict) -> str:
    return row["messages"][0]["content"]


def _names(row: dict) -> list[str]:
    return [tool["function"]["name"] for tool in row["tools"]]


def _pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """Each training irrelevance row with the rows (other than itself) that share its request."""
    return [(row, [other for other in rows if other is not row and _text(other) == _text(row)])
            for row in rows if row["category"] == "irrelevance"]


def test_each_irrelevance_row_has_one_twin_offering_its_function_too(twinned):
    rows = twinned["train"]
    pairs = _pairs(rows)
    assert len(pairs) == category_counts(200)["irrelevance"] > 0
    for irrelevance, sharing in pairs:
        assert len(sharing) == 1, _text(irrelevance)
        twin = sharing[0]
        extra = [name for name in _names(twin) if name not in _names(irrelevance)]
        assert len(extra) == 1 and len(_names(twin)) == len(_names(irrelevance)) + 1
        assert [name for name in _names(twin) if name != extra[0]] == _names(irrelevance)
        assert twin["category"] == "multiple" and twin["messages"] == irrelevance["messages"]
        assert [list(entry) for entry in twin["ground_truth"]] == [extra]
        assert function_named(extra[0])["group"] not in {
            function_named(name)["group"] for name in _names(irrelevance)}
        assert abs(rows.index(twin) - rows.index(irrelevance)) == 1  # a first-N cut keeps both
    twins = [twin for _, (twin,) in pairs]
    others = [row for row in rows if row["category"] != "irrelevance" and row not in twins]
    texts = [_text(row) for row in others + [irrelevance for irrelevance, _ in pairs]]
    assert len(set(texts)) == len(texts)  # only a twin repeats a request


def _reply(row: dict) -> str:
    calls = [{"name": name, "arguments": canonical_arguments(allowed)}
             for entry in row["ground_truth"] for name, allowed in entry.items()]
    return "".join(f"<tool_call>{json.dumps(call)}</tool_call>" for call in calls)


def test_the_reward_wants_the_call_on_the_twin_and_text_on_its_irrelevance_row(twinned):
    for irrelevance, (twin,) in _pairs(twinned["train"])[:10]:
        call, text = _reply(twin), "None of my functions can do that, sorry."
        rows = [twin, twin, irrelevance, irrelevance]
        scores = function_call_match(["p"] * 4, [call, text, call, text],
                                     ground_truth=[row["ground_truth"] for row in rows],
                                     tools=[row["tools"] for row in rows],
                                     category=[row["category"] for row in rows])
        assert scores == [1.0, 0.0, 0.0, 1.0]


def test_twins_keep_the_size_the_irrelevance_share_and_the_held_out_rows(twinned):
    plain = function_tasks(train=200, heldout=40, seed=3)
    assert jsonl_text(twinned["heldout"]) == jsonl_text(plain["heldout"])
    assert len(twinned["train"]) == len(twinned["sft"]) == 200
    counts = {category: 0 for category in CATEGORIES}
    for row in twinned["train"]:
        counts[row["category"]] += 1
    pairs = category_counts(200)["irrelevance"]
    expected = twin_counts(category_counts(200))
    assert counts == dict(expected, multiple=expected["multiple"] + pairs)
    assert counts["irrelevance"] == pairs and sum(expected.values()) == 200 - pairs
    for category in ("simple", "multiple", "parallel", "parallel_multiple"):  # shares kept roughly
        share = expected[category] / (200 - 2 * pairs)
        assert abs(share - category_counts(1000)[category] / 800) < 0.02


def test_twins_off_writes_the_bytes_main_wrote_and_twins_are_seeded(twinned):
    plain = function_tasks(train=200, heldout=40, seed=3)
    hashes = {name: hashlib.sha256(jsonl_text(rows).encode()).hexdigest() for name, rows in plain.items()}
    assert hashes == MAIN_HASHES
    again = function_tasks(train=200, heldout=40, seed=3, twins=True)
    other = function_tasks(train=200, heldout=40, seed=4, twins=True)
    assert jsonl_text(again["train"]) == jsonl_text(twinned["train"]) != jsonl_text(other["train"])
    assert jsonl_text(twinned["train"]) != jsonl_text(plain["train"])


def test_the_cli_writes_twins_and_refuses_them_where_they_cannot_be(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "tasks", "make", "--kind", "functions", "--out", tmp_path / "fn",
                           "--train", "50", "--heldout", "10", "--twins", "--json")
    report = json.loads(out)
    assert code == 0 and report["twins"] is True and report["rows"]["train"] == 50
    python = write_function_tasks(tmp_path / "py", train=50, heldout=10, twins=True)
    assert python["train"].read_bytes() == (tmp_path / "fn" / "train.jsonl").read_bytes()
    assert b"_multiple_twin_" in python["train"].read_bytes()
    code, _, err = run_cli(capsys, "tasks", "make", "--out", tmp_path / "calc", "--twins")
    assert code == 2 and err.count("\n") == 1 and "--twins" in err
    assert not (tmp_path / "calc").exists()
    with pytest.raises(UserError, match="at most half"):
        write_function_tasks(tmp_path / "half", train=20, heldout=0, twins=True,
                             mix={"simple": 0.4, "irrelevance": 0.6})
    assert not (tmp_path / "half").exists()
