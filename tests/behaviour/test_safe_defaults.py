"""Safe by default: no network unless a hub id is given, owner-only personal data, and
no code from checkpoints.

Other safety tests live beside their features: tool escapes in tests/ondevice/tools/test_tools.py, the
server's limits and API key in tests/ondevice/agent/server/test_serve.py, pickle and remote code refusals in
tests/cli/test_commands.py.
"""

import socket
import stat

import pytest

from slm_align.config import load_recipe
from slm_align.export.publishing.stage import ExportRequest, run_export
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import SamplingParams
from tests.helpers import finished_sft_run, run_cli


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""
    attempts = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise AssertionError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


def test_train_export_and_chat_open_no_connection(no_network, monkeypatch, tmp_path, tiny_models, stories):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the code, not the environment, must keep us offline
    run, _ = finished_sft_run(tmp_path / "run", tiny_models["llama"], stories, steps=2)
    artifact = run_export(ExportRequest(str(run), "gguf", "F16")).stage_dir
    reply = Agent.load(artifact, store=tmp_path / "prefs.db", consent=True,
                       sampling=SamplingParams(temperature=0, max_tokens=4)).chat("Hi")
    assert reply.turn_id == 1 and no_network == []


def test_personal_data_files_are_owner_only(tmp_path, capsys, tiny_models):
    artifact = run_export(ExportRequest(str(tiny_models["llama"]), "gguf", "F16", out=tmp_path, verify=False)).stage_dir
    agent = Agent.load(artifact, store=tmp_path / "prefs.db", consent=True, sampling=SamplingParams(max_tokens=4))
    agent.chat("My e-mail is ann@example.com")
    agent.feedback("edit", text="Thanks!")
    code, _, _ = run_cli(capsys, "feedback", "export", tmp_path / "prefs.db", "--out", tmp_path / "rows.jsonl")
    assert code == 0
    for path in (tmp_path / "prefs.db", tmp_path / "rows.jsonl", tmp_path / "rows.unpaired.jsonl"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_remote_code_and_pickle_are_off_unless_asked():
    recipe = load_recipe()
    assert recipe.model.trust_remote_code is False and recipe.model.allow_pickle is False
