"""Scrubbing before feedback leaves the device (issue 20, finding 7): on by default, every
string, wider patterns."""

import json
import re

import pytest

from slm_align.ondevice.agent import scrub as scrub_module
from slm_align.ondevice.agent.feedback_export import export_preferences, scrub_row
from slm_align.ondevice.agent.scrub import scrub
from slm_align.ondevice.agent.store import PreferenceStore
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
    assert export_preferences(db, tmp_path / "a.jsonl")["scrubbed_by"][0] == "regex floor"
    assert "<EMAIL>" in (tmp_path / "a.unpaired.jsonl").read_text()
    code, out, err = run_cli(capsys, "feedback", "export", db, "--out", tmp_path / "c.jsonl")
    assert code == 0 and "1 personal details scrubbed (regex floor" in " ".join(out.split()), err
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


# Issue 36, item 7: formats that leaked verbatim. The regex floor alone (no detect-secrets) must catch each.

@pytest.fixture
def floor_only(monkeypatch):
    """The torch-free install: detect-secrets absent, the regex floor alone."""
    monkeypatch.setattr(scrub_module, "library_rules", lambda: ((), None))
    assert scrub_module.detectors() == ["regex floor"]


PEM_BLOCK = ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun\n"
             "VTLw7onLRnrq0/IzW7yWR7QkrmBL7jTKEn5u+qKhbwKfBstIs+bMY2Zkp18gnTxK\n-----END RSA PRIVATE KEY-----")


@pytest.mark.parametrize("text, expected", [
    # SSNs: spaced, and nine bare digits after a label
    ("my SSN is 123 45 6789", "my SSN is <SSN>"),
    ("SSN: 123456789", "SSN: <SSN>"),
    ("my social security number is 123456789.", "my social security number is <SSN>."),
    # cards split by dots, double spaces or a line break
    ("card 4111.1111.1111.1111 exp 12/27", "card <CARD> exp 12/27"),
    ("card 4111  1111  1111  1111 thanks", "card <CARD> thanks"),
    ("card 4111 1111\n1111 1111 thanks", "card <CARD> thanks"),
    ("amex 3782.822463.10005", "amex <CARD>"),
    # seven-digit and slashed phones
    ("call me at 555-0132 tonight", "call me at <PHONE> tonight"),
    ("office 415/555-0132", "office <PHONE>"),
    # AWS secret access keys, bare and labelled
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "<SECRET>"),
    ('{"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}', "{<SECRET>}"),
    ("the secret is wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY ok", "the secret is <SECRET> ok"),
    # GitLab tokens
    ("use glpat-AbCdEfGhIj1234567890 for CI", "use <SECRET> for CI"),
    # PEM private keys, the body included, whole or cut short
    (f"here:\n{PEM_BLOCK}\nthanks", "here:\n<SECRET>\nthanks"),
    (PEM_BLOCK.rsplit("\n", 1)[0] + "\n\nwhat is this?", "<SECRET>\n\nwhat is this?"),
    # passwords said in prose
    ("my password is hunter2.", "my password is <SECRET>."),
    ("The password for my bank account is Tr0ub4dor&3", "The password for my bank account is <SECRET>"),
    # credentials in URLs
    ("GET https://api.example.com/v1/items?key=abc123&q=shoes", "GET https://api.example.com/v1/items?key=<SECRET>&q=shoes"),
    ("https://example.com/cb?state=x&token=abcdefghij", "https://example.com/cb?state=x&token=<SECRET>"),
    ("https://example.com/cb#access_token=ya29.a0AfH6&expires_in=3599",
     "https://example.com/cb#access_token=<SECRET>&expires_in=3599"),
    ("https://bob:hunter2@example.com/repo.git", "https://bob:<SECRET>@example.com/repo.git"),
])
def test_the_formats_that_leaked_verbatim_are_caught_by_the_floor(floor_only, text, expected):
    assert scrub(text) == (expected, expected.count("<"))


@pytest.mark.parametrize("text", [
    "12 + 30 = 42",
    "12345 * 10000 = 123450000",  # a nine-digit result with no SSN label stays
    "123456789 is the order number",
    "in 2024, version 3.11.7, on 2024-01-15 at 12:30; HTTP/1.1",
    "pi is 3.141592653589793 and 1/7 = 0.14285714285714285",
    "years 2019  2020  2021  2022, columns 1000  2000  3000  4000",
    "ranges 250-1000 K; ISBN 978-0-306-40615-7; zip 94105-1234",
    "the password is incorrect; your password is too short; the password is 12 characters long",
    "max_tokens: 1000000, temperature=0.7",
    "see https://docs.python.org/3/library/re.html?highlight=sub#re.sub and /Users/alice/Documents/notes.txt",
    "APPLICATIONS ARE OPEN UNTIL FRIDAY, APPROXIMATELY 5 PM",
])
@pytest.mark.parametrize("library", [False, True], ids=["floor", "floor+detect-secrets"])
def test_ordinary_text_and_numbers_are_not_over_scrubbed(monkeypatch, library, text):
    if library:
        pytest.importorskip("detect_secrets")
    else:
        monkeypatch.setattr(scrub_module, "library_rules", lambda: ((), None))
    assert scrub(text) == (text, 0)


def test_the_key_of_a_tool_argument_labels_its_value(floor_only):
    assert scrub("123456789", context="ssn") == ("<SSN>", 1)
    assert scrub("hunter2", context="password") == ("<SECRET>", 1)
    assert scrub("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", context="aws_secret_access_key") == ("<SECRET>", 1)
    assert scrub("groceries", context="key") == ("groceries", 0)  # a notes key is not a secret
    assert scrub("123456789", context="order_id") == ("123456789", 0)
    row = {"prompt": [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "signup", "arguments": {"ssn": "123456789", "password": "hunter2", "max_tokens": "1000000"}}}]}],
        "completion": [{"role": "assistant", "content": "done"}]}
    scrubbed, count = scrub_row(row)
    kept = scrubbed["prompt"][0]["tool_calls"][0]["function"]["arguments"]
    assert count == 2 and kept == {"ssn": "<SSN>", "password": "<SECRET>", "max_tokens": "1000000"}


def test_detect_secrets_adds_vendor_patterns_behind_the_same_interface(monkeypatch):
    pytest.importorskip("detect_secrets")
    scrub_module.library_rules.cache_clear()
    assert scrub_module.detectors()[0] == "regex floor" and scrub_module.detectors()[1].startswith("detect-secrets ")
    webhook = "alerts go to https://hooks.slack.com/services/T0AB12CD3/B0AB12CD3/abcdefABCDEF0123 now"
    discord = "bot MTk4NjIyNDgzNDcxOTI1MjQ4.Cl2FMQ.ZnCjm1XVW7vRze4b7Cq4se7kKWs"
    assert scrub(webhook) == ("alerts go to <SECRET> now", 1)
    assert scrub(discord) == ("bot <SECRET>", 1)
    monkeypatch.setattr(scrub_module, "library_rules", lambda: ((), None))
    assert scrub(discord)[1] == 0  # the floor alone lets this one through: the library is what adds it
    monkeypatch.undo()
    # the floor still runs first and keeps its placeholders; the library never re-scrubs a placeholder
    assert scrub("https://bob:hunter2@example.com mail bob@example.com ip 8.8.8.8") == (
        "https://bob:<SECRET>@example.com mail <EMAIL> ip <IP>", 3)


def test_library_patterns_run_word_by_word_and_skip_overlong_words():
    """detect-secrets' own patterns are quadratic in what they scan (``//.+/:_authToken``): they see one word
    at a time, words over the bound not at all (the floor, linear, still runs on the whole text)."""
    rule = scrub_module.Rule(re.compile(r"//.+/:_authToken=\w+"), scrub_module._always, "<SECRET>")
    short = "//registry.npmjs.org/:_authToken=abc123"
    long = "//" + "a/" * scrub_module.MAX_LIBRARY_TOKEN_CHARS + ":_authToken=abc123"
    assert scrub_module._apply_by_word((rule,), f"set {short} done") == ("set <SECRET> done", 1)
    assert scrub_module._apply_by_word((rule,), f"set {long} done") == (f"set {long} done", 0)
