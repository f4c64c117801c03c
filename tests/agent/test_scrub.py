"""Scrubbing before feedback leaves the device (issue 20, finding 7): on by default, every
string, wider patterns."""

import json

import pytest

from slm_align.agent.feedback_export import export_preferences, scrub_row
from slm_align.agent.scrub import scrub
from slm_align.agent.store import PreferenceStore
from tests.helpers import run_cli


@pytest.mark.parametrize("text, expected", [
    ("my SSN is 123-45-6789.", "my SSN is <SSN>."),
    ("call 5551234567 or 555.123.4567 today", "call <PHONE> or <PHONE> today"),
    ("host 2001:db8::8a2e:370:7334 and fe80::1 and ::ffff:192.0.2.1",
     "host <IP> and <IP> and <IP>"),
    ("iban de89 3704 0044 0532 0130 00 please", "iban <IBAN> please"),
    ("key sk-proj-abcdefghijklmnop1234567890XYZ", "key <SECRET>"),
    ("token ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789", "token <SECRET>"),
    ("aws AKIAIOSFODNN7EXAMPLE here", "aws <SECRET> here"),
    ("Authorization: Bearer abcdef0123456789abcdef", "Authorization: <SECRET>"),
    ("api_key=hunter2hunter2", "<SECRET>"),
    ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n", "jwt <SECRET>"),
])
def test_scrub_catches_what_it_used_to_let_through(text, expected):
    assert scrub(text) == (expected, expected.count("<"))


@pytest.mark.parametrize("text", [
    "the meeting is at 12:30:45, version 3.11.7, in 2024-01-15",
    "order 1234567890123456 (not Luhn-valid), timestamp 1700000000, population 8000000",
    "ISO 9001, USB3, COVID19 and AB12 word, ratio 1:2:3",
])
def test_scrub_still_keeps_ordinary_text(text):
    assert scrub(text) == (text, 0)


def test_every_string_of_a_row_is_scrubbed_tool_arguments_included():
    row = {"prompt": [{"role": "user", "content": "mail bob@example.com"},
                      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                          "name": "send", "arguments": {"to": ["alice@example.org"], "ssn": "123-45-6789"}}}]}],
           "completion": [{"role": "assistant", "content": "done"}], "label": True}
    scrubbed, count = scrub_row(row)
    text = json.dumps(scrubbed)
    assert count == 3 and "@example" not in text and "6789" not in text and scrubbed["label"] is True


def test_export_scrubs_by_default_and_the_flag_opts_out(tmp_path, capsys):
    db = tmp_path / "prefs.db"
    with PreferenceStore(db) as store:
        turn = store.record_turn("c", [{"role": "user", "content": "I am bob@example.com"}], "Hi Bob.",
                                 "ab" * 32, {}, True)
        store.thumbs(turn, up=True)
    export_preferences(db, tmp_path / "a.jsonl")
    assert "<EMAIL>" in (tmp_path / "a.unpaired.jsonl").read_text()
    code, _, err = run_cli(capsys, "feedback", "export", db, "--out", tmp_path / "b.jsonl", "--no-scrub")
    assert code == 0, err
    assert "bob@example.com" in (tmp_path / "b.unpaired.jsonl").read_text()
    code, out, _ = run_cli(capsys, "feedback", "export", "--help")
    assert "--no-scrub" in out and "names" in out and "addresses" in out


def test_the_keys_of_tool_arguments_are_scrubbed_too():
    arguments = {"bob@example.com": "hello", "alice@example.org": {"123-45-6789": True}, "plain": 1}
    row = {"prompt": [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "send", "arguments": arguments}}]}], "completion": [{"role": "assistant", "content": "done"}]}
    scrubbed, count = scrub_row(row)
    kept = scrubbed["prompt"][0]["tool_calls"][0]["function"]["arguments"]
    assert count == 3 and "@example" not in json.dumps(scrubbed) and "6789" not in json.dumps(scrubbed)
    assert kept == {"<EMAIL>": "hello", "<EMAIL> 2": {"<SSN>": True}, "plain": 1}  # two addresses stay two
